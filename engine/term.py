"""Term IR: the immutable, hash-consed graph that every rewrite works on.

A `Term` is an op applied to argument terms, plus hashable attributes. Terms
are interned in a `TermStore`: building the same op with the same arguments
and attributes twice returns the same object, so identical subexpressions are
shared and tests compare terms with `is`.

Every term carries `Meta` (shape, dtype, device, strides). The store gets it
from a `MetaHook` that the front end supplies (it runs the op on fake tensors),
so a rewrite that builds new terms never writes shape code by hand and this
module needs no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

# Sizes are ints, or sympy expressions when dynamic shapes are on; the engine
# only stores and compares them, so it does not import sympy here.
Size = Any


@dataclass(frozen=True)
class Meta:
    """What is known about a term's value at compile time."""

    shape: tuple[Size, ...] = ()
    dtype: str = "f32"  # short names: f32, f16, bf16, f64, i64, i32, b8, ...
    device: str = "cpu"
    strides: tuple[Size, ...] = ()
    # "tensor" for tensors, "scalar" for python numbers and SymInts,
    # "tuple" for multi-output ops (their parts are in `parts`), "none" for None.
    kind: str = "tensor"
    parts: tuple[Meta, ...] = ()
    # The front end's own value for this meta (a fake tensor); opaque here.
    payload: Any = field(default=None, compare=False, repr=False)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def numel(self) -> Size:
        n: Size = 1
        for s in self.shape:
            n = n * s
        return n

    def short(self) -> str:
        if self.kind == "tuple":
            return "(" + ", ".join(p.short() for p in self.parts) + ")"
        if self.kind != "tensor":
            return self.kind
        return f"{self.dtype}[{', '.join(str(s) for s in self.shape)}]"


@dataclass(frozen=True, eq=False)
class Term:
    """One node of the term graph. Create terms only through `TermStore.make`."""

    op: str
    args: tuple[Term, ...]
    attrs: tuple[tuple[str, Any], ...]
    meta: Meta = field(compare=False)
    uid: int = field(compare=False)

    # Identity is equality: the store guarantees one object per distinct term.
    def __hash__(self) -> int:
        return self.uid

    def __eq__(self, other: object) -> bool:
        return self is other

    def attr(self, name: str, default: Any = None) -> Any:
        for k, v in self.attrs:
            if k == name:
                return v
        return default

    @property
    def is_const(self) -> bool:
        return self.op == "const"

    @property
    def value(self) -> Any:
        """The python value of a `const` term."""
        return self.attr("value")

    def walk(self) -> Iterator[Term]:
        """Every term reachable from this one, each once, arguments first."""
        return postorder([self], set())

    def __repr__(self) -> str:
        return render(self)


def postorder(roots: list[Term], seen: set[int]) -> Iterator[Term]:
    """Terms reachable from `roots` and not in `seen` (updated), arguments first."""
    stack: list[tuple[Term, bool]] = [(r, False) for r in reversed(roots)]
    while stack:
        t, expanded = stack.pop()
        if expanded:
            yield t
            continue
        if t.uid in seen:
            continue
        seen.add(t.uid)
        stack.append((t, True))
        stack.extend((a, False) for a in reversed(t.args) if a.uid not in seen)


MetaHook = Callable[[str, tuple[Term, ...], tuple[tuple[str, Any], ...]], Meta]


class TermStore:
    """Interns terms and infers their metadata through one hook."""

    def __init__(self, meta_hook: MetaHook | None = None) -> None:
        self._table: dict[tuple[Any, ...], Term] = {}
        self._meta_hook = meta_hook
        self._next_uid = 0

    def __len__(self) -> int:
        return len(self._table)

    def make(
        self,
        op: str,
        args: Iterable[Term] = (),
        attrs: Iterable[tuple[str, Any]] | dict[str, Any] = (),
        meta: Meta | None = None,
    ) -> Term:
        args = tuple(args)
        items = attrs.items() if isinstance(attrs, dict) else attrs
        attrs_t = tuple((k, freeze(v)) for k, v in items)
        key = (op, tuple(a.uid for a in args), _attr_key(attrs_t))
        found = self._table.get(key)
        if found is not None:
            return found
        if meta is None:
            if self._meta_hook is None:
                raise ValueError(f"no metadata for new term {op!r} and no meta hook")
            meta = self._meta_hook(op, args, attrs_t)
        term = Term(op, args, attrs_t, meta, self._next_uid)
        self._next_uid += 1
        self._table[key] = term
        return term

    def const(self, value: Any, meta: Meta | None = None) -> Term:
        if meta is None:
            meta = Meta(kind="none") if value is None else \
                Meta(kind="scalar", dtype=_scalar_dtype(value))
        return self.make("const", (), (("value", value),), meta)


