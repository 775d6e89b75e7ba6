"""Constant folding and freezing: the torch half of the `fold` phase.

The engine decides *where* to fold (a term whose operands are all constants
or frozen parameters); this module computes the value with ATen at compile
time and wraps it as a `tensor` term.

Freezing (turning parameters into constants) is only sound while the
parameters do not change, so it is opt-in (`freeze=True`), as Inductor's is,
and applies to inference graphs only. The compiled function checks each frozen
parameter's identity, version counter and data pointer on every call: after
`optimizer.step()`, any in-place update or a `.data = ...` swap it runs an
unfrozen compilation of the same graph instead. A write through `.data`
(`p.data.mul_(0.5)`) bumps no version counter that the parameter shares, so
no guard cheaper than reading every weight sees it: that is why freezing is
not the default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..engine.term import Term, TermStore
from .bridge import Bridge, Opaque, meta_of

# Do not materialize constants larger than this many elements.
MAX_FOLD_NUMEL = 1 << 22
# Ops of no operands whose value their attributes fix (a fill, positions): folded
# with what reads them, up to this many elements: a mask built from positions
# (`arange`, compared, summed, indexed) becomes the constant it is. A larger fill
# stays an op, which a kernel computes inline as a literal (kinds/kernels.py)
# instead of reading memory.
SOURCES = ("full", "aten.arange.default", "aten.arange.start", "aten.arange.start_step")
MAX_SOURCE_NUMEL = 1 << 14


def tensor_term(store: TermStore, bridge: Bridge, value: torch.Tensor, label: str) -> Term:
    fake = bridge.fake_mode.from_tensor(value, static_shapes=True)
    return store.make("tensor", (), (("value", Opaque(value, label)),), meta=meta_of(fake))


@dataclass(frozen=True)
class FoldStep:
    """How one folded constant was computed: `fn(*args, **kwargs)` with `Slot(i)`
    standing for `operands[i]` (a parameter, an earlier folded constant or a
    literal). The graph cache (runtime/graph_cache.py) replays these on the
    parameters of the process that loads an entry, so it never stores weights."""

    fn: Any
    args: list[Any]
    kwargs: dict[str, Any]
    operands: list[Any]
    value: Any  # the result, held so that its id stays its own while compiling


def make_folder(store: TermStore, bridge: Bridge, steps: dict[int, FoldStep] | None = None
                ) -> Callable[[Term], Term | None]:
    """The folding callback of the `fold` phase; `steps` (if given) collects a
    FoldStep per folded constant, keyed by the id of its value."""
    counter = [0]

    def fold(t: Term) -> Term | None:
        if t.op in ("tensor", "const", "input", "call") or t.attr("nonce") is not None:
            return None
        # an op-table op by name, a captured ATen op (`aten`) by its overload
        source = not t.args and (t.op if t.op != "aten" else str(t.attr("target"))) in SOURCES
        if t.meta.kind != "tensor" or not (source or any(a.op == "tensor" for a in t.args)):
            return None
        if any(a.op not in ("tensor", "const") for a in t.args):
            return None
        try:
            numel = int(t.meta.numel())
        except TypeError:
            return None  # symbolic size
        if numel > (MAX_SOURCE_NUMEL if source else MAX_FOLD_NUMEL):
            return None
        values = [a.attr("value").value if a.op == "tensor" else a.value for a in t.args]
        # The compiler may run inside AOTAutograd's fake mode; folding needs real tensors.
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with torch.no_grad(), unset_fake_temporarily():
            value = bridge.run(t, values)
        if not isinstance(value, torch.Tensor):
            return None
        if steps is not None:
            fn, args, kwargs, order = bridge.call_parts(t)
            pos = {id(a): i for i, a in enumerate(t.args)}
            steps[id(value)] = FoldStep(fn, args, kwargs, [values[pos[id(a)]] for a in order],
                                        value)
        counter[0] += 1
        return tensor_term(store, bridge, value, f"folded{counter[0]}")

    return fold


def is_frozen(t: Term) -> bool:
    return t.op == "tensor"


class FrozenParams:
    """What a frozen compilation assumed of its parameters: the same objects, at the
    same version, over the same memory."""

    def __init__(self, frozen: dict[int, torch.Tensor]) -> None:
        self.checks = [(i, t, t._version, t.data_ptr()) for i, t in frozen.items()]

    def untouched(self, args: Any) -> bool:
        return all(args[i] is t and t._version == version and t.data_ptr() == ptr
                   for i, t, version, ptr in self.checks)


class FrozenGuard:
    """Calls the frozen compilation while the frozen parameters are untouched."""

    def __init__(self, frozen: dict[int, torch.Tensor], fast: Any,
                 make_slow: Callable[[list[Any]], Any]) -> None:
        self.frozen = FrozenParams(frozen)
        self.fast = fast
        self.make_slow = make_slow
        self.slow: Any = None
        self._boxed_call = True

    def __call__(self, args: list[Any]) -> Any:
        if self.frozen.untouched(args):
            return self.fast(args)
        if self.slow is None:
            # compiled for the call that needs it: the guard keeps no inputs of the
            # first call (an activation after a graph break can be hundreds of MB)
            self.slow = self.make_slow(list(args))
        return self.slow(args)
