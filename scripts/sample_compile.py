"""Where a first call's time goes, on every thread: a sampling profiler.

    python scripts/sample_compile.py CASE [--backend rewritec] [--every-ms 2]

cProfile (scripts/profile_compile.py) sees only the main thread and slows pure
Python several times over; this samples every thread's stack every few
milliseconds instead, so work on rewritec's Triton start-up thread and time spent
waiting on it both show. It prints, per thread, the seconds each function was on
the stack, and a timeline of the main thread in 50 ms buckets. Run it with fresh
REWRITEC_CACHE_DIR and TRITON_CACHE_DIR for the cold path, again for the warm one.
"""

from __future__ import annotations

import argparse
import collections
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cases import BY_NAME, Config  # noqa: E402
from benchmarks.run import compile_with, start_dynamo, synchronize  # noqa: E402

# Frames the timeline names: the innermost one from these places.
TIMELINE_KEYS = ("rewritec", "/work/", "triton/", "_functorch", "lark", "subprocess",
                 "importlib")


def _stack(frame: FrameType | None) -> list[str]:
    out = []
    while frame is not None:
        name = frame.f_code.co_filename.split("site-packages/")[-1]
        out.append(f"{name}:{frame.f_code.co_name}")
        frame = frame.f_back
    return out[::-1]


class Sampler(threading.Thread):
    def __init__(self, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s = every_s
        self.samples: list[tuple[float, str, list[str]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            now = time.perf_counter()
            names = {t.ident: t.name for t in threading.enumerate()}
            for tid, frame in sys._current_frames().items():
                if tid != self.ident:
                    self.samples.append((now, names.get(tid, str(tid)), _stack(frame)))
            time.sleep(self.every_s)


def report(samples: list[tuple[float, str, list[str]]], t0: float, t1: float,
           top: int) -> None:
    rows: dict[str, list[tuple[float, list[str]]]] = collections.defaultdict(list)
    for t, name, stack in samples:
        if t0 <= t <= t1:
            rows[name].append((t, stack))
    main = len(rows.get("MainThread", [])) or 1
    each = (t1 - t0) / main  # seconds a sample stands for
    for name, taken in rows.items():
        if len(taken) < 5:
            continue
        print(f"\n=== thread {name}: {len(taken)} samples (~{each * 1000:.1f} ms each)")
        inclusive: collections.Counter[str] = collections.Counter()
        for _, stack in taken:
            inclusive.update(set(stack))
        for frame, count in inclusive.most_common(top):
            print(f"{count * each:7.3f} s  {frame}")
    print("\n--- main thread, 50 ms buckets: the innermost frame of interest (samples)")
    buckets: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for t, stack in rows.get("MainThread", []):
        pick = next((f for f in reversed(stack) if any(k in f for k in TIMELINE_KEYS)), "?")
        buckets[int((t - t0) / 0.05)][pick] += 1
    for k in sorted(buckets):
        line = "  ;  ".join(f"{c}x {f}" for f, c in buckets[k].most_common(2))
        print(f"{k * 50:5d} ms: {line}")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case")
    p.add_argument("--backend", default="rewritec")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--every-ms", type=float, default=2.0)
    p.add_argument("--top", type=int, default=60)
    args = p.parse_args()
    device = torch.device(args.device)
    inst = BY_NAME[args.case].build(Config(device=device, quick=True))
    start_dynamo(device)
    sampler = Sampler(args.every_ms / 1000)
    sampler.start()
    synchronize(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        inst.run(compile_with(inst.fn, args.backend))
        synchronize(device)
    t1 = time.perf_counter()
    sampler.done.set()
    sampler.join()
    print(f"first call: {t1 - t0:.3f} s, {len(sampler.samples)} samples")
    report(sampler.samples, t0, t1, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
