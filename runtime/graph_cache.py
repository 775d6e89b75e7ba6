"""The graph cache: compiled inference graphs found again by their TorchDynamo graph.

When TorchDynamo hands over a graph that was compiled before (in this process
or an earlier one) with inputs of the same shapes, strides, dtypes and devices,
the backend loads the compiled wrapper instead of running AOTAutograd, the
rules and code generation again. An entry holds:

- the wrapper's Python source (runtime/wrapper.py) and what its names stand for:
  ATen ops, literals, kernels and constants;
- each kernel as its source and launcher (runtime/recipe.py: KernelRecipe); the
  compiled kernel itself comes from the kernel cache (runtime/build.py), Triton's;
- each constant as the steps that made it from the parameters (aten/fold.py:
  FoldStep), replayed on the loading process's parameters. Weights are never
  stored, so a model with other weights but the same structure loads the same
  entry and gets its own constants.

Only graphs that AOTAutograd passes through unchanged are stored, so that the
loaded wrapper can stand in for AOTAutograd's runtime wrapper: inference (no
input needs grad), static shapes, no input mutated, every output a fresh tensor.
Everything else compiles as before. The key covers the graph, the inputs, the
options, grad and autocast modes, the versions of torch and Triton, and the bytes
of rewritec's code, rules and templates (and of any rule files given), so an
edit to a rule is never served a stale entry.

Entries live in `$REWRITEC_CACHE_DIR/graphs/`, trusted as the kernel cache is
(runtime/disk_cache.py: this user's folder, each file signed with this user's
key), and are unpickled with a fixed table of the names they may use. `graph_cache=False` or
REWRITEC_GRAPH_CACHE=0 turns the cache off; it is also off under `debug`,
`out_dir`, REWRITEC_STATS and `rewritec explain`, whose output comes from
compiling: a cache hit would make them report no rewriting at all.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import io
import math
import operator
import os
import pickle
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from .. import report
from ..aten.bridge import Opaque, _fill
from ..aten.fold import FrozenParams
from ..engine.diag import log
from .cudagraphs import CudaGraphRunner
from .disk_cache import read_verified, store, subdir
from .graph_plans import planned
from .launch import Launcher
from .namespace import namespace as wrapper_namespace

FORMAT = 1  # bump when an entry's layout changes
# The package folders whose bytes are part of every key.
CODE_DIRS = ("engine", "aten", "frontend", "passes", "kinds", "runtime", "rules", "templates")
# call_function targets outside these modules (user functions, HOPs) are not keyed.
TARGET_MODULES = ("torch", "operator", "_operator", "math", "builtins")
TORCH_VALUE_TYPES = (torch.dtype, torch.device, torch.layout, torch.memory_format)


class Uncacheable(Exception):
    """Why a graph is compiled without the cache (said at REWRITEC_DEBUG=1)."""


class CachedKernelFailed(RuntimeError):
    """A kernel of a loaded entry failed at launch: the graph compiles again."""


@dataclass
class Artifact:
    """What compiler.compile_fx hands over for storing: one compiled graph."""

    name: str
    source: str
    globals: dict[str, Any]
    frozen: dict[int, torch.Tensor]  # input position -> parameter frozen as a constant
    steps: dict[int, Any]  # id(constant) -> aten.fold.FoldStep
    cudagraphs: bool
    record: report.GraphRecord


# --------------------------------------------------------------------------- the key


def key_for(gm: torch.fx.GraphModule, inputs: list[Any], params: list[bool],
            opts: Any) -> str | None:
    """The entry's key for this Dynamo graph and its inputs, or None (not cached)."""
    if (not opts.graph_cache or opts.debug or opts.out_dir or opts.explain or opts.profile
            or _stats_on()):
        return None
    try:
        _check_modes(inputs)
        text = "\n".join([
            f"format {FORMAT}", _fingerprint(), _options_text(opts),
            f"grad {torch.is_grad_enabled()} inference {torch.is_inference_mode_enabled()}",
            _inputs_text(inputs, params), _graph_text(gm),
        ])
    except Uncacheable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _stats_on() -> bool:
    """REWRITEC_STATS (options.py) counts the rules' work, which a hit skips."""
    return os.environ.get("REWRITEC_STATS", "") not in ("", "0")


