"""Lowering a term graph to one straight-line Python function.

The wrapper calls ATen for every term that no generated kernel covers (the
always-correct fallback) and launches kernels for the groups that one does.
Python computes every line; `templates/wrapper.py.j2` only lays them out.
Identifiers that reach the generated source are either validated names
(`aten.add.Tensor`) or our own counters (`v3`, `_g1`); every other object is
bound in the function's globals, never spelled out as source.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..aten.bridge import Bridge, Opaque, Slot
from ..aten.regions import CALL_LABEL as REGION_CALL
from ..engine.term import Graph, Term
from ..kinds.templates import render_template
from . import profile as timing
from .namespace import namespace

_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


@dataclass
class Lowered:
    source: str
    fn: Any
    fallback_ops: Counter[str] = field(default_factory=Counter)
    # The objects the source names (kernels, constants, ops), as bound.
    globals: dict[str, Any] = field(default_factory=dict)


class Emitter:
    """Names values and objects while the wrapper's lines are written."""

    def __init__(self) -> None:
        self.globals: dict[str, Any] = namespace()
        self.names: dict[Term, str] = {}
        self._bound: dict[int, str] = {}
        # constants this line reads from a device copy made once (`host_copies`)
        self.moved: dict[Term, str] = {}
        self._device_copies: dict[tuple[Term, str], str] = {}

    def bind(self, obj: Any, prefix: str = "_g") -> str:
        key = id(obj)
        if key not in self._bound:
            name = f"{prefix}{len(self._bound)}"
            self._bound[key] = name
            self.globals[name] = obj
        return self._bound[key]

    def callable_name(self, fn: Any) -> str:
        if isinstance(fn, torch._ops.OpOverload) and fn.namespace == "aten":
            name = f"aten.{fn._schema.name.split('::')[-1]}.{fn._overloadname}"
            if _DOTTED.match(name):
                return name
        return self.bind(fn, "_f")

    def literal(self, v: Any) -> str:
        if v is None or isinstance(v, bool | int):
            return repr(v)
        if isinstance(v, float):
            return repr(v) if math.isfinite(v) else f"float('{v}')"
        if isinstance(v, str):
            return repr(v)
        if isinstance(v, Opaque):
            return self.literal(v.value)
        if isinstance(v, list):
            return "[" + ", ".join(self.literal(x) for x in v) + "]"
        if isinstance(v, tuple):
            return "(" + "".join(self.literal(x) + ", " for x in v) + ")"
        if isinstance(v, torch.dtype | torch.memory_format):
            return f"torch.{str(v).removeprefix('torch.')}"
        return self.bind(v)

    def value(self, t: Term) -> str:
        if t.op == "const":
            return self.literal(t.value)
        if t in self.moved:
            return self.moved[t]
        if t.op == "tensor":
            return self.bind(t.attr("value").value, "_c")
        return self.names[t]

    def on_device(self, t: Term, device: str) -> str:
        """The name of constant `t` copied to `device` once, when the wrapper is built."""
        key = (t, device)
        if key not in self._device_copies:
            # lowering runs under AOTAutograd's fake mode; this copy is a real tensor
            with unset_fake_temporarily():
                moved = t.attr("value").value.to(device)
            self._device_copies[key] = self.bind(moved, "_c")
        return self._device_copies[key]

    def args(self, spec: Any, operands: list[Term]) -> str:
        if isinstance(spec, Slot):
            return self.value(operands[spec.index])
        if isinstance(spec, list):
            return "[" + ", ".join(self.args(s, operands) for s in spec) + "]"
        if isinstance(spec, tuple):
            return "(" + "".join(self.args(s, operands) + ", " for s in spec) + ")"
        return self.literal(spec)


def aten_line(em: Emitter, bridge: Bridge, term: Term, target: str) -> str:
    if term.op == "getitem":
        return f"{target} = {em.value(term.args[0])}[{int(term.attr('index'))}]"
    fn, args, kwargs, order = bridge.call_parts(term)
    em.moved = host_copies(em, fn, order, term)
    parts = [em.args(a, order) for a in args]
    parts += [f"{k}={em.args(v, order)}" for k, v in kwargs.items()]
    em.moved = {}
    return f"{target} = {em.callable_name(fn)}({', '.join(parts)})"


