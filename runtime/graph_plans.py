"""Graph plans: a compiled graph's wrapper with its kernel lines written out for the
layouts it is called with.

A kernel line of a wrapper calls its Launcher (runtime/launch.py), which works out
the launch's signature (each input's sizes, strides, dtype and alignment), finds
the plan learned for it, allocates the outputs and calls the kernel's runner: four
Python frames and a tuple per input around one launch. In a training step, whose
wrapper runs hundreds of launches back to back, that Python is most of the host
time of a launch. Yet every launch's signature follows from the graph's inputs:
an ATen call's output layout follows from its operands' layouts, a kernel's
outputs from its plan, and a fresh allocation is aligned to far more than the 16
bytes a signature tells apart. So once a graph has been called twice with one
input signature (the second call records which plan each kernel line launched),
`PlannedGraph` writes a variant of its wrapper in which each such line allocates
its outputs with their sizes and strides written in and launches the kernel's
binary directly (torch's static CUDA launcher, with the grid, the warps and the
numbers written in too), and every later call with that signature runs it after
one signature check for the whole graph. A line whose launch went through no plan
(the JIT, a call that fell back to ATen) stays as it was. So does every ATen call,
except views: a `reshape`, `t` or `expand` that gave a view of its operand is
written as that view's sizes, strides and offset (`_reinterpret_tensor`, as
Inductor's wrappers make views), skipping the dispatcher.

On the CPU the same holds for OpenMP kernels: a written line allocates the
outputs and calls the kernel's C function on the tensors' addresses and the
integers its launch plan keeps (runtime/launch.py: `_CppPlan`).

A graph calling anything whose output's size can depend on values (ops tagged
`dynamic_output_shape` or `data_dependent_output`, or a callable that is not an
ATen or rewritec op) is never planned, nor is a profiled wrapper (its timing lines
must see every launch). A variant that raises is dropped, with every other, and
the graph runs its plain wrapper from then on.
"""

from __future__ import annotations

import ast
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from . import launch as _launch
from .launch import _IN, _OUT, _TEMP, CppLauncher, Launcher, _CppPlan, _Plan, _Steps

# Input signatures a graph keeps a variant for, and signatures it counts calls of
VARIANTS = 8
COUNTED = 64
# ops whose output's size or layout depends on values, not on their operands' layouts
_DATA_DEPENDENT = (torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output)
# ...except this one, whose output's size follows from its operands' unless an index
# is a mask: the recording call checks its indices (a causal mask's positions)
_INDEX = "aten::index.Tensor"
_PLANNED_NAMESPACES = ("aten", "prims", "rewritec")
# torch's static CUDA launcher, and the current stream: what a written launch calls
STATIC_LAUNCH = getattr(getattr(torch._C, "_StaticCudaLauncher", None), "_launch_kernel", None)
CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
# a view of a tensor's storage with the given sizes, strides and added offset
try:
    from torch._C._dynamo.guards import (  # type: ignore[attr-defined]
        _reinterpret_tensor as REINTERPRET,
    )
except ImportError:  # pragma: no cover - another torch: views stay ATen calls
    REINTERPRET = None


class PlannedGraph:
    """A wrapper `call(args)` (boxed, as AOTAutograd calls it) that runs the variant
    written for its inputs' signature where there is one; see the module doc."""

    def __init__(self, fn: Callable[[list[Any]], Any], source: str, cuda: bool = True) -> None:
        # on the instance: a wrapper made with functools.wraps (torch._dynamo.disable)
        # copies the instance's __dict__, not its class's attributes
        self._boxed_call = True
        self.fn = fn
        self.source = source
        self.cuda = cuda  # it launches CUDA kernels: the current device is in its signature
        self.variants: dict[Any, Callable[[list[Any]], Any]] = {}
        self.sources: dict[Any, str] = {}  # each variant's source, for debugging
        self.calls: dict[Any, int] = {}  # plain calls per signature; -1: recorded
        self.record: Callable[[dict[int, Any], list[Any]], Any] | None = None
        self.planned_lines = 0  # lines (launches, views) the latest variant writes out
        self.broken = False  # a variant raised: the plain wrapper from then on

    def __call__(self, args: list[Any]) -> Any:
        if self.broken:
            return self.fn(args)
        try:
            key = graph_signature(args, self.cuda)
            variant = self.variants.get(key)
        except (AttributeError, TypeError, RuntimeError):  # no signature: the plain path
            return self.fn(args)
        if variant is not None:
            try:
                return variant(args)
            except Exception:
                self.broken, self.variants = True, {}
                raise
        seen = self.calls.get(key, 0)
        if seen < 0 or (seen == 0 and len(self.calls) >= COUNTED) \
                or len(self.variants) >= VARIANTS:
            return self.fn(args)
        self.calls[key] = seen + 1
        if seen == 0:
            return self.fn(args)
        return self._record(key, args)

    def _record(self, key: Any, args: list[Any]) -> Any:
        """Run the recording wrapper, then write the variant its launches allow."""
        if self.record is None:
            self.record = _recording(self.fn, self.source)
        found: dict[int, Any] = {}
        result = self.record(found, args)
        self.calls[key] = -1  # recorded once: the variant, or the plain path
        if found.pop(MASKED, False):
            found = {}
        if found:
            self.variants[key], self.sources[key] = _variant(self.fn, self.source, found)
            self.planned_lines = len(found)
        return result


