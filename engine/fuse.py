"""Fusion: grouping terms into kernels, driven by `kind: fuse` rules.

Consumers come first (reverse topological order). A term not yet in a group
that matches a fuse rule's pattern starts a group, which grows into its
producers while:
- the producer's op category is in the rule's `grow:` list;
- every user of the producer is already in the group (so nothing is computed
  twice and no intermediate must be written out);
- the producer fits the group's iteration space (`SPACES[template]`);
- the code generator can compile it (`can_compile`, from the target).
Then the rule's guards decide, with `root`, `ops` (the group's op count) and
`reductions` bound. A matmul group (`MatmulSpace`) holds one matrix product and its epilogue and
never grows into the product's operands. A group becomes one `kernel` term whose operands are the
group's inputs and whose `body` attribute is the group itself over `arg`
placeholders; `codegen/` renders it with the rule's template.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .guards import GuardContext, GuardEval, Undecided
from .ops import OpTable
from .pattern import Matcher
from .rules import Rule
from .term import Graph, Term, TermStore, postorder, rebuild

# Ops a row kernel reduces with, and whether they need the row's length (mean).
ROW_REDUCTIONS = ("sum", "mean", "amax", "amin")


def reduced_dim(t: Term) -> int | None:
    """The one dim a sum/mean/amax/amin reduces, keeping it (size 1); else None."""
    if t.op not in ROW_REDUCTIONS or t.attr("keepdim") is not True:
        return None
    if t.op in ("sum", "mean") and t.attr("dtype") is not None:
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
    for other ops, rank-0 inputs and sums/means with a `dtype`."""
    if t.op not in ROW_REDUCTIONS or not isinstance(t.attr("keepdim"), bool):
        return None
    if t.op in ("sum", "mean") and t.attr("dtype") is not None:
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


class PointwiseSpace:
    """Every member has the root's shape: one loop over the output's elements."""

    def __init__(self, root: Term) -> None:
        self.shape = tuple(root.meta.shape)

    def fits(self, t: Term) -> bool:
        return t.meta.kind == "tensor" and tuple(t.meta.shape) == self.shape \
            and t.meta.dtype in FLOATS and t.op not in ROW_REDUCTIONS


class RowSpace:
    """Rows along one dim `dim` of a shape S: members are S-shaped values or one
    value per row (S with size 1 at `dim`), and reductions run along `dim`.
    Softmax and layer_norm reduce the last dim; a bias gradient reduces dim 0."""

    def __init__(self, root: Term) -> None:
        self.dim = reduced_dim(root)
        src = root.args[0] if self.dim is not None else root
        self.shape = tuple(src.meta.shape)

    def per_row(self) -> tuple[Any, ...] | None:
        if self.dim is None:
            return None
        return self.shape[:self.dim] + (1,) + self.shape[self.dim + 1:]

    def fits(self, t: Term) -> bool:
        if t.meta.kind != "tensor" or t.meta.dtype not in FLOATS or not self.shape:
            return False
        if t.op in ROW_REDUCTIONS:
            d = reduced_dim(t)
            if d is None or tuple(t.args[0].meta.shape) != self.shape:
                return False
            if self.dim is None:
                self.dim = d  # the first reduction fixes the group's row dim
            return d == self.dim
        shape = tuple(t.meta.shape)
        if self.dim is None and len(shape) == len(self.shape):
            # A per-row value seen before any reduction fixes the row dim.
            ones = [k for k, (a, b) in enumerate(zip(shape, self.shape, strict=True))
                    if a != b]
            if len(ones) == 1 and shape[ones[0]] == 1:
                self.dim = ones[0]
        return shape in (self.shape, self.per_row())


# Matrix products a matmul kernel computes (2-d, with addmm's bias in its epilogue).
MATMULS = ("mm", "addmm")
# Reshapes a matmul kernel's epilogue may see through: [M, N] -> [..., N].
RESHAPES = ("view", "reshape", "unsafe_view")


