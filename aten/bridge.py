"""The bridge between terms and ATen: how a term is called, and what it yields.

Everything torch-specific about a term lives here:
- `Bridge.call_parts(term)`: the ATen overload and the arguments that run it
  (used by the wrapper's code generator and by constant folding);
- `Bridge.meta_hook`: the `TermStore` hook that infers a new term's metadata
  by running its op on fake tensors (symbolic sizes included);
- conversions between torch dtypes and the engine's short dtype names.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from ..engine.ops import OpInfo, OpTable, default_op_table
from ..engine.term import Meta, Term
from .dtypes import DTYPES, TORCH_DTYPES


@dataclass(frozen=True)
class Slot:
    """Where a generic ATen call takes its n-th tensor operand."""

    index: int


class Opaque:
    """A torch object (dtype, device, callable) held in a term attribute.

    The engine never looks inside; equality follows the wrapped value.
    """

    def __init__(self, value: Any, label: str) -> None:
        self.value = value
        self.label = label

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and type(other.value) is type(self.value) \
            and other.value == self.value

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return self.label


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def size_of(s: Any) -> Any:
    """An int, or the sympy expression behind a SymInt."""
    if isinstance(s, torch.SymInt):
        return s.node.expr
    return int(s)


def meta_of(value: Any) -> Meta:
    """Engine metadata for a (fake) value from an FX node or an ATen call."""
    if isinstance(value, torch.Tensor):
        return Meta(
            shape=tuple(size_of(s) for s in value.shape),
            dtype=dtype_name(value.dtype),
            device=str(value.device),
            strides=tuple(size_of(s) for s in value.stride()),
            payload=value,
        )
    if isinstance(value, tuple | list):
        return Meta(kind="tuple", parts=tuple(meta_of(v) for v in value), payload=value)
    if value is None:
        return Meta(kind="none")
    if isinstance(value, bool):
        return Meta(kind="scalar", dtype="b8", payload=value)
    if isinstance(value, int | torch.SymInt):
        return Meta(kind="scalar", dtype="i64", payload=value)
    if isinstance(value, float | torch.SymFloat):
        return Meta(kind="scalar", dtype="f64", payload=value)
    return Meta(kind="opaque", payload=value)


def to_torch_attr(value: Any, arg_type: Any = None) -> Any:
    """Turn an engine attribute (short dtype names, tuples) back into ATen's form."""
    # ScalarType arguments show as int in schema types; the engine spells them f32, f16, ...
    if isinstance(value, str) and value in TORCH_DTYPES and arg_type is not None \
            and str(arg_type.type) in ("int", "Optional[int]"):
        return TORCH_DTYPES[value]
    # rule examples spell memory formats by name: memory_format=contiguous_format
    if isinstance(value, str) and getattr(arg_type, "name", None) == "memory_format" \
            and isinstance(getattr(torch, value, None), torch.memory_format):
        return getattr(torch, value)
    if isinstance(value, tuple):
        return [to_torch_attr(v, None) for v in value]
    if isinstance(value, Opaque):
        return value.value
    return value


def from_torch_attr(value: Any) -> Any:
    if isinstance(value, torch.dtype):
        # dtypes outside the table (complex32, float8, uint16...) stay torch objects
        return DTYPES[value] if value in DTYPES else Opaque(value, repr(value))
    if isinstance(value, torch.device | torch.layout | torch.memory_format):
        return Opaque(value, repr(value))
    if isinstance(value, list | tuple):
        return tuple(from_torch_attr(v) for v in value)
    return value


def overload(name: str) -> torch._ops.OpOverload:
    """`add.Tensor` -> torch.ops.aten.add.Tensor; `rewritec::attention` ->
    torch.ops.rewritec.attention.default (ops of another namespace)."""
    namespace, _, name = name.rpartition("::")
    if namespace == "rewritec":
        from . import rewritec_ops  # noqa: F401 - define rewritec::*, on first use
    packet, _, over = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace or "aten"), packet), over or "default")


def operand_positions(schema_args: list[Any], n: int) -> list[int]:
    """Schema positions of an op's n operands: its first n tensor or scalar arguments
    (so native_layer_norm's operands are input, weight, bias around normalized_shape)."""
    found = [i for i, a in enumerate(schema_args)
             if str(a.type) in ("Tensor", "Optional[Tensor]", "number", "Optional[number]")]
    return found[:n]


def _is_scalar(t: Term) -> bool:
    return t.meta.kind != "tensor"


# Shape-only views that run as aten.reshape (see Bridge.call_parts).
RUN_AS_RESHAPE = ("view", "unsafe_view")

# The .Tensor overloads that take a Python number for a later Tensor argument
# (the others, such as lt.Tensor, reject it and have a .Scalar overload).
WRAPS_NUMBERS = {"add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor"}


def _accepts(schema_args: list[Any], operands: tuple[Term, ...], name: str = "") -> bool:
    positions = operand_positions(schema_args, len(operands))
    if len(positions) < len(operands):
        return False
    for i, term in zip(positions, operands, strict=True):
        arg = schema_args[i]
        type_s = str(arg.type)
        if "Tensor" in type_s:
            # ATen wraps a python number given for a later Tensor argument,
            # but `self` must really be a tensor (None only where optional).
            optional = type_s.startswith("Optional")
            if term.meta.kind == "none" and not optional:
                return False
            if term.meta.kind == "scalar" and (i == 0 or name not in WRAPS_NUMBERS):
                return False
        elif "number" in type_s and not _is_scalar(term):
            return False
    return True


