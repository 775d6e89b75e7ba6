"""Where the time goes: per-kernel profile of one benchmark case, per backend.

    python -m benchmarks.profile --case gpt2_block [--device cuda]
                                 [--backends eager,inductor,rewritec]

For each backend the case is compiled, warmed up, then run `--iters` times under
`torch.profiler`; the table lists the device kernels (or CPU ops) by total time,
per iteration. This is the tool behind the "why" column of the results files:
when rewritec loses a case, the profile shows which kernels make the difference.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from .cases import BY_NAME, Config
from .run import compile_with, synchronize


def kernel_table(prof: profile, iters: int, cuda: bool, top: int) -> list[tuple[str, float, float]]:
    """(name, ms per iteration, calls per iteration), largest first."""
    rows = []
    for evt in prof.key_averages():
        if cuda:
            total_us = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0)
            if not total_us or evt.device_type != torch.autograd.DeviceType.CUDA:
                continue
        else:
            total_us = evt.self_cpu_time_total
            if not total_us:
                continue
        rows.append((evt.key, total_us / 1000 / iters, evt.count / iters))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def profile_backend(case: str, backend: str, cfg: Config, iters: int, top: int) -> None:
    inst = BY_NAME[case].build(cfg)
    fn = inst.fn if backend == "eager" else compile_with(inst.fn, backend)
    grad = contextlib.nullcontext() if inst.training else torch.no_grad()
    cuda = cfg.device.type == "cuda"
    with grad:
        for _ in range(3):
            inst.run(fn)
        synchronize(cfg.device)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(iters):
                inst.run(fn)
            synchronize(cfg.device)
    rows = kernel_table(prof, iters, cuda, top)
    total = sum(r[1] for r in kernel_table(prof, iters, cuda, 10_000))
    print(f"\n## {case} / {backend}: {total:.3f} ms of {'kernels' if cuda else 'CPU ops'} "
          f"per iteration ({iters} iterations)")
    print("| ms/iter | calls/iter | kernel |\n|---:|---:|---|")
    for name, ms, calls in rows:
        print(f"| {ms:.4f} | {calls:.1f} | {name[:110]} |")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--case", required=True, help=f"one of {', '.join(BY_NAME)}")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", default="eager,inductor,rewritec")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    cfg = Config(device=torch.device(args.device), quick=args.quick)
    for case in args.case.split(","):
        for backend in args.backends.split(","):
            try:
                profile_backend(case, backend, cfg, args.iters, args.top)
            except Exception as e:  # noqa: BLE001 - report and go on to the next
                print(f"\n## {case} / {backend}: failed: {type(e).__name__}: {e}")
            torch._dynamo.reset()
    return 0


if __name__ == "__main__":
    sys.exit(main())
