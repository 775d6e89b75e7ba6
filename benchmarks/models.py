"""The models suite: real models (benchmarks/model_zoo.py), eager vs Inductor vs rewritec.

    python -m benchmarks.models                       # every model, mode and backend
    python -m benchmarks.models --jobs 2 --first-call # the full suite on a 2-GPU machine
    python -m benchmarks.models --quick --models gpt2 --modes infer
    python -m benchmarks.models --tiny --device cpu --backends eager,rewritec
    python -m benchmarks.run --suite models [same options]

Models are built from configs with random weights (nothing is downloaded); a model
whose library (transformers, timm) is missing is skipped with a line saying so.

Modes: `infer` (weights in `--dtype`, bf16 on CUDA, eval, no_grad, the model's
throughput batch), `latency` (the same at batch 1), `fp32` (fp32 inference, CNNs
only), `train` (fp32 parameters; `model.zero_grad(set_to_none=True)`, then forward
and loss under `torch.autocast(device, --dtype)` and backward; no optimizer).

Backends: `eager`, `inductor`, `inductor-ro` (mode="reduce-overhead"), `rewritec`,
`rewritec-ro`, and with `--autotune` `inductor-ma` and `rewritec-ma`
(mode="max-autotune"). All run in one process on the same model object; between
backends `torch._dynamo.reset()`, the compiled function dropped, `gc.collect()` and
`torch.cuda.empty_cache()`. Each step's result is dropped before the next, and the
CUDA-graph modes mark each step's start (`torch.compiler.cudagraph_mark_step_begin`),
as a user of them would.

Columns (per model, mode and backend):

* ms: median wall time of one step over `--steps` steps after `--warmup` steps,
  synchronizing before the step starts and after it returns.
* ×ind-best, ×eager: that time / the fastest Inductor backend's (of those measured) /
  eager's. Above 1 is slower.
* host ms: time for the step's Python call to return (perf_counter, before the
  synchronize): what the host spends issuing the step; the median over the steps.
* GPU ms, kernels: device kernel time and kernel count per step, from torch.profiler
  (ProfilerActivity.CUDA) over 3 steps (memcpy and memset excluded). Blank on the CPU.
* in kernels: rewritec only, the fusion coverage (`coverage.py`,
  docs/report.md#coverage) of every graph the backend compiled, ops weighted: of
  the ATen ops that are neither library calls (matrix products, convolutions,
  attention) nor views, the share computed inside generated kernels. What stays
  outside is listed under each table, commonest first, with the lowest share of any
  one graph, and in the JSON (`coverage`, `coverage.lowest_graph`).
* host µs/kernel: host ms / kernels.
* peak MB: `torch.cuda.max_memory_allocated()` over the timed steps (after
  `reset_peak_memory_stats()`), minus what was allocated before this backend compiled:
  the weights and inputs every backend shares are not counted, nor anything a previous
  backend left; what this backend keeps (CUDA-graph pools, its constants) is. The peak
  of compiling, the first call and warm-up (autotuning's buffers) is `compile_peak_mb`
  in the JSON. Blank on the CPU.
* reserved MB: the same with `max_memory_reserved()`. A CUDA graph's private pool
  is reserved for good but allocated only while a replay's outputs live, so for the
  CUDA-graph modes this, not peak MB, is what the graphs hold.
* 1st call s: trace + compile + first step in the measuring process (caches as they are).
  With `--first-call`: cold / warm, each a fresh process (`--first-call-child`)
  with TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR and REWRITEC_CACHE_DIR at a new,
  empty temporary directory (cold), then the same directory again (warm).
* err: max |out - ref| / max |ref| on the step's output (logits for inference, the loss
  for training) against an fp32 eager reference of the same mode (no autocast); grad
  err the same over all parameter gradients together. `eager err` is eager's own error.
* path: eager; Inductor: graphs compiled and graph breaks (Dynamo's counters); rewritec:
  graphs compiled / fell back to ATen / replayed as CUDA graphs (`rewritec.report.RECORDS`).

Under each GPU table, where its kernels and memory go (the "why" of a missed target):
the same profile's kernels by kind (`kernel_kind`: generated, ATen's own, matrix
products and convolutions, attention), count and GPU ms a step, with the commonest
generated and ATen kernels in the JSON (`kernel_breakdown.top`); and the memory
reserved after the timed steps, in private pools (CUDA graphs') and in the caching
allocator's shared pools, from `torch.cuda.memory._snapshot()` (`pools_mb`).

A failing (model, mode, backend), exception or OOM, is a row with the error's first
line. Output: the tables, printed and written to `benchmarks/results/models-<device>.md`
(device: `h100`, `cpu`, ...; `--out` elsewhere) with the raw numbers in the `.json`
beside it. Nothing here asserts on timings.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import gc
import importlib.metadata
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .model_zoo import BY_NAME, MODELS, TINY_BATCH, Built, Inputs, ModelSpec
from .run import (REPO_ROOT, RESULTS_DIR, clip, geomean, rewritec_backend, rewritec_records,
                  short_error, start_dynamo, synchronize)

MODES = ("infer", "latency", "fp32", "train")
# backend -> (torch.compile backend, mode); eager is not compiled
BACKENDS: dict[str, tuple[str, str | None] | None] = {
    "eager": None,
    "inductor": ("inductor", None),
    "inductor-ro": ("inductor", "reduce-overhead"),
    "inductor-ma": ("inductor", "max-autotune"),
    "rewritec": ("rewritec", None),
    "rewritec-ro": ("rewritec", "reduce-overhead"),
    "rewritec-ma": ("rewritec", "max-autotune"),
}
AUTOTUNE_ONLY = ("inductor-ma", "rewritec-ma")
PROFILE_STEPS = 3
CHILD_MARKER = "REWRITEC_MODELS_CHILD "
Reference = tuple[torch.Tensor, list[torch.Tensor]]  # fp32 output, parameter gradients


@dataclass
class Row:
    model: str
    family: str
    mode: str
    backend: str
    batch: int | None = None
    shape: str = ""
    ms: float | None = None
    host_ms: float | None = None
    gpu_ms: float | None = None
    kernels: float | None = None
    peak_mb: float | None = None  # the timed steps
    reserved_mb: float | None = None  # the timed steps, reserved by the allocator
    compile_peak_mb: float | None = None  # compile, first call and warm-up (JSON only)
    first_call_s: float | None = None
    cold_s: float | None = None
    warm_s: float | None = None
    err: float | None = None
    grad_err: float | None = None
    path: str = ""
    error: str | None = None
    traceback: str | None = None
    skipped: str | None = None
    graphs: dict[str, int] = field(default_factory=dict)
    # rewritec: coverage.py's measure summed over the graphs compiled (report.json's form)
    coverage: dict[str, Any] | None = None
    # the profile's kernels by kind, and the commonest generated and ATen ones (GPU)
    kernel_breakdown: dict[str, Any] | None = None
    pools_mb: dict[str, float] | None = None  # reserved after the timed steps (GPU)


@dataclass(frozen=True)
class Settings:
    device: torch.device
    dtype: torch.dtype  # the "bf16" of infer/latency and train's autocast
    tiny: bool
    steps: int
    warmup: int
    first_call: bool

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


# --------------------------------------------------------------------------- steps


def modes_for(spec: ModelSpec, modes: Sequence[str]) -> list[str]:
    return [m for m in modes if m != "fp32" or spec.family == "cnn"]


def batch_for(spec: ModelSpec, mode: str, tiny: bool) -> int:
    if mode == "latency":
        return 1
    if tiny:
        return TINY_BATCH
    return spec.train_batch if mode == "train" else spec.infer_batch


def compile_fn(fn: Callable[..., Any], backend: str) -> Callable[..., Any]:
    how = BACKENDS[backend]
    if how is None:
        return fn
    name, mode = how
    return torch.compile(fn, backend=rewritec_backend() if name == "rewritec" else name,
                         mode=mode)


def make_step(built: Built, mode: str, fn: Callable[[Inputs], torch.Tensor], inputs: Inputs,
              settings: Settings, graphs: bool) -> Callable[[], torch.Tensor]:
    """One step of `mode` through `fn` (the forward or the loss, compiled or not).

    `graphs`: a CUDA-graph mode, whose user marks each step's start."""
    amp = mode == "train" and settings.dtype != torch.float32
    model = built.model

    def step() -> torch.Tensor:
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if mode != "train":
            with torch.no_grad():
                return fn(inputs)
        model.zero_grad(set_to_none=True)
        with torch.autocast(settings.device.type, dtype=settings.dtype, enabled=amp):
            loss = fn(inputs)
        loss.backward()
        return loss.detach()
    return step