def planned(fn: Callable[[list[Any]], Any], source: str) -> Callable[[list[Any]], Any]:
    """`fn` (a wrapper exec'd from `source`) as a PlannedGraph where it may be
    planned: it launches kernels that learn plans and calls only ops whose outputs'
    layouts follow from their operands'."""
    scope = fn.__globals__
    if os.environ.get("REWRITEC_GRAPH_PLANS", "1") == "0":
        return fn
    if "_start" in scope:  # profiled: every launch is timed through its launcher
        return fn
    cuda = any(isinstance(v, Launcher) and v.plans is not None for v in scope.values())
    if not cuda and not any(isinstance(v, CppLauncher) for v in scope.values()):
        return fn  # no kernel learns plans: nothing to write out
    body = _body(source)
    if not all(_plannable(node, scope) for node in ast.walk(body)
               if isinstance(node, ast.Call)):
        return fn
    return PlannedGraph(fn, source, cuda)


def _plannable(call: ast.Call, scope: dict[str, Any]) -> bool:
    """Whether a wrapper's call makes outputs whose layouts follow from its operands'."""
    func = call.func
    if isinstance(func, ast.Name):
        obj = scope.get(func.id)
        return isinstance(obj, Launcher) or func.id == "float" or _layout_op(obj)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        # `args.clear()`, and an output's copy (of a value, or of a constant)
        if func.attr in ("clear", "clone") and (
                func.value.id not in scope or isinstance(scope[func.value.id], torch.Tensor)):
            return True
    return _layout_op(_aten_op(func))


def _layout_op(obj: Any) -> bool:
    return isinstance(obj, torch._ops.OpOverload) and obj.namespace in _PLANNED_NAMESPACES \
        and (obj.name() == _INDEX or not any(tag in obj.tags for tag in _DATA_DEPENDENT))


def graph_signature(args: list[Any], cuda: bool = True) -> tuple[Any, ...]:
    """What a graph's variant depends on: the current device (`cuda`: the graph
    launches CUDA kernels), whether cuDNN is on (a convolution's output layout may
    differ without it) and each argument's signature, a tensor's as a launch's
    (runtime/launch.py: _signature): its address modulo 16 only where Triton's
    kernels specialize on it (an OpenMP kernel reads any address)."""
    if not cuda:
        return (-1, torch.backends.cudnn.enabled,
                *[(x.shape, x.stride(), x.dtype, x.get_device())
                  if isinstance(x, torch.Tensor) else (type(x), x) for x in args])
    return (_launch._plan_device(), torch.backends.cudnn.enabled,
            *[(x.shape, x.stride(), x.dtype, x.get_device(), x.data_ptr() & 15)
              if isinstance(x, torch.Tensor) else (type(x), x) for x in args])


# --------------------------------------------------------------------------- source


def _body(source: str) -> ast.FunctionDef:
    tree = ast.parse(source)
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "call")


def _kernel_lines(fn: ast.FunctionDef, scope: dict[str, Any]) -> list[tuple[int, str]]:
    """(position in the body, launcher's name) of each line `v = _kN(...)`."""
    lines = []
    for i, stmt in enumerate(fn.body):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) \
                and isinstance(stmt.value.func, ast.Name) and not stmt.value.keywords \
                and isinstance(scope.get(stmt.value.func.id), Launcher):
            lines.append((i, stmt.value.func.id))
    return lines


def _view_lines(fn: ast.FunctionDef) -> list[int]:
    """Positions of the lines `v = aten.op.overload(x, ...)` whose op returns a view
    of its first operand (its schema's one result aliases without writing)."""
    lines = []
    for i, stmt in enumerate(fn.body):
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) \
                and stmt.value.args and _is_view(_aten_op(stmt.value.func)):
            lines.append(i)
    return lines


def _aten_op(func: ast.expr) -> Any:
    """The op a wrapper names as `aten.name.overload`, or None."""
    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if not (isinstance(func, ast.Name) and func.id == "aten" and len(parts) == 2):
        return None
    return getattr(getattr(torch.ops.aten, parts[1], None), parts[0], None)


