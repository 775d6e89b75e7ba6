"""Cold compile of the suite's Llama-style model, whole against regional.

    python -m benchmarks.regional                        # CUDA: the suite's config (8 layers)
    python -m benchmarks.regional --layers 2,4,8,16      # how compile time grows with depth
    python -m benchmarks.regional --tiny --device cpu    # the CPU smoke test

whole: `torch.compile(forward or loss, backend="rewritec")`, as the models suite
compiles it. regional: the same, with the decoder layer's `forward` marked with
`torch.compiler.nested_compile_region` (one subclass for every layer), so rewritec
compiles one layer and calls it for each (aten/regions.py).

Each (layers, mode, how) runs in a fresh process whose rewritec, Triton and Inductor
caches are new, empty folders (a cold compile). Modes: `infer` (eval, no_grad, weights
in `--dtype`, bf16 on CUDA) and `train` (forward, loss and backward under autocast).
Both run the model with `use_cache=False`: a KV cache is state that a region writes.

Columns: first call s (trace + compile + first step, in the child), rewritec s (the
compile time of rewritec's graph records, regions included), graphs (compiled graphs
by kind), rules and kernels (totals over them), err (max |out - ref| / max |ref| of the
output against an fp32 eager run of the same model). Output: the table, printed and
written to `benchmarks/results/regional-<device>.md` (`--out` elsewhere) with a `.json`
beside it. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .model_zoo import TINY_BATCH, BY_NAME, Built, build_llama
from .models import CHILD_MARKER, child_json, device_slug, environment_common
from .run import REPO_ROOT, RESULTS_DIR, clip, rewritec_backend, rewritec_records, start_dynamo

HOWS = ("whole", "regional")
MODES = ("infer", "train")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def mark_layers_regional(model: torch.nn.Module) -> int:
    """Give each decoder layer a subclass whose forward is a nested compile region;
    layers of one class share the subclass, so torch sees one region. Returns how
    many layers were marked."""
    subclasses: dict[type, type] = {}
    layers = model.model.layers
    for layer in layers:
        cls = type(layer)
        if cls not in subclasses:
            region = torch.compiler.nested_compile_region(cls.forward)
            subclasses[cls] = type(f"Regional{cls.__name__}", (cls,), {"forward": region})
        layer.__class__ = subclasses[cls]
    return len(layers)


def build(tiny: bool, layers: int | None, mode: str, device: torch.device
          ) -> tuple[Built, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    built = build_llama(tiny, layers)
    built.model.to(device).train(mode == "train")
    spec = BY_NAME["llama"]
    batch = TINY_BATCH if tiny else (spec.train_batch if mode == "train" else spec.infer_batch)
    return built, built.make_inputs(batch, device)


def step_of(built: Built, mode: str, dtype: torch.dtype, device: torch.device
            ) -> tuple[Any, Any]:
    """The function compiled (forward or loss) and a step that runs it, as the models
    suite's steps do."""
    model = built.model

    def forward(x: dict[str, torch.Tensor]) -> torch.Tensor:
        if mode == "train":
            return model(**x, labels=x["input_ids"], use_cache=False).loss
        return model(**x, use_cache=False).logits

    def step(fn: Any, x: dict[str, torch.Tensor], amp: bool) -> torch.Tensor:
        if mode != "train":
            with torch.no_grad():
                return fn(x)
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=amp):
            loss = fn(x)
        loss.backward()
        return loss.detach()
    return forward, step