def step_fn(built: Built, mode: str) -> Callable[[Inputs], torch.Tensor]:
    """What is compiled: the forward (inference) or the forward and the loss (train)."""
    if mode == "train":
        return lambda x: built.loss(built.model, x)
    return lambda x: built.forward(built.model, x)


def outputs_of(step: Callable[[], torch.Tensor], model: torch.nn.Module, mode: str
               ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run one step; its output and (training) the parameter gradients, as fp32 copies."""
    out = step().detach().float().clone()
    grads = [p.grad.detach().float().clone() for p in model.parameters()
             if mode == "train" and p.grad is not None]
    return out, grads


def rel_error(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> float | None:
    """max |got - want| / max |want| over all tensors together."""
    if not want or len(got) != len(want):
        return None
    diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    scale = max(float(w.abs().max()) for w in want)
    return diff / scale if scale > 0 else diff


# --------------------------------------------------------------------------- measuring


def time_steps(step: Callable[[], Any], settings: Settings) -> tuple[float, float]:
    """(median step ms, median host ms) over settings.steps steps."""
    walls, hosts = [], []
    for _ in range(settings.steps):
        synchronize(settings.device)
        t0 = time.perf_counter()
        step()
        t1 = time.perf_counter()
        synchronize(settings.device)
        t2 = time.perf_counter()
        hosts.append((t1 - t0) * 1e3)
        walls.append((t2 - t0) * 1e3)
    return statistics.median(walls), statistics.median(hosts)


def profile_kernels(step: Callable[[], Any], device: torch.device
                    ) -> tuple[float | None, float | None, dict[str, Any] | None]:
    """(device kernel ms per step, kernels per step, `kernel_breakdown`) over
    PROFILE_STEPS steps; CUDA only."""
    if device.type != "cuda":
        return None, None, None
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_STEPS):
            step()
        synchronize(device)
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events()
               if e.device_type == DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    total_us = sum(us for _, us in kernels)
    return (total_us / 1e3 / PROFILE_STEPS, len(kernels) / PROFILE_STEPS,
            kernel_breakdown(kernels, PROFILE_STEPS))


# Substrings of the device kernels' names, per kind (checked in this order, lower case)
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("attention", ("flash", "fmha", "attention", "sdpa", "attn")),
    ("matmul/conv", ("gemm", "matmul", "cutlass", "xmma", "nvjet", "cublas", "wgmma", "conv",
                     "sm90_", "sm80_", "cudnn")),
    ("aten", ("at::native", "at::cuda", "at_cuda_detail", "void at::", "elementwise_kernel",
              "reduce_kernel", "cub::", "thrust::")),
)
TOP_KERNELS = 15
GENERATED = ("triton_", "fuse_")  # Inductor's and rewritec's Triton kernels


def kernel_kind(name: str) -> str:
    """The kind of a device kernel, from its name: attention, matmul/conv (library
    calls), aten (ATen's own kernels: copies, casts, pointwise and reductions it ran
    outside any generated kernel) or generated (Triton's: Inductor's or rewritec's)."""
    low = name.lower()
    if low.startswith(GENERATED) and not any(m in low for m in ("attention", "matmul")):
        return "generated"  # (Inductor names a conv's fused epilogue "..._convolution_...")
    for kind, marks in KERNEL_KINDS:
        if any(m in low for m in marks):
            return kind
    return "generated"


def kernel_breakdown(kernels: Sequence[tuple[str, float]], steps: int) -> dict[str, Any]:
    """Per kind, {"count", "ms"} a step; `top`: the commonest generated and ATen
    kernels, [name (200 characters at most), count a step, ms a step], by count."""
    kinds: dict[str, dict[str, float]] = {}
    names: dict[str, list[float]] = {}
    for name, us in kernels:
        kind = kernel_kind(name)
        k = kinds.setdefault(kind, {"count": 0.0, "ms": 0.0})
        k["count"] += 1 / steps
        k["ms"] += us / 1e3 / steps
        if kind in ("generated", "aten"):
            n = names.setdefault(name[:200], [0.0, 0.0])
            n[0] += 1 / steps
            n[1] += us / 1e3 / steps
    top = sorted(names.items(), key=lambda kv: (-kv[1][0], -kv[1][1]))[:TOP_KERNELS]
    return {"kinds": kinds, "top": [[n, c, ms] for n, (c, ms) in top]}


def pools_mb(device: torch.device) -> dict[str, float] | None:
    """Reserved MB now: in private pools (CUDA graphs') and in the shared ones."""
    if device.type != "cuda":
        return None
    out = {"graph pools": 0.0, "shared": 0.0}
    for seg in torch.cuda.memory._snapshot(device)["segments"]:
        private = tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)
        out["graph pools" if private else "shared"] += seg["total_size"] / 2**20
    return out


def path_of(backend: str, records: list[Any], dynamo_before: dict[str, int]
            ) -> tuple[str, dict[str, int]]:
    """The path column and its counts: what ran."""
    if BACKENDS[backend] is None:
        return "eager", {}
    counts = dynamo_counts()
    graphs = {"dynamo_graphs": counts["graphs"] - dynamo_before["graphs"],
              "graph_breaks": counts["breaks"] - dynamo_before["breaks"]}
    if backend.startswith("rewritec"):
        graphs["compiled"] = sum(1 for r in records if r.status == "compiled")
        graphs["fallback"] = sum(1 for r in records if r.status != "compiled")
        graphs["cuda_graph"] = sum(1 for r in records
                                   if str(r.cudagraphs).startswith("CUDA graph recorded"))
        text = (f"{graphs['compiled']} compiled, {graphs['fallback']} fallback, "
                f"{graphs['cuda_graph']} CUDA graph")
        ops = sorted({op for r in records for op in r.fallback_ops})
        if ops:
            text += f" (ATen: {', '.join(ops[:4])}{'...' if len(ops) > 4 else ''})"
    else:
        text = f"{graphs['dynamo_graphs']} graphs"
    if graphs["graph_breaks"]:
        text += f", {graphs['graph_breaks']} breaks"
    return text, graphs


def coverage_of(backend: str, records: list[Any]) -> dict[str, Any] | None:
    """A rewritec backend's coverage over all its graphs: the counts of each graph
    (GraphRecord.coverage) added up, so a big graph weighs more than a small one."""
    if not backend.startswith("rewritec") or not records:
        return None
    from rewritec.coverage import Coverage

    per_graph = [(r.name, r.coverage()) for r in records]
    total = sum((c for _, c in per_graph), Coverage()).to_json()
    # issue 22's target is per graph: the graph with the lowest share, by name
    shares = [(c.share, name) for name, c in per_graph if c.share is not None]
    if shares:
        share, name = min(shares)
        total["lowest_graph"] = {"graph": name, "share": round(share, 4)}
    return total


def dynamo_counts() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]),
            "breaks": int(sum(counters["graph_break"].values()))}


