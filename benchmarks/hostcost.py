"""Host time per call: what a compiled graph costs in Python when the device waits.

    python -m benchmarks.hostcost [--device cpu|cuda] [--calls 3000]

Tiny tensors make every call host-bound, so the time per call (calls issued
back to back, no synchronization inside the loop) is the host path: TorchDynamo's
guards, AOTAutograd's runtime wrapper, the backend's wrapper and its launches.
Printed for eager PyTorch, Inductor and rewritec on a one-kernel graph and a
three-kernel graph; on CUDA also a bare Triton launch. This is the measurement
behind "host time per call" in results/cuda.md; it asserts nothing.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from .run import compile_with, synchronize


def per_call_us(fn: Callable[[], object], calls: int, device: torch.device) -> float:
    for _ in range(min(200, calls)):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0  # issue time: the device may still be running
    synchronize(device)
    return elapsed / calls * 1e6


def one_kernel(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x) * 2 + 1


def three_kernels(x: torch.Tensor) -> torch.Tensor:
    y = torch.softmax(x, dim=-1) * 2  # a row kernel
    return y.sum(0) + torch.relu(x).mean(0)  # two column reductions


def bare_triton_us(calls: int, device: torch.device) -> float | None:
    """A one-line Triton kernel launched through its JIT, or None without Triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1, mask=mask)

    x = torch.randn(1024, device=device)
    out = torch.empty_like(x)
    return per_call_us(lambda: add_one[(1,)](x, out, 1024, BLOCK=1024), calls, device)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--calls", type=int, default=3000)
    args = p.parse_args()
    device = torch.device(args.device)
    x = torch.randn(8, 128, device=device)
    print(f"host time per call, us ({device.type}; {args.calls} calls, "
          f"tensors of {x.numel()} values)")
    print("| graph | eager | inductor | rewritec |\n|---|---:|---:|---:|")
    with torch.no_grad():
        for fn in (one_kernel, three_kernels):
            row = [f"{per_call_us(lambda fn=fn: fn(x), args.calls, device):.1f}"]
            for backend in ("inductor", "rewritec"):
                torch._dynamo.reset()
                compiled = compile_with(fn, backend)
                torch.testing.assert_close(compiled(x), fn(x), rtol=1e-4, atol=1e-4)
                row.append(f"{per_call_us(lambda c=compiled: c(x), args.calls, device):.1f}")
            print(f"| {fn.__name__} | " + " | ".join(row) + " |", flush=True)
    if device.type == "cuda":
        bare = bare_triton_us(args.calls, device)
        if bare is not None:
            print(f"\nbare Triton launch through the JIT: {bare:.1f} us")


if __name__ == "__main__":
    main()
