"""A compiled graph's wrapper as data: what a package (runtime/package.py) holds
instead of Python source.

`encode` reads the wrapper runtime/wrapper.py generated (its source and the objects
its names are bound to) into a JSON-able program; `Program.build` checks a program
against an allow-list and generates the wrapper's source from it again, so a
package never carries code that is run as it is stored. A program is

    {"inputs": ["a0", ...], "steps": [STEP, ...], "outputs": [{"v": "v9"}, ...]}

where a STEP is one line of the wrapper:

    {"out": "v7", "op": "aten::addmm.default", "args": [...], "kwargs": {...}}
    {"out": "v9", "kernel": "k0_fuse_row_8925af52", "args": [...]}
    {"out": "v3", "fn": "_operator.mul", "args": [...]}      (arithmetic on sizes)
    {"out": "v13", "item": ["v12", 1]}
    {"del": ["v7", "a1"]}

and a value is a JSON scalar, {"v": NAME} (a variable), {"list": [...]},
{"tuple": [...]}, {"float": "inf"}, {"dtype": "float32"}, {"memory_format": ...},
{"layout": ...}, {"device": "cpu"} or {"const": "c0"} (a tensor constant).
Ops are looked up in `torch.ops.{aten,prims,rewritec}` only and functions in the graph
cache's table of pure ones (runtime/graph_cache.py), so a program can name no
call but an ATen, prims or rewritec overload (aten/attention.py), size arithmetic,
or a kernel of its package.
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..aten import rewritec_ops  # noqa: F401 - define rewritec::*, a program's ops
from ..aten.bridge import Bridge, Opaque, Slot
from ..engine.errors import PackageError
from ..engine.term import Term
from .graph_cache import ALLOWED_FNS, callable_ref
from .launch import Launcher
from .namespace import namespace

VARIABLE = re.compile(r"^[av][0-9]+$")
KERNEL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]*$")
OP_NAME = re.compile(r"^(aten|prims|rewritec)::([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")
# The ops a program may call: ATen's, prims', and rewritec's own (aten/attention.py,
# aten/iota.py)
OP_NAMESPACES = ("aten", "prims", "rewritec")
# torch values a program names: which of torch's types each tag stands for
TORCH_VALUES: dict[str, Any] = {"dtype": torch.dtype, "memory_format": torch.memory_format,
                                "layout": torch.layout}


class NotPackable(PackageError):
    """The compiled wrapper holds something a package cannot store as data."""


# --------------------------------------------------------------------------- encode


@dataclass
class Encoded:
    """A wrapper as data, and the objects its data names by key."""

    program: dict[str, Any]
    kernels: dict[str, Launcher]  # kernel name -> launcher
    constants: dict[str, torch.Tensor]  # c0, c1, ... -> tensor


def encode(source: str, bound: dict[str, Any]) -> Encoded:
    """The wrapper `source` (templates/wrapper.py.j2's layout) whose free names are
    bound to `bound`, as a program; NotPackable names what cannot be stored."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef))
    enc = _Encoder(bound)
    program: dict[str, Any] = {"inputs": [], "steps": [], "outputs": []}
    for stmt in fn.body:
        if isinstance(stmt, ast.Assign) and isinstance(stmt.targets[0], ast.Tuple):
            program["inputs"] = [_name(e) for e in stmt.targets[0].elts]
        elif isinstance(stmt, ast.Expr) and ast.unparse(stmt) == "args.clear()":
            continue
        elif isinstance(stmt, ast.Delete):
            program["steps"].append({"del": [_name(t) for t in stmt.targets[0].elts]}
                                    if isinstance(stmt.targets[0], ast.Tuple)
                                    else {"del": [_name(t) for t in stmt.targets]})
        elif isinstance(stmt, ast.Assign):
            program["steps"].append(enc.step(_name(stmt.targets[0]), stmt.value))
        elif isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Tuple):
            program["outputs"] = [enc.output(e) for e in stmt.value.elts]
        else:
            raise NotPackable(f"a wrapper line rewritec does not generate: {ast.unparse(stmt)}")
    return Encoded(program, enc.kernels, enc.constants)


def _name(node: ast.expr) -> str:
    if not isinstance(node, ast.Name):
        raise NotPackable(f"expected a name, got {ast.unparse(node)}")
    return node.id