def _is_view(op: Any) -> bool:
    if not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable:
        return False
    returns = op._schema.returns
    return len(returns) == 1 and returns[0].alias_info is not None \
        and not returns[0].alias_info.is_write and str(returns[0].type) == "Tensor"


def _recording(fn: Callable[..., Any], source: str
               ) -> Callable[[dict[int, Any], list[Any]], Any]:
    """`record(found, args)`: the wrapper run with each kernel line `v = _kN(a, b)`
    as `v = _rec(i, _kN, a, b)`, which sets `found[i]` to the plan line i launched,
    and each view line `v = aten.t.default(x)` as `v = _view(i, x, aten.t.default(x))`,
    which sets it to the view's layout where the op gave a view of `x`."""
    scope = dict(fn.__globals__)
    body = _body(source)
    for i, _ in _kernel_lines(body, scope):
        call = body.body[i].value  # type: ignore[attr-defined]
        call.args = [ast.Constant(i), ast.Name(call.func.id, ast.Load()), *call.args]
        call.func = ast.Name("_rec", ast.Load())
    for stmt in body.body:  # `aten.index.Tensor(x, [i, j])`: no masks
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) \
                and len(stmt.value.args) == 2 and _op_name(stmt.value.func, scope) == _INDEX:
            stmt.value = ast.Call(ast.Name("_index", ast.Load()),  # type: ignore[attr-defined]
                                  [stmt.value.args[1], stmt.value], [])
    if REINTERPRET is not None:
        for i in _view_lines(body):
            stmt = body.body[i]
            view = stmt.value  # type: ignore[attr-defined]
            stmt.value = ast.Call(ast.Name("_view", ast.Load()),  # type: ignore[attr-defined]
                                  [ast.Constant(i), view.args[0], view], [])
    exec(compile(ast.fix_missing_locations(ast.Module([body], [])),  # noqa: S102
                 "<rewritec recording wrapper>", "exec"), scope)
    recorded = scope["call"]

    def record(found: dict[int, Any], args: list[Any]) -> Any:
        scope["_rec"] = lambda i, launcher, *inputs: _launch_recorded(found, i, launcher,
                                                                      inputs)
        scope["_view"] = lambda i, base, out: _view_recorded(found, i, base, out)
        scope["_index"] = lambda indices, out: _index_recorded(found, indices, out)
        return recorded(args)

    return record


def _launch_recorded(found: dict[int, Any], i: int, launcher: Launcher,
                     inputs: tuple[Any, ...]) -> Any:
    fell_back = launcher.calls_fell_back
    result = launcher(*inputs)
    plan = launcher.plan_for(inputs)
    if isinstance(plan, _Plan | _Steps | _CppPlan) and not launcher.failed \
            and launcher.calls_fell_back == fell_back:
        found[i] = plan
    return result


