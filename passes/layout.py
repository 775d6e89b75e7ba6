"""The layout phase: running 4-d convolutions in channels_last (NHWC) memory.

cuDNN's convolutions are much faster on NHWC tensors than on the NCHW ones a
model usually holds, as TorchInductor's layout optimization also finds. The
`layout` phase (engine/pipeline.py, between folding and fusion) calls the
function `relayout_for` returns:
- each chosen convolution reads its input as channels_last: a
  `clone(x, memory_format=channels_last)` term, unless the input already is
  (the output of an earlier channels_last convolution, or of pointwise ops on
  one); its weight is converted once here when it is a constant (a frozen
  parameter), else by a clone term, once per call;
- every term downstream is built again with its metadata inferred again from
  fake tensors, so the strides in the graph stay those ATen will produce;
  pointwise kernels iterate in, and write, their root's layout (runtime/launch.py);
- an output whose strides now differ from eager's gets a
  `clone(o, memory_format=<eager's layout>)`: callers may `.view` it. Fusion
  usually makes that clone the root of the last pointwise kernel, which then
  writes eager's layout directly instead of copying afterwards;
- except a training forward graph's activations saved for the backward
  (`free_outputs`): they stay in the layout they were made in, and the
  compiler reports their strides to AOTAutograd, which traces the backward
  graph over them (compiler.py: `_report_output_strides`), as Inductor's
  layout optimization does. Only the results the caller sees keep eager's.
The graph stays as it was when a term downstream depends on strides
(`as_strided` & co.) or an output's eager layout is not one a clone makes,
and under `auto` when the layout copies would cost more than the NHWC
convolutions save (`pays_off`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from ..aten.bridge import Bridge, Opaque, Slot
from ..aten.fold import FoldStep, tensor_term
from ..engine.ops import default_op_table
from ..engine.term import Graph, Term, TermStore, rebuild, render
from ..kinds.kernels import dense_order

# Float dtypes cuDNN runs NHWC convolutions in.
FLOATS = ("f32", "f16", "bf16")
# Ops whose result depends on their operand's strides, not only its values.
STRIDE_READERS = ("as_strided", "as_strided_copy", "as_strided_scatter", "_reshape_alias",
                  "view", "sym_stride", "stride", "is_contiguous", "_nested_tensor_from_mask")
# Graph kinds whose outputs go to the user only: `auto` converts them. A training
# forward graph is converted when its saved activations may keep their layout
# (`free_outputs`; restored to NCHW they would cost one copy each) and CUDA graphs
# replay it (`replayed`). On an H100 (bf16 autocast, batch 32) a training step's
# kernels took 14.8 ms in NCHW and 9.1 in NHWC for ResNet-50, 12.9 and 5.7 for
# MobileNetV3 (reduce-overhead steps 18.9 -> 16.1 and 18.7 -> 12.2 ms); but
# ATen's NHWC convolutions cost more host time per call (eager ResNet-50: 25.6 ->
# 36.4 ms of host time a step), and a step launched from Python is host-bound:
# without replay the same change made the steps 27.2 -> 31.2 and 29.4 -> 36.6 ms.
INFERENCE_KINDS = ("inference", "export")
TRAINING_FORWARD = "forward"
# Devices where `auto` converts: cuDNN's and oneDNN's NHWC kernels are the reason.
AUTO_DEVICES = ("cuda", "cpu")
# (device, dtype) pairs `auto` leaves alone: ATen's NHWC convolution there disagrees
# with its NCHW one beyond rounding. On the CPU in bf16 an infinite input gives nan
# where NCHW (and float64) give inf, in 109 of 200 random 1x5x7x2 inputs with inf/nan
# mixed in (scripts/fuzz_long.py, seed 4242); f32 and f16 agreed in all 200.
AUTO_EXCLUDED = (("cpu", "bf16"),)
# What one copied element costs, in units of what one NHWC convolution output
# element saves, as (numerator, denominator) per device (see `pays_off`). On the
# CPU (2 cores, oneDNN, 2x64x56x56 3x3): a conv ran 4.2 ms in NCHW and 2.65 ms in
# NHWC, while the copies around it cost a fraction of that, so a lone conv pays.
# On CUDA likewise since copies across layouts are tiled kernels (pays_off).
COPY_COST = {"cuda": (1, 4), "cpu": (1, 4)}


class _Keep(Exception):
    """The graph keeps its layouts; the message says why."""


def _format(fmt: torch.memory_format) -> Opaque:
    # The same spelling the front end gives a captured memory_format (from_torch_attr).
    return Opaque(fmt, repr(fmt))


def memory_format(shape: tuple[Any, ...], strides: tuple[Any, ...]) -> torch.memory_format | None:
    """The memory format whose clone has exactly these strides, if any."""
    order = dense_order(shape, strides)
    if order == tuple(range(len(shape))):
        return torch.contiguous_format
    if order == (0, 2, 3, 1):
        return torch.channels_last
    if order == (0, 2, 3, 4, 1):
        return torch.channels_last_3d
    return None


def is_channels_last(t: Term) -> bool:
    """Is `t` dense in NHWC order? Size-1 dims may have any stride, as in
    `Tensor.is_contiguous(memory_format=torch.channels_last)`."""
    if t.meta.kind != "tensor" or t.meta.rank != 4 or len(t.meta.strides) != 4:
        return False
    expected: Any = 1
    for k in (1, 3, 2, 0):
        size, stride = t.meta.shape[k], t.meta.strides[k]
        if size != 1 and stride != expected:
            return False
        expected = expected * size
    return True


def eligible(t: Term, devices: tuple[str, ...] | None) -> bool:
    """A 2-d convolution (4-d tensors) in a float dtype, on one of `devices` (None: any)."""
    if t.op != "convolution" or t.attr("transposed") is not False or len(t.args) < 2:
        return False
    x, w = t.args[0], t.args[1]
    if x.meta.kind != "tensor" or w.meta.kind != "tensor" or x.meta.rank != 4 \
            or w.meta.rank != 4 or x.meta.dtype not in FLOATS:
        return False
    return devices is None or x.meta.device.split(":")[0] in devices


def relayout_for(mode: str, kind: str, store: TermStore, bridge: Bridge,
                 record: dict[str, Any], steps: dict[int, Any] | None = None,
                 free_outputs: frozenset[int] = frozenset(), replayed: bool = False
                 ) -> Callable[[Graph], tuple[Graph, str]] | None:
    """The layout phase for one graph under Options.conv_layout `mode`
    (None: layouts stay). What it did goes into `record` (the compile report);
    `steps` is to_channels_last's, and so is `free_outputs`: the positions of
    outputs that may keep a new layout (a training forward's saved activations).
    `replayed`: CUDA graphs replay the graph, so host time per call matters little."""
    if mode == "keep":
        return None
    if mode == "auto" and kind not in INFERENCE_KINDS \
            and not (kind == TRAINING_FORWARD and free_outputs and replayed):
        return None
    devices = None if mode == "channels_last" else AUTO_DEVICES

    def run(graph: Graph) -> tuple[Graph, str]:
        convs = {t for t in graph.terms() if eligible(t, devices)
                 and (mode != "auto" or not _excluded(t))}
        if not convs:
            return graph, "no convolution to convert"
        try:
            new, counts = to_channels_last(graph, store, bridge, convs, steps, free_outputs)
            if mode == "auto":
                pays_off(graph, new)
        except _Keep as e:
            record.update(conv_layout="keep", reason=str(e))
            return graph, f"layouts kept: {e}"
        record.update(conv_layout="channels_last", **counts)
        return new, ", ".join(f"{k} {v}" for k, v in counts.items())

    return run


def _excluded(t: Term) -> bool:
    x = t.args[0].meta
    return (x.device.split(":")[0], x.dtype) in AUTO_EXCLUDED


def pays_off(old: Graph, new: Graph) -> None:
    """Raise _Keep unless the NHWC convolutions of `new` save more than its layout
    copies cost. Measured on an H200 (fp32, 32x64x56x56, 3x3 conv): a convolution
    ran 0.104 ms in NCHW and 0.062 ms in NHWC; converting its input cost 0.040 ms
    (ATen's clone), and a 1-d relu kernel writing NCHW from NHWC 0.052 ms against
    0.024 ms in one layout. Since the input's conversion became a copy kernel
    (a one-op fuse-pointwise kernel, about 0.023 ms there), one copied element costs about 3/4 of
    what one output element of a convolution saves: a lone conv+bn+relu, its input
    converted and its output restored, loses; two convolutions between them (a
    ResNet basic block) win. Since layout changes run as tiled kernels
    (templates/triton/pointwise_tiled.py.j2), on an H100 the NCHW conv of a lone
    conv+bn+relu took 0.064 ms more than in NHWC (cuDNN transposes NCHW tensors
    itself), its input's conversion 0.016 ms and restoring the output inside the
    epilogue kernel almost nothing: a copied element costs well under 1/4 of what
    an output element saves, and a lone conv pays too. Weights are small and
    converted once; sizes that are symbolic count as one element."""
    before = set(old.terms())
    terms = [t for t in new.terms() if t not in before]
    convs = [t for t in terms if t.op == "convolution"]
    weights = {t.args[1] for t in convs}  # small next to activations
    saved = sum(_elements(t) for t in convs)
    copied = sum(_elements(t) for t in terms if t.op == "clone" and t not in weights)
    devices = {t.meta.device.split(":")[0] for t in convs}
    num, den = max((COPY_COST.get(d, COPY_COST["cuda"]) for d in devices),
                   key=lambda c: c[0] / c[1], default=COPY_COST["cuda"])
    if num * copied >= den * saved:
        raise _Keep(f"layout copies ({copied} elements) would cost more than NHWC "
                    f"convolutions save (outputs of {saved} elements)")


def _elements(t: Term) -> int:
    try:
        return int(t.meta.numel())
    except TypeError:
        return 1


def to_channels_last(graph: Graph, store: TermStore, bridge: Bridge, convs: set[Term],
                     steps: dict[int, Any] | None = None,
                     free_outputs: frozenset[int] = frozenset()) -> tuple[Graph, Counter[str]]:
    """`graph` with `convs` in channels_last and outputs in eager's layout, but for
    those at the positions `free_outputs` whose new strides are static; `steps`
    (if given) collects how each converted constant was made (aten/fold.py: FoldStep)."""
    counts: Counter[str] = Counter()
    cl = _format(torch.channels_last)

    def nhwc(t: Term, what: str) -> Term:
        if is_channels_last(t):
            return t
        if t.op == "tensor":
            # A constant (frozen weight): converted here, once.
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            value = t.attr("value")
            with torch.no_grad(), unset_fake_temporarily():
                nhwc_value = value.value.contiguous(memory_format=torch.channels_last)
            if steps is not None and nhwc_value is not value.value:
                steps[id(nhwc_value)] = FoldStep(
                    torch.ops.aten.clone.default, [Slot(0)],
                    {"memory_format": torch.channels_last}, [value.value], nhwc_value)
            counts["weights_converted_once"] += 1
            return tensor_term(store, bridge, nhwc_value, f"{value.label}_nhwc")
        counts[f"{what}_converted_per_call"] += 1
        return _make(store, "clone", [t], (("memory_format", cl),))

    def replace(t: Term, new: dict[Term, Term]) -> Term | None:
        args = [new.get(a, a) for a in t.args]
        if t in convs:
            counts["convolutions"] += 1
            return _make(store, t.op, [nhwc(args[0], "inputs"), nhwc(args[1], "weights"),
                                          *args[2:]], t.attrs)
        if all(n is a for n, a in zip(args, t.args, strict=True)):
            return t
        if t.op == "aten" and t.attr("target") is torch.ops.aten.view.default:
            # A view with symbolic sizes (the table's `view` already runs as reshape):
            # in a functional graph reshape means the same, and copies where an
            # NHWC tensor cannot be viewed.
            attrs = tuple((k, torch.ops.aten.reshape.default if k == "target" else v)
                          for k, v in t.attrs)
            return _make(store, t.op, args, attrs)
        if _reads_strides(t):
            raise _Keep(f"{render(t, 1)} depends on its operand's strides")
        return _make(store, t.op, args, t.attrs)

    done: dict[Term, Term] = {}

    def remember(t: Term, new: dict[Term, Term]) -> Term | None:
        out = replace(t, new)
        done[t] = t if out is None else out
        return out

    relaid = rebuild(graph, store, remember)
    restored: dict[Term, Term] = {}

    def eager_layout(old: Term) -> Term:
        """`old`'s new term with `old`'s strides again. A view is made again over
        its restored base, so outputs that share memory in eager still do."""
        if old in restored:
            return restored[old]
        t = done[old]
        if t.meta.strides == old.meta.strides:
            out = t
        elif old.args and _is_view(old):
            base = eager_layout(old.args[0])
            out = _make(store, old.op, [base, *(done[a] for a in old.args[1:])], old.attrs)
        else:
            fmt = memory_format(old.meta.shape, old.meta.strides)
            if fmt is None:
                raise _Keep(f"output {render(old, 1)} has strides {old.meta.strides} "
                            f"that no clone restores")
            out = _make(store, "clone", [t], (("memory_format", _format(fmt)),))
            counts["outputs_restrided"] += 1
        if out.meta.strides != old.meta.strides:
            raise _Keep(f"output {render(old, 1)} would have strides {out.meta.strides}, "
                        f"not eager's {old.meta.strides}")
        restored[old] = out
        return out

    def output(i: int, old: Term | None) -> Term | None:
        if old is None:
            return None
        new = done[old]
        if i in free_outputs and new.meta.strides != old.meta.strides \
                and all(isinstance(s, int) for s in new.meta.strides):
            counts["saved_in_new_layout"] += 1
            return new
        return eager_layout(old)

    outputs = tuple(output(i, o) for i, o in enumerate(graph.outputs))
    return Graph(relaid.inputs, outputs), counts


def _is_view(t: Term) -> bool:
    """Does `t` return a view of its first operand?"""
    if t.op == "aten":
        returns = t.attr("target")._schema.returns
        return bool(returns) and returns[0].alias_info is not None
    return t.op in default_op_table().ops and default_op_table().category(t.op) == "view"


def _make(store: TermStore, op: str, args: list[Term],
          attrs: tuple[tuple[str, Any], ...]) -> Term:
    """A term with its metadata inferred anew (fake tensors), so strides are ATen's."""
    try:
        return store.make(op, args, attrs)
    except Exception as e:  # whatever the fake run says, keep layouts
        raise _Keep(f"no metadata for {op} over the new layout: {type(e).__name__}: {e}") from e


def _reads_strides(t: Term) -> bool:
    if t.op == "call":
        return any(a.meta.kind == "tensor" for a in t.args)
    if t.op == "aten":
        return t.attr("target")._schema.name.split("::")[-1] in STRIDE_READERS
    return False
