"""Graphs that write into their own inputs: the writes leave the graph and one call
makes them after it.

AOTAutograd is asked to keep the updates of inputs that need no gradient in the
graph (frontend/backend.py: keep_inference_input_mutations), BatchNorm's running
statistics above all: it then ends the graph with `copy_(input, new_value)` where it
would otherwise return each new value and copy it into the input from Python after
the call (ResNet-50: 161 host calls a training step, MobileNetV3: 140). The rule
engine compiles pure graphs, so `split_input_writes` turns those trailing copies into
extra results, and `write_back` wraps the compiled graph so that one
`torch._foreach_copy_` per dtype and device writes them all; under CUDA-graph
replay the copies are part of the recorded graph (runtime/cudagraphs.py: `mutated`).

A copy that is not plainly the graph's last word on its input (one whose result is
read, a second write to the same input, or a read of the input after the write)
stays in the graph, whose conversion then refuses it, and the graph runs through
ATen as captured: correct, only slower.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

COPY = torch.ops.aten.copy_.default


def split_input_writes(gm: torch.fx.GraphModule
                       ) -> tuple[torch.fx.GraphModule, list[int], int] | None:
    """A copy of `gm` whose trailing input writes are results instead, the input
    position each new result goes to, and how many results the graph had; None
    when `gm` writes no input or a write cannot move (module docstring)."""
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    places = {n: i for i, n in enumerate(n for n in nodes if n.op == "placeholder")}
    output = nodes[-1]
    writes = [n for n in nodes if n.op == "call_function" and n.target is COPY
              and n.args and n.args[0] in places]
    if not writes or output.op != "output":
        return None
    targets = [n.args[0] for n in writes]
    if len(set(targets)) != len(targets) or any(n.kwargs for n in writes):
        return None
    for node, dst in zip(writes, targets, strict=True):
        if node.users or not isinstance(node.args[1], torch.fx.Node):
            return None
        if any(order[u] > order[node] for u in dst.users if u is not node):
            return None  # the input is read after it is written
    new = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in nodes:
        if node in writes or node is output:
            continue
        env[node] = new.node_copy(node, lambda n: env[n])
    returned = output.args[0]
    flat = list(returned) if isinstance(returned, tuple | list) else [returned]
    values = [env[n.args[1]] for n in writes]
    new.output(tuple(torch.fx.map_arg(flat, lambda n: env[n]) + values))
    split = torch.fx.GraphModule(gm, new)
    split.meta = dict(getattr(gm, "meta", {}))
    return split, [places[t] for t in targets], len(flat)


def write_back(fn: Callable[[list[Any]], Any], inputs: Sequence[int], n_results: int,
               single: bool) -> Callable[[list[Any]], Any]:
    """Call the boxed `fn` (a graph split by `split_input_writes`), copy its extra
    results into the inputs at `inputs` and return the rest (the one result itself,
    with `single`, where the graph returned a bare value)."""

    def call(args: list[Any]) -> Any:
        targets = [args[i] for i in inputs]  # a boxed call may empty `args`
        out = fn(args)
        groups: dict[tuple[Any, ...], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for dst, value in zip(targets, out[n_results:], strict=True):
            if dst.shape == value.shape and dst.dtype == value.dtype \
                    and dst.device == value.device:
                key = (dst.dtype, dst.device)
                dsts, srcs = groups.setdefault(key, ([], []))
                dsts.append(dst)
                srcs.append(value)
            else:
                dst.copy_(value)  # a broadcast or a cast
        for dsts, srcs in groups.values():
            if len(dsts) == 1:
                dsts[0].copy_(srcs[0])
            else:
                torch._foreach_copy_(dsts, srcs)
        results = out[:n_results]
        return results[0] if single else (
            tuple(results) if isinstance(out, tuple) else list(results))

    call._boxed_call = True  # type: ignore[attr-defined]
    return call
