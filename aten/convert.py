"""FX graph (ATen level) -> term graph.

Each `call_function` node becomes a term:
- an op of the op table when its overload is listed there (operands in schema
  order, every other schema argument as an attribute, defaults filled in), so
  rules can match it by name;
- otherwise a generic `aten` term that remembers the overload and the call's
  structure, so it still runs through ATen unchanged;
- python callables on sizes (`operator.mul` on SymInts, ...) become `call` terms.

Metadata comes from the fake values that AOTAutograd leaves in `node.meta`.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..engine.ops import OpInfo
from ..engine.term import Graph, Term, TermStore, freeze
from .bridge import (
    Bridge,
    Opaque,
    Slot,
    from_torch_attr,
    meta_of,
    operand_positions,
    takes_tensor_list,
)
from .fold import tensor_term
from .regions import Region


class Unsupported(Exception):
    """The FX graph holds something the term IR cannot represent faithfully."""


@dataclass
class Converted:
    graph: Graph
    store: TermStore
    bridge: Bridge
    # The FX node whose memory each output uses (views followed back to their base;
    # None for a None output): hash-consing may merge two outputs that eager
    # returns as two separate tensors.
    output_nodes: tuple[Any, ...] = ()


def _input_kind(value: Any, is_param: bool | None) -> str:
    if is_param:
        return "param"
    if isinstance(value, torch.SymInt | int):
        return "size"
    return "input"


def fx_to_terms(gm: torch.fx.GraphModule, bridge: Bridge,
                params: list[bool] | None = None,
                frozen: dict[int, torch.Tensor] | None = None) -> Converted:
    """Convert `gm`. Inputs listed in `frozen` are used as the given constant
    tensors (they stay in the graph's input list, unused)."""
    store = TermStore(bridge.meta_hook)
    numbers: dict[torch.fx.Node, Term] = {}  # scalar_tensor nodes as numbers
    env: dict[torch.fx.Node, Term] = {}
    inputs: list[Term] = []
    outputs: tuple[Term | None, ...] = ()
    output_nodes: tuple[Any, ...] = ()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            value = node.meta.get("val")
            i = len(inputs)
            kind = _input_kind(value, params[i] if params and i < len(params) else None)
            term = store.make("input", (), (("name", node.name), ("index", i), ("kind", kind)),
                              meta=meta_of(value))
            inputs.append(term)
            env[node] = term
            if frozen and i in frozen:
                env[node] = tensor_term(store, bridge, frozen[i], f"param{i}")
        elif node.op == "call_function":
            env[node] = _convert_call(node, env, store, bridge, numbers)
        elif node.op == "output":
            outs = node.args[0]
            outs = outs if isinstance(outs, tuple | list) else (outs,)
            outputs = tuple(_output(o, env) for o in outs)
            output_nodes = tuple(_fx_base(o) if isinstance(o, torch.fx.Node) else None
                                 for o in outs)
        elif node.op == "get_attr":
            # A constant tensor held by the graph module (torch.tensor(...) in forward).
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if not isinstance(value, torch.Tensor):
                raise Unsupported(f"get_attr node {node.target!r} of type {type(value).__name__}")
            env[node] = tensor_term(store, bridge, value, str(node.target))
        else:
            raise Unsupported(f"FX node kind {node.op!r}")
    return Converted(Graph(tuple(inputs), outputs), store, bridge, output_nodes)


def _fx_base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage `node` shares: views and getitems followed back."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        source, target = node.args[0], node.target
        if target is operator.getitem:
            node = source
            continue
        if not isinstance(target, torch._ops.OpOverload):
            break
        returns = target._schema.returns
        if not returns or returns[0].alias_info is None:
            break
        node = source
    return node


def _output(o: Any, env: dict[torch.fx.Node, Term]) -> Term | None:
    if o is None:
        return None
    if isinstance(o, torch.fx.Node):
        return env[o]
    raise Unsupported(f"graph output of type {type(o).__name__}")


def _has_node(x: Any) -> bool:
    if isinstance(x, torch.fx.Node):
        return True
    if isinstance(x, list | tuple):
        return any(_has_node(v) for v in x)
    if isinstance(x, dict):
        return any(_has_node(v) for v in x.values())
    return False


def _convert_call(node: torch.fx.Node, env: dict[torch.fx.Node, Term], store: TermStore,
                  bridge: Bridge, numbers: dict[torch.fx.Node, Term] | None = None) -> Term:
    target = node.target
    meta = meta_of(node.meta["val"]) if "val" in node.meta else None
    if target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
            and isinstance(node.args[1], int):
        return store.make("getitem", (env[node.args[0]],), (("index", node.args[1]),), meta)
    if isinstance(target, torch._ops.OpOverload):
        if target._schema.is_mutable:
            raise Unsupported(f"mutating op {target}")
        nonce: tuple[tuple[str, Any], ...] = ()
        if torch.Tag.nondeterministic_seeded in target.tags:
            # Two random draws are never the same term, even with equal arguments.
            nonce = (("nonce", node.name),)
        number = _scalar_tensor_const(node, store)
        if number is not None and numbers is not None:
            numbers[node] = number  # what table ops read; anything else the tensor
        term = _cat_of_one(node, env, store, bridge, meta)  # before the table's `cat`
        if term is not None:
            return term
        term = _table_term(node, target, env, store, bridge, meta, nonce, numbers or {})
        if term is not None:
            return term
        return _generic(node, "aten", target, env, store, meta, nonce)
    if callable(target):
        label = getattr(target, "__name__", type(target).__name__)
        # two calls of a region are never one term: a region may draw random numbers
        nonce = (("nonce", node.name),) if isinstance(target, Region) else ()
        return _generic(node, "call", Opaque(target, label), env, store, meta, nonce)
    raise Unsupported(f"call target {target!r}")


def _scalar_tensor_const(node: torch.fx.Node, store: TermStore) -> Term | None:
    """For `scalar_tensor(v)`, the constant v that op-table ops may read instead
    (`_table_term`, `_reads_a_number`); the node itself stays a tensor for anything
    else. Decompositions write `torch.where(c, x, 0)` so (the class-index loss's pick
    and mask, masked fills): the zero was an ATen fill launch and an input every
    kernel using it read, now a literal in the kernel."""
    if node.target is not torch.ops.aten.scalar_tensor.default or not node.args:
        return None
    value, val = node.args[0], node.meta.get("val")
    if not isinstance(value, bool | int | float) or not isinstance(val, torch.Tensor) \
            or val.dim() != 0 or val.dtype.is_complex:
        return None
    # the value the 0-dim tensor holds (0.1 in bf16 is 0.10009765625)
    with unset_fake_temporarily():  # a real number, whatever mode converts
        exact = torch.tensor(value, dtype=val.dtype).item()
    kind = bool if val.dtype == torch.bool else float if val.dtype.is_floating_point else int
    return store.const(kind(exact))


def _reads_a_number(user: torch.fx.Node, node: torch.fx.Node, schema: list[Any]) -> bool:
    """May `user`, an op-table op, read the scalar_tensor `node` as a number? Yes where
    the number promotes as the 0-dim tensor did: the user's other tensors (a `where`'s
    condition aside) have the scalar's dtype, and so does its result (or bool)."""
    dtype, out = node.meta["val"].dtype, user.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.dtype not in (dtype, torch.bool):
        return False
    tensors = 0  # operands that stay tensors of `dtype`: the result's dtype is theirs
    for i, arg in enumerate(user.args):
        if arg is node or not isinstance(arg, torch.fx.Node):
            continue
        v = arg.meta.get("val")
        if not isinstance(v, torch.Tensor):
            continue
        if schema[i].name == "condition" and v.dtype == torch.bool:
            continue
        if v.dtype != dtype:
            return False
        # another scalar_tensor may become a number too (where(c, 0.0, -inf))
        tensors += arg.target is not torch.ops.aten.scalar_tensor.default
    # numbers alone give the default dtype of their kind
    return tensors > 0 or dtype in (torch.get_default_dtype(), torch.int64, torch.bool)


def _cat_of_one(node: torch.fx.Node, env: dict[torch.fx.Node, Term], store: TermStore,
                bridge: Bridge, meta: Any) -> Term | None:
    """`cat` of one tensor and "legacy" empty ones (1-d, no elements: cat skips
    them) as the op table's contiguous `clone` of that tensor, which the fuse rules
    turn into a copy kernel with its producers. Hugging Face's key-value cache starts
    as such an empty tensor, so each layer's first `cat` onto it is a copy, which
    ATen's cat ran at a fraction of copy bandwidth (the cached keys arrive as a
    strided view of the projection): 0.95 ms of GPT-2's 5.8 ms inference step on an
    H100, 24 times a step."""
    if node.target is not torch.ops.aten.cat.default or "clone" not in bridge.table.ops \
            or not isinstance(node.args[0], list | tuple):
        return None
    values: list[tuple[torch.fx.Node, torch.Tensor]] = []
    for n in node.args[0]:
        value = n.meta.get("val") if isinstance(n, torch.fx.Node) else None
        if not isinstance(n, torch.fx.Node) or not isinstance(value, torch.Tensor):
            return None
        values.append((n, value))
    kept = [(n, v) for n, v in values if not (v.dim() == 1 and v.shape[0] == 0)]
    out = node.meta.get("val")
    if len(kept) != 1 or len(values) < 2 or not isinstance(out, torch.Tensor):
        return None
    one, value = kept[0]
    if not all(isinstance(d, int) for d in (*out.shape, *value.shape)):
        return None  # symbolic sizes: left to ATen
    if (out.dtype != value.dtype or out.device != value.device
            or out.shape != value.shape or not out.is_contiguous()):
        return None
    return store.make("clone", (env[one],), (("memory_format", torch.contiguous_format),),
                      meta)


def _table_term(node: torch.fx.Node, target: torch._ops.OpOverload,
                env: dict[torch.fx.Node, Term], store: TermStore, bridge: Bridge,
                meta: Any, nonce: tuple[tuple[str, Any], ...],
                numbers: dict[torch.fx.Node, Term]) -> Term | None:
    """`numbers`: scalar_tensor nodes as numbers (_scalar_tensor_const), read where
    `_reads_a_number` and one of the op's ATen overloads take them."""
    namespace, _, base = target._schema.name.rpartition("::")
    name = f"{base}.{target._overloadname}"
    if namespace != "aten":
        name = f"{namespace}::{name}"
    info = bridge.table.by_aten.get(name)
    if info is None:
        return None
    schema_args = target._schema.arguments
    bound: dict[str, Any] = {}
    for arg, value in zip(schema_args, node.args, strict=False):
        bound[arg.name] = value
    bound.update(node.kwargs)
    if takes_tensor_list(schema_args):
        return _list_term(info, schema_args, bound, env, store, meta)
    operands: list[Term] = []
    tensors: dict[int, Term] = {}  # operands read as numbers -> their tensor terms
    attrs: list[tuple[str, Any]] = []
    positions = operand_positions(schema_args, len(info.args))
    if len(positions) < len(info.args):
        return None
    for i, arg in enumerate(schema_args):
        value = _argument(arg, bound)
        if value is _MISSING:
            return None
        if i in positions:
            if isinstance(value, torch.fx.Node):
                number = numbers.get(value)
                if number is not None and _reads_a_number(node, value, schema_args):
                    tensors[len(operands)] = env[value]
                    operands.append(number)
                else:
                    operands.append(env[value])
            elif _has_node(value):
                return None
            else:
                operands.append(store.const(from_torch_attr(value)))
        else:
            if _has_node(value) or arg.name not in info.attrs:
                return None  # symbolic attribute or one the table does not know
            attrs.append((arg.name, from_torch_attr(value)))
    order = bridge.table.order[name]
    ordered = _in_table_order(operands, order)
    if tensors and bridge.accepting(info, ordered) is None:
        # no overload takes the numbers (maximum): the 0-dim tensors, as traced
        ordered = _in_table_order([tensors.get(k, t) for k, t in enumerate(operands)], order)
    if target is torch.ops.aten._to_copy.default:
        attrs = _plain_cast(attrs, ordered[0])
    return store.make(info.name, ordered, tuple(attrs) + nonce, meta)


_MISSING: Any = object()


def _argument(arg: Any, bound: dict[str, Any]) -> Any:
    """A schema argument's value in a call: as bound, else its default, else _MISSING."""
    if arg.name in bound:
        return bound[arg.name]
    return arg.default_value if arg.has_default_value() else _MISSING


def _list_term(info: OpInfo, schema_args: list[Any], bound: dict[str, Any],
               env: dict[torch.fx.Node, Term], store: TermStore, meta: Any) -> Term | None:
    """An op whose overload takes a tensor list first (`cat`): its operands are the
    list's tensors, two or more, and every other argument an attribute."""
    tensors = bound.get(schema_args[0].name)
    if not isinstance(tensors, list | tuple) or len(tensors) < 2 or not all(
            isinstance(n, torch.fx.Node) and isinstance(n.meta.get("val"), torch.Tensor)
            for n in tensors):
        return None
    attrs: list[tuple[str, Any]] = []
    for arg in schema_args[1:]:
        value = _argument(arg, bound)
        if value is _MISSING:
            return None
        if _has_node(value) or arg.name not in info.attrs:
            return None  # symbolic, or an attribute the table does not know
        attrs.append((arg.name, from_torch_attr(value)))
    return store.make(info.name, [env[n] for n in tensors], tuple(attrs), meta)


def _in_table_order(operands: list[Term], order: tuple[int, ...]) -> list[Term]:
    """An overload's operands (schema order) in the op table's order."""
    ordered: list[Term] = operands[:1] * len(operands)
    for k, term in enumerate(operands):
        ordered[order[k]] = term
    return ordered


def _plain_cast(attrs: list[tuple[str, Any]], src: Term) -> list[tuple[str, Any]]:
    """A `_to_copy`'s attributes, less those that change nothing (autocast's casts
    spell out the strided layout, the source's own device and pin_memory=False):
    the rules then see `to(x, dtype=d)`, whatever wrote the cast."""
    def same(key: str, value: Any) -> bool:
        plain = getattr(value, "value", value)
        if key == "layout":
            return plain == torch.strided
        if key == "device":
            return isinstance(plain, torch.device | str) and src.meta.kind == "tensor" \
                and str(torch.device(plain)) == src.meta.device
        return key == "pin_memory" and plain is False

    return [(k, None if same(k, v) else v) for k, v in attrs]


def _generic(node: torch.fx.Node, op: str, target: Any, env: dict[torch.fx.Node, Term],
             store: TermStore, meta: Any, nonce: tuple[tuple[str, Any], ...]) -> Term:
    operands: list[Term] = []

    def slot(x: Any) -> Any:
        if isinstance(x, torch.fx.Node):
            operands.append(env[x])
            return Slot(len(operands) - 1)
        if isinstance(x, list | tuple):
            return tuple(slot(v) for v in x)
        if isinstance(x, torch.dtype | torch.device | torch.layout | torch.memory_format):
            return Opaque(x, repr(x))
        return x

    args = tuple(slot(a) for a in node.args)
    kwargs = tuple((k, slot(v)) for k, v in node.kwargs.items())
    return store.make(op, operands, (("target", target), ("spec", freeze((args, kwargs))))
                      + nonce, meta)
