"""The long differential-fuzzing profile, run by hand (CI runs tests/test_fuzz.py).

    .venv/bin/python scripts/fuzz_long.py                       # 2000 examples x 2 targets
    .venv/bin/python scripts/fuzz_long.py --examples 20000 --minutes 60
    .venv/bin/python scripts/fuzz_long.py --seed 123 --targets aten --max-ops 10
    TRITON_INTERPRET=1 .venv/bin/python scripts/fuzz_long.py    # also target=triton

Same property as the quick profile (tests/fuzz_graphs.py: random program,
`rewritec.compile(fn, strict=True, target=...)`, outputs and gradients ==
eager), with random seeds and many more examples. It does not stop at the
first failure: failures are grouped by kind, the smallest example of each
kind is shrunk, and the summary prints each as a `Graph(...)` ready to paste
into tests/regressions/test_fuzz_regressions.py. Failures listed in
`fuzz_graphs.KNOWN_FAILURES` (already regression-tested) are only counted,
unless --include-known. Exit status: 1 if there were new failures.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
# Like the test suite: kernels build into a private cache, not ~/.cache/rewritec.
os.environ.setdefault("REWRITEC_CACHE_DIR", tempfile.mkdtemp(prefix="rewritec-fuzz-cache-"))

import fuzz_graphs as fg  # noqa: E402 - after sys.path and the cache folder are set
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import seed as hseed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--examples", type=int, default=2000, help="examples per target (default 2000)")
    ap.add_argument("--seed", type=int, default=None, help="hypothesis seed (default: random)")
    ap.add_argument("--targets", default=None,
                    help="comma-separated targets (default: fuzz_graphs.TARGET_OPTIONS)")
    ap.add_argument("--max-ops", type=int, default=8, help="ops per program (default 8)")
    ap.add_argument("--grad", choices=["any", "yes", "no"], default="any")
    ap.add_argument("--no-conv", action="store_true", help="leave conv2d out")
    ap.add_argument("--minutes", type=float, default=None, help="stop drawing after this long")
    ap.add_argument("--include-known", action="store_true",
                    help="report failures in KNOWN_FAILURES too")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--keep", type=int, default=3, help="examples kept per failure kind")
    args = ap.parse_args()

    warnings.simplefilter("ignore")
    logging.getLogger("torch").setLevel(logging.ERROR)
    if args.include_known:
        fg.KNOWN_FAILURES.clear()
    options = ([{"target": t} for t in args.targets.split(",")] if args.targets
               else fg.TARGET_OPTIONS)
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    grad = {"any": None, "yes": True, "no": False}[args.grad]
    deadline = time.monotonic() + 60 * args.minutes if args.minutes else None
    print(f"fuzz_long: seed {seed}, {args.examples} examples per target, targets "
          f"{[fg.options_id(o) for o in options]}, max_ops {args.max_ops}, grad {args.grad}",
          flush=True)

    failures: dict[tuple[str, str], list[fg.Graph]] = defaultdict(list)
    timings: dict[str, tuple[int, float]] = {}

    def property_for(opts: dict, counted: list[int], t0: float):
        @hseed(seed)
        @settings(max_examples=args.examples, deadline=None, database=None,
                  phases=[Phase.explicit, Phase.reuse, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(graph=fg.graphs(max_ops=args.max_ops, grad=grad, allow_conv=not args.no_conv))
        def run(graph: fg.Graph) -> None:
            if deadline is not None and time.monotonic() > deadline:
                return
            counted[0] += 1
            if counted[0] % 250 == 0:
                print(f"  [{fg.options_id(opts)}] {counted[0]} examples, "
                      f"{time.perf_counter() - t0:.0f} s", flush=True)
            try:
                fg.check_graph(graph, opts)
            except Exception as e:  # noqa: BLE001 - collect, do not stop
                known = fg.known_failure(e, graph, opts)
                if known:
                    fg.STATS["known failure: " + known] += 1
                    return
                key = (fg.options_id(opts), fg.failure_signature(e))
                if len(failures[key]) < args.keep:
                    failures[key].append(graph)
                    print(f"  new failure [{key[0]}] {key[1]}", flush=True)
                fg.STATS["failures"] += 1

        return run

    for opts in options:
        counted = [0]
        t0 = time.perf_counter()
        property_for(opts, counted, t0)()
        timings[fg.options_id(opts)] = (counted[0], time.perf_counter() - t0)

    print("\n=== summary")
    for name, (n, secs) in timings.items():
        print(f"  {name}: {n} examples in {secs:.0f} s ({1000 * secs / max(n, 1):.0f} ms each)")
    st = fg.STATS
    print(f"  forward-only {st['forward']}, with gradients {st['grad']}, "
          f"with parameters {st['with parameters']}, "
          f"needed the float64 reference {st['needed float64 reference']}, "
          f"kernels launched {st['kernels']}")
    ops = sorted(((k[3:], v) for k, v in st.items() if k.startswith("op:")), key=lambda kv: -kv[1])
    print("  ops: " + ", ".join(f"{k} {v}" for k, v in ops))
    rules = sorted(((k[6:], v) for k, v in st.items() if k.startswith("rule: ")),
                   key=lambda kv: -kv[1])
    print("  rules fired: " + (", ".join(f"{k} {v}" for k, v in rules) or "none"))
    for k, v in st.items():
        if k.startswith("known failure: "):
            print(f"  {k} (skipped): {v} examples")
    if not failures:
        print("  new failures: none")
        return 0
    print(f"  new failures: {len(failures)} kind(s), {st['failures']} examples")
    for (target, sig), graphs in failures.items():
        opts = dict(kv.split("=", 1) for kv in target.split(","))
        smallest = min(graphs, key=lambda g: len(repr(g)))
        print(f"\n--- [{target}] {sig}  ({len(graphs)} kept)")
        if not args.no_shrink:
            smallest = fg.shrink(smallest, fg.fails_like(sig, opts))
        print(repr(smallest))
        try:
            fg.check_graph(smallest, opts)
            print("(passes now: flaky?)")
        except Exception as e:  # noqa: BLE001
            print("\n".join(str(e).strip().split("\n")[:12]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
