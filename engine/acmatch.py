"""Associative-commutative matching: a sum seen as the multiset of its operands.

`add`, `mul`, `maximum` and `minimum` are flagged `commutative` and
`associative` in the op table, so `(a + b) + c`, `a + (c + b)` and
`c + (b + a)` are one sum of {a, b, c}. A pattern whose root is such an op is
matched against that multiset, not against one grouping of it:

- the term is flattened into *leaves* (its operands under any nesting of the
  same op, with the op's default attributes and the root's dtype, so that a
  regrouping never moves a type promotion) and *items*: every leaf and every
  nested sum already in the graph, each with the set of leaves it covers;
- the pattern is flattened the same way (`Compiler` does it once);
- each pattern operand is assigned a distinct item, the items' leaf sets
  disjoint. Nested in a pattern, the items must cover every leaf; at a rule's
  root they may leave some uncovered, and the rewriter re-attaches those
  around the replacement (`a + b` fires inside `a + c + b`).

Cost is bounded three ways. Every pattern operand is matched against every
item once, up front (the partial matches are kept, and later combined by
merging bindings). Before any backtracking, a bipartite matching checks that
the pattern operands can take distinct items at all (a head that occurs once
too few fails here, not after n! tries). The search then always extends the
pattern operand with the fewest consistent choices left, skipping choices
that only differ by an identical term. What remains is exponential only for
adversarial non-linear patterns (AC matching is NP-complete), and the
matcher's step budget stops it (`MatchBudget`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from .ops import OpInfo
from .term import Term, lit_equal

Env = dict[str, Any]
# A pattern operand is opaque here: `match(q, term, env)` interprets it.
MatchFn = Callable[[Any, Term, Env], Iterator[Env]]

# A sum of more operands than this is flattened this far; the deeper sums stay
# single leaves (so a shared chain such as x2 = x1 + x1, x1 = x0 + x0 cannot
# flatten into exponentially many leaves).
MAX_LEAVES = 64


@dataclass(frozen=True)
class Item:
    """A leaf of a flattened sum, or a nested sum already in the graph."""

    term: Term
    mask: int  # bit i set: covers leaf i


@dataclass(frozen=True)
class Flat:
    """A term flattened under its associative-commutative root op."""

    root: Term
    leaves: tuple[Term, ...]
    items: tuple[Item, ...]  # the leaves first (item i is leaf i), then nested sums

    @property
    def full(self) -> int:
        return (1 << len(self.leaves)) - 1

    def pieces(self, mask: int) -> list[tuple[int, Term]]:
        """Terms that together cover exactly the leaves in `mask`, as few as the
        graph's own nested sums allow, each with its first leaf's index."""
        out: list[tuple[int, Term]] = []
        left = mask
        for it in sorted(self.items, key=lambda it: -it.mask.bit_count()):
            if it.mask & left == it.mask:
                out.append(((it.mask & -it.mask).bit_length() - 1, it.term))
                left &= ~it.mask
        return sorted(out, key=lambda p: p[0])


def is_ac(info: OpInfo | None, t: Term) -> bool:
    """`t` applies an associative-commutative op with its default attributes
    (add with alpha != 1 is neither)."""
    return info is not None and info.commutative and info.associative and len(t.args) == 2 \
        and all(lit_equal(t.attr(k, v), v) for k, v in info.attrs.items())


def flatten(t: Term, info: OpInfo) -> Flat:
    """The leaves and items of `t`, whose op is `info` (see the module docstring)."""
    leaves: list[Term] = []
    nested: list[Item] = []
    slots = 2  # leaves if nothing more were expanded

    def same(a: Term) -> bool:
        return a.op == t.op and is_ac(info, a) and a.meta.dtype == t.meta.dtype \
            and a.meta.kind == t.meta.kind

    def visit(a: Term, root: bool) -> int:
        nonlocal slots
        if root or (same(a) and slots < MAX_LEAVES):
            if not root:
                slots += 1
            mask = visit(a.args[0], False) | visit(a.args[1], False)
            if not root:
                nested.append(Item(a, mask))
            return mask
        leaves.append(a)
        return 1 << (len(leaves) - 1)

    visit(t, True)
    items = tuple(Item(leaf, 1 << i) for i, leaf in enumerate(leaves)) + tuple(nested)
    return Flat(t, tuple(leaves), items)


class MatchBudget(Exception):
    """A match used up its step budget (see `Matcher.budget`)."""


Choice = tuple[int, int, Env]  # (item index, which of the item's matches, its bindings)


def assignments(pats: Sequence[Any], flat: Flat, env: Env, match: MatchFn,
                tick: Callable[[], None], *, partial: bool) -> Iterator[tuple[Env, int]]:
    """Bindings that give each pattern operand its own item, with the leaves used:
    first those that cover every leaf, then (partial=True) those that leave one
    or more leaves for the caller to re-attach."""
    k, n = len(pats), len(flat.leaves)
    if k > n:
        return
    choices: list[list[Choice]] = []
    for q in pats:
        row = [(j, i, _delta(e, env)) for j, it in enumerate(flat.items)
               for i, e in enumerate(match(q, it.term, env))]
        if not row:
            return
        choices.append(row)
    if not _distinct_items_exist(choices):
        return
    yield from _Search(flat, choices, tick, cover=True).run(env)
    if partial and k < n:
        yield from _Search(flat, choices, tick, cover=False).run(env)


def _delta(new: Env, old: Env) -> Env:
    """The bindings `new` adds to `old` (matching only ever extends an env)."""
    return {k: v for k, v in new.items() if k not in old}


def _merge(env: Env, delta: Env) -> Env | None:
    out = env
    for k, v in delta.items():
        if k in env:
            w = env[k]
            if w is not v and (isinstance(w, Term) or isinstance(v, Term)
                               or not lit_equal(w, v)):
                return None
        else:
            if out is env:
                out = dict(env)
            out[k] = v
    return out


def _distinct_items_exist(choices: list[list[Choice]]) -> bool:
    """A bipartite matching (augmenting paths) of pattern operands to distinct
    items: necessary for any assignment, and polynomial to decide."""
    owner: dict[int, int] = {}
    options = [sorted({j for j, _, _ in row}) for row in choices]

    def augment(p: int, seen: set[int]) -> bool:
        for j in options[p]:
            if j in seen:
                continue
            seen.add(j)
            if j not in owner or augment(owner[j], seen):
                owner[j] = p
                return True
        return False

    return all(augment(p, set()) for p in range(len(choices)))


@dataclass
class _Search:
    flat: Flat
    choices: list[list[Choice]]
    tick: Callable[[], None]
    cover: bool

    def run(self, env: Env) -> Iterator[tuple[Env, int]]:
        return self._extend(env, 0, tuple(range(len(self.choices))))

    def _extend(self, env: Env, used: int, left: tuple[int, ...]) -> Iterator[tuple[Env, int]]:
        self.tick()
        if not left:
            if (used == self.flat.full) == self.cover:
                yield env, used
            return
        if self.cover and (self.flat.full & ~used).bit_count() < len(left):
            return  # each pattern operand takes one leaf at least
        best: tuple[int, list[tuple[int, Env]]] | None = None
        for p in left:
            options = self._options(p, env, used)
            if not options:
                return
            if best is None or len(options) < len(best[1]):
                best = (p, options)
                if len(options) == 1:
                    break
        assert best is not None
        p, options = best
        rest = tuple(q for q in left if q != p)
        for mask, env2 in options:
            yield from self._extend(env2, used | mask, rest)

    def _options(self, p: int, env: Env, used: int) -> list[tuple[int, Env]]:
        """The consistent choices for pattern operand p: a free item, its bindings
        merged with env's; of identical terms, only the first free one."""
        out = []
        seen: set[tuple[int, int]] = set()
        for j, i, delta in self.choices[p]:
            item = self.flat.items[j]
            key = (item.term.uid, i)
            if item.mask & used or key in seen:
                continue
            self.tick()
            merged = _merge(env, delta)
            if merged is not None:
                seen.add(key)
                out.append((item.mask, merged))
        return out
