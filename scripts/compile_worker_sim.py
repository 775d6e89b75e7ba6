"""The compile workers' effect on a cold compile, measured without a GPU.

    python scripts/compile_worker_sim.py critical MODE [--extra S]  # old, worker or nowarm
    python scripts/compile_worker_sim.py parallel N [--workers W]   # W = 0: in this process

Triton compiles sm_90 binaries on any machine, so the part of a CUDA cold compile
that runtime/ahead.py changes can be timed on the CPU:

- `critical`: from `torch.compile` to the pointwise_chain kernel's binary in hand. The
  main thread does a real TorchDynamo + AOTAutograd trace (plus `--extra` seconds of
  Python work, standing in for a longer trace and the rules), then needs the binary.
  `old` is the backend without workers: Triton's start-up on a thread, the compile on
  the main thread; `worker` and `nowarm` start a compile worker (with and without its
  warm-up compile) where the backend is looked up.
- `parallel`: N kernels of one graph compiled one after another in this process (the
  JIT at each first launch) or by W workers side by side.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

# the pointwise_chain kernel as rewritec renders it (templates/triton/pointwise.py.j2)
KERNEL = '''\
import triton
import triton.language as tl


@triton.jit
def k0_chain(in0_ptr, in1_ptr, out_ptr, n_elements, size0: tl.constexpr,
             BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n_elements
    x0 = tl.load(in0_ptr + offs, mask=mask, other=0).to(tl.float32)
    x1 = tl.load(in1_ptr + offs, mask=mask, other=0).to(tl.float32)
    t3 = x0 * 0.5 + x1
    t6 = (2.0 * tl.sigmoid(2.0 * t3) - 1.0) * tl.sigmoid(x0)
    t9 = tl.maximum(t6 - x1 * 0.25, 0.0, propagate_nan=tl.PropagateNan.ALL)
    tl.store(out_ptr + offs, (t9 + x0 * x1).to(tl.float32), mask=mask)
'''
SM90 = ("cuda", 90, 32)
N = 1 << 16


def _args(n: int) -> list[dict[str, object]]:
    return [{"tensor": "float32", "align": 0}] * 3 + [{"int": n}]


def critical(mode: str, extra: float, path: str) -> None:
    import torch

    def chain(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.tanh(x * 0.5 + y) * torch.sigmoid(x)
        return torch.relu(a - 0.25 * y) + x * y

    warm = torch.compile(lambda t: t + 1, backend="eager")
    warm(torch.ones(4))
    torch._dynamo.reset()
    x, y = torch.randn(N), torch.randn(N)
    t0 = time.perf_counter()
    from rewritec.runtime import ahead, triton_startup

    if mode == "old":
        import threading

        def start_up() -> None:  # triton_startup._start_up, less what needs a GPU
            import triton
            from triton.runtime import cache

            root = Path(cache.__file__).resolve().parents[1]
            key = "rewritec-" + triton_startup.installed_fingerprint(root, triton.__version__)
            cache.triton_key = lambda: key
            triton_startup._import_compiler()

        thread = threading.Thread(target=start_up)
        thread.start()
    else:
        worker = ahead.Worker(ahead.triton_key(), SM90 if mode == "worker" else None)
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def backend(gm: torch.fx.GraphModule, example: list[torch.Tensor]) -> object:
        return aot_module_simplified(gm, example,
                                     fw_compiler=lambda g, _: make_boxed_func(g.forward))

    with torch.no_grad():
        torch.compile(chain, backend=backend)(x, y)
    began = time.perf_counter()
    while time.perf_counter() - began < extra:
        sum(range(1000))
    rendered = time.perf_counter()
    kwargs = {"size0": N, "BLOCK_SIZE": 1024}
    if mode == "old":
        time.sleep(0.02)  # lowering and TorchDynamo's guards come before the launch
        thread.join()
        from rewritec.runtime import compile_worker as cw

        compiled = cw.Compiler(None).compile(path, "k0_chain", list(SM90),
                                             [cw.decode(a) for a in _args(N)], kwargs)
    else:
        job = worker.submit(path, "k0_chain", SM90, _args(N), kwargs)
        time.sleep(0.02)
        compiled = job.wait()
    done = time.perf_counter()
    assert compiled is not None
    print(f"{mode}: main thread {rendered - t0:.3f} s before the kernel, "
          f"binary in hand at {done - t0:.3f} s")


def parallel(n: int, workers: int, path: str) -> None:
    from rewritec.runtime import ahead

    jobs = [(_args(N), {"size0": N + 16 * i, "BLOCK_SIZE": 1024}) for i in range(n)]
    if workers == 0:
        from rewritec.runtime import compile_worker as cw

        compiler = cw.Compiler(ahead.triton_key())
        compiler.warm(list(SM90))
        t0 = time.perf_counter()
        for args, kwargs in jobs:
            compiler.compile(path, "k0_chain", list(SM90), [cw.decode(a) for a in args], kwargs)
    else:
        pool = [ahead.Worker(ahead.triton_key(), SM90, on_idle=ahead._dispatch)
                for _ in range(workers)]
        for w in pool:
            w.ready.wait()
        ahead._workers[:] = pool
        t0 = time.perf_counter()
        pending = [ahead.submit(path, "k0_chain", SM90, args, kwargs) for args, kwargs in jobs]
        assert all(j is not None and j.wait() is not None for j in pending)
    print(f"{n} kernels, {workers or 'no'} workers: {time.perf_counter() - t0:.3f} s")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["critical", "parallel"])
    p.add_argument("arg")
    p.add_argument("--extra", type=float, default=0.0)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # cold, as the probes are
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns without it
    path = str(Path(tempfile.mkdtemp()) / "k0_chain.py")
    Path(path).write_text(KERNEL)
    if args.what == "critical":
        critical(args.arg, args.extra, path)
    else:
        parallel(int(args.arg), args.workers, path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
