"""Which ops of common activations and losses run outside kernels in a training step.

    python scripts/scan_outside.py [--target openmp|triton]

Each case is `loss(f(linear(x)), t)` compiled with rewritec on the CPU (the Triton
target under TRITON_INTERPRET=1), forward and backward; a line per case lists the ATen
ops its graphs still ran (views and matrix products left out): the coverage gaps a
rule or an op-table entry would close (issue 22). Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

T = torch.Tensor
CASES: dict[str, Callable[[T, T], T]] = {
    "gelu_tanh": lambda y, t: F.gelu(y, approximate="tanh").sum(),
    "softplus": lambda y, t: F.softplus(y).sum(),
    "elu": lambda y, t: F.elu(y).sum(),
    "selu": lambda y, t: F.selu(y).sum(),
    "celu": lambda y, t: F.celu(y).sum(),
    "leaky_relu": lambda y, t: F.leaky_relu(y, 0.1).sum(),
    "logsigmoid": lambda y, t: F.logsigmoid(y).sum(),
    "hardsigmoid": lambda y, t: F.hardsigmoid(y).sum(),
    "softsign": lambda y, t: F.softsign(y).sum(),
    "glu": lambda y, t: F.glu(y, -1).sum(),
    "mish": lambda y, t: F.mish(y).sum(),
    "mse": lambda y, t: F.mse_loss(y, t),
    "l1": lambda y, t: F.l1_loss(y, t),
    "smooth_l1": lambda y, t: F.smooth_l1_loss(y, t),
    "bce_logits": lambda y, t: F.binary_cross_entropy_with_logits(y, t.sigmoid()),
    "kl_div": lambda y, t: F.kl_div(F.log_softmax(y, -1), F.softmax(t, -1),
                                    reduction="batchmean"),
    "cosine": lambda y, t: F.cosine_similarity(y, t).sum(),
    "normalize": lambda y, t: F.normalize(y, dim=-1).sum(),
    "group_norm": lambda y, t: F.group_norm(y.view(8, 4, 4), 2).sum(),
    "var": lambda y, t: y.var(-1).sum(),
    "std": lambda y, t: y.std(-1).sum(),
    "max": lambda y, t: y.max(-1).values.sum(),
    "cumsum": lambda y, t: torch.cumsum(y, -1).sum(),
    "abs_pow": lambda y, t: (y.abs() ** 1.5).sum(),
    "atan": lambda y, t: torch.atan(y).sum(),
}
# ops that launch no kernel of their own or are library calls
SKIP = {"t", "addmm", "mm", "expand", "view", "permute", "_unsafe_view", "reshape", "alias",
        "unsqueeze", "squeeze"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", choices=("openmp", "triton"), default="openmp")
    target = parser.parse_args().target
    if target == "triton":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import rewritec  # noqa: F401 - registers the backend
    from rewritec import report

    warnings.filterwarnings("ignore")
    for name, loss in CASES.items():
        report.reset()
        torch._dynamo.reset()
        lin = torch.nn.Linear(16, 16)
        step = torch.compile(lambda x, t, loss=loss, lin=lin: loss(lin(x), t),
                             backend="rewritec", options={"target": target})
        x, t = torch.randn(8, 16, requires_grad=True), torch.randn(8, 16)
        step(x, t).backward()
        outside = {f"{r.kind}:{op}": n for r in report.RECORDS
                   for op, n in r.fallback_ops.items() if op not in SKIP}
        print(f"{name:12s} {outside or 'all inside kernels'}")


if __name__ == "__main__":
    main()