def clear_rewritec_records() -> None:
    with contextlib.suppress(Exception):
        from rewritec import report

        report.RECORDS.clear()


def release(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        # cuBLAS workspaces live in the caching allocator and CUDA-graph capture frees
        # them: freed here, each backend's peak counts the ones it uses itself
        torch._C._cuda_clearCublasWorkspaces()
        torch.cuda.empty_cache()


def memory_base(device: torch.device) -> tuple[int, int]:
    """(allocated, reserved) bytes now, with the peaks reset."""
    if device.type != "cuda":
        return 0, 0
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def peak_mb(device: torch.device, base: int) -> float:
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def reserved_mb(device: torch.device, base: int) -> float:
    return (torch.cuda.max_memory_reserved(device) - base) / 2**20


def measure(row: Row, built: Built, inputs: Inputs, ref: Reference, settings: Settings) -> None:
    """Fill `row` with one backend's numbers on one (model, mode)."""
    backend, mode, model = row.backend, row.mode, built.model
    model.zero_grad(set_to_none=True)
    # reset, then collect, before the base: what the last backend left is freed now,
    # not during this one's steps (which made Inductor's peaks negative)
    release(settings.device)
    clear_rewritec_records()
    dynamo_before = dynamo_counts()
    base, reserved_base = memory_base(settings.device)
    graphs = backend.endswith(("-ro", "-ma"))
    t0 = time.perf_counter()
    step = make_step(built, mode, compile_fn(step_fn(built, mode), backend), inputs, settings,
                     graphs)
    step()
    synchronize(settings.device)
    row.first_call_s = time.perf_counter() - t0
    for _ in range(settings.warmup):
        step()
    out, grads = outputs_of(step, model, mode)
    row.err = rel_error([out], [ref[0]])
    row.grad_err = rel_error(grads, ref[1]) if mode == "train" else None
    del out, grads
    if settings.cuda:
        row.compile_peak_mb = peak_mb(settings.device, base)
        torch.cuda.reset_peak_memory_stats(settings.device)
    row.ms, row.host_ms = time_steps(step, settings)
    if settings.cuda:
        row.peak_mb = peak_mb(settings.device, base)
        row.reserved_mb = reserved_mb(settings.device, reserved_base)
    row.pools_mb = pools_mb(settings.device)
    row.gpu_ms, row.kernels, row.kernel_breakdown = profile_kernels(step, settings.device)
    row.path, row.graphs = path_of(backend, rewritec_records(), dynamo_before)
    row.coverage = coverage_of(backend, rewritec_records())


def prepare(spec: ModelSpec, mode: str, settings: Settings, reference: bool = True
            ) -> tuple[Built, Inputs, Reference | None]:
    """The model and inputs of one mode, and (`reference`) its fp32 eager output."""
    torch.manual_seed(0)
    built = spec.build(settings.tiny)
    built.model.to(settings.device).train(mode == "train")
    inputs = built.make_inputs(batch_for(spec, mode, settings.tiny), settings.device)
    ref = None
    if reference:
        fp32 = Settings(settings.device, torch.float32, settings.tiny, 0, 0, False)
        ref_step = make_step(built, mode, step_fn(built, mode), inputs, fp32, graphs=False)
        ref = outputs_of(ref_step, built.model, mode)
        built.model.zero_grad(set_to_none=True)
    if mode in ("infer", "latency") and settings.dtype != torch.float32:
        built.model.to(settings.dtype)
        inputs = {k: v.to(settings.dtype) if v.is_floating_point() else v
                  for k, v in inputs.items()}
    return built, inputs, ref


def first_line(e: BaseException) -> str:
    """The error's first line, of its root cause: what a row shows."""
    cause = e
    # Dynamo's BackendCompilerFailed keeps the backend's error as inner_exception
    while (inner := getattr(cause, "inner_exception", None) or cause.__cause__) is not None:
        cause = inner
    lines = str(cause).strip().splitlines()
    text = f"{type(cause).__name__}: {lines[0] if lines else ''}"
    return clip(text if cause is e else f"{type(e).__name__} from {text}", 300)


def run_mode(spec: ModelSpec, mode: str, backends: Sequence[str], settings: Settings
             ) -> list[Row]:
    batch = batch_for(spec, mode, settings.tiny)
    rows = [Row(spec.name, spec.family, mode, b, batch=batch) for b in backends]
    try:
        built, inputs, ref = prepare(spec, mode, settings)
    except Exception as e:  # noqa: BLE001 - a row, never the end of the suite
        for row in rows:
            row.error = f"could not build: {first_line(e)}"
        return rows
    assert ref is not None
    for row in rows:
        row.shape = built.shape
        t0 = time.perf_counter()
        try:
            measure(row, built, inputs, ref, settings)
        except Exception as e:  # noqa: BLE001 - exception or OOM: a row
            row.error = first_line(e)
            row.traceback = traceback.format_exc(limit=-8)
        print(f"  {spec.name:14} {mode:8} {row.backend:12} {fmt(row.ms):>9} ms  "
              f"{row.error or row.path}  ({time.perf_counter() - t0:.1f} s)", flush=True)
        if settings.first_call and BACKENDS[row.backend] is not None and not row.error:
            first_call_pair(row, settings)
    del built, inputs, ref
    release(settings.device)
    return rows


def run_model(spec: ModelSpec, modes: Sequence[str], backends: Sequence[str],
              settings: Settings) -> list[Row]:
    why = spec.missing()
    if why:
        print(f"  {spec.name}: skipped, {why}", flush=True)
        return [Row(spec.name, spec.family, "—", "—", skipped=why)]
    return [row for mode in modes_for(spec, modes)
            for row in run_mode(spec, mode, backends, settings)]


# --------------------------------------------------------------------------- first call


def first_call_child(spec: ModelSpec, mode: str, backend: str, settings: Settings) -> dict:
    """In a fresh process: trace + compile + first step of one backend, in seconds."""
    built, inputs, _ = prepare(spec, mode, settings, reference=False)
    start_dynamo(settings.device)
    synchronize(settings.device)
    t0 = time.perf_counter()
    step = make_step(built, mode, compile_fn(step_fn(built, mode), backend), inputs, settings,
                     backend.endswith(("-ro", "-ma")))
    step()
    synchronize(settings.device)
    return {"first_call_s": time.perf_counter() - t0}


def first_call_pair(row: Row, settings: Settings) -> None:
    """Cold and warm first call of row's backend, each in a fresh process."""
    root = Path(tempfile.mkdtemp(prefix=f"rewritec-models-{row.model}-{row.backend}-"))
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(root / "inductor"),
               TRITON_CACHE_DIR=str(root / "triton"), REWRITEC_CACHE_DIR=str(root / "rewritec"))
    cmd = [sys.executable, "-m", "benchmarks.models", "--first-call-child", "--models", row.model,
           "--modes", row.mode, "--backends", row.backend, "--device", settings.device.type,
           "--dtype", dtype_name(settings.dtype), *(["--tiny"] if settings.tiny else [])]
    try:
        for which in ("cold", "warm"):
            data = child_json(subprocess.run(cmd, check=False, cwd=REPO_ROOT, env=env,
                                             capture_output=True, text=True, timeout=1800))
            if "error" in data:
                row.error = row.error or f"{which} first call: {data['error']}"
                break
            setattr(row, f"{which}_s", data["first_call_s"])
    except subprocess.TimeoutExpired:
        row.error = row.error or "first call: timed out"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def child_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_MARKER):
            return json.loads(line[len(CHILD_MARKER):])
    tail = " ".join(proc.stderr.strip().splitlines()[-2:])
    return {"error": f"exited with {proc.returncode}: {clip(tail, 300)}"}


