"""Ahead-of-time path: `torch.export` a model, then compile its ATen graph.

Used by `rewritec compile SCRIPT` when SCRIPT defines module-level `model`
and `example_inputs` without calling torch.compile itself.

The exported graph goes through AOTAutograd with the table Dynamo's graphs get
(frontend/decompositions.py), not through `ExportedProgram.run_decompositions`:
export keeps CompositeImplicitAutograd ops whole (`aten.linear`, `aten.softmax.int`),
which no rule knows, and AOTAutograd decomposes them as it does under
torch.compile, so a model reaches the same rules and kernels on both paths
(tests/test_export_parity.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch.export.graph_signature import InputKind, OutputKind

from ..compiler import compile_fx
from ..engine.errors import RewritecError
from ..options import Options
from .attention_masks import contiguous_attention_masks
from .decompositions import decomposition_table, kept_whole


class ExportedProgram:
    """A compiled exported program, called like the model (positional inputs)."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple[Any, ...],
                 opts: Options) -> None:
        self.ep = ep = export_program(model, tuple(example_inputs))
        self._lifted, params = lifted_inputs(ep)
        self.out_spec = ep.call_spec.out_spec
        self._n_user_outs = sum(s.kind == OutputKind.USER_OUTPUT
                                for s in ep.graph_signature.output_specs)
        args = self._args(example_inputs)
        self.fn = _compile_inference(ep.graph_module, args, opts, params)

    def _args(self, inputs: tuple[Any, ...]) -> list[Any]:
        user = iter(inputs)
        return [next(user) if t is None else t for t in self._lifted]

    def __call__(self, *inputs: Any) -> Any:
        with torch.no_grad():
            flat = self.fn(*self._args(inputs))
        flat = list(flat)[-self._n_user_outs:] if self._n_user_outs else []
        return torch.utils._pytree.tree_unflatten(flat, self.out_spec)


def export_program(model: torch.nn.Module, example_inputs: tuple[Any, ...],
            dynamic_shapes: Any = None) -> torch.export.ExportedProgram:
    """torch.export, whose failure (data-dependent control flow, inputs that do not
    fit) is one line naming the model, not a trace through the exporter."""
    try:
        return torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
    except Exception as e:  # noqa: BLE001 - whatever the exporter raises
        lines = [line for line in str(e).splitlines() if line.strip()]
        raise RewritecError(f"torch.export cannot export {type(model).__name__}: "
                            f"{type(e).__name__}: {lines[0] if lines else ''}") from e


def lifted_inputs(ep: torch.export.ExportedProgram) -> tuple[list[Any], list[bool]]:
    """Per placeholder of the exported graph: the tensor export lifted into it
    (a parameter, buffer or constant), or None for a user input; and whether it is a
    parameter or buffer (what freezing may fold, as on Dynamo's path)."""
    state = dict(ep.state_dict)
    lifted: list[Any] = []
    params: list[bool] = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            lifted.append(None)
            params.append(False)
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            lifted.append(state[spec.target] if spec.target in state
                          else ep.constants[spec.target])
            params.append(True)
        else:
            lifted.append(ep.constants[spec.target])
            params.append(False)
    return lifted, params


def _compile_inference(gm: torch.fx.GraphModule, args: list[Any], opts: Options,
                       params: list[bool]) -> Any:
    """AOTAutograd traces the exported graph without grad (an inference graph, as
    Dynamo's path gets under no_grad) and compiler.compile_fx compiles it."""
    # named as AOTAutograd's compiler protocol names them
    def inference(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        aligned = len(example_inputs) == len(args)
        return compile_fx(gm, list(example_inputs), opts, kind="export", params=params,
                          param_values=args if aligned else None)

    def no_backward(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        raise AssertionError("an exported program compiles for inference only")

    contiguous_attention_masks(gm)  # as Dynamo's graphs (frontend/attention_masks.py)
    with torch.no_grad():
        return aot_module_simplified(gm, args, fw_compiler=no_backward,
                                     bw_compiler=no_backward, inference_compiler=inference,
                                     decompositions=decomposition_table(kept_whole(opts)))


def export_and_compile(model: torch.nn.Module, example_inputs: tuple[Any, ...],
                       opts: Options) -> ExportedProgram:
    return ExportedProgram(model, example_inputs, opts)
