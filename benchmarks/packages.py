"""Load-to-first-result: a rewritec package against a warm torch.compile and
Inductor's AOT package.

    python -m benchmarks.packages                      # CUDA if present: GPT-2, ResNet-50
    python -m benchmarks.packages --device cpu         # small models on the CPU
    python -m benchmarks.packages --device cpu --models mlp --repeats 1   # a smoke run

Each number is one fresh process, from before `import torch` to the first result
(synchronized on CUDA), the median of `--repeats` processes:

- `rewritec package`: `rewritec.load_package(path)` and a first call. The package
  was written beforehand (`rewritec.package`, `--target`: its kernels; on CUDA the
  Triton binaries of its launches, `--target aten` for ATen calls only).
- `torch.compile warm`: `torch.compile(model)` (Inductor) and a first call, with
  Inductor's and Triton's caches filled by an earlier process (a warm start). Building
  the model in the process is not counted (a package carries its weights; here they
  are made in memory), so this column is import + warm compile + first call.
- `AOTInductor`: `torch._inductor.aoti_load_package(path)` and a first call, the
  package made beforehand by `aoti_compile_and_package`.

Columns also give the time to write each package (s, in the parent) and the
first result's error against eager (max |out - ref| / max |ref|). Output:
`benchmarks/results/packages-<device>.md` (`--out` elsewhere). Nothing here
asserts on timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .model_zoo import BY_NAME
from .models import CHILD_MARKER, child_json, device_slug, environment_common
from .run import REPO_ROOT, RESULTS_DIR, clip

WAYS = ("rewritec", "compile", "aoti")
WAY_NAMES = {"rewritec": "rewritec package", "compile": "torch.compile warm",
             "aoti": "AOTInductor"}
CPU_MODELS = ("mlp", "convnet", "reduce")
GPU_MODELS = ("gpt2", "resnet50")


# --------------------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, width: int = 256) -> None:
        super().__init__()
        self.fc1, self.ln = nn.Linear(width, 4 * width), nn.LayerNorm(4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc2(F.gelu(self.ln(self.fc1(x)))), dim=-1)


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16)
        self.c2, self.b2 = nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.b1(self.c1(x)))
        return F.relu(self.b2(self.c2(x))).mean(dim=(2, 3))


class Reduce(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(x - x.amax(dim=-1, keepdim=True)).sum(dim=0) + (x * x).mean(dim=-1).sum()


class Logits(nn.Module):
    """A transformers language model called with token ids, returning its logits
    (no KV cache: a package, as export, takes and returns tensors)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.inner(input_ids=input_ids, use_cache=False).logits


def build(name: str, device: torch.device) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """The model (eval, on `device`) and its inputs, the same in every process."""
    torch.manual_seed(0)
    if name in GPU_MODELS:  # the models suite's, at batch 1
        built = BY_NAME[name].build(False)
        inputs = built.make_inputs(1, device)
        if name == "gpt2":
            model: nn.Module = Logits(built.model)
            xs = (inputs["input_ids"],)
        else:
            model, xs = built.model, (inputs["images"],)
    else:
        model = {"mlp": MLP, "convnet": ConvNet, "reduce": Reduce}[name]()
        shape = {"mlp": (32, 256), "convnet": (8, 3, 32, 32), "reduce": (64, 1024)}[name]
        xs = (torch.randn(*shape, device=device),)
    return model.to(device).eval(), xs


# --------------------------------------------------------------------------- children


# One timed process: everything from before `import torch` counts, but building the
# model for torch.compile (a package carries its weights; here they are made in memory).
CHILD = """
import sys, time
t0 = time.perf_counter()
import json
import torch
way, name, device, path, io = sys.argv[1:6]
device = torch.device(device)
xs, ref = torch.load(io, weights_only=True)
built_s = 0.0
with torch.no_grad():
    if way == "rewritec":
        import rewritec
        out = rewritec.load_package(path)(*xs)
    elif way == "aoti":
        import torch._inductor
        out = torch._inductor.aoti_load_package(path)(*xs)
    else:
        t = time.perf_counter()
        from benchmarks.packages import build
        model, _ = build(name, device)
        built_s = time.perf_counter() - t
        out = torch.compile(model)(*xs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
seconds = time.perf_counter() - t0 - built_s
err = (out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)
print(MARKER + json.dumps({"first_result_s": seconds, "err": err.item()}), flush=True)
""".replace("MARKER", repr(CHILD_MARKER))


def run_child(way: str, name: str, device: str, path: Path, io: Path, env: dict[str, str]
              ) -> dict[str, Any]:
    try:
        proc = subprocess.run([sys.executable, "-c", CHILD, way, name, device, str(path),
                               str(io)], check=False, cwd=REPO_ROOT, env=env,
                              capture_output=True, text=True, timeout=1800)
        return child_json(proc)
    except subprocess.TimeoutExpired:
        return {"error": "timed out"}