# --------------------------------------------------------------------------- jobs


def run_jobs(argv: Sequence[str], names: Sequence[str], jobs: int) -> list[Row]:
    """Run the models in `jobs` processes, process k on GPU k with every jobs-th model."""
    tmp = Path(tempfile.mkdtemp(prefix="rewritec-models-jobs-"))
    procs = []
    for k in range(jobs):
        share = names[k::jobs]
        if not share:
            continue
        out = tmp / f"rows-{k}.json"
        cmd = [sys.executable, "-m", "benchmarks.models", *argv, "--models", ",".join(share),
               "--rows-out", str(out)]
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(k))
        procs.append((out, share, subprocess.Popen(cmd, cwd=REPO_ROOT, env=env)))
    rows: list[Row] = []
    for out, share, proc in procs:
        code = proc.wait()
        if out.exists():
            rows += [Row(**r) for r in json.loads(out.read_text())]
        else:
            rows += [Row(n, BY_NAME[n].family, "—", "—", error=f"job exited with {code}")
                     for n in share]
    shutil.rmtree(tmp, ignore_errors=True)
    order = {n: i for i, n in enumerate(names)}
    return sorted(rows, key=lambda r: order[r.model])


# --------------------------------------------------------------------------- report


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "—"
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.{digits}g}"