def _check_modes(inputs: list[Any]) -> None:
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                       for x in inputs):
        raise Uncacheable("training graph")
    if torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"):
        raise Uncacheable("autocast")


@cache
def _fingerprint() -> str:
    """rewritec's code, rules and templates, and the versions it runs on."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = sorted(root.glob("*.py"))
    for d in CODE_DIRS:
        files += sorted(p for p in (root / d).rglob("*") if p.is_file()
                        and "__pycache__" not in p.parts)
    for p in files:
        h.update(str(p.relative_to(root)).encode())
        h.update(p.read_bytes())
    triton = importlib.util.find_spec("triton")
    triton_init = Path(triton.origin) if triton and triton.origin else None
    return (f"code {h.hexdigest()} torch {torch.__version__} python {sys.version_info[:3]} "
            f"triton {triton_init and (triton_init, triton_init.stat().st_mtime_ns)} "
            f"interpret {os.environ.get('TRITON_INTERPRET', '')}")


def _options_text(opts: Any) -> str:
    h = hashlib.sha256(repr(opts).encode())
    for given in opts.rules:  # rule files given by path: their bytes, not their names
        path = Path(given)
        # a folder holds its templates; a file's are in `templates/` beside it
        beside = path.parent / "templates"
        files = sorted(path.rglob("*")) if path.is_dir() else [path, *sorted(beside.rglob("*"))]
        for p in files:
            h.update(str(p).encode())
            h.update(p.read_bytes() if p.is_file() else b"missing")
    return f"options {h.hexdigest()}"


def _inputs_text(inputs: list[Any], params: list[bool]) -> str:
    lines = []
    first_user: dict[int, int] = {}
    for i, x in enumerate(inputs):
        if type(x) not in (torch.Tensor, torch.nn.Parameter):
            raise Uncacheable(f"input {i} is a {type(x).__name__}")
        storage = x.untyped_storage().data_ptr()
        lines.append(f"in{i} {tuple(x.shape)} {x.stride()} {x.storage_offset()} {x.dtype} "
                     f"{x.device} grad={x.requires_grad} param={i < len(params) and params[i]} "
                     f"shares={first_user.setdefault(storage, i)}")
        if x.is_cuda:
            lines.append(torch.cuda.get_device_name(x.device))
    return "\n".join(lines)


def _graph_text(gm: torch.fx.GraphModule) -> str:
    index: dict[torch.fx.Node, int] = {}
    lines = []
    for i, n in enumerate(gm.graph.nodes):
        index[n] = i
        if n.op == "placeholder":
            ev = n.meta.get("example_value")
            if not isinstance(ev, torch.Tensor) or not all(
                    isinstance(s, int) for s in (*ev.shape, *ev.stride())):
                raise Uncacheable(f"input {n.name} is symbolic or not a tensor")
            target = "input"
        elif n.op == "call_function":
            target = _target_name(n.target)
        elif n.op in ("call_method", "output"):
            target = str(n.target)
        else:  # get_attr, call_module: state outside the graph's inputs
            raise Uncacheable(f"{n.op} node {n.name}")
        lines.append(f"{n.op} {target} {_arg_text(n.args, index)} {_arg_text(n.kwargs, index)}")
    return "\n".join(lines)


def _target_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
        return f"op {target}"
    return ".".join(callable_ref(target))


def callable_ref(fn: Any) -> tuple[str, str]:
    """(module, qualified name) that find `fn` again, for torch's and Python's own."""
    module = getattr(fn, "__module__", None) or ""
    if module.split(".")[0] in TARGET_MODULES:
        # torch.sin's qualified name is `_VariableFunctionsClass.sin`; `torch.sin` finds it
        for name in (getattr(fn, "__qualname__", None), getattr(fn, "__name__", None)):
            if name and _resolve(module, name) is fn:
                return module, name
    raise Uncacheable(f"call of {fn!r}")


def _resolve(module: str, qualname: str) -> Any:
    try:
        obj: Any = sys.modules.get(module) or importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    except (ImportError, AttributeError):
        return None


def _arg_text(a: Any, index: dict[torch.fx.Node, int]) -> str:
    if isinstance(a, torch.fx.Node):
        return f"%{index[a]}"
    if a is None or a is Ellipsis or isinstance(a, bool | int | float | str):
        return repr(a)
    if isinstance(a, TORCH_VALUE_TYPES):
        return f"{type(a).__name__}({a})"
    if isinstance(a, slice):
        return f"slice({_arg_text((a.start, a.stop, a.step), index)})"
    if isinstance(a, tuple | list):
        return f"{type(a).__qualname__}({', '.join(_arg_text(x, index) for x in a)})"
    if isinstance(a, dict):
        return "{" + ", ".join(f"{k!r}: {_arg_text(v, index)}" for k, v in a.items()) + "}"
    raise Uncacheable(f"argument of type {type(a).__name__}")


# --------------------------------------------------------------------------- storing


def aot_passes_through(fw_gm: torch.fx.GraphModule, n_inputs: int, n_outputs: int) -> bool:
    """Does AOTAutograd's runtime wrapper do nothing for this inference graph (no
    input mutated, every output fresh, inputs neither merged nor added)?"""
    from torch._functorch._aot_autograd.schemas import MutationType, OutputType
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    meta = getattr(ctx, "fw_metadata", None)
    if meta is None:
        return False
    placeholders = [n for n in fw_gm.graph.nodes if n.op == "placeholder"]
    return (len(placeholders) == n_inputs and len(meta.output_info) == n_outputs
            and all(i.mutation_type == MutationType.NOT_MUTATED for i in meta.input_info)
            and all(o.output_type == OutputType.non_alias for o in meta.output_info)
            and meta.num_intermediate_bases == 0 and not meta.tokens)


def save(key: str, art: Artifact) -> None:
    """Store `art` under `key`. Storing never fails a compilation: a graph that
    cannot be stored (or a cache that cannot be written) is only said at debug."""
    try:
        entry = _entry(art)
        buf = io.BytesIO()
        _Pickler(buf).dump(entry)
        store(_dir() / f"{key}.pkl", buf.getvalue())
    except Exception as e:  # noqa: BLE001 - see the docstring
        _note(f"graph {art.name} not stored: {type(e).__name__}: {e}")


def _entry(art: Artifact) -> dict[str, Any]:
    names: dict[str, Any] = {}
    for name, obj in art.globals.items():
        if name in ("torch", "aten"):
            continue
        if isinstance(obj, Launcher):
            if obj.recipe is None:
                raise Uncacheable(f"kernel {obj.spec.name} has no recipe")
            names[name] = ("kernel", obj.recipe, obj.spec.for_launch(), obj.strict)
        elif isinstance(obj, torch.Tensor):
            names[name] = ("tensor", _tensor_ref(obj, art))
        else:
            names[name] = ("value", obj)
    rec = art.record
    return {
        "name": art.name, "source": art.source, "names": names,
        "frozen": sorted(art.frozen), "cudagraphs": art.cudagraphs,
        "record": {"nodes_in": rec.nodes_in, "nodes_out": rec.nodes_out,
                   "rules_fired": dict(rec.rules_fired), "kernels": rec.kernels,
                   "fallback_ops": dict(rec.fallback_ops), "stop_reason": rec.stop_reason,
                   "layout": rec.layout},
    }


def _tensor_ref(t: torch.Tensor, art: Artifact) -> tuple[Any, ...]:
    """A constant as a parameter's position or the fold step that made it."""
    for i, p in art.frozen.items():
        if t is p:
            return ("param", i)
    step = art.steps.get(id(t))
    if step is None or step.value is not t:
        raise Uncacheable("a constant that is neither a parameter nor folded from one")
    operands = [("ref", _tensor_ref(o, art)) if isinstance(o, torch.Tensor) else ("value", o)
                for o in step.operands]
    return ("step", step.fn, _plain(step.args), _plain(step.kwargs), operands)


