"""rewritec: a pattern-rewriting compiler for PyTorch graphs driven by YAML rules.

    import rewritec
    fast = rewritec.compile(model)                 # or torch.compile(model, backend="rewritec")

The folders are the architecture:
    frontend/   capture: TorchDynamo + AOTAutograd, torch.export; FX graph -> terms
    engine/     rewrite: term IR, rule language, matcher, phased fixed-point driver (no torch)
    rules/      what to rewrite: the op table and the YAML rule files
    codegen/    lower: the per-graph wrapper, fused kernels, the kernel cache
    templates/  how generated code looks (Jinja)
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def compile(model: Any, **options: Any) -> Any:  # noqa: A001 - mirrors torch.compile
    """Compile `model` (a module or function) with rewritec; see `rewritec.options`."""
    from .frontend.api import compile_model

    return compile_model(model, **options)


__all__ = ["compile", "__version__"]
