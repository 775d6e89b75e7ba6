"""When does the Triton matmul template pay? Linear + tanh-GELU (+ residual) in fp16,
with rule fuse-matmul on (one kernel) and off (cuBLAS, then a pointwise kernel).

    python -m benchmarks.matmul_epilogue      # CUDA only; prints a table

The numbers behind the size guard of `fuse-matmul` in rules/fuse/kernels.yaml.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

import rewritec

SHAPES = [(16, 768, 3072), (128, 768, 3072), (512, 768, 3072), (1024, 768, 3072),
          (2048, 768, 3072), (8192, 768, 3072), (8192, 3072, 768), (8192, 1024, 4096)]


def layer(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    from triton.testing import do_bench

    print(f"# fuse-matmul on {torch.cuda.get_device_name()}: Linear + tanh-GELU, fp16\n")
    print("| M x K -> N | cuBLAS + kernel ms | matmul template ms | template / split |")
    print("|---|---:|---:|---:|")
    for m, k, n in SHAPES:
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        w = torch.randn(n, k, device="cuda", dtype=torch.float16) * k ** -0.5
        b = torch.randn(n, device="cuda", dtype=torch.float16)
        times = []
        for disable in (("fuse-matmul",), ()):
            torch._dynamo.reset()
            fn = rewritec.compile(layer, disable=disable)
            with torch.no_grad():
                fn(x, w, b)
                times.append(do_bench(lambda fn=fn, x=x, w=w, b=b: fn(x, w, b),
                                      warmup=25, rep=100))
        print(f"| {m} x {k} -> {n} | {times[0]:.4f} | {times[1]:.4f} "
              f"| {times[1] / times[0]:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
