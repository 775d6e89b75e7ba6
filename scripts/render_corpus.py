"""Render every kernel of a fixed corpus of programs, for comparing the generated
kernels before and after a change to the kinds (issue 23: "the generated kernels
are the same source").

    TRITON_INTERPRET=1 python scripts/render_corpus.py before.json --fuzz 150
    ... change the code ...
    TRITON_INTERPRET=1 python scripts/render_corpus.py after.json --fuzz 150
    diff <(python -m json.tool before.json) <(python -m json.tool after.json)

The corpus: each fuse rule's examples, a few hand-picked programs that reach the
variants (wide and symbolic rows, a layout change) and the other kinds, and `--fuzz`
programs drawn, derandomized, from tests/fuzz_graphs.py. Each runs for the OpenMP
and the Triton target (on CPU tensors: Triton's interpreter). Nothing is built:
each kernel's source is recorded where runtime/prepare.py renders it, and the
kernel then falls back to ATen (so the script runs in minutes on two cores).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["REWRITEC_CACHE_DIR"] = tempfile.mkdtemp(prefix="render-corpus-")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import rewritec  # noqa: E402
from rewritec.kinds.kernels import RenderError, compilable  # noqa: E402
from rewritec.kinds.registry import SPACES  # noqa: E402
from rewritec.kinds.variants import variants_for  # noqa: E402
from rewritec.rulecheck import build_example, is_frozen, make_folder  # noqa: E402
from rewritec.rulesets import builtin_rules  # noqa: E402
from rewritec.runtime import prepare  # noqa: E402
from rewritec.engine.pipeline import run_pipeline  # noqa: E402

TARGETS = ("openmp", "triton")
RENDERS: dict[str, str] = {}  # "<case> <target> <kernel name>" -> source
CASE = ["?"]


def _record(real: Any) -> Any:
    def render(term: Any, index: int, target: str, table: Any) -> Any:
        spec, source, launcher = real(term, index, target, table)
        key = f"{CASE[0]} {target} {spec.name}"
        RENDERS[key] = source
        raise RenderError("recorded")  # the kernel falls back: nothing is built
    return render


def rule_examples() -> None:
    for rule in builtin_rules():
        if rule.kind != "fuse":
            continue
        for i, ex in enumerate(rule.examples):
            for target in TARGETS:
                CASE[0] = f"{rule.name}[{i}]"
                graph, store, bridge, _ = build_example(rule, ex, seed=i)
                result = run_pipeline(graph, store, [rule], table=bridge.table,
                                      folder=make_folder(store, bridge), is_frozen=is_frozen,
                                      can_compile=compilable(target, bridge.table),
                                      spaces=SPACES, variants=variants_for(target, store))
                prepare.prepare_kernels(result.graph, store, target, strict=False,
                                        out_dir=None, name=rule.name, bridge=bridge,
                                        warn=lambda m: None)


def _ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], w, b) * 2


def _tiled_two(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.relu(a * 2.0 + b).contiguous()  # NHWC in, NCHW out: 2-d tiles
    return z, torch.sigmoid(z) * 3.0


def hand_picked() -> list[tuple[str, Any, tuple[Any, ...], dict[str, Any]]]:
    g = torch.Generator().manual_seed(0)

    def r(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=g)

    wide = r(4, 4096)
    return [
        ("layer_norm_wide", _ln, (wide, r(4096), r(4096)), {}),
        ("layer_norm_narrow", _ln, (r(8, 64), r(64), r(64)), {}),
        ("layer_norm_dynamic", lambda x: F.layer_norm(x, x.shape[-1:]) * 2, (r(8, 96),),
         {"dynamic": True}),
        ("softmax_dynamic", lambda x: torch.softmax(x, -1) * 2, (r(8, 96),), {"dynamic": True}),
        ("softmax_wide", lambda x: torch.softmax(x, -1) + 1, (wide,), {}),
        ("rms_wide", lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6),
         (wide,), {}),
        ("variance_wide", lambda x: (x - x.mean(-1, keepdim=True)).pow(2).mean(-1) + 1,
         (wide,), {}),
        ("nhwc_to_nchw", lambda x: (x.permute(0, 3, 1, 2) + 1).contiguous(),
         (r(2, 16, 16, 32),), {}),
        ("nhwc_two", _tiled_two, (r(2, 16, 12, 12).contiguous(memory_format=torch.channels_last),
                                  r(2, 16, 12, 12)), {}),
        ("layer_norm_wide_f16", _ln, (wide.half(), r(4096).half(), r(4096).half()), {}),
        ("layer_norm_wide_stats",
         lambda x: torch.ops.aten.native_layer_norm(x * 2, [4096], None, None, 1e-5),
         (wide,), {}),
        ("layer_norm_wide_strided", lambda x: F.layer_norm(x.t(), (4096,)) + 1,
         (r(4096, 4),), {}),
        ("softmax_wide_masked",
         lambda x, m: torch.softmax(x.masked_fill(m, float("-inf")), -1),
         (wide, r(4, 4096) > 1), {}),
        ("sum_dim0", lambda x: (x * 2).sum(0), (r(64, 33),), {}),
        ("gelu_bias", lambda x, b: F.gelu(x + b), (r(16, 64), r(64)), {}),
    ]


def compile_case(name: str, fn: Any, args: tuple[Any, ...], extra: dict[str, Any]) -> None:
    for target in TARGETS:
        CASE[0] = name
        torch._dynamo.reset()
        try:
            with torch.no_grad():
                rewritec.compile(fn, target=target, **extra)(*args)
        except Exception as e:  # noqa: BLE001 - a program the compiler refuses: no kernels
            print(f"{name} {target}: {type(e).__name__}: {e}", file=sys.stderr)


def fuzz(n: int) -> None:
    from fuzz_graphs import graphs, instantiate  # tests/fuzz_graphs.py
    from hypothesis import HealthCheck, given, settings

    programs: list[Any] = []

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(graphs(grad=False))
    def draw(graph: Any) -> None:
        programs.append(graph)

    draw()
    for k, graph in enumerate(programs):
        inst = instantiate(graph)
        compile_case(f"fuzz{k}", inst.fn, tuple(inst.args), {})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fuzz", type=int, default=100)
    opts = ap.parse_args()
    prepare._render = _record(prepare._render)
    warnings.simplefilter("ignore")
    rule_examples()
    for case in hand_picked():
        compile_case(*case)
    fuzz(opts.fuzz)
    Path(opts.out).write_text(json.dumps(RENDERS, indent=1, sort_keys=True))
    print(f"{len(RENDERS)} kernels rendered -> {opts.out}")


if __name__ == "__main__":
    main()