# A copy from host memory in every call synchronises with the device and cannot be
# recorded in a CUDA graph (T5's `decoder_start_token_id` is such a 0-dim constant);
# up to this many values, the constant is copied to the device once instead.
HOST_COPY_MAX = 1 << 16


def host_copies(em: Emitter, fn: Any, order: list[Term], term: Term) -> dict[Term, str]:
    """For a `copy` onto a GPU tensor from a host constant: the constant's device copy."""
    if callable_label(fn) not in ("copy", "copy_") or len(order) < 2:
        return {}
    src, device = order[1], term.meta.device
    value = src.attr("value").value if src.op == "tensor" else None
    if (not isinstance(value, torch.Tensor) or value.device.type != "cpu"
            or device == "cpu" or value.numel() > HOST_COPY_MAX):
        return {}
    return {src: em.on_device(src, device)}


def op_label(bridge: Bridge, term: Term) -> str:
    """The name of the op a term runs, for `fallback_ops` (docs/report.md): the
    overload packet of the ATen op actually called (`addmm` for aten.addmm.default,
    `mul` for aten.mul.Scalar), `ns::name` for an op of another namespace, and a
    Python callable's module-qualified name otherwise (`operator.mul` on SymInts).
    One scheme, whether the term is an op-table op, a captured ATen call or an
    exported one."""
    try:
        fn = bridge.call_parts(term)[0]
    except Exception:  # noqa: BLE001 - a label never stops a compilation
        return term.op
    return callable_label(fn)


def callable_label(fn: Any) -> str:
    schema = getattr(fn, "_schema", None)
    qualified = schema.name if schema is not None else getattr(fn, "_qualified_op_name", None)
    if isinstance(qualified, str):  # an OpOverload ("aten::addmm") or OpOverloadPacket
        ns, _, packet = qualified.partition("::")
        return packet if ns == "aten" else qualified
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None) or "builtins"
    # operator.mul on SymInts keeps its module: bare, it would read as ATen's mul
    return f"{'operator' if module == '_operator' else module}.{name}"


def timed(profile: timing.GraphProfile | None, slot: timing.Slot | None, line: str
          ) -> list[str]:
    """`line`, between the profile's clock reads when `slot` is to be timed."""
    if profile is None or slot is None:
        return [line]
    return ["_t = _start()", line, f"_stop({profile.slot(slot)}, _t)"]


def schedule(graph: Graph, movable: Callable[[Term], bool]) -> list[Term]:
    """The order the wrapper runs `graph` in: `graph.terms()` (a depth-first order
    from the outputs), except that once a value's other readers have run, its last
    readers run at once where they can (their operands are ready), are `movable`
    (kernels, op-table ops: pure, no random numbers drawn out of turn) and make
    nothing larger than what they free. A backward's weight gradients (a product
    of an activation and a gradient, a layer norm's sums over rows) otherwise wait
    for the whole input-gradient chain, each holding its operands: the layer norm
    sums written as rules held 0.3-0.6 GB more under GPT-2 and BERT training."""
    base = graph.terms()
    place = {t: i for i, t in enumerate(base)}
    readers: dict[Term, list[Term]] = {}
    for t in base:
        for a in dict.fromkeys(t.args):
            readers.setdefault(a, []).append(t)
    done = {t for t in base if not t.args}
    out = [t for t in base if not t.args]

    def ready(c: Term) -> bool:
        return c not in done and movable(c) and all(a in done for a in c.args)

    def frees(c: Term, a: Term) -> bool:
        made, held = _numel(c), _numel(a)
        return made is not None and held is not None and made <= held

    for t in base:
        if t in done:
            continue
        work = [t]
        while work:
            u = work.pop()
            if u in done:
                continue
            done.add(u)
            out.append(u)
            later: list[Term] = []
            for a in dict.fromkeys(u.args):
                rest = [c for c in readers.get(a, ()) if c not in done]
                if rest and all(ready(c) and frees(c, a) for c in rest):
                    later += rest
            work += sorted(dict.fromkeys(later), key=place.__getitem__, reverse=True)
    return out


