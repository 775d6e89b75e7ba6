"""The rewriter: applies a set of rules to a term graph until nothing changes.

Each pass rebuilds the graph bottom-up. At every term, the rules indexed by
its op are tried in order (priority, then file order); the first that
matches, passes its guards and keeps the term's shape and dtype replaces it,
and the replacement is normalized in turn. Passes repeat until one fires
nothing (`saturated`).

It stops early, with a reason naming the rules, when:
- a term rewrites back into itself through a chain of rules (`cycle`);
- the step budget runs out (`budget`), e.g. a rule that keeps growing a term;
- one term is rewritten MAX_CHAIN times in a row without reaching a normal
  form (a rule that keeps rewriting its own result);
- the time budget runs out (`seconds`): each step of a growing term can cost
  more than the one before, so counting steps alone does not bound the time.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import RewriteStop
from .guards import GuardContext, GuardEval, Undecided
from .ops import OpTable
from .acmatch import Flat, MatchBudget
from .pattern import MATCH_BUDGET, Builder, Failure, Matcher, Rest
from .rules import ATTR_FUNCS, Rule
from .term import Graph, Term, TermStore, render
from .trace import Trace


@dataclass
class RuleStats:
    tried: int = 0
    matched: int = 0
    rejected_guard: int = 0
    rejected_meta: int = 0
    gave_up: int = 0  # matches stopped by the match budget
    fired: int = 0
    seconds: float = 0.0


@dataclass
class Explanation:
    """The closest a rule came to firing, for `rewritec explain` (the `explain`
    option): a rewrite rule's deepest partial match (`best`); for a fuse rule, each
    group that did not form or a producer a group refused, and why (`refused`)."""

    rule: str
    fired: int = 0
    best: Failure | None = None
    roots_seen: int = 0
    ops: set[str] = field(default_factory=set)  # every op of the graphs watched
    # fuse rules: (the group's root, the term refused: the root or a producer, why)
    refused: list[tuple[Term, Term, str]] = field(default_factory=list)

    def consider(self, failure: Failure) -> None:
        if self.best is None or failure.depth >= self.best.depth:
            self.best = failure


@dataclass
class RewriteResult:
    graph: Graph
    fired: Counter[str]
    stop_reason: str
    passes: int
    steps: int
    stats: dict[str, RuleStats] = field(default_factory=dict)


Folder = Callable[[Term], Term | None]

# Steps the rewriter takes that are not YAML rules, counted under "rules fired" as
# rules are: name -> what the step does (`rules list` and `explain` say so).
FOLD_CONSTANTS = "fold-constants"
BUILTIN_STEPS = {
    FOLD_CONSTANTS: "an op whose arguments are all constants becomes its value, computed "
                    "once at compile time (aten/fold.py: make_folder)",
}
Log = Callable[[str], None]


# Rewrites in a row at one term (a replacement, rewritten, rewritten again ...):
# a decomposition chain of the library takes a dozen.
MAX_CHAIN = 200
# Per rewrite run (one phase of one graph): GPT-2-sized graphs take a fraction of a
# second (benchmarks/results/engine.md).
REWRITE_SECONDS = 60.0


class _Cycle(Exception):
    def __init__(self, term: Term, chain: list[str]) -> None:
        self.term = term
        self.chain = chain  # the rules that led from `term` back to itself


def index_rules(rules: list[Rule]) -> dict[str, list[Rule]]:
    by_root: dict[str, list[Rule]] = {}
    for r in rules:
        by_root.setdefault(r.root, []).append(r)
    for lst in by_root.values():
        lst.sort(key=lambda r: -r.priority)  # stable: file order among equals
    return by_root


class Rewriter:
    def __init__(self, store: TermStore, table: OpTable, rules: list[Rule], *,
                 folder: Folder | None = None, is_frozen: Callable[[Term], bool] | None = None,
                 budget: int | None = None, log: Log | None = None,
                 stats: dict[str, RuleStats] | None = None,
                 explain: Explanation | None = None, match_budget: int = MATCH_BUDGET,
                 seconds: float = REWRITE_SECONDS, trace: Trace | None = None) -> None:
        self.store = store
        self.trace = trace  # the HTML report's record of firings (engine/trace.py)
        self.table = table
        self.index = index_rules(rules)
        self.folder = folder
        self.budget = budget
        self.log = log
        self.stats = stats if stats is not None else {}
        self.explain = explain
        self.match_budget = match_budget
        self.seconds = seconds
        self.deadline = float("inf")
        self.users: dict[Term, int] = {}
        self.readers: dict[Term, list[Term | None]] = {}
        self.guards = GuardEval(GuardContext(users=self._users,
                                             is_frozen=is_frozen or (lambda t: False),
                                             user_categories=self._user_categories,
                                             category=lambda t: self.table.category(t.op)))
        self.builder = Builder(table, store, ATTR_FUNCS)
        self.fired: Counter[str] = Counter()
        self.steps = 0
        self.flats: dict[Term, Flat] = {}  # sums flattened for AC matching, this pass
        # (rule name, term uid) of tries that found no rewrite, kept across passes:
        # a term is its whole sub-graph (hash-consed), so the same try finds none
        # again, unless the rule's guards read the graph around it (`users`)
        self.settled: set[tuple[str, int]] = set()

    def _users(self, t: Term) -> int:
        if t not in self.users:
            raise Undecided("term created in this pass")
        return self.users[t]

    def _user_categories(self, t: Term) -> list[str]:
        if t not in self.users:
            raise Undecided("term created in this pass")
        return ["output" if u is None else self.table.category(u.op)
                for u in self.readers.get(t, [])]

    # ------------------------------------------------------------------ driver
    def run(self, graph: Graph, max_passes: int = 50) -> RewriteResult:
        budget = self.budget or max(10_000, 50 * len(graph.terms()))
        self.deadline = time.perf_counter() + self.seconds
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))
        try:
            for passes in range(1, max_passes + 1):
                before = self.steps
                graph = self._pass(graph, budget)
                if self.steps == before:
                    return self._result(graph, "saturated", passes)
            return self._result(graph, f"pass limit ({max_passes}) reached; last rules "
                                f"fired: {self._top()}", max_passes)
        finally:
            sys.setrecursionlimit(limit)

    def _result(self, graph: Graph, reason: str, passes: int) -> RewriteResult:
        return RewriteResult(graph, self.fired, reason, passes, self.steps, self.stats)

    def _top(self, counts: bool = True) -> str:
        return ", ".join(f"{n} x{c}" if counts else n for n, c in self.fired.most_common(3))

    def _pass(self, graph: Graph, budget: int) -> Graph:
        # one walk over the graph: who reads each term, and so how many times
        self.readers = graph.readers()
        self.users = {t: len(r) for t, r in self.readers.items()}
        self.flats = {}
        self.normal: dict[Term, Term] = {}
        self.active: list[tuple[Term, str]] = []  # (term, rule that rewrote it), for cycles
        self.on_chain: dict[Term, int] = {}  # term -> its index in active
        self.total_budget = budget
        try:
            for t in graph.terms():
                self._normalize(t)
        except _Cycle as c:
            loop = c.chain + [c.chain[0]]
            raise RewriteStop(f"rules loop: {' -> '.join(loop)} (rewriting "
                              f"`{render(c.term, 3)}` leads back to itself)") from None
        inputs = tuple(self.normal.get(t, t) for t in graph.inputs)
        outputs = tuple(None if o is None else self.normal[o] for o in graph.outputs)
        if self.trace:
            self.trace.moved(self.normal)
        return Graph(inputs, outputs)

    def _normalize(self, t: Term) -> Term:
        """The normal form of `t`, whose arguments are visited first."""
        done = self.normal.get(t)
        if done is not None:
            return done
        args = tuple(self._normalize(a) for a in t.args)
        if any(a is not b for a, b in zip(args, t.args, strict=True)):
            # The rewrites below keep shape and dtype, so the old metadata still holds,
            # but for a view's strides, which follow its input's: those are recomputed
            # (guards such as keeps_layout read them).
            rebuilt = self._rebuild(t, args)
        else:
            rebuilt = t
        result = self._rewrite_root(rebuilt)
        self.normal[t] = result
        self.normal[rebuilt] = result
        return result

    def _rebuild(self, t: Term, args: tuple[Term, ...]) -> Term:
        # Only a view whose input now has other strides needs the meta hook (a fake
        # tensor run, the bulk of a rewrite's time if done for every rebuilt view).
        if self.table.category(t.op) == "view" and any(
                a.meta.strides != b.meta.strides for a, b in zip(args, t.args, strict=True)):
            try:
                return self.store.make(t.op, args, t.attrs)
            except Exception:  # noqa: BLE001, S110 - no meta hook, or one that cannot run this view: keep the old
                pass
        return self.store.make(t.op, args, t.attrs, meta=t.meta)

    def _rewrite_root(self, t: Term) -> Term:
        i = self.on_chain.get(t)
        if i is not None:
            raise _Cycle(t, [name for _, name in self.active[i:]])
        if time.perf_counter() > self.deadline:
            raise RewriteStop(f"time budget ({self.seconds:g} s) exhausted; rules fired most: "
                              f"{self._top(counts=False)}")
        for rule in self.index.get(t.op, ()):
            key = (rule.name, t.uid)
            if key in self.settled:
                continue
            replacement = self._try(rule, t)
            if replacement is None or replacement is t:
                if not rule.reads_graph and self.explain is None:
                    self.settled.add(key)
                continue
            self.steps += 1
            self.fired[rule.name] += 1
            self.stats[rule.name].fired += 1
            if self.log:
                self.log(f"{rule.name} @ {rule.location}: {render(t, 3)} -> "
                         f"{render(replacement, 3)}")
            if self.trace:
                self.trace.fired(rule.name, rule.location, t, replacement)
            if self.steps > self.total_budget:
                raise RewriteStop(f"step budget ({self.steps} rewrites) exhausted; most "
                                  f"fired: {self._top()} (a rule that keeps growing a term?)")
            if len(self.active) >= MAX_CHAIN:
                names = Counter(name for _, name in self.active).most_common(2)
                raise RewriteStop(f"{MAX_CHAIN} rewrites in a row at one term without reaching "
                                  f"a normal form: {', '.join(n for n, _ in names)} (a rule "
                                  f"that keeps growing a term?)")
            self.on_chain[t] = len(self.active)
            self.active.append((t, f"{rule.name} ({rule.location})"))
            try:
                return self._normalize(replacement)
            finally:
                self.active.pop()
                del self.on_chain[t]
        if self.folder is not None and t.op not in ("input", "getitem"):
            folded = self.folder(t)
            if folded is not None:
                self.steps += 1
                self.fired[FOLD_CONSTANTS] += 1
                if self.trace:
                    self.trace.fired(FOLD_CONSTANTS, "frontend/fold.py", t, folded)
                return folded
        return t

    def _try(self, rule: Rule, t: Term) -> Term | None:
        st = self.stats.setdefault(rule.name, RuleStats())
        st.tried += 1
        start = time.perf_counter()
        # the explanation being built for this rule (`rewritec explain`), if any
        explain = self.explain if self.explain is not None and self.explain.rule == rule.name \
            else None
        early = rule.early_guards if explain is None else None
        admits = None
        if early:
            check = self.guards.check

            def admits(name: str, value: Any) -> bool:
                if all(check(g, {name: value}) for g in early.get(name, ())):
                    return True
                st.rejected_guard += 1  # as a whole match its guards refuse counts
                return False
        matcher = Matcher(self.table, budget=self.match_budget, flats=self.flats,
                          admits=admits)
        try:
            for env, rest in matcher.match_root(rule.pattern, t, {}):
                st.matched += 1
                if rule.root_name is not None:
                    env = {**env, rule.root_name: t}
                failed = next((src for g, src in rule.guards if not self.guards.check(g, env)),
                              None)
                if failed is not None:
                    st.rejected_guard += 1
                    if explain is not None:
                        explain.consider(Failure(10**6, f"guard `{failed}` is false", t))
                    continue
                replacement, why = self._replacement(rule, t, env, rest)
                if replacement is None:
                    st.rejected_meta += 1
                    if explain is not None:
                        explain.consider(Failure(10**6, why, t))
                    continue
                return replacement
            if explain is not None and matcher.failure is not None:
                explain.consider(matcher.failure)
            return None
        except MatchBudget as e:
            st.gave_up += 1
            if explain is not None:
                explain.consider(Failure(10**6, f"gave up: {e}", t))
            return None
        finally:
            st.seconds += time.perf_counter() - start
            if explain is not None:
                explain.roots_seen += 1

    def _replacement(self, rule: Rule, t: Term, env: dict[str, Any],
                     rest: Rest | None) -> tuple[Term | None, str]:
        """The rule's replacement for `t`, or None and why it is refused."""
        try:
            assert rule.replace is not None
            built = self.builder.term(rule.replace, env)
            if rest is not None:
                whole, why = self._reattach(t, rest, built)
                if whole is None:
                    return None, why
                built = whole
        except Exception as e:  # noqa: BLE001 - an op that cannot take these inputs
            return None, f"replacement cannot be built: {e}"
        if not _same_value_type(t, built):
            return None, (f"replacement changes the result type "
                          f"({t.meta.short()} -> {built.meta.short()})")
        return built, ""

    def _reattach(self, t: Term, rest: Rest, replacement: Term) -> tuple[Term | None, str]:
        """`replacement` stands for the operands `rest.used` of the sum `t`; the sum
        of the others, in their order, with it where its first operand was. The
        operands it replaces must have had its type: a regrouping keeps every
        type promotion where it was (the flattened sums all have t's dtype)."""
        flat = rest.flat
        used = flat.pieces(rest.used)
        part = self._sum(t, [term for _, term in used])
        if not _same_value_type(part, replacement):
            return None, (f"replacement changes the type of the operands it replaces "
                          f"({part.meta.short()} -> {replacement.meta.short()})")
        pieces = flat.pieces(flat.full & ~rest.used) + [(used[0][0], replacement)]
        pieces.sort(key=lambda piece: piece[0])
        return self._sum(t, [term for _, term in pieces]), ""

    def _sum(self, t: Term, terms: list[Term]) -> Term:
        """terms[0] op terms[1] op ..., grouped from the left, with t's op and attributes."""
        out = terms[0]
        for term in terms[1:]:
            out = self.store.make(t.op, (out, term), t.attrs)
        return out


def _same_value_type(old: Term, new: Term) -> bool:
    """A rewrite must keep the result's kind, shape, dtype and device (strides may
    differ). A 0-d CPU tensor joins CUDA tensors in ATen's ops (a copy of it onto a
    CUDA tensor is a CUDA tensor); a rewrite to a view of it would be a CPU one."""
    a, b = old.meta, new.meta
    if a.kind != b.kind or a.dtype != b.dtype or len(a.shape) != len(b.shape) \
            or (a.kind == "tensor" and a.device != b.device):
        return False
    if a.kind == "tuple":
        return len(a.parts) == len(b.parts) and all(
            p.dtype == q.dtype and tuple(p.shape) == tuple(q.shape)
            for p, q in zip(a.parts, b.parts, strict=True))
    return all(_size_eq(x, y) for x, y in zip(a.shape, b.shape, strict=True))


def _size_eq(x: Any, y: Any) -> bool:
    if x is y or x == y:
        return True
    try:
        return bool((x - y) == 0)
    except TypeError:
        return False
