"""Ahead-of-time path: `torch.export` a model, then compile its ATen graph.

Used by `rewritec compile SCRIPT` when SCRIPT defines module-level `model`
and `example_inputs` without calling torch.compile itself.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.export.graph_signature import InputKind

from ..compiler import compile_fx
from ..options import Options
from .decompositions import decomposition_table


class ExportedProgram:
    """A compiled exported program, called like the model (positional inputs)."""

    def __init__(self, model: torch.nn.Module, example_inputs: tuple[Any, ...],
                 opts: Options) -> None:
        ep = torch.export.export(model, tuple(example_inputs))
        with warnings.catch_warnings():
            # torch 2.13's run_decompositions deep-copies its own LeafSpecs, which warns
            # that LeafSpec is deprecated: nothing a user of rewritec can act on
            warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)",
                                    category=FutureWarning)
            ep = ep.run_decompositions(decomposition_table())
        self.ep = ep
        gm = ep.graph_module
        state = dict(ep.state_dict)
        self._lifted: list[Any] = []  # per placeholder: a tensor, or None for a user input
        params: list[bool] = []
        for spec in ep.graph_signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                self._lifted.append(None)
                params.append(False)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                self._lifted.append(state[spec.target] if spec.target in state
                                    else ep.constants[spec.target])
                params.append(spec.kind == InputKind.PARAMETER)
            else:
                self._lifted.append(ep.constants[spec.target])
                params.append(False)
        fakes = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
        self.fn = compile_fx(gm, fakes, opts, kind="export", params=params,
                             param_values=self._lifted)
        self.out_spec = ep.call_spec.out_spec

    def __call__(self, *inputs: Any) -> Any:
        user = iter(inputs)
        args = [next(user) if t is None else t for t in self._lifted]
        flat = self.fn(args)
        n_user_outs = len([s for s in self.ep.graph_signature.output_specs
                           if s.kind.name == "USER_OUTPUT"])
        flat = list(flat)[-n_user_outs:] if n_user_outs else []
        return torch.utils._pytree.tree_unflatten(flat, self.out_spec)


def export_and_compile(model: torch.nn.Module, example_inputs: tuple[Any, ...],
                       opts: Options) -> ExportedProgram:
    return ExportedProgram(model, example_inputs, opts)