def _numel(t: Term) -> int | None:
    """Elements `t` holds (a tuple's parts together), None when not known as a number."""
    parts = t.meta.parts if t.meta.kind == "tuple" else (t.meta,)
    total = 0
    for m in parts:
        if m is None or m.kind != "tensor":
            return None
        n = m.numel()
        if not isinstance(n, int):
            return None
        total += n
    return total


def lower(graph: Graph, bridge: Bridge, name: str, *, rules: list[str] | None = None,
          launchers: dict[Term, Any] | None = None,
          clone_outputs: set[int] | None = None,
          profile: timing.GraphProfile | None = None) -> Lowered:
    """Render the wrapper for `graph`. `launchers` maps each `kernel` term to the
    launcher of its generated kernel (runtime/launch.py). With `profile`, each
    launch, each ATen call and the whole call are timed into it (runtime/profile.py);
    without, the wrapper has no timing line at all."""
    em = Emitter()
    if profile is not None:
        em.globals["_start"], em.globals["_stop"] = profile.functions()
    launchers = launchers or {}
    order = [t for t in schedule(graph, lambda t: t.op in ("kernel", "getitem")
                                 or bridge.table.get(t.op) is not None)
             if t.op not in ("const", "tensor")]
    for t in graph.inputs:
        em.names[t] = f"a{t.attr('index')}"
    # Find each value's last use so intermediates are freed as early as eager would.
    reads: dict[Term, list[Term]] = {}
    for t in order:
        if t.op != "input":
            reads[t] = list(t.args)
    last_use: dict[Term, int] = {}
    for i, t in enumerate(order):
        for a in reads.get(t, ()):
            last_use[a] = i
    keep = {o for o in graph.outputs if o is not None}
    body: list[str] = []
    fallback: Counter[str] = Counter()
    for i, t in enumerate(order):
        if t.op == "input":
            continue
        em.names[t] = f"v{i}"
        if t in launchers:
            kernel = em.bind(launchers[t], "_k")
            args = ", ".join(em.value(a) for a in t.args)
            line = f"{em.names[t]} = {kernel}({args})  # {launchers[t].spec.name}"
            body += timed(profile, timing.Slot("kernel", launchers[t].spec.name, t.uid), line)
        elif t.op == "getitem":
            body.append(aten_line(em, bridge, t, em.names[t]))
        else:
            label = op_label(bridge, t)
            fallback[label] += 1
            # a region's calls are timed in the region's own graph
            slot = None if label == REGION_CALL else timing.Slot("aten", label, t.uid)
            body += timed(profile, slot, aten_line(em, bridge, t, em.names[t]))
        # inputs too: the wrapper holds the only reference once `args` is cleared (a
        # backward's saved activations go as soon as they are read)
        dead = [a for a in reads[t] if last_use.get(a) == i and a not in keep
                and a.op not in ("const", "tensor")]
        if dead:
            body.append("del " + ", ".join(sorted({em.names[a] for a in dead})))
    outs = []
    for i, o in enumerate(graph.outputs):
        if o is None:
            outs.append("None")
        elif clone_outputs and i in clone_outputs:
            outs.append(f"{em.value(o)}.clone()")
        else:
            outs.append(em.value(o))
    epilogue: list[str] = []
    if profile is not None:  # slot 0: the whole call
        body, epilogue = ["_t0 = _start()", *body], ["_stop(0, _t0)"]
    source = render_template(
        "wrapper.py.j2", graph_name=name, rules=rules or [],
        kernels=[launcher.spec.name for launcher in launchers.values()],
        inputs=[em.names[t] for t in graph.inputs], body=body,
        epilogue=epilogue, outputs=outs)
    namespace = dict(em.globals)
    exec(compile(source, f"<rewritec wrapper {name}>", "exec"), namespace)  # noqa: S102
    return Lowered(source, namespace["call"], fallback, em.globals)