def encode_body(body: Sequence[Term], outputs: Sequence[Term], bridge: Bridge,
                first_constant: int = 0) -> Encoded:
    """A kernel's group as ATen calls (runtime/prepare.py: AtenBody), as a program
    that takes the kernel's inputs and returns its outputs: what a package runs
    where its kernel cannot launch. Its tensor constants are named from
    `c{first_constant}` on, after the wrapper's."""
    enc = _Encoder({}, first_constant)
    values: dict[Term, Any] = {}
    inputs = 0
    for t in body:
        if t.op == "arg":
            values[t] = {"v": f"a{t.attr('index')}"}
            inputs = max(inputs, t.attr("index") + 1)
        elif t.op == "const":
            values[t] = enc.obj(t.value, f"k{id(t)}")
    steps: list[dict[str, Any]] = []
    for t in body:
        if t.op in ("arg", "const"):
            continue
        fn, args, kwargs, order = bridge.call_parts(t)
        operands = [values[a] for a in order]
        out = f"v{len(steps)}"
        if fn is operator.getitem:
            steps.append({"out": out, "item": [operands[0]["v"], args[1]]})
        else:
            step: dict[str, Any] = {"out": out, **enc.callee_obj(fn)}
            step["args"] = [enc.filled(a, operands) for a in args]
            if kwargs:
                step["kwargs"] = {k: enc.filled(v, operands) for k, v in kwargs.items()}
            steps.append(step)
        values[t] = {"v": out}
    program = {"inputs": [f"a{i}" for i in range(inputs)], "steps": steps,
               "outputs": [values[o] for o in outputs]}
    return Encoded(program, {}, enc.constants)