class MatmulSpace:
    """One matrix product [M, K] @ [K, N] and the pointwise epilogue on its result,
    in the root's shape S: S is [M, N], or [..., N] when a reshape splits M (a
    Linear on a 3-d input). The product's operands are the kernel's inputs: the
    group never grows past the matmul (`stops_at`)."""

    def __init__(self, root: Term) -> None:
        self.shape = tuple(root.meta.shape)
        self.mm: Term | None = None

    def stops_at(self, t: Term) -> bool:
        return t.op in MATMULS

    def fits(self, t: Term) -> bool:
        if t.meta.kind != "tensor" or t.meta.dtype not in FLOATS or len(self.shape) < 2:
            return False
        if t.op in MATMULS:
            ok = self.mm is None and t.meta.rank == 2 and _static(t.meta.shape) \
                and _static(self.shape) and tuple(t.meta.shape) == self._flat()
            if ok:
                self.mm = t
            return ok
        if t.op in RESHAPES:
            # only the reshape right above the product, from [M, N] to S
            return self.mm is None and tuple(t.meta.shape) == self.shape \
                and tuple(t.args[0].meta.shape) == self._flat() and t.args[0].op in MATMULS
        return tuple(t.meta.shape) == self.shape and t.op not in ROW_REDUCTIONS

    def _flat(self) -> tuple[Any, ...]:
        m = 1
        for s in self.shape[:-1]:
            m *= s
        return (m, self.shape[-1])


def _static(shape: Any) -> bool:
    return all(isinstance(s, int) for s in shape)



class ReductionSpace:
    """sum/mean/amax/amin over any dims of an input shape I, giving output shape O:
    members are I-shaped values (the prologue, computed per reduced element),
    reductions over the same dims of I-shaped values, and O-shaped values (the
    epilogue, on the reduced values). I == O (only size-1 dims reduced, keepdim)
    is refused: the two phases could not be told apart by shape."""

    def __init__(self, root: Term) -> None:
        self.out_shape = tuple(root.meta.shape)
        self.in_shape: tuple[Any, ...] | None = None
        self.signature: tuple[Any, ...] | None = None  # (I, dims, keepdim)

    def fits(self, t: Term) -> bool:
        if t.meta.kind != "tensor" or t.meta.dtype not in FLOATS:
            return False
        shape = tuple(t.meta.shape)
        if t.op in ROW_REDUCTIONS:
            dims = reduced_dims(t)
            if dims is None or shape != self.out_shape:
                return False
            signature = (tuple(t.args[0].meta.shape), dims, t.attr("keepdim"))
            if self.signature is None and signature[0] != shape:
                self.signature, self.in_shape = signature, signature[0]
            return signature == self.signature
        return shape == self.out_shape or shape == self.in_shape

    def accepts(self, members: set[Term]) -> bool:
        """One pass: no prologue value may depend on a reduced one (a variance's
        `x - mean(x)` needs two passes over I; fuse-row does that along one dim)."""
        return all(tuple(a.meta.shape) == self.in_shape
                   for m in members if tuple(m.meta.shape) == self.in_shape
                   for a in m.args if a in members)


class AttentionSpace:
    """One `attention` op (rules/recognize/attention.yaml) and nothing else: its
    operands are the kernel's inputs."""

    def __init__(self, root: Term) -> None:
        self.root = root

    def fits(self, t: Term) -> bool:
        return t is self.root and t.op == "attention"


SPACES: dict[str, Callable[[Term], Any]] = {"pointwise": PointwiseSpace, "row": RowSpace,
                                            "reduction": ReductionSpace, "matmul": MatmulSpace,
                                            "attention": AttentionSpace}


@dataclass
class Group:
    rule: Rule
    root: Term
    members: set[Term]


