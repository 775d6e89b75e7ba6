"""torch dtypes and the engine's short dtype names ("f32", "bf16", ...).

Apart from aten/bridge.py so that launching a kernel (runtime/launch.py) needs
torch and nothing of the rule engine.
"""

from __future__ import annotations

import torch

DTYPES: dict[torch.dtype, str] = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}
TORCH_DTYPES: dict[str, torch.dtype] = {v: k for k, v in DTYPES.items()}
