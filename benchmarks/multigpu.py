"""Data-parallel training through rewritec: DDP and FSDP2 on several GPUs (or CPU gloo).

    python -m benchmarks.multigpu                  # every GPU of the host, NCCL
    python -m benchmarks.multigpu --device cpu --tiny --world 2   # gloo smoke run

For each model (the models suite's GPT-2 and Llama-style decoder), each wrapper (DDP,
FSDP2 with every block sharded) and each backend (eager, Inductor, rewritec), WORLD
processes train from the same weights for `--warmup` + `--steps` steps (zero_grad,
forward and loss under `torch.autocast(bfloat16)` on the GPU, backward, AdamW), each
rank on its own data. A (model, wrapper) pair runs in its own processes, so a crash
or hang there costs only its rows.

Columns:
- **step ms**: median wall time of a training step on rank 0, the ranks synchronised
  by the collectives inside the step;
- **/eager**, **/inductor**: that time over eager's and Inductor's;
- **peak MB/GPU**: the most memory allocated on any one rank during the timed steps,
  above what the model and optimiser held before the first step;
- **loss err**: max |loss - eager loss| / |eager loss| over the warm-up steps, same
  data and weights: agreement with eager, not with an fp32 reference;
- **path**: Dynamo graphs and graph breaks on rank 0, and rewritec's graphs that were
  compiled / fell back to ATen (with the first reason).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .model_zoo import BY_NAME, Built
from .models import (clear_rewritec_records, device_slug, dynamo_counts,
                     environment_common, release)
from .run import RESULTS_DIR, rewritec_backend

MODELS = ("gpt2", "llama")
WRAPPERS = ("ddp", "fsdp2")
BACKENDS = ("eager", "inductor", "rewritec")
# Collectives must not use NVLink multicast on the lent machines (device notes);
# set here too, so the spawned workers keep them whatever started this process.
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated transformer blocks FSDP2 shards one by one."""
    for name in ("transformer.h", "model.layers"):
        mod: Any = model
        try:
            for part in name.split("."):
                mod = getattr(mod, part)
        except AttributeError:
            continue
        return list(mod)
    raise ValueError(f"no transformer blocks found in {type(model).__name__}")