def fuse(graph: Graph, store: TermStore, table: OpTable, rules: list[Rule], *,
         can_compile: Callable[[Term], bool], log: Callable[[str], None] | None = None
         ) -> tuple[Graph, Counter[str]]:
    """Group terms into `kernel` terms; returns the new graph and groups per rule."""
    order = graph.terms()
    consumers: dict[Term, list[Term]] = {}
    for t in order:
        for a in t.args:
            consumers.setdefault(a, []).append(t)
    outputs = {o for o in graph.outputs if o is not None}
    uses = graph.users()
    guards = GuardEval(GuardContext(users=lambda t: uses.get(t, 0), is_frozen=lambda t: False))
    ranked = sorted(rules, key=lambda r: -r.priority)
    owner: dict[Term, Group] = {}
    groups: list[Group] = []
    fired: Counter[str] = Counter()
    for t in reversed(order):
        if t in owner or table.get(t.op) is None or not can_compile(t):
            continue
        for rule in ranked:
            group = _try_rule(rule, t, table, consumers, outputs, owner, can_compile, guards)
            if group is not None:
                groups.append(group)
                for m in group.members:
                    owner[m] = group
                fired[rule.name] += 1
                if log:
                    log(f"{rule.name} @ {rule.location}: {len(group.members)} op(s) "
                        f"-> kernel ({rule.template})")
                break
    if not groups:
        return graph, fired
    return _rebuild(graph, store, owner), fired


def _try_rule(rule: Rule, root: Term, table: OpTable, consumers: dict[Term, list[Term]],
              outputs: set[Term], owner: dict[Term, Group], can_compile: Callable[[Term], bool],
              guards: GuardEval) -> Group | None:
    if next(Matcher(table).match(rule.pattern, root, {}), None) is None:
        return None
    assert rule.template is not None
    space = SPACES.get(rule.template, PointwiseSpace)(root)
    if not space.fits(root):
        return None
    members = {root}
    changed = True
    while changed:
        changed = False
        for m in list(members):
            if getattr(space, "stops_at", None) and space.stops_at(m):
                continue
            for a in m.args:
                if a in members or a in owner or a in outputs:
                    continue
                info = table.get(a.op)
                if info is None or info.category not in rule.grow or not can_compile(a):
                    continue
                if not space.fits(a):
                    continue
                if all(c in members for c in consumers.get(a, ())):
                    members.add(a)
                    changed = True
    accepts = getattr(space, "accepts", None)  # a check on the whole group, if any
    if accepts is not None and not accepts(members):
        return None
    env = {"root": root, "ops": len(members),
           "reductions": sum(m.op in ROW_REDUCTIONS for m in members),
           "matmuls": sum(m.op in MATMULS for m in members)}
    try:
        if not all(guards.check(g, env) for g, _ in rule.guards):
            return None
    except Undecided:
        return None
    return Group(rule, root, members)


def _rebuild(graph: Graph, store: TermStore, owner: dict[Term, Group]) -> Graph:
    def replace(t: Term, new: dict[Term, Term]) -> Term | None:
        group = owner.get(t)
        if group is None:
            return None
        # A member other than the root lives inside its group's kernel only.
        return _kernel(group, store, new) if group.root is t else t

    return rebuild(graph, store, replace)


def _kernel(group: Group, store: TermStore, new: dict[Term, Term]) -> Term:
    """The group as one `kernel` term: operands are its inputs, `body` the group
    over `arg` placeholders (constants stay inline)."""
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
    rule = group.rule
    return store.make("kernel", [new.get(i, i) for i in inputs],
                      (("rule", rule.name), ("template", rule.template),
                       ("location", rule.location), ("body", root)), meta=group.root.meta)


def body_terms(kernel: Term) -> list[Term]:
    """A kernel's body in topological order (args and constants included): what
    its outputs need."""
    return list(postorder(list(kernel_outputs(kernel)), set()))


def kernel_outputs(kernel: Term) -> tuple[Term, ...]:
    """The body terms a kernel writes: its root, then any side outputs (an
    `outputs` attribute; a kernel without one writes its root alone)."""
    return kernel.attr("outputs") or (kernel.attr("body"),)