def fmt_err(x: float | None) -> str:
    return "—" if x is None else f"{x:.1e}"


def fmt_share(coverage: dict[str, Any] | None) -> str:
    if coverage is None or coverage["share"] is None:
        return "—"
    return f"{100 * coverage['share']:.1f}%"


def outside_lines(mode_groups: Sequence[Sequence[Row]], top: int = 10) -> list[str]:
    """Per model: the ops its rewritec graphs leave outside kernels, commonest first;
    rewritec backends with the same list share a line."""
    lines = []
    for group in mode_groups:
        same: dict[str, list[str]] = {}
        for r in group:
            if r.coverage is not None:
                ops = list(r.coverage["outside_ops"].items())
                text = ", ".join(f"{op} {n}" for op, n in ops[:top]) or "nothing"
                more = f", +{len(ops) - top} more" if len(ops) > top else ""
                low = r.coverage.get("lowest_graph")
                lowest = f" (lowest graph: {fmt_share(low)})" if low else ""
                key = f"{fmt_share(r.coverage)} in kernels{lowest}; outside: {text}{more}"
                same.setdefault(key, []).append(r.backend)
        lines += [f"- `{group[0].model}` ({', '.join(b)}): {key}" for key, b in same.items()]
    title = f"Outside kernels (rewritec; ops after rewriting, the {top} commonest):"
    return ["", title, "", *lines] if lines else []


