"""`rewritec.compile(model, **options)`: torch.compile with the rewritec backend."""

from __future__ import annotations

from typing import Any

import torch

from ..options import Options
from .backend import check_options, rewritec_backend


def compile_model(model: Any, *, dynamic: bool | None = None, fullgraph: bool = False,
                  **options: Any) -> Any:
    # reject unknown options, wrong values and unknown rule names now, not at the first call
    check_options(Options.make(options))

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        return rewritec_backend(gm, example_inputs, options=options)

    return torch.compile(model, backend=backend, dynamic=dynamic, fullgraph=fullgraph)