def _scalar_dtype(value: Any) -> str:
    if isinstance(value, bool):
        return "b8"
    if isinstance(value, int):
        return "i64"
    return "f64"


def freeze(v: Any) -> Any:
    """Make an attribute value hashable: lists become tuples, recursively."""
    if isinstance(v, list | tuple):
        return tuple(freeze(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((k, freeze(x)) for k, x in v.items()))
    return v


def lit_equal(a: Any, b: Any) -> bool:
    """Attribute values and constants are equal: of one type (True is not 1) and
    value, nan equal to nan."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b or (a != a and b != b)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(lit_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b) and type(a) is type(b)


def _attr_key(attrs: tuple[tuple[str, Any], ...]) -> tuple[Any, ...]:
    # 1 and 1.0 and True hash alike in python; the type keeps them apart so
    # `x * 1` (int) and `x * 1.0` (float) stay distinct terms.
    return tuple((k, _typed(v)) for k, v in attrs)


def _typed(v: Any) -> Any:
    if isinstance(v, tuple):
        return tuple(_typed(x) for x in v)
    if isinstance(v, bool | int | float):
        return (type(v).__name__, v if v == v else "nan")
    return v


@dataclass(frozen=True)
class Graph:
    """A term graph: its input terms in call order and its output terms."""

    inputs: tuple[Term, ...]
    outputs: tuple[Term | None, ...]

    def terms(self) -> list[Term]:
        """All terms reachable from the outputs, in a topological order (one
        traversal: subgraphs shared by many outputs are visited once)."""
        seen: set[int] = set()
        order: list[Term] = []
        for t in self.inputs:
            if t.uid not in seen:
                seen.add(t.uid)
                order.append(t)
        order.extend(postorder([o for o in self.outputs if o is not None], seen))
        return order

    def users(self) -> dict[Term, int]:
        """How many times each term is used as an argument or an output."""
        count: dict[Term, int] = {}
        for t in self.terms():
            for a in t.args:
                count[a] = count.get(a, 0) + 1
        for out in self.outputs:
            if out is not None:
                count[out] = count.get(out, 0) + 1
        return count

    def readers(self) -> dict[Term, list[Term | None]]:
        """The terms that read each term, once per use (None: a graph output)."""
        out: dict[Term, list[Term | None]] = {}
        for t in self.terms():
            for a in t.args:
                out.setdefault(a, []).append(t)
        for o in self.outputs:
            if o is not None:
                out.setdefault(o, []).append(None)
        return out

    def op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.terms():
            if t.op not in ("input", "const"):
                counts[t.op] = counts.get(t.op, 0) + 1
        return counts


def rebuild(graph: Graph, store: TermStore,
            replace: Callable[[Term, dict[Term, Term]], Term | None],
            moved: dict[Term, Term] | None = None) -> Graph:
    """Rebuild `graph` bottom-up. `replace(t, new)` gives t's replacement (with
    `new` mapping the terms already visited), or None to keep t, re-made over
    its replaced arguments. Metadata carries over: replacements keep it. `moved`,
    if given, receives each term -> the term it became (for a trace)."""
    new: dict[Term, Term] = {}
    for t in graph.terms():
        out = replace(t, new)
        if out is None:
            if t.args and any(new.get(a, a) is not a for a in t.args):
                out = store.make(t.op, [new.get(a, a) for a in t.args], t.attrs, meta=t.meta)
            else:
                out = t
        new[t] = out
    if moved is not None:
        moved.update(new)
    return Graph(tuple(new.get(t, t) for t in graph.inputs),
                 tuple(None if o is None else new[o] for o in graph.outputs))


def render(term: Term, depth: int = 4) -> str:
    """A short, PyTorch-like rendering of a term for logs and errors."""
    if term.op == "const":
        return repr(term.value)
    if term.op == "input":
        return str(term.attr("name"))
    if depth == 0:
        return f"{term.op}(...)"
    parts = [render(a, depth - 1) for a in term.args]
    parts += [f"{k}={v!r}" for k, v in term.attrs if k not in ("target", "spec")]
    name = term.attr("target") if term.op == "aten" else term.op
    return f"{name}({', '.join(parts)})"