BREAKDOWN_KINDS = ("generated", "aten", "matmul/conv", "attention")


def breakdown_lines(mode_groups: Sequence[Sequence[Row]]) -> list[str]:
    """A table of each row's kernels by kind (count / GPU ms a step) and reserved
    memory by pool, for the rows that have them (GPU)."""
    rows = [r for g in mode_groups for r in g if r.kernel_breakdown or r.pools_mb]
    if not rows:
        return []
    lines = ["", "Kernels by kind, count / GPU ms a step; reserved MB after the timed steps:",
             "", "| model | backend | " + " | ".join(BREAKDOWN_KINDS)
             + " | graph pools MB | shared MB |", "|---|---|" + "---:|" * 6]
    for r in rows:
        kinds = (r.kernel_breakdown or {}).get("kinds", {})
        cells = [f"{fmt(kinds[k]['count'])} / {fmt(kinds[k]['ms'])}" if k in kinds else "—"
                 for k in BREAKDOWN_KINDS]
        pools = r.pools_mb or {}
        lines.append(f"| {r.model} | {r.backend} | " + " | ".join(cells)
                     + f" | {fmt(pools.get('graph pools'))} | {fmt(pools.get('shared'))} |")
    return lines


def best(rows: Sequence[Row], prefix: str) -> float | None:
    times = [r.ms for r in rows if r.backend.split("-")[0] == prefix and r.ms]
    return min(times) if times else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a and b else None


def counterpart(rows: Sequence[Row], row: Row) -> Row | None:
    """Inductor's row of the same mode flavour: rewritec-ro -> inductor-ro."""
    name = "inductor" + row.backend[len("rewritec"):]
    return next((r for r in rows if r.backend == name and r.ms), None)