def _wrap(model: torch.nn.Module, wrapper: str, device: torch.device) -> torch.nn.Module:
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        return DDP(model, device_ids=ids)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in _blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _compiled(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    if backend == "eager":
        return model
    chosen = rewritec_backend() if backend == "rewritec" else backend
    return torch.compile(model, backend=chosen)  # type: ignore[return-value]


def _rewritec_path() -> str:
    try:
        from rewritec import report
    except ImportError:
        return ""
    records = list(report.RECORDS)
    fell = [r for r in records if r.status != "compiled"]
    text = f"; rewritec {len(records) - len(fell)} compiled, {len(fell)} fell back"
    if fell:
        text += f" ({fell[0].reason.splitlines()[0][:80]})"
    return text


def _run_backend(built: Built, wrapper: str, backend: str, args: argparse.Namespace,
                 device: torch.device, rank: int) -> dict[str, Any]:
    model = built.model.to(device)
    model.train()
    wrapped = _wrap(model, wrapper, device)
    net = _compiled(wrapped, backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    torch.manual_seed(1000 + rank)  # each rank its own data, the same for every backend
    inputs = built.make_inputs(args.batch, device)
    amp = device.type == "cuda"

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = built.loss(net, inputs)
        loss.backward()
        opt.step()
        return float(loss.detach())

    losses = [step() for _ in range(args.warmup)]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    peak = ((torch.cuda.max_memory_allocated(device) - base) / 2**20
            if device.type == "cuda" else None)
    peaks: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(peaks, peak)
    counts = dynamo_counts()
    path = f"{counts['graphs']} graphs, {counts['breaks']} breaks" + (
        _rewritec_path() if backend == "rewritec" else "")
    return {"backend": backend, "ms": statistics.median(times), "losses": losses,
            "peak_mb": max(peaks) if peaks[0] is not None else None, "path": path}


def _reset_between_backends(device: torch.device) -> None:
    """What one backend leaves behind: compiled code, memory, records and counters."""
    from torch._dynamo.utils import counters

    release(device)
    counters.clear()  # `path` counts this backend's graphs and breaks only
    clear_rewritec_records()


def _worker(rank: int, world: int, port: int, model_name: str, wrapper: str,
            args: argparse.Namespace, out: str) -> None:
    os.environ.update(NO_MULTICAST)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    rows = []
    try:
        for backend in args.backends:
            _reset_between_backends(device)
            torch.manual_seed(0)  # the same weights for every backend and rank
            built = BY_NAME[model_name].build(args.tiny)
            try:
                row = _run_backend(built, wrapper, backend, args, device, rank)
            except Exception as e:  # a backend's failure is a row, not the end of the run
                if rank == 0:
                    traceback.print_exc()
                row = {"backend": backend, "error": f"{type(e).__name__}: {e}".splitlines()[0]}
            row.update(model=model_name, wrapper=wrapper)
            rows.append(row)
            if rank == 0:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
            del built
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(model_name: str, wrapper: str, args: argparse.Namespace, out: Path) -> str | None:
    """Run one (model, wrapper) pair in `args.world` processes; an error line or None."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker,
                         args=(r, args.world, port, model_name, wrapper, args, str(out)))
             for r in range(args.world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + args.timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    if hung:
        return f"timed out after {args.timeout} s"
    codes = [p.exitcode for p in procs]
    return None if all(c == 0 for c in codes) else f"workers exited {codes}"


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}g}"


def _loss_err(row: dict[str, Any], eager: dict[str, Any] | None) -> float | None:
    if eager is None or "losses" not in row or "losses" not in eager:
        return None
    return max(abs(a - b) / max(abs(b), 1e-12)
               for a, b in zip(row["losses"], eager["losses"], strict=False))


def markdown(rows: Sequence[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [f"# Data-parallel training: {env['device_name']} x {env['world']}", "",
             "Generated by `benchmarks/multigpu.py`; columns are defined there.", "",
             f"- torch {env['torch']}, Triton {env['triton']}, transformers "
             f"{env['transformers']}; commit {env['git_commit']}; {env['date']}",
             f"- command: `{env['command']}`",
             f"- batch {env['batch']} per rank, {env['warmup']} warm-up + {env['steps']} "
             "timed steps, AdamW" + (", autocast bf16" if env["device"] == "cuda" else ""),
             "", "| model | wrapper | backend | step ms | /eager | /inductor | peak MB/GPU "
             "| loss err | path |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mates = {m["backend"]: m for m in rows
                 if m["model"] == r["model"] and m["wrapper"] == r["wrapper"] and "ms" in m}
        if "ms" not in r:
            lines.append(f"| {r['model']} | {r['wrapper']} | {r['backend']} | failed | | | | | "
                         f"{r.get('error', '')} |")
            continue
        eager, ind = mates.get("eager"), mates.get("inductor")
        lines.append(
            f"| {r['model']} | {r['wrapper']} | {r['backend']} | {r['ms']:.2f} "
            f"| {_fmt(r['ms'] / eager['ms'] if eager else None)} "
            f"| {_fmt(r['ms'] / ind['ms'] if ind else None)} | {_fmt(r.get('peak_mb'), 4)} "
            f"| {_fmt(_loss_err(r, eager), 2)} | {r.get('path', '')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--world", type=int, default=0, help="processes (default: every GPU, or 2)")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--wrappers", default=",".join(WRAPPERS))
    p.add_argument("--backends", default=",".join(BACKENDS))
    p.add_argument("--tiny", action="store_true", help="the suite's small configs")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per (model, wrapper)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.wrappers = [w for w in args.wrappers.split(",") if w]
    args.backends = [b for b in args.backends.split(",") if b]
    for name, known in ((args.models, BY_NAME), (args.wrappers, WRAPPERS),
                        (args.backends, BACKENDS)):
        bad = [n for n in name if n not in known]
        if bad:
            p.error(f"unknown {bad}; known: {', '.join(known)}")
    if args.world <= 0:
        args.world = torch.cuda.device_count() if args.device == "cuda" else 2
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    out = args.out or RESULTS_DIR / f"models-multigpu-{device_slug(device)}.md"
    env = environment_common(device, ["python -m benchmarks.multigpu",
                                      *(argv if argv is not None else sys.argv[1:])])
    env.update(world=args.world, batch=args.batch, steps=args.steps, warmup=args.warmup,
               device=args.device)
    rows_file = out.with_suffix(".jsonl")
    rows_file.parent.mkdir(parents=True, exist_ok=True)
    rows_file.write_text("")
    for model in args.models:
        for wrapper in args.wrappers:
            print(f"{model} {wrapper} ...", flush=True)
            error = _spawn(model, wrapper, args, rows_file)
            rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
            if error:
                done = {r["backend"] for r in rows if r["model"] == model
                        and r["wrapper"] == wrapper}
                rows_file.open("a").writelines(
                    json.dumps({"model": model, "wrapper": wrapper, "backend": b,
                                "error": error}) + "\n"
                    for b in args.backends if b not in done)
                rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
            out.write_text(markdown(rows, env))
    print(out.read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