class Bridge:
    """Term <-> ATen for one compilation (one fake mode, one op table)."""

    def __init__(self, fake_mode: FakeTensorMode | None = None,
                 table: OpTable | None = None) -> None:
        self.fake_mode = fake_mode or FakeTensorMode(allow_non_fake_inputs=True)
        self.table = table or default_op_table()

    # -- calling -----------------------------------------------------------
    def call_parts(self, term: Term) -> tuple[Any, list[Any], dict[str, Any], list[Term]]:
        """(callable, args, kwargs, operand order) to run `term`.

        In args/kwargs, `Slot(i)` marks where operand i of the returned list goes.
        """
        if term.op == "aten":
            args, kwargs = term.attr("spec")
            return term.attr("target"), list(args), dict(kwargs), list(term.args)
        if term.op == "call":
            args, kwargs = term.attr("spec")
            return term.attr("target").value, list(args), dict(kwargs), list(term.args)
        if term.op == "getitem":
            return operator.getitem, [Slot(0), term.attr("index")], {}, list(term.args)
        info = self.table.get(term.op)
        if info is None:
            raise KeyError(f"no way to run op {term.op!r}")
        if term.op in RUN_AS_RESHAPE:
            # Rewrites keep shapes and dtypes but may change strides (a decomposed
            # softmax keeps its input's layout where ATen's returns a contiguous
            # tensor), so a captured view may no longer be possible: reshape is the
            # same view when it is, and a copy otherwise (graphs are functional).
            return (torch.ops.aten.reshape.default, [Slot(0), list(term.attr("size"))], {},
                    list(term.args))
        return self._table_call(info, term)

    @staticmethod
    def accepting(info: OpInfo, operands: Sequence[Term]
                  ) -> tuple[torch._ops.OpOverload, list[Term]] | None:
        """The first of the op's overloads that takes these operands (op-table
        order), and the operands in its order; None if none does."""
        for name, perm in info.overloads():
            op = overload(name)
            schema_args = op._schema.arguments
            order = [operands[i] for i in perm]
            if _accepts(schema_args, tuple(order), name):
                return op, order
            if info.commutative and len(order) == 2 and _accepts(
                    schema_args, (order[1], order[0]), name):
                return op, [order[1], order[0]]
        return None

    def _table_call(self, info: OpInfo, term: Term) -> tuple[Any, list[Any], dict[str, Any],
                                                             list[Term]]:
        operands = list(term.args)
        listed = _list_overload(info)
        if listed is not None:
            found: tuple[torch._ops.OpOverload, list[Term]] | None = (listed, operands)
            slots: dict[int, Any] = {0: [Slot(k) for k in range(len(operands))]}
        else:
            found = self.accepting(info, operands)
            slots = {} if found is None else {pos: Slot(k) for k, pos in enumerate(
                operand_positions(found[0]._schema.arguments, len(found[1])))}
        if found is not None:
            op, order = found
            schema_args = op._schema.arguments
            args: list[Any] = []
            kwargs: dict[str, Any] = {}
            attrs = dict(term.attrs)
            for i, arg in enumerate(schema_args):
                if i in slots:
                    value: Any = slots[i]
                elif arg.name in attrs:
                    value = to_torch_attr(attrs[arg.name], arg)
                else:
                    continue
                if arg.kwarg_only:
                    kwargs[arg.name] = value
                else:
                    args.append(value)
            return op, args, kwargs, order
        raise TypeError(f"no ATen overload of {info.name!r} takes these operands "
                        f"({', '.join(a.meta.short() for a in operands)})")

    def run(self, term: Term, values: list[Any]) -> Any:
        """Run `term` eagerly on the given operand values."""
        fn, args, kwargs, order = self.call_parts(term)
        pos = {id(t): i for i, t in enumerate(term.args)}
        vals = [values[pos[id(t)]] for t in order]
        return fn(*_fill(args, vals), **_fill(kwargs, vals))

    # -- metadata ----------------------------------------------------------
    def meta_hook(self, op: str, args: tuple[Term, ...],
                  attrs: tuple[tuple[str, Any], ...]) -> Meta:
        if op == "const":
            return meta_of(dict(attrs)["value"])
        probe = Term(op, args, attrs, Meta(), -1)
        values = [a.value if a.op == "const" else a.meta.payload for a in args]
        for a, v in zip(args, values, strict=True):
            if a.meta.kind == "tensor" and v is None:
                raise ValueError(f"operand of {op} has no fake value")
        with self.fake_mode:
            out = self.run(probe, [self._fakeify(v) for v in values])
        return meta_of(out)

    def _fakeify(self, v: Any) -> Any:
        if isinstance(v, torch.Tensor) and not isinstance(v, torch._subclasses.FakeTensor):
            return self.fake_mode.from_tensor(v)
        return v


@functools.lru_cache(maxsize=None)
def _list_overload(info: OpInfo) -> torch._ops.OpOverload | None:
    """The op's overload if it takes a tensor list first (`cat`): the term's operands,
    two or more, are that list (aten/convert.py: _list_term)."""
    if len(info.aten) != 1:
        return None
    op = overload(info.overloads()[0][0])
    return op if takes_tensor_list(op._schema.arguments) else None


def takes_tensor_list(schema_args: Sequence[Any]) -> bool:
    """Whether an overload's first argument is a list of tensors (`cat`'s)."""
    return bool(schema_args) and str(schema_args[0].type) == "List[Tensor]"


def _fill(spec: Any, values: list[Any]) -> Any:
    if isinstance(spec, Slot):
        return values[spec.index]
    if isinstance(spec, Opaque):
        return spec.value
    if isinstance(spec, list):
        return [_fill(s, values) for s in spec]
    if isinstance(spec, tuple):
        return tuple(_fill(s, values) for s in spec)
    if isinstance(spec, dict):
        return {k: _fill(s, values) for k, s in spec.items()}
    return spec
