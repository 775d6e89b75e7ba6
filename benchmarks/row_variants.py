"""Row kernels under variants of their launch choices, on one GPU, in one process.

    python -m benchmarks.row_variants [--cases layer_norm_32k,rms_norm_32k,softmax_32k]

Each variant patches choices of kinds/row_looped.py or runtime/launch.py (the
looped kernel's chunk, its warps, where rows start to loop), compiles the case
with rewritec, checks it against eager and prints the median time (do_bench) with
Inductor's alongside. The numbers behind those constants come from here.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .cases import BY_NAME, Config
from .run import check_close, compile_with


@contextmanager
def patched(changes: dict[str, Any]) -> Iterator[None]:
    from rewritec.kinds import row_looped, spec
    from rewritec.runtime import launch

    modules = {"launch": launch, "row_looped": row_looped, "spec": spec}
    saved = []
    for key, value in changes.items():
        mod, _, attr = key.partition(".")
        saved.append((modules[mod], attr, getattr(modules[mod], attr)))
        setattr(modules[mod], attr, value)
    try:
        yield
    finally:
        for mod, attr, value in saved:
            setattr(mod, attr, value)


def _warps(n: int) -> Callable[[int], int]:
    return lambda block: n


VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "no cache hints": {"row_looped.EVICTION_HINTS": False},
    "8 warps": {"launch.row_warps": _warps(8)},
    "16 warps": {"launch.row_warps": _warps(16)},
    "32 warps": {"launch.row_warps": _warps(32)},
    "persistent": {"row_looped.PERSISTENT_ROW_MAX_COLS": 1 << 30},
    "looped": {"row_looped.PERSISTENT_ROW_MAX_COLS": 1024},
}
for _w in (4, 8, 16, 32):
    VARIANTS[f"looped {_w} warps"] = {"row_looped.PERSISTENT_ROW_MAX_COLS": 512,
                                      "launch.row_warps": _warps(_w)}
# looped kernels over (chunk, warps)
for _chunk, _w in ((2048, 8), (2048, 16), (4096, 8), (4096, 16), (8192, 16), (8192, 32),
                   (16384, 32), (32768, 32)):
    VARIANTS[f"looped {_chunk}/{_w}"] = {
        "row_looped.PERSISTENT_ROW_MAX_COLS": 1024,
        "spec.STATIC_LOOPED_BLOCK_C": _chunk, "spec.STATIC_WHOLE_ROW_C": 0,
        "launch.row_warps": _warps(_w)}

def main() -> None:
    import triton.testing

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", default="layer_norm_32k,rms_norm_32k,softmax_32k")
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args()
    cfg = Config(device=torch.device("cuda"), quick=True)
    print("| case | variant | ms | inductor ms | status |\n|---|---|---:|---:|---|")
    for case in args.cases.split(","):
        inst = BY_NAME[case].build(cfg)
        want = inst.run(inst.fn)
        ind = compile_with(inst.fn, "inductor")
        inst.run(ind)
        t_ind = triton.testing.do_bench(lambda inst=inst, ind=ind: inst.run(ind),
                                        return_mode="median")
        for name in args.variants.split(","):
            try:
                with patched(VARIANTS[name]):
                    fn = compile_with(inst.fn, "rewritec")
                    got = inst.run(fn)
                    bad = check_close(got, want, inst.rtol, inst.atol)
                    t = triton.testing.do_bench(lambda inst=inst, fn=fn: inst.run(fn),
                                                return_mode="median")
            except Exception as e:  # noqa: BLE001 - a variant that fails is a row, not the end
                print(f"| {case} | {name} | — | {t_ind:.4f} | {type(e).__name__}: "
                      f"{str(e).splitlines()[0][:120] if str(e) else ''} |", flush=True)
                continue
            print(f"| {case} | {name} | {t:.4f} | {t_ind:.4f} | {bad or 'ok'} |", flush=True)


if __name__ == "__main__":
    main()