def _plain(spec: Any) -> Any:
    """Call arguments with `Opaque` wrappers taken off (Slot markers stay)."""
    if isinstance(spec, Opaque):
        return spec.value
    if isinstance(spec, list | tuple):
        return type(spec)(_plain(s) for s in spec)
    if isinstance(spec, dict):
        return {k: _plain(v) for k, v in spec.items()}
    return spec


class _Pickler(pickle.Pickler):
    """Torch objects by name; anything else must be plain data or rewritec's own."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            return ("op", obj.namespace, obj._opname, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            return ("packet", obj._qualified_op_name)
        if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
            return ("torch", str(obj).removeprefix("torch."))
        if isinstance(obj, torch.device):
            return ("device", str(obj))
        if isinstance(obj, torch.Tensor):
            raise Uncacheable("a tensor among the wrapper's values")
        if callable(obj) and not isinstance(obj, type):
            ref = callable_ref(obj)
            if ALLOWED_FNS.get(ref) is not obj:
                raise Uncacheable(f"call of {obj!r}, which entries may not name")
            return ("fn", *ref)
        return None


# --------------------------------------------------------------------------- loading


class _Unpickler(pickle.Unpickler):
    """Plain data, rewritec's own classes, and torch values by name: each reference
    is looked up in a fixed table, or checked to be of the type it claims, so that
    an entry never names a function to call (eval, torch.load, ...)."""

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid or not all(isinstance(p, str) for p in pid):
            raise pickle.UnpicklingError("malformed reference")
        kind = pid[0]
        if kind == "op" and len(pid) == 4:
            _, ns, name, overload = pid
            if ns == "rewritec":
                from ..aten import rewritec_ops  # noqa: F401 - define rewritec::*
            return _checked(_op(ns, name, overload), torch._ops.OpOverload, pid)
        if kind == "packet" and len(pid) == 2 and pid[1].count("::") == 1:
            ns, name = pid[1].split("::")
            return _checked(_op(ns, name), torch._ops.OpOverloadPacket, pid)
        if kind == "torch" and len(pid) == 2:
            value = getattr(torch, pid[1], None) if pid[1].isidentifier() else None
            return _checked(value, (torch.dtype, torch.layout, torch.memory_format), pid)
        if kind == "device" and len(pid) == 2:
            return torch.device(pid[1])
        if kind == "fn" and len(pid) == 3 and (pid[1], pid[2]) in ALLOWED_FNS:
            return ALLOWED_FNS[(pid[1], pid[2])]
        raise pickle.UnpicklingError(f"reference {pid!r} is not expected in a graph entry")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _PLAIN or (module.startswith("rewritec.") and _is_class(module, name)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not expected in a graph entry")


def _is_class(module: str, name: str) -> bool:
    """A class of rewritec's (never one of its functions, which could build code)."""
    try:
        return isinstance(getattr(importlib.import_module(module), name, None), type)
    except ImportError:
        return False


