"""What does mode max-autotune buy? Each case compiled in mode default and in
max-autotune-no-cudagraphs (so both launch the same way, without CUDA graphs),
timed in the same process, with the winners runtime/autotune.py chose.

    python -m benchmarks.autotune      # CUDA only; prints a table

Winners are stored in $REWRITEC_CACHE_DIR/autotune; the first max-autotune
compile of a case times its candidates, a rerun reads them.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

import rewritec
from rewritec.runtime import autotune


def gelu_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + b)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return F.softmax(x, dim=-1)


def layer_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w, w * 0.5)


def linear_gelu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def col_sum(x: torch.Tensor) -> torch.Tensor:
    return x.sum(0)


def _cases() -> list[tuple[str, Callable[..., torch.Tensor], tuple[torch.Tensor, ...]]]:
    def r(*shape: int, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype)

    return [
        ("gelu_bias 8192x4096 f16", gelu_bias, (r(8192, 4096), r(4096))),
        ("softmax 4096x1000 f32", softmax, (r(4096, 1000, dtype=torch.float32),)),
        ("layer_norm 8192x768 f16", layer_norm, (r(8192, 768), r(768))),
        ("layer_norm 1024x32768 f32", layer_norm,
         (r(1024, 32768, dtype=torch.float32), r(32768, dtype=torch.float32))),
        ("linear_gelu 4096x768->3072 f16", linear_gelu,
         (r(4096, 768), r(3072, 768) * 768 ** -0.5, r(3072))),
        ("linear_gelu 512x1024->1024 f32", linear_gelu,
         (r(512, 1024, dtype=torch.float32), r(1024, 1024, dtype=torch.float32) / 32,
          r(1024, dtype=torch.float32))),
        ("col_sum 16384x512 f32", col_sum, (r(16384, 512, dtype=torch.float32),)),
    ]


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    from triton.testing import do_bench

    winners: list[str] = []

    class Winners(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("autotune"):
                winners.append(record.getMessage())

    logging.getLogger("rewritec").addHandler(Winners())
    logging.getLogger("rewritec").setLevel(logging.INFO)
    print(f"# mode max-autotune on {torch.cuda.get_device_name()}\n")
    print("| case | default ms | max-autotune ms | autotuned / default | first call s |")
    print("|---|---:|---:|---:|---:|")
    for name, fn, inputs in _cases():
        times, first = [], 0.0
        for mode in ("default", "max-autotune-no-cudagraphs"):
            torch._dynamo.reset()
            compiled = rewritec.compile(fn, mode=mode)
            with torch.no_grad():
                start = time.perf_counter()
                got = compiled(*inputs)
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                torch.testing.assert_close(got, fn(*inputs), rtol=2e-2, atol=2e-2)
                times.append(do_bench(lambda c=compiled, a=inputs: c(*a), warmup=25, rep=100))
        print(f"| {name} | {times[0]:.4f} | {times[1]:.4f} | {times[1] / times[0]:.2f} "
              f"| {first:.2f} |")
    print(f"\nstats: {autotune.STATS}")
    for line in winners:
        print(f"- {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
