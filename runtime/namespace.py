"""The names every wrapper's source uses without binding them: `torch`, and `aten`
whose `aten.mm.default` is the op's C++ entry point. Apart from runtime/wrapper.py
so that a graph-cache load (runtime/graph_cache.py) imports no renderer."""

from __future__ import annotations

from typing import Any

import torch


class _Overloads:
    """One ATen op's overloads as their C++ entry points (`OpOverload._op`), which
    is all `OpOverload.__call__` calls: a wrapper line `aten.mm.default(a, b)` then
    costs one Python frame less, as eager's `torch.mm` does."""

    def __init__(self, packet: Any) -> None:
        self._packet = packet

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._packet, name)._op
        setattr(self, name, fn)
        return fn


class _Aten:
    """`aten` as wrappers see it (`aten.add.Tensor`): see _Overloads."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        ns = _Overloads(getattr(torch.ops.aten, name))
        setattr(self, name, ns)
        return ns


ATEN = _Aten()


def namespace() -> dict[str, Any]:
    """The names every wrapper's source uses without binding them."""
    return {"torch": torch, "aten": ATEN}