_PLAIN = {("builtins", "slice"), ("builtins", "set"), ("builtins", "frozenset"),
          ("builtins", "complex"), ("collections", "Counter"), ("copyreg", "_reconstructor"),
          ("builtins", "object")}


def _op(ns: str, *names: str) -> Any:
    """torch.ops.<ns>.<name>[.<overload>], without touching torch.ops' own methods."""
    if not all(n.isidentifier() and not n.startswith("_") for n in (ns, *names)):
        return None
    try:
        obj: Any = getattr(torch.ops, ns)
        if not isinstance(obj, torch._ops._OpNamespace):
            return None
        for n in names:
            obj = getattr(obj, n)
        return obj
    except (AttributeError, RuntimeError):
        return None


def _checked(value: Any, kind: Any, pid: tuple[str, ...]) -> Any:
    if not isinstance(value, kind):
        raise pickle.UnpicklingError(f"reference {pid!r} is not a {kind}")
    return value


def allowed_fns() -> dict[tuple[str, str], Any]:
    """The functions an entry may name: pure arithmetic of `operator` and `math`
    (the targets a Dynamo graph calls besides ATen ops), never a door to code
    (eval, getattr, operator.call, torch.load)."""
    pure_operator = ("abs add and_ concat contains eq floordiv ge getitem gt index inv "
                     "invert is_ is_not le lshift lt matmul mod mul ne neg not_ or_ pos pow "
                     "rshift sub truediv truth xor").split()
    pure_math = ("ceil floor trunc sqrt exp log log2 log10 log1p expm1 sin cos tan asin acos "
                 "atan atan2 sinh cosh tanh asinh acosh atanh fabs fmod copysign isnan isinf "
                 "isfinite gcd lcm pow erf erfc gamma lgamma radians degrees hypot "
                 "prod fsum").split()
    table: dict[tuple[str, str], Any] = {}
    for module, names in ((operator, pure_operator), (math, pure_math)):
        for name in names:
            fn = getattr(module, name, None)
            if fn is not None:
                table[(fn.__module__, name)] = fn
    for fn in (abs, min, max, round, divmod, len):
        table[("builtins", fn.__name__)] = fn
    return table


