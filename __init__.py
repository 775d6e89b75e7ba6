"""rewritec: a pattern-rewriting compiler for PyTorch graphs driven by YAML rules.

    import rewritec
    fast = rewritec.compile(model)                 # or torch.compile(model, backend="rewritec")

The folders are the architecture; each imports only those listed before it
(tests/test_layers.py):
    engine/     rewrite: term IR, rule language, matcher, phased fixed-point driver (no torch)
    aten/       the bridge to ATen: dtypes, calling a term, FX graph -> terms, fold steps
    passes/     graph passes that need torch (layout)
    kinds/      kernel kinds: a kernel term's spec and its source per target
    runtime/    build, launch, the kernel and graph caches, CUDA graphs, compile workers
    compiler.py one graph, from capture to a callable
    frontend/   capture: TorchDynamo + AOTAutograd, torch.export, rewritec.compile
    cli.py      the command line
    rules/      what to rewrite: the op table and the YAML rule files
    templates/  how generated code looks (Jinja)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def compile(model: Any, **options: Any) -> Any:  # noqa: A001 - mirrors torch.compile
    """Compile `model` (a module or function) with rewritec; see `rewritec.options`."""
    from .frontend.api import compile_model  # here: `import rewritec` loads no torch

    return compile_model(model, **options)


def write_profiles() -> None:
    """Write the times measured so far with the `profile` option into report.json and
    report.html of each `out_dir` (done anyway when the process exits)."""
    from .compiler import write_profiles as write  # as in compile: no torch at import

    write()


def package(model: Any, example_inputs: Any, path: Any, *, weights: bool = True,
            dynamic_shapes: Any = None, options: dict[str, Any] | None = None) -> Any:
    """Export and compile `model` for `example_inputs` and write one file to `path`
    that `load_package` runs without compiling (frontend/package.py, runtime/package.py).
    `weights=False` leaves the weights out; `dynamic_shapes` is torch.export's."""
    from .frontend.package import package as write_package  # as in compile

    return write_package(model, example_inputs, path, weights=weights,
                         dynamic_shapes=dynamic_shapes, options=options)


def load_package(path: Any, *, state_dict: dict[str, Any] | None = None,
                 cudagraphs: str | bool = "auto") -> Any:
    """The package at `path` as a callable: no TorchDynamo, AOTAutograd, rules or
    compiler. `state_dict` supplies weights by name (needed for weights=False);
    `cudagraphs` ("auto", "on"/True, "off"/False) replays a CUDA package's calls as
    CUDA graphs, as mode="reduce-overhead" does a compiled graph's."""
    from .runtime.package import load  # imports no compiler, frontend or rules

    return load(path, state_dict=state_dict, cudagraphs=cudagraphs)


def __getattr__(name: str) -> Any:
    if name == "PackageError":  # without importing torch for `import rewritec`
        from .engine.errors import PackageError

        return PackageError
    raise AttributeError(f"module 'rewritec' has no attribute {name!r}")


__all__ = ["compile", "write_profiles", "package", "load_package", "PackageError",
           "__version__"]
