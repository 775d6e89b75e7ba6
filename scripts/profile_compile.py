"""Where cold-compile time goes: cProfile of one case's first call with rewritec.

    python scripts/profile_compile.py gpt2_block [cuda|cpu] [--top 30]

Run it in a fresh process with fresh caches (REWRITEC_CACHE_DIR, TRITON_CACHE_DIR)
to see the cold path; TorchDynamo is started first on a trivial function, as the
benchmark's compile probes do.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.cases import BY_NAME, Config  # noqa: E402
from benchmarks.run import compile_with, start_dynamo, synchronize  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("case")
    p.add_argument("device", nargs="?", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="rewritec")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--save", help="also write the profile to this file (pstats format)")
    args = p.parse_args()
    cfg = Config(device=torch.device(args.device), quick=False)
    inst = BY_NAME[args.case].build(cfg)
    start_dynamo(cfg.device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with torch.no_grad():
        prof.enable()
        compiled = compile_with(inst.fn, args.backend)
        inst.run(compiled)
        synchronize(cfg.device)
        prof.disable()
    print(f"first call: {time.perf_counter() - t0:.2f} s")
    if args.save:
        prof.dump_stats(args.save)
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(args.top)
    stats.sort_stats("tottime").print_stats(15)
    return 0


if __name__ == "__main__":
    sys.exit(main())
