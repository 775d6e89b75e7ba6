"""Minimized failures found by the OpInfo oracle (tests/test_opinfo.py), as plain tests.

(Its scalar-comparison failures are in test_fuzz_regressions.py.)
"""

from __future__ import annotations

import pytest
import rewritec
import torch


# Found by OpInfo `chalf` (x.chalf()). aten/bridge.py:DTYPES had no entry for
# complex32, uint16, uint32, float8_*...: from_torch_attr stored such a dtype as
# dtype_name()'s fallback string ('complex32'), to_torch_attr converted back only
# names in TORCH_DTYPES, so the wrapper called aten._to_copy(x, dtype='complex32')
# and ATen rejected the string at run time. A cast to float8 was the same.
# Fixed (from_torch_attr keeps such dtypes as torch objects).
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")
@pytest.mark.parametrize("dtype", [torch.complex32, torch.uint16, torch.float8_e4m3fn],
                         ids=str)
def test_cast_to_a_dtype_outside_the_table(dtype: torch.dtype) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return (x * 2).to(dtype)

    x = torch.randn(4)
    got = rewritec.compile(f, strict=True, target="aten")(x)
    assert got.dtype == dtype
    torch.testing.assert_close(got.to(torch.complex128), f(x).to(torch.complex128))