class _Encoder:
    def __init__(self, bound: dict[str, Any], first_constant: int = 0) -> None:
        self.bound = bound
        self.kernels: dict[str, Launcher] = {}
        self.constants: dict[str, torch.Tensor] = {}
        self._const_names: dict[str, str] = {}
        self._first = first_constant

    def step(self, out: str, value: ast.expr) -> dict[str, Any]:
        if isinstance(value, ast.Subscript):
            return {"out": out, "item": [_name(value.value), self.value(value.slice)]}
        if not isinstance(value, ast.Call):
            raise NotPackable(f"a wrapper line rewritec does not generate: {out} = "
                              f"{ast.unparse(value)}")
        step: dict[str, Any] = {"out": out, **self.callee(value.func)}
        step["args"] = [self.value(a) for a in value.args]
        if value.keywords:
            step["kwargs"] = {k.arg: self.value(k.value) for k in value.keywords}
        return step

    def callee(self, func: ast.expr) -> dict[str, str]:
        text = ast.unparse(func)
        if text.startswith("aten."):  # aten.addmm.default
            _, packet, overload = text.split(".")
            return {"op": f"aten::{packet}.{overload}"}
        obj = self.bound.get(text)
        if isinstance(obj, Launcher):
            self.kernels[obj.spec.name] = obj
            return {"kernel": obj.spec.name}
        return self.callee_obj(obj)

    def callee_obj(self, obj: Any) -> dict[str, str]:
        if isinstance(obj, torch._ops.OpOverload) and obj.namespace in OP_NAMESPACES:
            return {"op": f"{obj.namespace}::{obj._opname}.{obj._overloadname}"}
        try:
            ref = callable_ref(obj)
        except Exception:  # noqa: BLE001 - graph_cache.Uncacheable: not a function by name
            ref = None
        if ref is not None and ALLOWED_FNS.get(ref) is obj:
            return {"fn": ".".join(ref)}
        raise NotPackable(f"the wrapper calls {obj!r}, which a package cannot name "
                          "(ATen, prims and rewritec ops, size arithmetic and its kernels "
                          "only)")

    def output(self, node: ast.expr) -> dict[str, Any] | None:
        if isinstance(node, ast.Constant) and node.value is None:
            return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "clone":
            return {**self.value(node.func.value), "clone": True}
        return self.value(node)  # type: ignore[no-any-return]

    def value(self, node: ast.expr) -> Any:
        if isinstance(node, ast.Constant):
            return self.scalar(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) \
                and isinstance(node.operand, ast.Constant):
            return self.scalar(-node.operand.value)  # type: ignore[operator]
        if isinstance(node, ast.List | ast.Tuple):
            kind = "list" if isinstance(node, ast.List) else "tuple"
            return {kind: [self.value(e) for e in node.elts]}
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "float":
            return {"float": node.args[0].value}  # type: ignore[attr-defined]
        if isinstance(node, ast.Attribute) and ast.unparse(node.value) == "torch":
            return self.torch_value(getattr(torch, node.attr))
        if isinstance(node, ast.Name):
            if VARIABLE.match(node.id):
                return {"v": node.id}
            return self.bound_value(node.id)
        raise NotPackable(f"a wrapper value rewritec does not generate: {ast.unparse(node)}")

    def scalar(self, v: Any) -> Any:
        if isinstance(v, float) and not math.isfinite(v):
            return {"float": repr(v)}
        if v is None or isinstance(v, bool | int | float | str):
            return v
        raise NotPackable(f"a literal of type {type(v).__name__}")

    def torch_value(self, obj: Any) -> dict[str, str]:
        for tag, kind in TORCH_VALUES.items():
            if isinstance(obj, kind):
                return {tag: str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": str(obj)}
        raise NotPackable(f"the wrapper binds a {type(obj).__name__}: {obj!r}")

    def bound_value(self, name: str) -> Any:
        return self.obj(self.bound.get(name), name)

    def obj(self, obj: Any, name: str) -> Any:
        """A Python object as a value; a tensor is a constant, by `name` once."""
        if isinstance(obj, torch.Tensor):
            key = self._const_names.setdefault(
                name, f"c{self._first + len(self._const_names)}")
            self.constants[key] = obj
            return {"const": key}
        if obj is None or isinstance(obj, bool | int | float | str):
            return self.scalar(obj)
        return self.torch_value(obj)

    def filled(self, spec: Any, operands: list[Any]) -> Any:
        """An argument of a call the bridge makes (aten/bridge.py: call_parts), its
        `Slot`s filled with the operands' values."""
        if isinstance(spec, Slot):
            return operands[spec.index]
        if isinstance(spec, Opaque):
            return self.obj(spec.value, f"o{id(spec)}")
        if isinstance(spec, list | tuple):
            kind = "list" if isinstance(spec, list) else "tuple"
            return {kind: [self.filled(s, operands) for s in spec]}
        return self.obj(spec, f"o{id(spec)}")


# --------------------------------------------------------------------------- build


def overload(ns: str, name: str, overload: str) -> torch._ops.OpOverload | None:
    """torch.ops.<ns>.<name>.<overload> if it is that op (ATen's own start with `_`
    too: `_to_copy`, `_softmax`), never another attribute of torch.ops."""
    if name.startswith("__") or overload.startswith("__"):
        return None
    try:
        packet = getattr(getattr(torch.ops, ns), name)
        op = getattr(packet, overload)
    except (AttributeError, RuntimeError):
        return None
    if isinstance(op, torch._ops.OpOverload) and op._schema.name == f"{ns}::{name}":
        return op
    return None


@dataclass
class Program:
    """A checked program, made into the wrapper function it stands for."""

    data: dict[str, Any]
    where: str  # the package, for errors

    def build(self, kernels: dict[str, Any], constants: dict[str, torch.Tensor]) -> Any:
        """The wrapper `call(args)`: its source generated from the data, every object it
        names bound in its globals (ops from the allow-list, `kernels`, `constants`)."""
        gen = _Generator(self.where, kernels, constants)
        try:
            source = gen.source(self.data)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, RuntimeError) as e:
            raise PackageError(f"{self.where}: program.json is malformed: "
                               f"{type(e).__name__}: {e}") from None
        scope = {**namespace(), **gen.globals}
        exec(compile(source, f"<rewritec package {self.where}>", "exec"), scope)  # noqa: S102
        return scope["call"], source


