"""Fusion: grouping terms into kernels, driven by `kind: fuse` rules.

Consumers come first (reverse topological order, the graph's first outputs
first: see `fuse`). A term not yet in a group that matches a fuse rule's
pattern starts a group, which grows into its producers while:
- the producer's op category is in the rule's `grow:` list;
- the producer fits the group's iteration space (its kernel kind's `space`,
  kinds/*.py);
- the code generator can compile it (`can_compile`, from the target);
- if something outside the group uses the producer too (or the graph returns
  it), the space takes side outputs (`side_outputs`: pointwise and row spaces
  do; reduction, matmul and attention spaces do not, their docstrings say why),
  can store this one (`can_output`: a float, and in a pointwise space of the
  root's shape, not one that broadcasts to it) and joining makes no cycle
  (`Order`). The kernel then computes the producer
  once and also writes it out, for those users.
A group with side outputs also takes in users of its members (not of its root)
that it can compute from its members alone, under the same conditions, reductions
excepted: a cast of layer_norm's mean is one more output and no more inputs. Then the rule's guards
decide, with `root`, `ops` (the group's op count), `reductions`, `matmuls` and
`outputs` (1 + the side outputs) bound. A matmul group (`MatmulSpace`) holds one
matrix product and its epilogue and never grows into the product's operands.

Sibling reductions: once every group has formed (and side outputs were given to
their readers to compute again), groups of rules with `siblings: true` whose
spaces give one key (a reduction kernel's input shape, dims and output shape) and
that read a common input merge, where no path joins them (`Order.merge`): one
kernel, one pass over the input, several outputs (`_merge_siblings`).

A group becomes one `kernel` term whose operands are the group's inputs and
whose `body` attribute is its root over `arg` placeholders; `kinds/` renders it
by its kind (kinds/kind.py). A kernel with side outputs is tuple-valued (its meta's
kind is "tuple"): its `outputs` attribute lists the body terms it writes, the
root's first, and each outside use reads `getitem(kernel, i)`. A kernel of one
output has no `outputs` and is the root's value itself, as it always was.

No cycle: each group stays convex (no path leaves it and comes back) in the graph
where every group formed before it counts as one node, so that graph stays
acyclic when the group becomes one node too (convex in the graph of terms alone
would not do: two groups could each read the other's side output). `Order` keeps
a topological order of that graph, so the checks a new member must pass search
only a window of it: no user of the member outside the group reaches the group,
and none of the member's operands depends on it (needed only once the group has
side outputs: before that, its root is its only way out, and nothing in the
group depends on the root).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .guards import GuardContext, GuardEval, Undecided
from .ops import OpTable
from .pattern import Matcher
from .rewrite import Explanation
from .rules import Rule
from .term import Graph, Meta, Term, TermStore, postorder
from .trace import Trace

# Ops a row kernel reduces with, and whether they need the row's length (mean).
ROW_REDUCTIONS = ("sum", "mean", "amax", "amin")


# Bits of each float dtype: a sum whose `dtype` is at least as wide as its input's
# reads each value exactly in that dtype (see `plain_accumulation`).
FLOAT_BITS = {"f16": 16, "bf16": 16, "f32": 32, "f64": 64}


def plain_accumulation(t: Term) -> bool:
    """A sum/mean a kernel computes as ATen does: without a `dtype`, or with one that
    widens its input (autocast's bias gradients, `sum(g_bf16, dtype=f32)`: ATen casts
    the input, exactly, then sums; kernels accumulate in f32, or f64 for an f64
    result, either way). A narrower `dtype` would round each input value first, an
    integer one count instead."""
    dtype = t.attr("dtype")
    if dtype is None:
        return True
    if not t.args:
        return False
    src = t.args[0].meta.dtype
    return dtype == src or (FLOAT_BITS.get(dtype, 0) > FLOAT_BITS.get(src, 99))


def reduced_dim(t: Term) -> int | None:
    """The one dim a sum/mean/amax/amin reduces, keeping it (size 1); else None."""
    if t.op not in ROW_REDUCTIONS or t.attr("keepdim") is not True:
        return None
    if t.op in ("sum", "mean") and not plain_accumulation(t):
        return None
    dims = t.attr("dim")
    rank = t.args[0].meta.rank
    if rank == 0 or not isinstance(dims, tuple) or len(dims) != 1 \
            or not isinstance(dims[0], int):
        return None
    return dims[0] % rank


def reduced_dims(t: Term) -> tuple[int, ...] | None:
    """The dims (sorted, non-negative) a sum/mean/amax/amin reduces: ATen reads an
    empty or missing `dim` as every dim (`x.sum()` is `sum(x, dim=())`). None
    for other ops, rank-0 inputs and sums/means whose `dtype` a kernel would not
    compute as ATen does (`plain_accumulation`)."""
    if t.op not in ROW_REDUCTIONS or not isinstance(t.attr("keepdim"), bool):
        return None
    if t.op in ("sum", "mean") and not plain_accumulation(t):
        return None
    dims = t.attr("dim")
    rank = t.args[0].meta.rank
    if rank == 0:
        return None
    if dims is None or dims == ():
        return tuple(range(rank))
    if not isinstance(dims, tuple) or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(sorted({d % rank for d in dims}))


# Kernels compute in f32 (f64 when a member is f64) and round to each member's own
# dtype where it differs, so members may mix these (f16 softmax: f32 inside).
FLOATS = ("f32", "f16", "bf16", "f64")
# Integers a kernel computes in their own dtype (kinds/kernels.py: INT_OPS)
INTS = ("i64", "i32")


def counts(t: Term) -> bool:
    """A sum of a bool mask: an integer count (a loss's number of kept labels). A
    kernel holding one computes in f64 (kinds/spec.py: compute), exact to 2**53."""
    return t.op == "sum" and t.meta.dtype in INTS and bool(t.args) \
        and t.args[0].meta.dtype == "b8" and t.attr("dtype") is None


def kernel_value(t: Term) -> bool:
    """A tensor a kernel computes in: a float, an integer (kinds/kernels.py:
    INT_OPS) or a bool mask (a comparison, read by a `where` or written out). Not
    an iota: only a row kernel computes one, from its column index (kinds/row.py
    takes it before asking this)."""
    return t.meta.kind == "tensor" and t.op != "iota" and (
        t.meta.dtype in FLOATS or t.meta.dtype in INTS or t.meta.dtype == "b8")


def broadcasts(shape: tuple[Any, ...], to: tuple[Any, ...]) -> bool:
    """`shape` broadcasts to `to` (numpy's rule: align the last dims; 1 stretches)."""
    return len(shape) <= len(to) and all(
        a == b or a == 1 for a, b in zip(reversed(shape), reversed(to), strict=False))


# Matrix products a matmul kernel computes (2-d, with addmm's bias in its epilogue).
MATMULS = ("mm", "addmm")
# Reshapes a matmul kernel's epilogue may see through: [M, N] -> [..., N].
RESHAPES = ("view", "reshape", "unsafe_view")


def static_shape(shape: Any) -> bool:
    return all(isinstance(s, int) for s in shape)


class Space(Protocol):
    """Where a group grows: a kernel kind's iteration space (kinds/*.py). `fits` may
    fix the space's layout on its first fit (the row dim, the reduced dims). A space
    may also have `can_output(t)` (where it takes side outputs), `stops_at(t)` (a
    member whose operands stay inputs) and `accepts(members)` (a check on the whole
    group)."""

    side_outputs: bool

    def fits(self, t: Term) -> bool: ...


@dataclass(eq=False)
class Group:
    rule: Rule
    root: Term
    members: set[Term]
    # What the kernel writes: the root, then the side outputs in graph order.
    outputs: list[Term] = field(default_factory=list)
    # Its place in `Order` once formed: the group is one node there.
    rank: int = 0
    # Its kind's iteration space (fits, accepts), as the group grew in it.
    space: Any = None


Node = Term | Group


class Order:
    """A topological order of the graph in which every group formed so far is one
    node (`rank`: a term's or a group's position). It bounds the searches that keep
    groups convex, and `commit` keeps it topological as groups form."""

    def __init__(self, order: list[Term], consumers: dict[Term, list[Term]],
                 owner: dict[Term, Group]) -> None:
        self.ranks = {t: i for i, t in enumerate(order)}
        self.consumers = consumers
        self.owner = owner
        # Groups that compute a term another group owns, again (its side output, which
        # `_recompute_side_outputs` gave to its readers): they read its operands, not it
        self.held: dict[Term, list[Group]] = {}

    def node(self, t: Term) -> Node:
        return self.owner.get(t, t)

    def rank(self, n: Node) -> int:
        return n.rank if isinstance(n, Group) else self.ranks[n]

    def _next(self, n: Node, forward: bool) -> list[Node]:
        terms = n.members if isinstance(n, Group) else (n,)
        if forward:
            return [r for t in terms for r in self.readers(t, n)]
        inside = n.members if isinstance(n, Group) else ()
        return [self.node(a) for t in terms for a in t.args
                if a not in inside and a.op != "const"]

    def readers(self, t: Term, n: Node) -> list[Node]:
        """The nodes other than `n` that read term `t` (a member of `n`): those of its
        users, and the groups computing a user again, that do not compute `t` too."""
        inside = n.members if isinstance(n, Group) else ()
        found: list[Node] = []
        for c in self.consumers.get(t, ()):
            if c in inside:
                continue
            for m in (self.node(c), *self.held.get(c, ())):
                if m is not n and not (isinstance(m, Group) and t in m.members):
                    found.append(m)
        return found

    def _search(self, starts: list[Node], targets: set[Term], forward: bool,
                bound: int) -> set[Node] | None:
        """The nodes reachable from `starts` (forward: through users; else through
        operands) whose rank stays within `bound` (<= forward, >= backward); None
        as soon as one is in `targets` (terms of a group still growing)."""
        seen: set[Node] = set()
        stack = [n for n in starts if (self.rank(n) <= bound if forward else
                                       self.rank(n) >= bound)]
        while stack:
            n = stack.pop()
            if n in seen:
                continue
            if not isinstance(n, Group) and n in targets:
                return None
            seen.add(n)
            for m in self._next(n, forward):
                if m not in seen and (self.rank(m) <= bound if forward else
                                      self.rank(m) >= bound):
                    stack.append(m)
        return seen

    def may_join(self, t: Term, members: set[Term], top: int, exits: bool) -> bool:
        """Whether `t`, an operand or a user of a member, may join `members` (of
        highest rank `top`) without a cycle: no user of `t` outside the group reaches
        it, and (once the group has side outputs, `exits`: otherwise its only way out
        is the root, which nothing in the group depends on) no operand of `t`
        depends on it."""
        users = [self.node(c) for c in self.consumers.get(t, ()) if c not in members]
        if users and self._search(users, members, True, top) is None:
            return False
        if not exits:
            return True
        operands = [self.node(a) for a in t.args if a not in members and a.op != "const"]
        low = min(self.ranks[m] for m in members)
        return self._search(operands, members, False, low) is not None

    def commit(self, group: Group) -> None:
        """Make the group one node, at its last member's place. Users of its outputs
        that come before that (users of side outputs, or of the root when a user
        joined) move after it, with what they reach up to there, and what the group
        depends on moves before them (Pearce and Kelly's reordering: the same
        places, dealt out again)."""
        high = max(self.ranks[m] for m in group.members)
        group.rank = high
        for m in group.members:
            self.owner[m] = group
        self._place(group, high)

    def merge(self, keep: Group, drop: Group) -> bool:
        """Make two formed groups one node (`keep`, which takes `drop`'s members and
        outputs) at the later one's place, if no path leads from one to the other
        (their union would not be convex). Users of the earlier one's outputs that
        lay before that place move after it, as in `commit`."""
        first, last = sorted((keep, drop), key=self.rank)
        reach = self._search(self._next(first, True), set(), True, self.rank(last))
        if reach is None or last in reach:
            return False
        high = self.rank(last)
        for m in drop.members:
            if self.owner.get(m) is drop:  # not members another group owns and recomputes
                self.owner[m] = keep
            held = self.held.get(m, [])
            if drop in held:
                held[held.index(drop)] = keep
        keep.members |= drop.members
        keep.outputs += [o for o in drop.outputs if o not in keep.outputs]
        keep.rank = high
        self._place(keep, high)
        return True

    def _place(self, group: Group, high: int) -> None:
        late = [r for s in group.outputs for r in self.readers(s, group) if self.rank(r) < high]
        if not late:
            return
        after = self._search(late, set(), True, high)
        assert after is not None
        low = min(self.rank(n) for n in after)
        before = self._search(self._next(group, False), set(), False, low)
        assert before is not None
        moved = sorted(before, key=self.rank) + [group] + sorted(after, key=self.rank)
        places = sorted(self.rank(n) for n in moved)
        for n, r in zip(moved, places, strict=True):
            if isinstance(n, Group):
                n.rank = r
            else:
                self.ranks[n] = r


def fuse(graph: Graph, store: TermStore, table: OpTable, rules: list[Rule], *,
         can_compile: Callable[[Term], bool], spaces: Mapping[str, Callable[[Term], Space]],
         log: Callable[[str], None] | None = None, explain: Explanation | None = None,
         trace: Trace | None = None) -> tuple[Graph, Counter[str]]:
    """Group terms into `kernel` terms; returns the new graph and groups per rule.
    `spaces` gives each kernel kind's iteration space (kinds/registry.py: SPACES);
    a rule naming a kind it lacks is an error, never a silent default. `explain`,
    if it names one of `rules`, records why each of its groups did not form and
    which producers its groups refused. `trace` (engine/trace.py) records each
    kernel and why rules whose pattern matched a root refused it."""
    missing = sorted({r.kernel for r in rules if r.kernel not in spaces}, key=str)
    if missing:
        raise ValueError(f"no iteration space for kernel kind(s) {missing} "
                         f"(known: {', '.join(sorted(spaces))})")
    # Topological, the graph's last outputs first: roots are visited from the end, so
    # the caller's values (AOTAutograd returns them first, then what it saves for the
    # backward) start groups first, and the saved values join them as side outputs
    order = list(dict.fromkeys(graph.inputs))
    order += postorder([o for o in reversed(graph.outputs) if o is not None],
                       {t.uid for t in order})
    consumers: dict[Term, list[Term]] = {}
    for t in order:
        for a in t.args:
            consumers.setdefault(a, []).append(t)
    outputs = {o for o in graph.outputs if o is not None}
    uses = graph.users()
    guards = GuardEval(GuardContext(users=lambda t: uses.get(t, 0), is_frozen=lambda t: False))
    ranked = sorted(rules, key=lambda r: -r.priority)
    owner: dict[Term, Group] = {}
    places = Order(order, consumers, owner)
    groups: list[Group] = []
    fired: Counter[str] = Counter()
    watched = next((r for r in rules if explain is not None and r.name == explain.rule), None)
    watch = _Watch(explain, watched, table) if explain is not None and watched else None
    for t in reversed(order):
        if t in owner or table.get(t.op) is None or not can_compile(t):
            if watch is not None and t in owner and owner[t].rule.name != watch.rule:
                watch.root_taken(t, owner[t].rule)
            continue
        for rule in ranked:
            seen = watch if watch is not None and rule.name == watch.rule else \
                _TraceWatch(trace, rule, table) if trace is not None else None
            group = _try_rule(rule, t, table, places, outputs, can_compile, guards, spaces,
                              seen)
            if group is not None:
                groups.append(group)
                places.commit(group)
                fired[rule.name] += 1
                if watch is not None and rule.name != watch.rule:
                    watch.root_taken(t, rule)
                if log:
                    side = len(group.outputs) - 1
                    log(f"{rule.name} @ {rule.location}: {len(group.members)} op(s) "
                        f"-> kernel ({rule.kernel})"
                        + (f", {side} side output(s)" if side else ""))
                break
    if not groups:
        return graph, fired
    _recompute_side_outputs(groups, places, outputs, table)
    merged = _merge_siblings(groups, places)
    if log and merged:
        log(f"{merged} sibling reduction kernel(s) merged into others")
    return _rebuild(graph, store, places, trace), fired


# Reductions one kernel holds at most after merging siblings: each is an accumulator
# block in registers (a Triton reduction's [BLOCK_O, BLOCK_R], compensated)
SIBLING_REDUCTIONS = 4


def _merge_siblings(groups: list[Group], places: Order) -> int:
    """Groups of rules with `siblings: true` whose spaces give one key (a reduction
    kernel's input shape, dims and output shape) and that read a common input become
    one kernel with several outputs, where no path joins them and the space accepts
    their union: one pass over the input for both (the weight and bias gradients of
    layer norm and batch norm, sum(g * x^) and sum(g)). After `_recompute_side_outputs`,
    which makes a weight gradient's sum read what the bias gradient's reads (x^ from
    x, mean and rstd instead of the row kernel's side output). Returns the merges."""
    buckets: dict[Any, list[Group]] = {}
    for g in groups:
        key = g.space.siblings() if g.rule.siblings and hasattr(g.space, "siblings") else None
        if key is not None:
            buckets.setdefault(key, []).append(g)
    merged = 0
    for bucket in buckets.values():
        live = sorted(bucket, key=places.rank)
        while _merge_one(live, places):
            merged += 1
    return merged


def _merge_one(live: list[Group], places: Order) -> bool:
    """Merge the first pair of `live` (in graph order) that may merge; whether one did."""
    for i, h in enumerate(live):
        reads = _reads(h)
        accepts = getattr(h.space, "accepts", None)
        for g in live[i + 1:]:
            if _reductions(h) + _reductions(g) <= SIBLING_REDUCTIONS \
                    and not reads.isdisjoint(_reads(g)) \
                    and (accepts is None or accepts(h.members | g.members)) \
                    and places.merge(h, g):
                live.remove(g)
                return True
    return False


def _reads_tensor(members: set[Term]) -> bool:
    return any(a.meta.kind == "tensor" for a in _leaves(members))


def _reads(g: Group) -> set[Term]:
    """What a group's kernel reads: its members' operands computed outside it."""
    return _leaves(g.members)


def _leaves(terms: set[Term]) -> set[Term]:
    """The operands of `terms` computed outside them (constants aside)."""
    return {a for t in terms for a in t.args if a not in terms and a.op != "const"}


def _reductions(g: Group) -> int:
    return sum(m.op in ROW_REDUCTIONS for m in g.members)


# A side output that only other kernels read, computed in its kernel by a few
# pointwise ops from the kernel's own inputs, is computed again by each reader from
# those inputs instead: its writer stores one tensor less and no memory holds it
# (layer_norm backward's x^ = (x - mean) * rstd, which the row kernel of the input's
# gradient computed and wrote for the weight gradient's sum over the rows). Only
# where that moves no more bytes: the full-size tensors each reader reads instead,
# against the side output's write and each reader's read of it (an f32 g * x^ read
# by one sum: 8 bytes an element, against bf16 g and f32 x, 6).
RECOMPUTE_OPS = 8

# Bits of a dtype's value, for the comparison above (others count as too wide)
DTYPE_BITS = {**FLOAT_BITS, "b8": 8, "u8": 8, "i8": 8, "i16": 16, "i32": 32, "i64": 64}


def _recompute_side_outputs(groups: list[Group], places: Order, outputs: set[Term],
                            table: OpTable) -> None:
    for h in groups:
        for s in list(h.outputs[1:]):
            # every kernel reading it: its users' and those computing a user again
            readers = places.readers(s, h)
            if s in outputs or not readers or any(not isinstance(g, Group) for g in readers):
                continue  # an ATen op (or the caller) reads it: it must be written
            part = _closure(s, h.members)
            info = [table.get(t.op) for t in part]
            if len(part) > RECOMPUTE_OPS or any(i is None or i.category != "pointwise"
                                                for i in info):
                continue
            full = [a for a in _leaves(part) if tuple(a.meta.shape) == tuple(s.meta.shape)]
            takers = list(dict.fromkeys(g for g in readers if isinstance(g, Group)))
            bits = sum(DTYPE_BITS.get(a.meta.dtype, 999) for a in full)
            if len(takers) * bits > (1 + len(takers)) * DTYPE_BITS.get(s.meta.dtype, 0) or \
                    not all(_can_take(g, part) for g in takers):
                continue
            for g in takers:
                g.members |= part  # its kernel computes them again; `h` still owns them
                for t in part:
                    places.held.setdefault(t, []).append(g)
            h.outputs.remove(s)


def _closure(t: Term, members: set[Term]) -> set[Term]:
    """`t` and the members it is computed from, up to the group's inputs."""
    seen = {t}
    stack = [t]
    while stack:
        for a in stack.pop().args:
            if a in members and a not in seen:
                seen.add(a)
                stack.append(a)
    return seen


def _can_take(g: Group, part: set[Term]) -> bool:
    space = g.space
    if space is None or not all(space.fits(t) for t in part):
        return False
    accepts = getattr(space, "accepts", None)
    return accepts is None or accepts(g.members | part)


def _try_rule(rule: Rule, root: Term, table: OpTable, places: Order, outputs: set[Term],
              can_compile: Callable[[Term], bool], guards: GuardEval,
              spaces: Mapping[str, Callable[[Term], Space]],
              watch: _Watch | None = None) -> Group | None:
    bound = next(Matcher(table).match(rule.pattern, root, {}), None)
    if bound is None:
        return None
    assert rule.kernel is not None
    space = spaces[rule.kernel](root)
    if watch is not None:
        watch.explanation.roots_seen += 1
    if not space.fits(root):
        if watch is not None:
            watch.refuse(root, root, f"its root is not in the {rule.kernel} space "
                                     f"({root.meta.short()})")
        return None
    members = _grow(rule, root, space, table, places, outputs, can_compile, watch)
    if not _reads_tensor(members):
        # a kernel takes its device from its inputs: members of no operands (fills)
        # leave a group that would read nothing else, and the rest reads them
        members = {m for m in members if m.args}
        if root not in members or not _reads_tensor(members):
            return None
    accepts = getattr(space, "accepts", None)  # a check on the whole group, if any
    if accepts is not None and not accepts(members):
        if watch is not None:
            watch.refuse(root, root, f"the {rule.kernel} space refuses the group of "
                                     f"{len(members)} op(s) as a whole")
        return None
    side = sorted((m for m in members if m is not root and _used_outside(m, members, places,
                                                                         outputs)),
                  key=places.rank)
    # the pattern's variables too (`attention(q, kt, v, m, s)`: q.shape[-1])
    env = {**bound, "root": root, "ops": len(members),
           "reductions": sum(m.op in ROW_REDUCTIONS for m in members),
           "matmuls": sum(m.op in MATMULS for m in members),
           "outputs": 1 + len(side)}
    try:
        failed = next((src for g, src in rule.guards if not guards.check(g, env)), None)
    except Undecided:
        failed = "(undecided)"
    if failed is not None:
        if watch is not None:
            watch.refuse(root, root, f"guard `{failed}` is false for the group of "
                                     f"{len(members)} op(s)")
        return None
    return Group(rule, root, members, [root, *side], space=space)


class _Watch:
    """What `explain` records for its fuse rule (engine/rewrite.py: Explanation)."""

    LIMIT = 1000  # refusals kept per graph

    def __init__(self, explanation: Explanation, rule: Rule, table: OpTable) -> None:
        self.explanation = explanation
        self.rule = rule.name
        self.watched = rule
        self.table = table

    def refuse(self, root: Term, t: Term, why: str) -> None:
        if len(self.explanation.refused) < self.LIMIT:
            self.explanation.refused.append((root, t, why))

    def root_taken(self, t: Term, other: Rule) -> None:
        """`t` went to a group of another rule first (a higher priority, or a group
        grown from a user): say so where the watched rule's pattern matches it."""
        if next(Matcher(self.table).match(self.watched.pattern, t, {}), None) is not None:
            self.refuse(t, t, f"it is in a kernel of rule {other.name} @ {other.location}")


class _TraceWatch(_Watch):
    """Why `rule` refused a group's root, for a trace (engine/trace.py)."""

    def __init__(self, trace: Trace, rule: Rule, table: OpTable) -> None:
        super().__init__(Explanation(rule.name), rule, table)
        self.trace = trace

    def refuse(self, root: Term, t: Term, why: str) -> None:
        if t is root:
            self.trace.refuse(root, self.watched, why)


def _used_outside(t: Term, members: set[Term], places: Order, outputs: set[Term]) -> bool:
    return t in outputs or any(c not in members for c in places.consumers.get(t, ()))


def _grow(rule: Rule, root: Term, space: Any, table: OpTable, places: Order,
          outputs: set[Term], can_compile: Callable[[Term], bool],
          watch: _Watch | None = None) -> set[Term]:
    """The root and the producers (and users) it takes in (see the module
    docstring), members visited latest first, so that the group is the same on
    every run."""
    members = {root}
    writes = getattr(space, "side_outputs", False)
    user_inputs = getattr(space, "user_inputs", False)
    admits = getattr(space, "admits", None)  # a check of one more member, if any
    stops_at = getattr(space, "stops_at", None)
    top = places.rank(root)  # the highest rank among the members
    exits = False  # has a member other than the root a user outside the group?

    def joins(t: Term, user: bool) -> bool:
        """Whether producer (or, `user`, consumer) `t` of a member may join now."""
        info = table.get(t.op)
        if t in members or t in places.owner or info is None \
                or info.category not in rule.grow or not can_compile(t):
            if watch is not None and not user and t not in members \
                    and t.op not in ("input", "const"):
                watch.refuse(root, t, _why_not(t, info, rule, places, can_compile))
            return False
        if user:
            # users computed from members alone (a cast of layer_norm's mean): one
            # more output and no more inputs, so only its own users can close a cycle.
            # Not reductions: one would fix a row kernel's layout from the side (a
            # column sum read as rows), where its own kernel would choose better
            # A space with `user_inputs` takes users reading other values too (a
            # running mean's update), where none of those depends on the group
            own = all(a in members or a.op == "const" for a in t.args)
            return t.op not in ROW_REDUCTIONS \
                and (own or user_inputs) and space.can_output(t) \
                and places.may_join(t, members, max(top, places.rank(t)), not own)
        shared = _used_outside(t, members, places, outputs)
        if shared and not (writes and space.can_output(t)):
            if watch is not None:
                watch.refuse(root, t, "a user outside the group reads it too, and the "
                             f"{rule.kernel} space " + ("cannot write it as a side output"
                                                        if writes else "takes no side outputs"))
            return False
        if not (shared or exits) or places.may_join(t, members, top, exits):
            return True
        if watch is not None:
            watch.refuse(root, t, "joining would make a cycle through a user outside the group")
        return False

    changed = True
    while changed:
        changed = False
        for m in sorted(members, key=places.rank, reverse=True):
            if stops_at is not None and stops_at(m):
                continue
            # its producers; then, where the space takes side outputs, its users (not
            # the root's: they were visited before it, as roots of their own groups)
            near = [(a, False) for a in m.args]
            if writes and m is not root:
                near += [(c, True) for c in places.consumers.get(m, ())]
            for t, user in near:
                if not joins(t, user):
                    continue
                if not space.fits(t):  # last: a space fixes its layout on the first fit
                    if watch is not None and not user:
                        watch.refuse(root, t, f"not in the {rule.kernel} space "
                                              f"({t.meta.short()})")
                    continue
                if admits is not None and not admits(t, members):
                    continue
                members.add(t)
                top = max(top, places.rank(t))
                changed = True
                exits = any(u is not root and any(c not in members
                                                  for c in places.consumers.get(u, ()))
                            for u in members)
    return members


def _why_not(t: Term, info: Any, rule: Rule, places: Order,
             can_compile: Callable[[Term], bool]) -> str:
    """Why producer `t` may not join a group of `rule` (for `explain`)."""
    if t in places.owner:
        return f"it is in a kernel of rule {places.owner[t].rule.name}"
    if info is None:
        name = t.attr("target") if t.op in ("aten", "call") else t.op
        return f"`{name}` is no op of the op table: it runs as its own ATen call"
    if info.category not in rule.grow:
        return f"its category `{info.category}` is not in the rule's grow list"
    return "the target cannot compile it"


def _rebuild(graph: Graph, store: TermStore, places: Order, trace: Trace | None) -> Graph:
    """The graph with each group replaced by its kernel, built in `places`' order
    (a group's operands all come before it there: a KeyError here is a bug of
    `Order`, and the graph falls back to eager, never to a wrong result)."""
    terms = graph.terms()
    # leaves first: `Order` does not place constants (no search goes through them)
    new = {t: t for t in terms if not t.args and t not in places.owner}
    nodes = sorted({places.node(t) for t in terms if t not in new}, key=places.rank)
    for n in nodes:
        if isinstance(n, Group):
            kernel = _kernel(n, store, new)
            if trace:
                trace.kernel(n.rule, n.root, frozenset(n.members), kernel)
            if len(n.outputs) == 1:
                new[n.root] = kernel
            for i, o in enumerate(n.outputs if len(n.outputs) > 1 else ()):
                new[o] = store.make("getitem", [kernel], (("index", i),), meta=o.meta)
        elif any(new[a] is not a for a in n.args):
            new[n] = store.make(n.op, [new[a] for a in n.args], n.attrs, meta=n.meta)
        else:
            new[n] = n
    if trace:
        trace.moved(new)
    return Graph(tuple(new[t] for t in graph.inputs),
                 tuple(None if o is None else new[o] for o in graph.outputs))


def _kernel(group: Group, store: TermStore, new: dict[Term, Term]) -> Term:
    """The group as one `kernel` term: operands are its inputs, `body` the group
    over `arg` placeholders (constants stay inline); with side outputs, `outputs`
    the body terms it writes, and the kernel's value their tuple."""
    inputs: list[Term] = []
    body: dict[Term, Term] = {}

    def build(t: Term) -> Term:
        if t in body:
            return body[t]
        if t.op == "const":
            out = t
        elif t in group.members:
            out = store.make(t.op, [build(a) for a in t.args], t.attrs, meta=t.meta)
        else:
            if t not in inputs:
                inputs.append(t)
            # The metadata is part of the key: hash-consing must not hand one kernel
            # the `arg` term (and so the shape) of another kernel's input.
            key = (t.meta.shape, t.meta.dtype, t.meta.device, t.meta.strides)
            out = store.make("arg", (), (("index", inputs.index(t)), ("meta", key)),
                             meta=t.meta)
        body[t] = out
        return out

    root = build(group.root)
    for o in group.outputs:
        build(o)  # a side output that is a user of members, not a producer of the root
    rule = group.rule
    attrs: tuple[tuple[str, Any], ...] = (
        ("rule", rule.name), ("kind", rule.kernel), ("location", rule.location),
        ("body", root))
    if rule.template_dir is not None:  # a user's folder: its templates come first
        attrs += (("template_dir", rule.template_dir),)
    meta = group.root.meta
    if len(group.outputs) > 1:
        attrs += (("outputs", tuple(body[o] for o in group.outputs)),)
        meta = Meta(kind="tuple", parts=tuple(o.meta for o in group.outputs))
    return store.make("kernel", [new[i] for i in inputs], attrs, meta=meta)


def body_terms(kernel: Term) -> list[Term]:
    """A kernel's body in topological order (args and constants included): what
    its outputs need."""
    return list(postorder(list(kernel_outputs(kernel)), set()))


def kernel_outputs(kernel: Term) -> tuple[Term, ...]:
    """The body terms a kernel writes: its root, then any side outputs (an
    `outputs` attribute; a kernel without one writes its root alone)."""
    return kernel.attr("outputs") or (kernel.attr("body"),)