# --------------------------------------------------------------------------- parent


def prepare(way: str, name: str, device: torch.device, work: Path, env: dict[str, str],
            target: str = "auto") -> tuple[Path, float]:
    """Write the package of `way` (or warm torch.compile's caches); its path and seconds."""
    model, xs = build(name, device)
    t = time.perf_counter()
    if way == "rewritec":
        import rewritec

        path = rewritec.package(model, xs, work / f"{name}.rwc", options={"target": target})
    elif way == "aoti":
        with torch.no_grad():
            ep = torch.export.export(model, xs)
            path = Path(torch._inductor.aoti_compile_and_package(
                ep, package_path=str(work / f"{name}.pt2")))
    else:  # one process that compiles: the timed ones start warm
        path = work / "warm"
        warm = run_child("compile", name, str(device), path, work / f"{name}.io.pt", env)
        if "error" in warm:
            raise RuntimeError(warm["error"])
    return path, time.perf_counter() - t


def measure(name: str, device: torch.device, repeats: int, ways: Sequence[str] = WAYS,
            target: str = "auto") -> list[dict[str, Any]]:
    work = Path(tempfile.mkdtemp(prefix="rewritec-packages-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(work / "inductor"),
               TRITON_CACHE_DIR=str(work / "triton"), REWRITEC_CACHE_DIR=str(work / "rewritec"))
    model, xs = build(name, device)
    with torch.no_grad():
        torch.save((xs, model(*xs)), work / f"{name}.io.pt")
    rows = []
    try:
        for way in ways:
            row: dict[str, Any] = {"model": name, "way": way}
            try:
                path, row["write_s"] = prepare(way, name, device, work, env, target)
                runs = [run_child(way, name, str(device), path, work / f"{name}.io.pt", env)
                        for _ in range(repeats)]
                bad = [r["error"] for r in runs if "error" in r]
                if bad:
                    raise RuntimeError(bad[0])
                row["first_result_s"] = statistics.median(r["first_result_s"] for r in runs)
                row["err"] = max(r["err"] for r in runs)
                if path.is_file():
                    row["mb"] = path.stat().st_size / 2**20
            except Exception as e:  # noqa: BLE001 - a row with the error
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def markdown(rows: Sequence[dict[str, Any]], env: dict[str, Any], repeats: int) -> str:
    lines = [f"# Load to first result: rewritec packages ({env['device_name']})", "",
             f"torch {env['torch']}, triton {env['triton']}, python {env['python']}, "
             f"commit {env['git_commit']}, {env['date']}; `{env['command']}`.", "",
             f"Fresh process, from before `import torch` to the first result; median of "
             f"{repeats}. write s: writing the package (rewritec: in the parent process, "
             "whose kernel cache may already hold the kernels; torch.compile: the cold "
             "process that fills its caches). See benchmarks/packages.py for what each "
             "column runs.",
             "",
             "| model | way | first result s | write s | file MB | err |", "|" + "---|" * 6]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {WAY_NAMES[r['way']]} | error: "
                         f"{clip(r['error'], 200)} | | | |")
            continue
        mb = f"{r['mb']:.2f}" if "mb" in r else ""
        lines.append(f"| {r['model']} | {WAY_NAMES[r['way']]} | {r['first_result_s']:.2f} | "
                     f"{r['write_s']:.1f} | {mb} | {r['err']:.1e} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.packages", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--models", default=None, help="comma-separated (default: by device)")
    p.add_argument("--ways", default=",".join(WAYS), help="comma-separated, of " + ", ".join(WAYS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target", choices=("auto", "aten", "openmp", "triton"), default="auto",
                   help="the rewritec package's kernels (default: the device's)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    default = GPU_MODELS if args.device == "cuda" else CPU_MODELS
    args.models = args.models.split(",") if args.models else list(default)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    rows: list[dict] = []
    command = ["python", "-m", "benchmarks.packages", *(argv if argv is not None
                                                          else sys.argv[1:])]
    out = args.out or RESULTS_DIR / f"packages-{device_slug(device)}.md"
    text = ""
    for name in args.models:
        if name in GPU_MODELS and BY_NAME[name].missing():
            print(f"{name}: skipped, {BY_NAME[name].missing()}")
            continue
        rows += measure(name, device, args.repeats, args.ways.split(","), args.target)
        # written after each model: a run cut short (a device's time limit) keeps
        # the rows it finished
        text = markdown(rows, environment_common(device, command), args.repeats)
        out.write_text(text)
    print(text)
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