@dataclass(frozen=True)
class _View:
    """A view line's result: sizes, strides and storage offset less its operand's."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


# `found` holding this: the recorded call indexed with a mask, and is not planned
MASKED = -1


def _index_recorded(found: dict[int, Any], indices: Any, out: Any) -> Any:
    if any(isinstance(x, torch.Tensor) and x.dtype in (torch.bool, torch.uint8)
           for x in indices):
        found[MASKED] = True
    return out


def _op_name(func: ast.expr, scope: dict[str, Any]) -> str | None:
    op = scope.get(func.id) if isinstance(func, ast.Name) else _aten_op(func)
    return op.name() if isinstance(op, torch._ops.OpOverload) else None


def _view_recorded(found: dict[int, Any], i: int, base: Any, out: Any) -> Any:
    if isinstance(base, torch.Tensor) and isinstance(out, torch.Tensor) \
            and out.dtype == base.dtype and out.device == base.device \
            and out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr():
        found[i] = _View(tuple(out.shape), tuple(out.stride()),
                         int(out.storage_offset() - base.storage_offset()))
    return out


def _variant(fn: Callable[..., Any], source: str, found: dict[int, Any]
             ) -> tuple[Callable[[list[Any]], Any], str]:
    """The wrapper with each kernel line in `found` written out, and its source."""
    scope = dict(fn.__globals__)
    body = _body(source)
    writer = _Writer(scope)
    statements: list[ast.stmt] = []
    for i, stmt in enumerate(body.body):
        plan = found.get(i)
        if plan is None:
            statements.append(stmt)
            continue
        target = stmt.targets[0].id  # type: ignore[attr-defined]
        inputs = [ast.unparse(a) for a in stmt.value.args]  # type: ignore[attr-defined]
        lines = [f"{target} = _rt({inputs[0]}, {plan.size!r}, {plan.stride!r}, "
                 f"{plan.offset})"] if isinstance(plan, _View) else \
            writer.plan_lines(target, inputs, plan)
        statements += [s for line in lines for s in ast.parse(line).body]
    streams = [ast.parse(f"_st{d} = _stream({d})").body[0] for d in sorted(writer.devices)]
    body.body = streams + statements
    module = ast.fix_missing_locations(ast.Module([body], []))
    exec(compile(module, "<rewritec planned wrapper>", "exec"), scope)  # noqa: S102
    return scope["call"], ast.unparse(module)


class _Writer:
    """Writes a kernel line's plan as source, binding what it names in `scope`."""

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope
        self.devices: set[int] = set()
        self._bound: dict[int, str] = {}
        scope["_alloc"] = _launch._plan_alloc
        scope["_calloc"] = _launch._EMPTY_STRIDED_CPU or _launch._cpu_alloc
        scope["_chk"] = _launch.check_bounds
        scope["_stream"] = CURRENT_STREAM
        scope["_lk"] = STATIC_LAUNCH
        scope["_rt"] = REINTERPRET

    def bind(self, obj: Any) -> str:
        key = id(obj)
        if key not in self._bound:
            self._bound[key] = name = f"_p{len(self._bound)}"
            self.scope[name] = obj
        return self._bound[key]

    def literal(self, v: Any) -> str:
        if v is None or isinstance(v, bool | int | str):
            return repr(v)
        if isinstance(v, float) and math.isfinite(v):
            return repr(v)
        if isinstance(v, tuple) and all(isinstance(x, int) for x in v):
            return repr(v)
        return self.bind(v)

    def alloc(self, size: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> str:
        return f"_alloc({size!r}, {stride!r}, {self.bind(dtype)})"

    def plan_lines(self, target: str, inputs: list[str], plan: Any) -> list[str]:
        if isinstance(plan, _CppPlan):
            return self.cpp_lines(target, inputs, plan)
        lines, out_names = _assigned(target, [self.alloc(*o) for o in plan.outs])
        if isinstance(plan, _Plan):
            lines.append(self.launch(plan.run, [*inputs, *out_names,
                                                *[self.literal(v) for v in plan.rest]]))
            return lines
        temps = [f"_t{target}_{j}" for j in range(len(plan.temps))]
        lines += [f"{t} = {self.alloc(*a)}" for t, a in zip(temps, plan.temps, strict=True)]
        for run, slots in plan.steps:
            args = [inputs[v] if k == _IN else out_names[v] if k == _OUT else temps[v]
                    if k == _TEMP else self.literal(v) for k, v in slots]
            lines.append(self.launch(run, args))
        if temps:
            lines.append(f"del {', '.join(temps)}")
        return lines

    def cpp_lines(self, target: str, inputs: list[str], plan: _CppPlan) -> list[str]:
        """An OpenMP launch: the outputs allocated on the CPU, then the kernel called
        on the addresses and the integers, all written in."""
        outs = [f"_calloc({size!r}, {stride!r}, {self.bind(dtype)})"
                for size, stride, dtype in plan.outs]
        checks = [f"_chk(({''.join(x + ', ' for x in inputs)}), {plan.bounds!r})"] \
            if plan.bounds else []  # a take's indices, as the launcher checks them
        lines, out_names = _assigned(target, outs)
        lines = [*checks, *lines]
        if plan.ints is not None:
            ptrs = [f"{x}.data_ptr()" for x in (*inputs, *out_names)]
            lines.append(f"{self.bind(plan.fn)}({', '.join([*ptrs, *map(str, plan.ints)])})")
        return lines

    def launch(self, run: Any, args: list[str]) -> str:
        """One launch of `run` on `args`: through the static launcher where `run` is
        one of its launches (runtime/static_launch.py: `static`), else `run` itself."""
        static = getattr(run, "static", None)
        if static is None or self.scope["_lk"] is None:
            return f"{self.bind(run)}({', '.join(args)})"
        function, grid, warps, shared, codes, keep, nulls, device = static
        self.devices.add(device)
        chosen = [args[i] for i in keep] + ["None"] * nulls
        return (f"_lk({self.bind(function)}, {grid[0]}, {grid[1]}, {grid[2]}, {warps}, "
                f"{shared}, {codes!r}, ({''.join(a + ', ' for a in chosen)}), _st{device})")


def _assigned(target: str, outs: list[str]) -> tuple[list[str], list[str]]:
    """The line giving `target` a launch's outputs (the allocations `outs`: one
    tensor, or a tuple of them) and each output's name in the lines after it."""
    if len(outs) == 1:
        return [f"{target} = {outs[0]}"], [target]
    return [f"{target} = ({', '.join(outs)},)"], [f"{target}[{j}]" for j in range(len(outs))]
