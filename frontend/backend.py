"""The TorchDynamo backend `rewritec` (registered through the
`torch_dynamo_backends` entry point, so `torch.compile(m, backend="rewritec")`
works without importing rewritec first).

Dynamo hands over a torch-level FX graph; AOTAutograd traces it to ATen and
splits forward and backward, and each half is compiled by `compiler.compile_fx`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd

from ..codegen import triton_startup
from ..compiler import compile_fx
from ..options import Options
from .decompositions import decomposition_table


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _is_buffer(node: torch.fx.Node) -> bool:
    """A module buffer lifted to a graph input (running_mean, ...): Dynamo's
    source for it reads `..._buffers['name']`."""
    source = getattr(node.meta.get("grapharg"), "source", None)
    return source is not None and "._buffers[" in source.name


def rewritec_backend(gm: torch.fx.GraphModule, example_inputs: list[Any],
                     options: dict[str, Any] | None = None, mode: str | None = None) -> Any:
    opts = Options.make(options)
    if opts.target in ("auto", "triton") and any(
            isinstance(x, torch.Tensor) and x.is_cuda for x in example_inputs):
        triton_startup.start()  # overlaps Triton's own start-up with tracing
    # Parameters and buffers arrive as graph inputs; remember which, for folding
    # in inference graphs (frontend/fold.py guards that against later updates).
    params = [isinstance(x, torch.nn.Parameter) or _is_buffer(n)
              for x, n in zip(example_inputs, _placeholders(gm), strict=False)]
    values = list(example_inputs)

    def forward(fw_gm: torch.fx.GraphModule, fw_inputs: list[Any]) -> Any:
        return compile_fx(fw_gm, fw_inputs, opts, kind="forward", params=params)

    def inference(fw_gm: torch.fx.GraphModule, fw_inputs: list[Any]) -> Any:
        # Inference graphs (no grad) may fold parameters: frontend/fold.py says when.
        aligned = len(fw_inputs) == len(values)
        return compile_fx(fw_gm, fw_inputs, opts, kind="inference", params=params,
                          param_values=values if aligned else None)

    def backward(bw_gm: torch.fx.GraphModule, bw_inputs: list[Any]) -> Any:
        return compile_fx(bw_gm, bw_inputs, opts, kind="backward")

    return aot_autograd(
        fw_compiler=forward,
        bw_compiler=backward,
        inference_compiler=inference,
        decompositions=decomposition_table(),
    )(gm, example_inputs)
