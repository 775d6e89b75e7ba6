"""Regional compilation: graphs that call `invoke_subgraph`.

A block marked with `torch.compiler.nested_compile_region` reaches the backend as
one subgraph module that the forward, backward or inference graph calls once per
layer: `invoke_subgraph(subgraph, identifier, *operands)` (AOTAutograd splits a
region's joint graph into a forward and a backward subgraph itself). Before a graph
is converted to terms, `compile_regions` compiles each distinct region once, through
the callback it is given (compiler.compile_fx), and points every call at the compiled
region; so a model of N identical blocks compiles one block, not N.

To the rules a region's call is one opaque call: fusion stops at its boundary, and
two calls are never merged (a region may draw random numbers).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ..engine.errors import RewritecError

# (subgraph, fake operands, identifier) -> the compiled Region
CompileRegion = Callable[[torch.fx.GraphModule, list[Any], str], "Region"]


def invoke_subgraph_op() -> Any:
    return getattr(torch.ops.higher_order, "invoke_subgraph", None)


# How a region's call is labelled (runtime/wrapper.py: callable_label names a Python
# callable by its module and name). It runs no ATen op of the graph that calls it, so
# it is left out of that graph's `fallback_ops`: the region's own record counts its ops.
CALL_LABEL = f"{__name__}.invoke_subgraph"


class Region:
    """A compiled region, called like the subgraph: operands in, its results out."""

    def __init__(self, name: str, fn: Callable[[list[Any]], Any], record: Any = None) -> None:
        self.name = name
        self.fn = fn
        self.record = record  # its report.GraphRecord: what each call launches
        self.__qualname__ = self.__name__ = "invoke_subgraph"

    def __call__(self, *operands: Any) -> Any:
        return self.fn(list(operands))

    def __repr__(self) -> str:
        return f"Region({self.name})"


def has_regions(gm: torch.fx.GraphModule) -> bool:
    hop = invoke_subgraph_op()
    return hop is not None and any(n.op == "call_function" and _calls(n, hop)
                                   for n in gm.graph.nodes)


def _calls(node: torch.fx.Node, hop: Any) -> bool:
    """A call of `hop`, or of a wrapper that takes it first (auto_functionalized)."""
    return node.target is hop or bool(node.args) and node.args[0] is hop


def compile_regions(gm: torch.fx.GraphModule, compile_region: CompileRegion
                    ) -> torch.fx.GraphModule:
    """A copy of `gm` whose `invoke_subgraph` calls run compiled regions: one
    compilation per distinct subgraph and operand layout (shapes, strides, dtypes)."""
    hop = invoke_subgraph_op()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is not hop and _calls(node, hop):
            # AOTAutograd wraps a region that writes to a buffer or an input in
            # auto_functionalized; its writes would be hidden from the rules
            raise RewritecError(f"region {node.kwargs.get('identifier', node.name)} writes "
                                "to a tensor it is given (a buffer or an input); only "
                                "regions that do not are compiled")
    compiled: dict[tuple[Any, ...], Region] = {}
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is hop:
            sub = _subgraph(gm, node)
            operands = torch.fx.map_arg(node.args[2:], lambda n: env[n])
            fakes = [_val(a) for a in node.args[2:]]
            key = (id(sub), _layout(fakes))
            if key not in compiled:
                compiled[key] = compile_region(_typed(sub, fakes), fakes, str(node.args[1]))
            new = graph.call_function(compiled[key], tuple(operands), dict(node.kwargs))
            new.meta = dict(node.meta)
            env[node] = new
        elif node.op == "get_attr" and node.users and all(
                u.target is hop and u.args[0] is node for u in node.users):
            continue  # a subgraph module: its calls now hold the compiled region
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return torch.fx.GraphModule(gm, graph)


def region_calls(gm: torch.fx.GraphModule | None) -> list[Region]:
    """The compiled regions a graph from `compile_regions` calls, once per call."""
    if gm is None:
        return []
    return [n.target for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, Region)]


def region_bodies(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """The subgraph modules `gm`'s region calls run, and theirs in turn."""
    hop = invoke_subgraph_op()
    bodies: list[torch.fx.GraphModule] = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and hop is not None and _calls(node, hop):
            target = node.args[0] if node.target is hop else node.kwargs.get("subgraph")
            sub = getattr(gm, str(target.target), None) if isinstance(target, torch.fx.Node) \
                else None
            if isinstance(sub, torch.fx.GraphModule) and sub not in bodies:
                bodies += [sub, *region_bodies(sub)]
    return bodies


def _subgraph(gm: torch.fx.GraphModule, node: torch.fx.Node) -> torch.fx.GraphModule:
    target = node.args[0]
    sub = getattr(gm, str(target.target), None) if isinstance(target, torch.fx.Node) \
        and target.op == "get_attr" else None
    if not isinstance(sub, torch.fx.GraphModule):
        raise RewritecError(f"invoke_subgraph {node.name} calls no subgraph module")
    for inner in sub.graph.nodes:
        if isinstance(inner.target, torch._ops.OpOverload) and inner.target._schema.is_mutable:
            # a call the rules see as pure must be pure: the graph runs as captured
            raise RewritecError(f"region {node.args[1]} mutates a tensor ({inner.target})")
    return sub


def _val(arg: Any) -> Any:
    if isinstance(arg, torch.fx.Node):
        if "val" not in arg.meta:
            raise RewritecError(f"operand {arg.name} of a region has no fake value")
        return arg.meta["val"]
    return arg


def _layout(values: list[Any]) -> tuple[Any, ...]:
    """What a compiled region is specialised on, per operand (str: sizes may be
    symbolic, and comparing those would add guards)."""
    return tuple((str(tuple(v.shape)), str(v.stride()), v.dtype, v.device.type)
                 if isinstance(v, torch.Tensor) else (type(v).__name__, str(v)) for v in values)


def _typed(sub: torch.fx.GraphModule, fakes: list[Any]) -> torch.fx.GraphModule:
    """`sub` with fake values of this call's operands in its nodes' metadata: the
    subgraph's own when they match, else a copy with values propagated anew."""
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(fakes):
        raise RewritecError(f"a region takes {len(placeholders)} operands, called with "
                          f"{len(fakes)}")
    if _layout([p.meta.get("val") for p in placeholders]) == _layout(fakes):
        return sub
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    copy = torch.fx.GraphModule(sub, _copy_graph(sub.graph))
    FakeTensorProp(copy, detect_fake_mode(fakes)).propagate_dont_convert_inputs(*fakes)
    return copy


def _copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in graph.nodes:
        env[node] = new.node_copy(node, lambda n: env[n])
    return new

