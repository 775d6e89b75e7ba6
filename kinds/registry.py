"""Every kernel kind, by the name a fuse rule's `kernel:` gives it.

The rule loader checks each fuse rule's kind against `RULE_KINDS` (rulesets.py
passes it), fusion grows groups in each kind's `SPACES` entry (engine/fuse.py), and
runtime/prepare.py renders and launches a kernel term through its kind. Adding a
kind is one module here, its templates and a rule (docs/fusion.md).

Kept apart from kinds/__init__.py: a graph-cache load imports kinds/spec.py and
nothing else of this folder (tests/test_graph_cache.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..engine.term import Term
from . import (attention, matmul, pointwise, pointwise_tiled, reduction, row, row_looped,
               row_multi)
from .kind import KernelRewrite, Kind

KINDS: dict[str, Kind] = {k.name: k for k in (
    pointwise.KIND, pointwise_tiled.KIND, row.KIND, row_looped.KIND, row_multi.KIND,
    reduction.KIND, matmul.KIND, attention.KIND)}

# The kinds a rule may name (variants are chosen by their kind, never named) -> the
# kinds its kernels may run as, itself and its variants: the templates a user's
# folder may give for a rule of that kind (engine/rules.py, kinds/templates.py).
RULE_KINDS: dict[str, tuple[str, ...]] = {
    n: (n, *(v for v, kv in KINDS.items() if kv.base == n))
    for n, k in KINDS.items() if k.space is not None}

SPACES: dict[str, Callable[[Term], Any]] = {
    n: k.space for n, k in KINDS.items() if k.space is not None}


# Named rewrites of kernels (kinds/kind.py: KernelRewrite), which "rules fired" counts
# as it counts rules: name -> the rewrite.
KERNEL_REWRITES: dict[str, KernelRewrite] = {
    rw.name: rw for k in KINDS.values() for rw in k.rewrites}


class UnknownKind(KeyError):
    pass


def kind(name: str) -> Kind:
    """The kind named `name`; an unknown name is an error, never a default."""
    try:
        return KINDS[name]
    except KeyError:
        raise UnknownKind(f"unknown kernel kind {name!r} (known: "
                          f"{', '.join(sorted(KINDS))})") from None