def groups(rows: Sequence[Row], mode: str) -> list[list[Row]]:
    """The rows of `mode`, one list per model, in order."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        if r.mode == mode:
            out.setdefault(r.model, []).append(r)
    return list(out.values())


HEADER = ["model", "batch", "backend", "ms", "×ind-best", "×eager", "host ms", "GPU ms",
          "kernels", "in kernels", "host µs/kernel", "peak MB", "reserved MB", "1st call s",
          "cold / warm s", "err", "eager err", "grad err", "eager grad err", "path"]


def table_row(r: Row, group: Sequence[Row]) -> list[str]:
    eager = next((g for g in group if g.backend == "eager"), None)
    per_kernel = r.host_ms * 1e3 / r.kernels if r.host_ms and r.kernels else None
    cold_warm = "—" if r.cold_s is None else f"{fmt(r.cold_s)} / {fmt(r.warm_s)}"
    return [r.model, str(r.batch), r.backend, fmt(r.ms), fmt(ratio(r.ms, best(group, "inductor"))),
            fmt(ratio(r.ms, eager.ms if eager else None)), fmt(r.host_ms), fmt(r.gpu_ms),
            fmt(r.kernels), fmt_share(r.coverage), fmt(per_kernel), fmt(r.peak_mb),
            fmt(r.reserved_mb), fmt(r.first_call_s), cold_warm,
            fmt_err(r.err), fmt_err(eager.err if eager else None), fmt_err(r.grad_err),
            fmt_err(eager.grad_err if eager else None),
            f"ERROR: {r.error}" if r.error else r.path]


def summary(rows: Sequence[Row]) -> dict[str, dict[str, Any]]:
    """Per mode and rewritec backend: geomean time / Inductor's best, and three counts."""
    out: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        for group in groups(rows, mode):
            ind_best = best(group, "inductor")
            eager = next((g.ms for g in group if g.backend == "eager"), None)
            for r in group:
                if not r.backend.startswith("rewritec") or not r.ms:
                    continue
                s = out.setdefault(f"{mode} {r.backend}", {"ratios": [], "models": 0,
                                                            "slower_than_eager": 0,
                                                            "more_memory": 0, "more_host": 0})
                s["models"] += 1
                if ind_best:
                    s["ratios"].append(r.ms / ind_best)
                s["slower_than_eager"] += bool(eager and r.ms > eager)
                ind = counterpart(group, r)
                mine, theirs = held_mb(r), held_mb(ind) if ind else None
                s["more_memory"] += bool(mine and theirs and mine > theirs)
                s["more_host"] += bool(ind and r.host_ms and ind.host_ms
                                       and r.host_ms > ind.host_ms)
    for s in out.values():
        s["geomean_vs_inductor_best"] = geomean(s.pop("ratios"))
    return out


def held_mb(row: Row) -> float | None:
    """The memory a row's backend holds: its peak allocated, or, in the CUDA-graph
    modes, its reserved memory. Inductor's CUDA-graph trees keep their pool out of the
    allocator's allocated counts (its reduce-overhead peaks read about 0 MB), so only
    reserved memory compares the two there."""
    return row.reserved_mb if row.backend.endswith(("-ro", "-ma")) else row.peak_mb


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: Sequence[Row], env: dict[str, Any]) -> str:
    lines = [f"# rewritec models suite: {env['device_name']}", "",
             f"- torch {env['torch']}, triton {env['triton']}, transformers "
             f"{env['transformers']}, timm {env['timm']}, python {env['python']}, "
             f"rewritec @ {env['git_commit']}",
             f"- date: {env['date']}; {env['steps']} timed steps after {env['warmup']} warm-up; "
             f"dtype {env['dtype']}{'; tiny configs' if env['tiny'] else ''}",
             f"- command: `{env['command']}`", ""]
    skipped = [r for r in rows if r.skipped]
    lines += [f"- `{r.model}` skipped: {r.skipped}" for r in skipped]
    for mode in MODES:
        mode_groups = groups(rows, mode)
        if not mode_groups:
            continue
        lines += ["", f"## {mode}", "", "| " + " | ".join(HEADER) + " |",
                  "|" + "|".join(["---"] * 3 + ["---:"] * (len(HEADER) - 4) + ["---"]) + "|"]
        for group in mode_groups:
            lines += ["| " + " | ".join(cell(c) for c in table_row(r, group)) + " |"
                      for r in group]
        shapes = "; ".join(f"`{g[0].model}` {g[0].shape}" for g in mode_groups if g[0].shape)
        lines += ["", f"Shapes: {shapes}"]
        lines += outside_lines(mode_groups)
        lines += breakdown_lines(mode_groups)
    lines += ["", "## Summary", "", "| mode / backend | models | geomean time / Inductor best "
              "| slower than eager | memory > Inductor's | host time > Inductor's |",
              "|---|---:|---:|---:|---:|---:|"]
    for key, s in summary(rows).items():
        lines.append(f"| {key} | {s['models']} | {fmt(s['geomean_vs_inductor_best'])} | "
                     f"{s['slower_than_eager']} | {s['more_memory']} | {s['more_host']} |")
    lines += ["", "Memory and host time compare with Inductor's backend of the same mode "
              "(rewritec-ro with inductor-ro); memory is peak MB, or reserved MB in the "
              "CUDA-graph modes (see the columns).", "", "## Columns", "", column_docs()]
    return "\n".join(lines) + "\n"


