"""A backward graph traced over the layouts its forward graph saved.

A training forward graph whose convolutions run channels_last keeps the
activations it saves for the backward in that layout (passes/layout.py) and
reports their strides to AOTAutograd (compiler.py: `_report_output_strides`).
AOTAutograd then hands the backward compiler example inputs with those strides,
but leaves the graph's node metadata as it was traced, over eager's layouts.
Kernels are planned from that metadata (a "flat" input is read as contiguous), so
`follow_saved_layouts` propagates fake tensors through the graph again from the
inputs as they really come. The backward's results (parameter gradients) are then
given eager's layouts back where a clone can restore them: a gradient whose layout
differs from its parameter's is copied anyway when autograd stores it, and the
clone usually joins the kernel that computes the gradient.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from ..passes.layout import memory_format


def _strides(value: Any) -> tuple[int, ...] | None:
    """A tensor's strides when they are all plain ints, else None."""
    if not isinstance(value, torch.Tensor):
        return None
    strides = tuple(value.stride())
    return strides if all(isinstance(s, int) for s in strides) else None


def follow_saved_layouts(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> bool:
    """Make `gm`'s metadata match `example_inputs`' strides where they differ from
    the traced ones; True when anything changed."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return False
    changed = False
    for node, value in zip(placeholders, example_inputs, strict=True):
        got, traced = _strides(value), _strides(node.meta.get("val"))
        if got is not None and traced is not None and got != traced:
            changed = True
    if not changed:
        return False
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], tuple | list) else (output.args[0],)
    before = [_strides(r.meta.get("val")) if isinstance(r, torch.fx.Node) else None
              for r in results]
    mode = detect_fake_mode(example_inputs)
    if mode is None:  # real tensors (AOTAutograd passes fake ones): made fake here
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        FakeTensorProp(gm, mode).propagate(*example_inputs)
    else:
        FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*example_inputs)
    restored = list(results)
    for i, (r, want) in enumerate(zip(results, before, strict=True)):
        if not isinstance(r, torch.fx.Node) or want is None:
            continue
        value = r.meta.get("val")
        if not isinstance(value, torch.Tensor) or _strides(value) in (None, want):
            continue
        fmt = memory_format(tuple(value.shape), want)
        if fmt is None:
            continue  # autograd copies it into its parameter's layout itself
        with gm.graph.inserting_before(output):
            clone = gm.graph.call_function(torch.ops.aten.clone.default, (r,),
                                           {"memory_format": fmt})
        with mode:
            clone.meta["val"] = torch.ops.aten.clone.default(value, memory_format=fmt)
        restored[i] = clone
    output.args = (tuple(restored) if isinstance(output.args[0], tuple | list)
                   else restored[0],)
    gm.recompile()
    return True