class _Generator:
    def __init__(self, where: str, kernels: dict[str, Any],
                 constants: dict[str, torch.Tensor]) -> None:
        self.where = where
        self.kernels = kernels
        self.constants = constants
        self.globals: dict[str, Any] = {}
        self._ids: dict[int, str] = {}

    def bad(self, what: str) -> PackageError:
        return PackageError(f"{self.where}: program.json {what}")

    def bind(self, obj: Any) -> str:
        name = self._ids.setdefault(id(obj), f"_g{len(self._ids)}")
        self.globals[name] = obj
        return name

    def source(self, data: dict[str, Any]) -> str:
        inputs = [self.var(n) for n in data["inputs"]]
        lines = ["def call(args):"]
        if inputs:
            lines += [f"    {', '.join(inputs)}, = args", "    args.clear()"]
        lines += [f"    {self.line(s)}" for s in data["steps"]]
        outs = [self.output(o) for o in data["outputs"]]
        lines.append(f"    return ({''.join(o + ', ' for o in outs)})")
        return "\n".join(lines) + "\n"

    def var(self, name: Any) -> str:
        if not isinstance(name, str) or not VARIABLE.match(name):
            raise self.bad(f"names a variable {name!r}")
        return name

    def line(self, step: dict[str, Any]) -> str:
        if "del" in step:
            return "del " + ", ".join(self.var(n) for n in step["del"])
        out = self.var(step["out"])
        if "item" in step:
            src, index = step["item"]
            if type(index) is not int:
                raise self.bad(f"indexes with {index!r}")
            return f"{out} = {self.var(src)}[{index}]"
        args = [self.value(a) for a in step.get("args", [])]
        args += [f"{self.keyword(k)}={self.value(v)}" for k, v in step.get("kwargs", {}).items()]
        note = f"  # {step['kernel']}" if "kernel" in step else ""  # a checked name
        return f"{out} = {self.callee(step)}({', '.join(args)}){note}"

    def keyword(self, k: Any) -> str:
        if not isinstance(k, str) or not k.isidentifier():
            raise self.bad(f"passes a keyword {k!r}")
        return k

    def callee(self, step: dict[str, Any]) -> str:
        if "op" in step:
            m = OP_NAME.match(str(step["op"]))
            op = overload(m.group(1), m.group(2), m.group(3)) if m else None
            if not isinstance(op, torch._ops.OpOverload):
                raise self.bad(f"calls {step['op']!r}, which is not an ATen, prims or "
                               "rewritec op")
            if op.namespace == "aten":  # as the compiled wrapper spells it (namespace.py)
                return f"aten.{m.group(2)}.{m.group(3)}"  # type: ignore[union-attr]
            return self.bind(op)
        if "kernel" in step:
            kernel = self.kernels.get(step["kernel"])
            if kernel is None or not KERNEL_NAME.match(step["kernel"]):
                raise self.bad(f"launches kernel {step['kernel']!r}, which it does not hold")
            return self.bind(kernel)
        module, _, name = str(step.get("fn")).rpartition(".")
        fn = ALLOWED_FNS.get((module, name))
        if fn is None:
            raise self.bad(f"calls {step.get('fn')!r}, which is not a pure function "
                           "rewritec's wrappers call")
        return self.bind(fn)

    def output(self, o: Any) -> str:
        if o is None:
            return "None"
        text = self.value({k: v for k, v in o.items() if k != "clone"})
        return f"{text}.clone()" if o.get("clone") else text

    def value(self, v: Any) -> str:
        if v is None or isinstance(v, bool | int | str):
            return repr(v)
        if isinstance(v, float):
            if not math.isfinite(v):
                raise self.bad("holds a non-finite float")
            return repr(v)
        if not isinstance(v, dict) or len(v) != 1:
            raise self.bad(f"holds a value {v!r}")
        (tag, x), = v.items()
        if tag == "v":
            return self.var(x)
        if tag in ("list", "tuple"):
            items = [self.value(e) for e in x]
            if tag == "list":
                return f"[{', '.join(items)}]"
            return f"({''.join(i + ', ' for i in items)})"
        if tag == "float" and x in ("inf", "-inf", "nan"):
            return f"float({x!r})"
        if tag in TORCH_VALUES:
            obj = getattr(torch, x, None) if isinstance(x, str) and x.isidentifier() else None
            if not isinstance(obj, TORCH_VALUES[tag]):
                raise self.bad(f"names torch.{x}, which is not a {tag}")
            return self.bind(obj)
        if tag == "device":
            return self.bind(torch.device(str(x)))
        if tag == "const" and x in self.constants:
            return self.bind(self.constants[x])
        raise self.bad(f"holds a value {v!r}")