def child(layers: int | None, mode: str, how: str, tiny: bool, device: torch.device,
          dtype: torch.dtype) -> dict[str, Any]:
    """In a fresh process: the first call of one (layers, mode, how), and what it compiled."""
    built, inputs = build(tiny, layers, mode, device)
    forward, step = step_of(built, mode, dtype, device)
    ref = step(forward, inputs, amp=False).float()
    n_layers = len(built.model.model.layers)
    if how == "regional":
        mark_layers_regional(built.model)
    if mode != "train" and dtype != torch.float32:
        built.model.to(dtype)
    start_dynamo(device)
    t0 = time.perf_counter()
    out = step(torch.compile(forward, backend=rewritec_backend()), inputs,
               amp=mode == "train" and dtype != torch.float32)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    first_call = time.perf_counter() - t0
    records = rewritec_records()
    err = ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    return {"layers": n_layers, "mode": mode, "how": how, "first_call_s": first_call,
            # a region compiles inside the graph that calls it: its time is in that one's
            "rewritec_s": sum(r.compile_seconds for r in records if r.kind != "region"),
            "graphs": dict(Counter(r.kind for r in records)),
            "fallbacks": sum(r.status != "compiled" for r in records),
            "rules": sum(sum(r.rules_fired.values()) for r in records),
            "kernels": sum(len(r.kernels) for r in records), "err": err}


def run_child(layers: int | None, mode: str, how: str, args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="rewritec-regional-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
               TRITON_CACHE_DIR=str(root / "triton"), REWRITEC_CACHE_DIR=str(root / "rewritec"))
    cmd = [sys.executable, "-m", "benchmarks.regional", "--child", "--modes", mode,
           "--hows", how, "--device", args.device, "--dtype", args.dtype,
           *(["--layers", str(layers)] if layers else []), *(["--tiny"] if args.tiny else [])]
    try:
        proc = subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env, capture_output=True,
                              text=True, timeout=3600)
        data = child_json(proc)
    except subprocess.TimeoutExpired:
        data = {"error": "timed out"}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"layers": layers, "mode": mode, "how": how, **data}


def markdown(rows: Sequence[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [f"# Cold compile, whole against regional: the suite's Llama ({env['device_name']})",
             "", f"torch {env['torch']}, transformers {env['transformers']}, "
             f"commit {env['git_commit']}, {env['date']}; `{env['command']}`.", "",
             "| layers | mode | how | first call s | rewritec s | graphs | rules | kernels "
             "| err |", "|" + "---|" * 9]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['layers'] or ''} | {r['mode']} | {r['how']} | "
                         f"error: {clip(r['error'], 200)} | | | | | |")
            continue
        graphs = ", ".join(f"{n} {k}" for k, n in sorted(r["graphs"].items()))
        if r["fallbacks"]:
            graphs += f" ({r['fallbacks']} fell back)"
        lines.append(f"| {r['layers']} | {r['mode']} | {r['how']} | {r['first_call_s']:.2f} | "
                     f"{r['rewritec_s']:.2f} | {graphs} | {r['rules']} | {r['kernels']} | "
                     f"{r['err']:.1e} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.regional", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default=None,
                   help="comma-separated depths (default: the config's, 8; tiny 2)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--hows", default=",".join(HOWS))
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                   help="infer's weights and train's autocast (default: bf16 on CUDA, fp32 CPU)")
    p.add_argument("--tiny", action="store_true", help="the suite's tiny config")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if BY_NAME["llama"].missing():
        print(f"llama: skipped, {BY_NAME['llama'].missing()}")
        return 0
    layer_counts = [int(n) for n in args.layers.split(",")] if args.layers else [None]
    modes, hows = args.modes.split(","), args.hows.split(",")
    if args.child:
        device, dtype = torch.device(args.device), DTYPES[args.dtype]
        try:
            data = child(layer_counts[0], modes[0], hows[0], args.tiny, device, dtype)
        except Exception as e:  # noqa: BLE001 - a row with the error, as the suite does
            data = {"error": f"{type(e).__name__}: {e}"}
        print(CHILD_MARKER + json.dumps(data), flush=True)
        return 0
    rows = []
    for layers in layer_counts:
        for mode in modes:
            for how in hows:
                rows.append(run_child(layers, mode, how, args))
                print(json.dumps(rows[-1]), flush=True)
    env = environment_common(torch.device(args.device),
                             ["python -m benchmarks.regional", *(argv or sys.argv[1:])])
    text = markdown(rows, env)
    out = args.out or RESULTS_DIR / f"regional-{device_slug(torch.device(args.device))}.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"environment": env, "rows": rows},
                                                   indent=2) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