def column_docs() -> str:
    """The column definitions: the module docstring's list."""
    doc = __doc__ or ""
    start = doc.index("Columns")
    return doc[start:doc.index("A failing")].strip()


def device_slug(device: torch.device) -> str:
    """`h100`, `a100`, ... from the GPU's name; `cpu` on the CPU."""
    if device.type != "cuda":
        return "cpu"
    vendor = {"nvidia", "geforce", "tesla", "quadro", "rtx"}
    words = re.split(r"[\s_-]+", torch.cuda.get_device_name(device).lower())
    return next((w for w in words if w not in vendor and re.search(r"\d", w)), "cuda")


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def environment_common(device: torch.device, command: Sequence[str]) -> dict[str, Any]:
    """Device, versions, commit and date: what every results file of a suite names."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], check=False, cwd=REPO_ROOT,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    return {"device_name": f"{name} ({device_slug(device)})", "torch": torch.__version__,
            "triton": version("triton"), "transformers": version("transformers"),
            "timm": version("timm"), "python": sys.version.split()[0], "git_commit": commit,
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join(command)}


def environment(settings: Settings, argv: Sequence[str]) -> dict[str, Any]:
    env = environment_common(settings.device, ["python -m benchmarks.models", *argv])
    env.update(steps=settings.steps, warmup=settings.warmup, tiny=settings.tiny,
               dtype=dtype_name(settings.dtype))
    return env


def write_results(rows: Sequence[Row], env: dict[str, Any], out: Path) -> str:
    text = markdown(rows, env)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    raw = {"environment": env, "summary": summary(rows), "rows": [asdict(r) for r in rows]}
    out.with_suffix(".json").write_text(json.dumps(raw, indent=2, default=str) + "\n")
    return text


# --------------------------------------------------------------------------- main


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.models", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=None, help="comma-separated (default: all): "
                   + ",".join(m.name for m in MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--backends", default=None,
                   help="comma-separated (default: all; -ma ones only with --autotune): "
                        + ",".join(BACKENDS))
    p.add_argument("--autotune", action="store_true", help="also the max-autotune backends")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None)
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="low-precision dtype (default bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--tiny", action="store_true", help="few-layer configs, small inputs")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 20; quick 5)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps (default 5; quick 3)")
    p.add_argument("--quick", action="store_true", help="fewer steps, no --first-call")
    p.add_argument("--first-call", action="store_true",
                   help="cold and warm first call of every compiled backend in fresh processes")
    p.add_argument("--jobs", type=int, default=1, help="processes, one GPU each")
    p.add_argument("--out", type=Path, default=None,
                   help="markdown path (default benchmarks/results/models-<device>.md)")
    p.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rows-out", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def names_of(spec: str | None, known: Sequence[str], what: str) -> list[str]:
    if not spec:
        return list(known)
    names = [n.strip() for n in spec.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown {what} {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def settings_of(args: argparse.Namespace) -> Settings:
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if dev == "cuda" else "fp32")]
    steps = args.steps or (5 if args.quick else 20)
    warmup = args.warmup if args.warmup is not None else (3 if args.quick else 5)
    return Settings(torch.device(dev), dtype, args.tiny, steps, warmup,
                    args.first_call and not args.quick)


def child_argv(argv: Sequence[str]) -> list[str]:
    """argv without --jobs, --models and --out: what each job process is given."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--jobs", "--models", "--out"):
            skip = True
        elif not a.startswith(("--jobs=", "--models=", "--out=")):
            out.append(a)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    settings = settings_of(args)
    models = names_of(args.models, list(BY_NAME), "model")
    modes = names_of(args.modes, MODES, "mode")
    default_backends = [b for b in BACKENDS if args.autotune or b not in AUTOTUNE_ONLY]
    backends = names_of(args.backends, default_backends if not args.backends else list(BACKENDS),
                        "backend")
    if args.first_call_child:
        try:
            data = first_call_child(BY_NAME[models[0]], modes[0], backends[0], settings)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            data = {"error": short_error(e)}
        print(CHILD_MARKER + json.dumps(data), flush=True)
        return 0
    if args.jobs > 1:
        rows = run_jobs(child_argv(argv), models, args.jobs)
    else:
        rows = [r for name in models for r in run_model(BY_NAME[name], modes, backends, settings)]
    if args.rows_out:
        args.rows_out.write_text(json.dumps([asdict(r) for r in rows], default=str))
        return 0
    out = args.out or RESULTS_DIR / f"models-{device_slug(settings.device)}.md"
    text = write_results(rows, environment(settings, argv), out)
    print()
    print(text)
    print(f"wrote {out} and {out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
