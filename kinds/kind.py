"""What a kernel kind is: the one unit that fusion, code generation and launching ask.

A fuse rule names a kind (`kernel: row`), and the rule loader checks the name
against the registry (kinds/registry.py): an unknown kind is a load error. The
kind then answers what used to be a switch on a template's name, in each place
that needed it:

- `space`: the iteration space a group grows in (engine/fuse.py asks it whether
  a producer fits, and whether it may be a side output);
- `spec`: a `kernel` term -> its `KernelSpec` (kinds/spec.py);
- `variant`: the kind that renders this spec on a target instead (a row too wide
  for registers loops over chunks, a layout change runs in 2-d tiles);
- `render`: the spec -> source for a target, through templates/<target>/<name>.*.j2
  (a user's folder may hold its own; `template_variables` are what the render gives
  each target's template, which a user's is checked against when it loads);
- `launchers`: per target it renders for, the runtime/launch.py launcher class;
- `tuning`: what autotuning may vary in its Triton launch (kinds/tuning.py), or
  None (not tuned);
- `rewrites`: named rewrites of its kernels that the variants pass applies
  (`KernelRewrite`: Welford's variance in a looped row);
- `matrix_products`: whether its kernels compute matrix products, which keep a GPU
  as busy as a library call (runtime/cudagraphs.py counts them so under `auto`).

A variant (`row_looped`, `pointwise_tiled`) is a kind no rule names: the
variants pass (kinds/variants.py) picks it, and it has no space or spec of its
own, only its `base` kind's spec, its render and launchers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ..engine.ops import OpTable
from ..engine.term import Term
from .spec import KernelSpec
from .tuning import TuneSpace

Target = Literal["triton", "openmp"]
# spec, target, the C++ vector-math declarations (runtime/build.py probes them) -> source
Render = Callable[[KernelSpec, str, tuple[str, ...], OpTable], str]


def _same(spec: KernelSpec, target: str) -> str | None:
    return None


@dataclass(frozen=True)
class KernelRewrite:
    """A named rewrite of a kernel of one kind, which the variants pass
    (kinds/variants.py) applies where `applies(kernel)`: it adds its name to the
    kernel term's `rewrites` attribute, which the spec's meta carries to the kind's
    render, and records a firing that the report counts and the trace shows as a
    rule's. `rewritec rules list` names it among the built-in steps."""

    name: str  # kebab-case, as a rule's
    doc: str  # one line with the math
    location: str  # the module that implements it
    applies: Callable[[Term], bool]


@dataclass(frozen=True)
class Kind:
    name: str  # what a fuse rule's `kernel:` names; its templates are <target>/<name>.*.j2
    doc: str
    render: Render
    # target -> the name of its launcher class (runtime/launch.py: LAUNCHERS); a target
    # missing here leaves the kind's groups on ATen there
    launchers: Mapping[str, str]
    # target -> the variables its render gives templates/<target>/<name>.*.j2
    template_variables: Mapping[str, frozenset[str]] = field(default_factory=dict)
    space: Callable[[Term], Any] | None = None  # None: a variant only
    spec: Callable[[Term, int], KernelSpec] | None = None
    # the name of the kind that runs `spec` on `target` instead, or None (the
    # variants pass, kinds/variants.py, asks it)
    variant: Callable[[KernelSpec, str], str | None] = field(default=_same)
    base: str | None = None  # a variant: the kind whose spec it renders
    tuning: TuneSpace | None = None
    rewrites: tuple[KernelRewrite, ...] = ()
    matrix_products: bool = False

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(self.launchers)
