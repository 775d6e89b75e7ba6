"""Attention as one Triton kernel (templates/triton/attention.py.j2).

An `attention` kernel term (rule fuse-attention) holds one `attention(q, kt, v,
mask, scale)` op (aten/attention.py): softmax(masked_fill(q @ kt * scale,
mask, -inf)) @ v over [B, H, T, d] operands, read with their run-time strides
(head-split views of a projection, broadcast dims as stride 0), the result
written in the op's [B, T, H, d] memory layout. The kernel is FlashAttention's
forward: each program keeps BLOCK_M queries and streams the keys and values
past them with an online softmax.

A mask that is a frozen constant equal to `triu(ones(T, T), 1)` (GPT-style
causal masking, `masked_fill(~tril)`) is not read at all: the kernel masks by
index and skips the key blocks past each query block's diagonal, half the work.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from ..engine.ops import OpTable
from ..engine.term import Term
from .kernels import TRITON_DTYPES, RenderError, kernel_header
from .kind import Kind
from .spec import KernelSpec, KInput, KOutput
from .templates import render_template


def attention_spec(term: Term, index: int) -> KernelSpec:
    root = term.attr("body")
    if root.op != "attention":
        raise RenderError("an attention kernel holds one attention op")
    q, kt, v, mask, scale = root.args
    for operand in (q, kt, v):
        if operand.op != "arg" or operand.meta.rank != 4:
            raise RenderError("attention operands must be 4-d kernel inputs")
        if not all(isinstance(s, int) for s in operand.meta.shape):
            raise RenderError("the attention template needs static shapes")
    if scale.op != "const" or not isinstance(scale.value, int | float):
        raise RenderError("the attention scale must be a number")
    has_mask = mask.op == "arg"
    if not has_mask and not (mask.op == "const" and mask.value is None):
        raise RenderError("the attention mask must be a kernel input or None")
    dtype = q.meta.dtype
    if dtype not in ("f16", "bf16", "f32") or kt.meta.dtype != dtype or v.meta.dtype != dtype:
        raise RenderError(f"attention in {dtype}: the template takes f16, bf16 or f32 alike")
    tq, tk = q.meta.shape[2], kt.meta.shape[3]
    causal = has_mask and _is_causal(term.args[mask.attr("index")], tq, tk)
    inputs = [KInput(f"in{i}", a.meta.dtype, False, False, 4) for i, a in enumerate(term.args)]
    digest = hashlib.sha256(repr((term.attr("rule"), dtype, has_mask, causal)).encode())
    name = f"k{index}_{term.attr('rule').replace('-', '_')}_{digest.hexdigest()[:8]}"
    return KernelSpec(name=name, kind="attention", rule=term.attr("rule"),
                      location=term.attr("location"), template=term.attr("kind"),
                      template_dir=term.attr("template_dir"),
                      inputs=inputs, body=[t for t in root.walk()], root=root, written=[root],
                      outputs=[KOutput("out", dtype, False, tuple(root.meta.shape))],
                      rank=4, replaced_ops=_replaced_ops(has_mask),
                      meta={"q": q.attr("index"), "kt": kt.attr("index"), "v": v.attr("index"),
                            "mask": mask.attr("index") if has_mask else None,
                            "scale": float(scale.value), "causal": causal, "dtype": dtype,
                            "d": q.meta.shape[3], "dv": v.meta.shape[3]})


def _replaced_ops(has_mask: bool) -> int:
    # two bmm, mul, softmax (+ masked_fill) and the expand/clone/view copies of the
    # three operands and the probabilities that torch.matmul captures as
    return 4 + (1 if has_mask else 0) + 3 * 3 + 2


def _is_causal(mask: Term, tq: Any, tk: Any) -> bool:
    """Is `mask` a frozen constant that drops exactly the keys after each query?"""
    if mask.op != "tensor" or tq != tk:
        return False
    import torch  # only here: the kinds load no torch (they work on terms)

    value = mask.attr("value")
    value = getattr(value, "value", value)
    if not isinstance(value, torch.Tensor) or value.dtype != torch.bool or value.dim() < 2 \
            or any(s != 1 for s in value.shape[:-2]) or tuple(value.shape[-2:]) != (tq, tk):
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():  # compiling runs under AOTAutograd's fake mode
        expected = torch.ones(tq, tk, dtype=torch.bool, device=value.device).triu(1)
        return bool(torch.equal(value.reshape(tq, tk), expected))


def render_attention(spec: KernelSpec) -> str:
    dtype = spec.meta["dtype"]
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    operand_cast, dot_args, p_dtype = "", "", TRITON_DTYPES[dtype]
    if dtype == "f32" or (dtype == "bf16" and interpreted):
        # f32 products in IEEE (tensor cores would round to TF32); Triton's interpreter
        # gets bf16 tl.dot wrong (kinds/matmul.py), so interpreted kernels widen first
        operand_cast = ".to(tl.float32)" if dtype != "f32" else ""
        dot_args, p_dtype = ', input_precision="ieee"', "tl.float32"
    return render_template(f"triton/{spec.template}.py.j2", spec.template_dirs,
                           header=kernel_header(spec, "triton", "#"),
                           name=spec.symbol, dtype=TRITON_DTYPES[dtype], p_dtype=p_dtype,
                           operand_cast=operand_cast, dot_args=dot_args)


class AttentionSpace:
    """One `attention` op (rules/recognize/attention.yaml) and nothing else: its
    operands are the kernel's inputs. No side outputs (it has no other member)."""

    side_outputs = False

    def __init__(self, root: Term) -> None:
        self.root = root

    def fits(self, t: Term) -> bool:
        return t is self.root and t.op == "attention"


def _render(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
            table: OpTable) -> str:
    return render_attention(spec)


# What the render gives each target's template (a user's template may read these
# and nothing else: kinds/templates.py, tests/test_user_folder.py)
TEMPLATE_VARIABLES = {
    "triton": frozenset({"dot_args", "dtype", "header", "name", "operand_cast",
                         "p_dtype"}),
}


KIND = Kind(name="attention", template_variables=TEMPLATE_VARIABLES,
            doc="softmax(q @ kT * scale, masked) @ v as one flash-attention kernel",
            space=AttentionSpace, spec=attention_spec, render=_render,
            launchers={"triton": "AttentionLauncher"},
            matrix_products=True)
