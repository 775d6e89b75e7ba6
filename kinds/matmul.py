"""Matrix product with its pointwise epilogue, as one Triton kernel.

A `matmul` kernel term (engine/fuse.py: `MatmulSpace`) holds one `mm` or
`addmm` over [M, K] @ [K, N], optionally a reshape of its result to S = [..., N]
(a Linear on a 3-d input), and the pointwise work on it (bias, activation,
residual add). The product's operands are read with their run-time strides (a
Linear's weight is a transposed view); the epilogue's other inputs are read in
S with their own strides, broadcasting included; `addmm`'s bias is read in
[M, N]. Only the GPU target has this template: on the CPU, matrix products stay
with the BLAS library and their epilogue becomes the next kernel.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

from ..engine.fuse import FLOATS, MATMULS, RESHAPES, ROW_REDUCTIONS, body_terms, static_shape
from ..engine.ops import OpTable
from ..engine.term import Term
from .kernels import (
    MOVES,
    TRITON_DTYPES,
    RenderError,
    _contiguous,
    aligned_shape,
    kernel_header,
    _key,
    term_names,
    print_index,
    strided_offset,
    value_expr,
)
from .kind import Kind
from .spec import KernelSpec, KInput, KOutput
from .templates import render_template
from .tuning import MatmulTuning


def matmul_spec(term: Term, index: int) -> KernelSpec:
    body = body_terms(term)
    root = term.attr("body")
    mm = next(t for t in body if t.op in MATMULS)
    shape = tuple(root.meta.shape)
    if not all(isinstance(s, int) for s in shape):
        raise RenderError("the matmul template needs static shapes")
    rank = len(shape)
    x, y = mm.args[-2], mm.args[-1]
    bias = mm.args[0] if mm.op == "addmm" else None
    for operand in (x, y):
        if operand.op != "arg":
            raise RenderError("a matmul operand must be a kernel input")
    epilogue_args = {a for t in body if t.op not in MATMULS and t.op != "arg"
                     for a in t.args if a.op == "arg"}
    inputs = []
    for i, a in enumerate(term.args):
        ashape = aligned_shape(a, rank)
        flat = a.meta.rank == rank and _contiguous(a) and ashape == shape
        inputs.append(KInput(f"in{i}", a.meta.dtype, flat, False, rank))
    digest = hashlib.sha256(repr((term.attr("rule"), [_key(t) for t in body], shape,
                                  [(k.dtype, k.flat) for k in inputs])).encode())
    name = f"k{index}_{term.attr('rule').replace('-', '_')}_{digest.hexdigest()[:8]}"
    ops = [t for t in body if t.op not in ("arg", "const")]
    return KernelSpec(name=name, kind="matmul", rule=term.attr("rule"),
                      location=term.attr("location"), template=term.attr("kind"),
                      template_dir=term.attr("template_dir"),
                      inputs=inputs, body=body, root=root, written=[root],
                      outputs=[KOutput("out", root.meta.dtype, False, shape)], rank=rank,
                      replaced_ops=len([t for t in ops if t.op not in RESHAPES]),
                      meta={"shape": shape, "a": x.attr("index"), "b": y.attr("index"),
                            "bias": None if bias is None or bias.op != "arg"
                            else bias.attr("index"),
                            "epilogue": sorted(a.attr("index") for a in epilogue_args),
                            "alpha": mm.attr("alpha") if mm.op == "addmm" else 1,
                            "beta": mm.attr("beta") if mm.op == "addmm" else 1,
                            "dtype": x.meta.dtype})


def render_matmul(spec: KernelSpec, table: OpTable) -> str:
    names = term_names(spec)
    meta = spec.meta
    loads, stmts = [], []
    for i in meta["epilogue"]:
        inp = spec.inputs[i]
        if inp.flat:
            off = "offs_m[:, None] * N + offs_n[None, :]"
        else:
            rows = print_index(strided_offset(spec.rank, inp.name, "offs_m", skip_last=True),
                               "triton")
            off = f"({rows})[:, None] + offs_n[None, :] * {inp.name}_stride{spec.rank - 1}"
        loads.append(f"x{i} = tl.load({inp.name}_ptr + {off}, mask=mask, other=0).to(tl.float32)")
    for t in spec.body:
        if t.op in ("arg", "const"):
            continue
        if t.op in MATMULS:
            e = "acc" if meta["alpha"] == 1 else f"acc * {float(meta['alpha'])!r}"
            if meta["bias"] is not None:
                bias = spec.inputs[meta["bias"]].name
                loads.append(f"bias = tl.load({bias}_ptr + offs_m[:, None] * stride_biasm + "
                             f"offs_n[None, :] * stride_biasn, mask=mask, other=0)"
                             ".to(tl.float32)")
                e += " + bias" if meta["beta"] == 1 else f" + bias * {float(meta['beta'])!r}"
            elif t.op == "addmm":
                raise RenderError("addmm's bias must be a kernel input")
            stmts.append(f"{names[t]} = {e}")
        elif t.op in RESHAPES:
            stmts.append(f"{names[t]} = {names[t.args[0]]}")
        else:
            stmts.append(f"{names[t]} = {value_expr(t, names, 'triton', table)}")
    params = [f"{k.name}_ptr" for k in spec.inputs] + ["out_ptr", "M", "N", "K"]
    params += [f"size{k}" for k in range(spec.rank)]
    params += ["stride_am", "stride_ak", "stride_bk", "stride_bn", "stride_biasm", "stride_biasn"]
    params += [f"{spec.inputs[i].name}_stride{k}" for i in meta["epilogue"]
               if not spec.inputs[i].flat for k in range(spec.rank)]
    dot_args = ', input_precision="ieee"' if meta["dtype"] in ("f32", "f64") else ""
    operand_cast = ""
    if meta["dtype"] == "bf16" and os.environ.get("TRITON_INTERPRET") == "1":
        # Triton's interpreter gets bf16 tl.dot wrong (checked with triton 3.x: errors
        # of 1e10 on a 16x16 product), so interpreted kernels widen the operands first.
        operand_cast, dot_args = ".to(tl.float32)", ', input_precision="ieee"'
    return render_template(f"triton/{spec.template}.py.j2", spec.template_dirs,
                           header=kernel_header(spec, "triton", "#"),
                           name=spec.symbol, params=params, loads=loads, stmts=stmts,
                           result=names[spec.root], out_dtype=TRITON_DTYPES[spec.out_dtype],
                           a_ptr=f"{spec.inputs[meta['a']].name}_ptr",
                           b_ptr=f"{spec.inputs[meta['b']].name}_ptr", dot_args=dot_args,
                           operand_cast=operand_cast)


class MatmulSpace:
    """One matrix product [M, K] @ [K, N] and the pointwise epilogue on its result,
    in the root's shape S: S is [M, N], or [..., N] when a reshape splits M (a
    Linear on a 3-d input). The product's operands are the kernel's inputs: the
    group never grows past the matmul (`stops_at`). No side outputs: the template
    stores one output tile, and a value the epilogue shares with another user
    stays outside the kernel, as before side outputs existed."""

    side_outputs = False

    def __init__(self, root: Term) -> None:
        self.shape = tuple(root.meta.shape)
        self.mm: Term | None = None

    def stops_at(self, t: Term) -> bool:
        return t.op in MATMULS

    def fits(self, t: Term) -> bool:
        if t.meta.kind != "tensor" or t.meta.dtype not in FLOATS or len(self.shape) < 2:
            return False
        if t.op in MATMULS:
            ok = self.mm is None and t.meta.rank == 2 and static_shape(t.meta.shape) \
                and static_shape(self.shape) and tuple(t.meta.shape) == self._flat()
            if ok:
                self.mm = t
            return ok
        if t.op in RESHAPES:
            # only the reshape right above the product, from [M, N] to S
            return self.mm is None and tuple(t.meta.shape) == self.shape \
                and tuple(t.args[0].meta.shape) == self._flat() and t.args[0].op in MATMULS
        # not a slice, which the rule's `view` lets in: pointwise kernels read those
        return tuple(t.meta.shape) == self.shape and t.op not in ROW_REDUCTIONS \
            and t.op not in MOVES

    def _flat(self) -> tuple[Any, ...]:
        m = 1
        for s in self.shape[:-1]:
            m *= s
        return (m, self.shape[-1])


def _render(spec: KernelSpec, target: str, simd_decls: tuple[str, ...],
            table: OpTable) -> str:
    return render_matmul(spec, table)


# What the render gives each target's template (a user's template may read these
# and nothing else: kinds/templates.py, tests/test_user_folder.py)
TEMPLATE_VARIABLES = {
    "triton": frozenset({"a_ptr", "b_ptr", "dot_args", "header", "loads", "name",
                         "operand_cast", "out_dtype", "params", "result", "stmts"}),
}


KIND = Kind(name="matmul", template_variables=TEMPLATE_VARIABLES,
            doc="a half-precision matrix product and its pointwise epilogue",
            space=MatmulSpace, spec=matmul_spec, render=_render,
            launchers={"triton": "MatmulLauncher"},
            tuning=MatmulTuning(),
            matrix_products=True)