ALLOWED_FNS = allowed_fns()
def load(key: str, inputs: list[Any], params: list[bool], opts: Any,
         recompile: Callable[[list[Any], bool], Any]) -> Any:
    """The stored graph under `key` as a Dynamo-callable, or None (not stored, or not
    loadable: the caller compiles, and the new entry replaces this one)."""
    try:
        data = read_verified(_dir() / f"{key}.pkl")
        if data is None:  # not stored, damaged, or not written by this user
            return None
        entry = _Unpickler(io.BytesIO(data)).load()
        return _rebuild(entry, inputs, params, opts, recompile)
    except Exception as e:  # noqa: BLE001 - a bad entry or cache is a miss, never a failure
        _note(f"graph cache entry {key[:16]} not loaded: {type(e).__name__}: {e}")
        return None


def _rebuild(entry: dict[str, Any], inputs: list[Any], params: list[bool], opts: Any,
             recompile: Callable[[list[Any], bool], Any]) -> Any:
    namespace: dict[str, Any] = wrapper_namespace()
    kernels = []
    for name, (kind, *rest) in entry["names"].items():
        if kind == "kernel":
            recipe, spec, strict = rest
            launcher, _ = recipe.build(spec, _kernel_failed, lazy=True)
            launcher.strict = strict
            namespace[name] = launcher
            kernels.append(launcher)
        elif kind == "tensor":
            with torch.no_grad():
                namespace[name] = _make_tensor(rest[0], inputs)
        else:
            namespace[name] = rest[0]
    rec = report.GraphRecord(name=report.graph_name("inference"), kind="inference",
                             cached=True, **{k: v for k, v in entry["record"].items()
                                             if k not in ("rules_fired", "fallback_ops")})
    rec.rules_fired.update(entry["record"]["rules_fired"])
    rec.fallback_ops.update(entry["record"]["fallback_ops"])
    exec(compile(entry["source"], f"<rewritec wrapper {rec.name} (cached)>", "exec"),  # noqa: S102
         namespace)
    fn = planned(namespace["call"], entry["source"])
    if entry["cudagraphs"]:
        def log(line: str) -> None:
            rec.cudagraphs = line

        fn = CudaGraphRunner(fn, params, opts.cudagraphs, log)
    frozen = {i: inputs[i] for i in entry["frozen"]}
    report.RECORDS.append(rec)  # last: an entry that fails to load leaves no record
    return CachedGraph(fn, frozen, recompile, opts.freeze)


def _make_tensor(ref: tuple[Any, ...], inputs: list[Any]) -> torch.Tensor:
    if ref[0] == "param":
        return inputs[ref[1]]
    _, fn, args, kwargs, operands = ref
    values = [_make_tensor(v, inputs) if k == "ref" else v for k, v in operands]
    return fn(*_fill(args, values), **_fill(kwargs, values))


def _kernel_failed(*inputs: Any) -> Any:
    raise CachedKernelFailed("a kernel of a cached graph failed to launch")


class CachedGraph:
    """A loaded entry, called as AOTAutograd's compiled function would be (`*args`).

    It checks, with aten/fold.py's FrozenParams, that the frozen parameters
    are untouched; after an in-place update (or a failed kernel launch) the graph is
    compiled again the usual way and that compilation is used from then on.
    """

    def __init__(self, fn: Any, frozen: dict[int, torch.Tensor],
                 recompile: Callable[[list[Any], bool], Any], freeze: bool) -> None:
        self.fn = fn
        self.frozen = FrozenParams(frozen)
        self.recompile = recompile
        self.freeze = freeze
        self.slow: Any = None
        self._boxed_call = False

    def __call__(self, *args: Any) -> Any:
        if self.slow is not None:
            return self.slow(*args)
        if not self.frozen.untouched(args):
            self.slow = self.recompile(list(args), False)
            return self.slow(*args)
        try:
            return self.fn(list(args))
        except CachedKernelFailed:
            self.slow = self.recompile(list(args), self.freeze)
            return self.slow(*args)


# --------------------------------------------------------------------------- helpers


def _dir() -> Path:
    return subdir("graphs")


def _note(line: str) -> None:
    log.info(line)
