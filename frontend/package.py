"""`rewritec.package`: export a model, compile it, and write the result as one file.

The model is exported (`torch.export`, with `dynamic_shapes` if given), compiled
for inference as frontend/export.py compiles an exported program, and what the
compilation produced (the graph cache's Artifact: the wrapper, its kernels and
constants) is stored by runtime/package.py, which also loads it again. A dim
declared dynamic is compiled symbolic: the wrapper computes sizes from the
inputs and the OpenMP kernels take every size and stride at run time, so one
package serves every size in the dim's range.

On CUDA, the compiled graph is run on the example inputs, so that each Triton
kernel is compiled for its launches and its binaries stored
(runtime/static_launch.py); the package holds those binaries. With dynamic dims
it is also run at sizes chosen so that the binaries serve every size in range
(`probe_sizes`): Triton specializes an integer argument on whether it is 1 or a
multiple of 16, so a binary compiled for odd sizes assumes neither and serves
them all (runtime/package.py: `admits`); and a row kernel's block grows with its
row, so each power-of-two bracket of a dim is run once, up to where no new
binary is made.

What a package cannot hold is refused here, with one PackageError: a graph that
did not compile whole (it fell back to eager, or a kernel to ATen), Triton
kernels without binaries (TRITON_INTERPRET=1, mode max-autotune), a graph
that needs AOTAutograd's runtime wrapper (an input or buffer written in place,
an output aliasing an input), and `weights=False` with `freeze`, whose folded
constants are made of the weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._functorch.aot_autograd import aot_module_simplified
from torch._guards import TracingContext, tracing
from torch.export.graph_signature import InputKind, OutputKind

from ..compiler import compile_fx
from ..engine.diag import log
from ..engine.errors import PackageError
from ..kinds import registry
from ..options import Options
from ..runtime import package as fmt
from ..runtime import static_launch
from ..runtime.build import build_cpp
from ..runtime.graph_cache import Artifact, aot_passes_through
from ..runtime.launch import Launcher
from ..runtime.prepare import AtenBody
from ..runtime.program import NotPackable, encode, encode_body
from .decompositions import decomposition_table, kept_whole
from .attention_masks import contiguous_attention_masks
from .export import export_program, lifted_inputs


def package(model: Any, example_inputs: Sequence[Any], path: str | Path, *,
            weights: bool = True, dynamic_shapes: Any = None,
            options: dict[str, Any] | None = None) -> Path:
    """Export and compile `model` (an nn.Module or an ExportedProgram) for
    `example_inputs` and write the package to `path`; see runtime/package.py."""
    # a package runs untimed: `profile` instruments the wrapper with clock reads
    opts = dataclasses.replace(Options.make(dict(options or {})), profile=False)
    if not weights and opts.freeze:
        raise PackageError(f"{path}: weights=False cannot be combined with freeze=True "
                           "(frozen constants are folded from the weights)")
    inputs = tuple(example_inputs) if isinstance(example_inputs, list | tuple) \
        else (example_inputs,)
    if isinstance(model, torch.export.ExportedProgram):
        ep = model
    else:
        ep = export_program(model, inputs, dynamic_shapes)
    art, run = _compile(ep, inputs, opts, str(path))
    if any(launcher.recipe is not None and launcher.recipe.target == "triton"
           for launcher in _launchers(art)):
        _launch_triton(run, ep, inputs, art)
    members, program = _contents(ep, art, weights, str(path))
    manifest = {"versions": fmt.versions(), "target": _target(art, ep),
                "dynamic": _ranges(ep), "weights": weights}
    members["program.json"] = fmt.json_bytes(program)
    return fmt.write(path, members, manifest)


def _compile(ep: torch.export.ExportedProgram, inputs: tuple[Any, ...], opts: Options,
             where: str) -> tuple[Artifact, Callable[..., Any]]:
    """The exported graph compiled for inference, as the graph cache would store it.
    A dynamic export is traced with its symbolic example values, a static one with
    the real tensors (which `freeze` needs)."""
    lifted, params = lifted_inputs(ep)
    placeholders = [n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"]
    if _ranges(ep):
        args = placeholders
    else:
        user = iter(inputs)
        args = [next(user) if t is None else t for t in lifted]
    kept: list[Artifact] = []
    why: list[str] = []

    def inference(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        n_out = len(next(n for n in gm.graph.nodes if n.op == "output").args[0])
        if not aot_passes_through(gm, len(example_inputs), n_out):
            why.append("it writes an input or buffer in place or returns an alias of an "
                       "input, which needs AOTAutograd's runtime wrapper")
        aligned = len(example_inputs) == len(args)
        return compile_fx(gm, list(example_inputs), opts, kind="export", params=params,
                          param_values=args if aligned else None, keep=kept.append)

    def no_backward(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        raise AssertionError("an exported program compiles for inference only")

    contiguous_attention_masks(ep.graph_module)  # as compiled graphs' (same values)
    with torch.no_grad(), tracing(TracingContext(None)):
        compiled = aot_module_simplified(ep.graph_module, args, fw_compiler=no_backward,
                                         bw_compiler=no_backward, inference_compiler=inference,
                                         decompositions=decomposition_table(kept_whole(opts)))
    if why:
        raise PackageError(f"{where}: cannot package this model: {why[0]}")
    if not kept:
        raise PackageError(f"{where}: cannot package this model: its graph did not compile "
                           "whole (it or one of its kernels fell back to ATen; see the "
                           "warning, or pass options={'strict': True})")

    def run(*given: Any) -> Any:
        user = iter(given)
        return compiled(*[next(user) if t is None else t for t in lifted])

    return kept[0], run


def _launchers(art: Artifact) -> list[Launcher]:
    return [v for v in art.globals.values() if isinstance(v, Launcher)]


def _launch_triton(run: Callable[..., Any], ep: torch.export.ExportedProgram,
                   inputs: tuple[Any, ...], art: Artifact) -> None:
    """Run the compiled graph on the example inputs, and with dynamic dims at the
    sizes `probe_sizes` picks: each Triton kernel is compiled for its launches and
    its binaries stored (runtime/static_launch.py), which is what the package holds."""
    free = torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else 0
    peak = _peak_bytes(run, inputs)
    ranges = _ranges(ep)
    if ranges:
        example = _example_sizes(ep, inputs)
        tried = 0
        for sizes in probe_sizes(ranges, example, lambda: _variants(art)):
            # a probe's memory grows with its sizes; one that could not fit is left out
            scale = math.prod(max(1.0, sizes[k] / example[k]) for k in example if k in sizes)
            if peak * scale > free / 2:
                continue
            try:
                with torch.no_grad():
                    run(*_resized_inputs(ep, inputs, sizes))
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                continue
            tried += 1
        log.info("package: ran %d probe sizes of dynamic dims %s", tried, sorted(ranges))
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _variants(art: Artifact) -> int:
    """How many (kernel, constexprs) pairs the launches so far compiled binaries for."""
    seen = set()
    for launcher in _launchers(art):
        for kernel in launcher.watched():
            binaries = getattr(kernel, "binaries", None)
            for call in getattr(binaries, "calls", ()):
                seen.add((kernel.symbol, call[0]))
    return len(seen)


def probe_sizes(ranges: dict[str, list[int | None]], example: dict[str, int],
                variants: Callable[[], int], cap: int = 1 << 16
                ) -> Iterator[dict[str, int]]:
    """Sizes of the dynamic dims to run the compiled graph at so that its Triton
    binaries serve every size in range (what `example` holds is the example's).

    First every dim at its least odd size above 1 (sizes and strides then are 1 or
    a multiple of 16 only where the example's static dims make them so, which
    every size shares); then each dim alone through odd sizes just past each power
    of two (2**k + 1: a row kernel's block is the row rounded up to one), stopping
    after two in a row that made no new binary (`variants` counts them), at the
    range's end or at `cap`. A call at sizes past the last one tried whose kernel
    wants a block no probe made finds no binary and runs that kernel's ATen body."""
    def odd(low: int, high: int | None) -> int | None:
        n = max(low, 3)
        n += 1 - n % 2
        return n if high is None or n <= high else None

    base = dict(example)
    for sym, (low, high) in ranges.items():
        if sym in base:
            first = odd(low or 0, high)
            if first is not None:
                base[sym] = first
    yield dict(base)
    for sym, (low, high) in ranges.items():
        if sym not in base:
            continue
        idle, k, before = 0, 4, variants()
        while idle < 2:
            n = (1 << k) + 1
            k += 1
            if n > cap or (high is not None and n > high):
                break
            if n <= base[sym] or n < (low or 0):
                continue
            yield {**base, sym: n}
            after = variants()
            idle = idle + 1 if after == before else 0
            before = after


def _example_sizes(ep: torch.export.ExportedProgram, inputs: tuple[Any, ...]) -> dict[str, int]:
    """Each dynamic dim's size in the example inputs (dims named by a plain symbol)."""
    sizes: dict[str, int] = {}
    for x, want in zip(inputs, _user_inputs(ep), strict=True):
        for n, size in zip(x.shape, want["shape"], strict=True):
            if isinstance(size, dict) and size["sym"].isidentifier():
                sizes.setdefault(size["sym"], int(n))
    return sizes


def _resized_inputs(ep: torch.export.ExportedProgram, inputs: tuple[Any, ...],
                    sizes: dict[str, int]) -> list[torch.Tensor]:
    """The example inputs at other sizes of the dynamic dims: each input tiled or cut
    along them (so its values stay those of the example: valid indices stay valid)."""
    found = []
    for x, want in zip(inputs, _user_inputs(ep), strict=True):
        shape = [s if isinstance(s, int) else _size(s["sym"], sizes, n)
                 for s, n in zip(want["shape"], x.shape, strict=True)]
        y = x
        for d, n in enumerate(shape):
            if y.shape[d] not in (0, n):
                y = torch.cat([y] * -(-n // y.shape[d]), dim=d).narrow(d, 0, n)
        found.append(y.contiguous() if y is not x else y)
    return found


def _size(expr: str, sizes: dict[str, int], example: int) -> int:
    """A dim's size from its symbolic expression; the example's where it names a dim
    without a size."""
    import sympy  # noqa: PLC0415 - torch's own dependency, only for a derived dim

    value = sympy.sympify(expr).subs({sympy.Symbol(k): v for k, v in sizes.items()})
    return int(value) if value.is_Integer else example


def _peak_bytes(run: Callable[..., Any], inputs: tuple[Any, ...]) -> int:
    """Run the graph at the example's sizes: the GPU memory it takes beyond what is
    allocated already."""
    if not torch.cuda.is_available():
        with torch.no_grad():
            run(*inputs)
        return 0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    with torch.no_grad():
        run(*inputs)
    return max(0, torch.cuda.max_memory_allocated() - base)


def _contents(ep: torch.export.ExportedProgram, art: Artifact, weights: bool, where: str
              ) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The members (but program.json) and program.json's data."""
    try:
        enc = encode(art.source, art.globals)
    except NotPackable as e:
        raise PackageError(f"{where}: cannot package this model: {e}") from None
    members: dict[str, bytes] = {"exported.txt": str(ep).encode(),
                                 "wrapper.py": art.source.encode()}
    tensors = dict(enc.constants)
    kernels = [_kernel(launcher, members, tensors, where) for launcher in enc.kernels.values()]
    constants: dict[str, dict[str, Any]] = {}
    for key, t in tensors.items():
        member = f"constants/{len(constants)}.bin"
        members[member] = fmt.tensor_bytes(t)
        constants[key] = {**fmt.tensor_meta(t), "member": member}
    slots, stored = _inputs(ep, weights, members)
    program = {"graph": enc.program, "kernels": kernels, "constants": constants,
               "inputs": slots, "weights": stored, "user_inputs": _user_inputs(ep),
               "user_outputs": sum(s.kind == OutputKind.USER_OUTPUT
                                   for s in ep.graph_signature.output_specs),
               "out_spec": pytree.treespec_dumps(ep.call_spec.out_spec)}
    return members, program


def _kernel(launcher: Launcher, members: dict[str, bytes], tensors: dict[str, torch.Tensor],
            where: str) -> dict[str, Any]:
    """A kernel's entry, its source and binaries added to `members`: the OpenMP
    library the compilation built (runtime/build.py's cache), or the Triton binaries
    its launches stored (runtime/static_launch.py); and its group as ATen calls, run
    where it cannot launch (its constants added to `tensors`)."""
    recipe, spec = launcher.recipe, launcher.spec
    if recipe is None or recipe.target not in ("openmp", "triton"):
        raise PackageError(f"{where}: kernel {spec.name} has no recipe to package")
    entry = {"launcher": recipe.launcher, "target": recipe.target,
             "contract": recipe.contract, "spec": fmt.spec_data(spec),
             # what CUDA-graph replay's `auto` counts (runtime/package.py: _replayed)
             "matrix_products": registry.kind(spec.template).matrix_products}
    body = launcher.fallback
    if isinstance(body, AtenBody):
        try:
            enc = encode_body(body.body, body.outputs, body.bridge, len(tensors))
        except (NotPackable, KeyError) as e:  # the kernel runs, and fails alone
            log.info("package: kernel %s has no ATen fallback: %s", spec.name, e)
        else:
            entry["aten"] = enc.program
            tensors.update(enc.constants)
    if recipe.target == "openmp":
        _, source = build_cpp(recipe.source, spec.symbol_in(recipe.source), recipe.contract)
        members[f"kernels/{spec.name}.cpp"] = recipe.source.encode()
        members[f"kernels/{spec.name}.so"] = source.with_suffix(".so").read_bytes()
        return {**entry, "source": f"kernels/{spec.name}.cpp",
                "binary": f"kernels/{spec.name}.so"}
    members[f"kernels/{spec.name}.py"] = recipe.source.encode()
    return {**entry, "source": f"kernels/{spec.name}.py",
            "binaries": _triton_binaries(launcher, members, where)}


def _triton_binaries(launcher: Launcher, members: dict[str, bytes], where: str
                     ) -> list[dict[str, Any]]:
    """Each binary a launch of this kernel stored, by call, with what it assumes of
    its arguments (runtime/package.py: `assumptions`), added to `members` once each."""
    found: list[dict[str, Any]] = []
    members_of: dict[str, str] = {}
    for kernel in launcher.watched():
        binaries = getattr(kernel, "binaries", None)
        if binaries is None:
            raise PackageError(f"{where}: kernel {launcher.spec.name} has no Triton binaries "
                               "to package (TRITON_INTERPRET=1, mode max-autotune, or a torch "
                               "without the static CUDA launcher): package for the CPU, or "
                               "pass options={'target': 'aten'}")
        if (kernel.direct or kernel.jitted) and not binaries.calls:
            raise PackageError(f"{where}: kernel {launcher.spec.name} launched, but its "
                               f"binary cannot be launched without Triton "
                               f"({binaries.failed or 'the static launcher does not take it'})")
        for call, key in binaries.calls.items():
            stored = static_launch.stored(key)
            if stored is None:
                raise PackageError(f"{where}: the binary of kernel {launcher.spec.name} is "
                                   "no longer in the cache")
            meta, cubin = stored
            member = members_of.get(meta["cubin"])
            if member is None:
                member = members_of[meta["cubin"]] = \
                    f"kernels/{launcher.spec.name}.{len(members_of)}.cubin"
                members[member] = cubin
            found.append({"symbol": kernel.symbol, "call": repr(call),
                          "kwargs": repr(call[0]), "assume": fmt.assumptions(call, meta),
                          "meta": meta, "cubin": member})
    return found


def _inputs(ep: torch.export.ExportedProgram, weights: bool, members: dict[str, bytes]
            ) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """Per graph input: a user input or a stored tensor by name; and those tensors.
    Parameters and persistent buffers (the state_dict's) are left out with
    `weights=False`; constants and non-persistent buffers are always stored."""
    state = ep.state_dict
    slots: list[dict[str, Any]] = []
    stored: dict[str, dict[str, Any]] = {}
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            slots.append({"kind": "user"})
            continue
        name = str(spec.target)
        t = state[name] if name in state else ep.constants[name]
        slots.append({"kind": "weight", "name": name})
        entry = {**fmt.tensor_meta(t), "member": None}
        if weights or name not in state:
            entry["member"] = f"weights/{len(stored)}.bin"
            members[entry["member"]] = fmt.tensor_bytes(t)
        stored[name] = entry
    return slots, stored


def _user_inputs(ep: torch.export.ExportedProgram) -> list[dict[str, Any]]:
    """What each user input must be: dtype, device, and per dim a size or a symbol."""
    vals = {n.name: n.meta["val"] for n in ep.graph.nodes if n.op == "placeholder"}
    found: list[dict[str, Any]] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind != InputKind.USER_INPUT:
            continue
        val = vals[spec.arg.name]
        if not isinstance(val, torch.Tensor):
            raise PackageError(f"input {spec.arg.name} is a {type(val).__name__}; packages "
                               "take tensors")
        shape = [int(s) if isinstance(s, int) else {"sym": str(s.node.expr)}
                 for s in val.shape]
        found.append({"dtype": fmt.tensor_meta(val)["dtype"], "device": str(val.device),
                      "shape": shape})
    return found


def _ranges(ep: torch.export.ExportedProgram) -> dict[str, list[int | None]]:
    """Each dynamic dim's symbol and its range (None: unbounded)."""
    def bound(v: Any) -> int | None:
        try:
            return int(v)
        except (TypeError, ValueError, OverflowError):
            return None

    return {str(sym): [bound(r.lower), bound(r.upper)]
            for sym, r in ep.range_constraints.items()}


def _target(art: Artifact, ep: torch.export.ExportedProgram) -> dict[str, Any]:
    launchers = _launchers(art)
    devices = {str(n.meta["val"].device).split(":")[0] for n in ep.graph.nodes
               if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor)}
    device = "cuda" if "cuda" in devices else "cpu"
    if not launchers:
        return fmt.device_target(device, "aten")
    if any(launcher.recipe.target == "triton" for launcher in launchers):
        return fmt.device_target(device, "triton")
    contract = any(launcher.recipe.contract for launcher in launchers)
    return fmt.cpu_target("openmp", contract)
