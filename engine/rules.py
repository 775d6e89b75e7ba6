"""Rule files: loading and validating the YAML rule schema.

    rules:
      - name: mul-one                 # unique: letters, digits, '-', '_'
        doc: "x * 1 -> x"             # the math, one line
        kind: simplify                # recognize | decompose | simplify | fold | fuse
        pattern: x * 1                # what to match
        replace: x                    # what to build instead
        where: [is_float(x)]          # optional guards
        priority: 0                   # optional: higher is tried first
        fp_exact: true                # optional: false if only exact over the reals
        more_launches: false          # optional: true if it launches more than it replaces
        examples: [{x: f32[4, 8]}]    # inputs on which it must fire
        no_match: [{x: i64[4]}]       # inputs on which it must not

Every problem is reported with `file:line:col [rule]`. Loading only reads
YAML with the safe loader and parses expressions with the lark grammar.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import syntax as S
from .arith import ARITH
from .errors import RuleError, RuleErrors, Where
from .guards import DTYPE_NAMES, GUARD_FUNCTIONS, broadcast_view, guard_problem
from .ops import (
    CATEGORIES,
    OpTable,
    default_op_table,
    parse_ops,
    with_user_ops,
)
from .pattern import Compiler, Pattern, PBind, PCat, POp, PVar, op_name
from .yamlio import load_yaml

KINDS = ("recognize", "decompose", "simplify", "fold", "fuse")
FUSE_GUARD_NAMES = ("root", "ops", "reductions", "matmuls", "outputs")
# A rule name appears in generated code, logs and file names: letters, digits,
# '-' and '_', starting with a letter, so kebab-case and snake_case both work and
# nothing can quote, call, or climb out of a folder.
NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]*")
RULE_KEYS = {"name", "doc", "kind", "pattern", "replace", "where", "priority", "examples",
             "no_match", "fp_exact", "overrides", "kernel", "grow", "siblings",
             "more_launches"}
FILE_KEYS = {"rules", "kind", "doc", "ops"}
# Functions a replacement may use to compute attribute values.
ATTR_FUNCS: dict[str, Any] = {
    "len": len,
    "last_dims": lambda n: tuple(range(-n, 0)) if isinstance(n, int) else tuple(range(-len(n), 0)),
    # the dims of t before its last len(s): the rows a normalization over s sums across
    "outer_dims": lambda t, s: tuple(range(t.meta.rank - (s if isinstance(s, int) else len(s)))),
    "neg": lambda x: -x,
    "compose_perm": lambda p, q: tuple(p[i] for i in q),
    # dim d of a term like t once dims a and b are swapped (rules/simplify/sink_views.yaml)
    "swapped_dim": lambda d, a, b, t: _swapped_dim(d, a, b, t.meta.rank),
    # a size list with entries a and b swapped
    "swapped_sizes": lambda s, a, b: _swapped_sizes(tuple(s), a, b),
    # the dim of a reduction's operand that dim i of its result (keepdim false, the
    # dims ds reduced) comes from
    "operand_dim": lambda i, ds, t: _operand_dim(i, ds, t.meta.rank),
    # a term's dtype; dtype_of(t, i): output i's of a multi-output op (layer_norm's mean)
    "dtype_of": lambda t, i=None: (t.meta if i is None else t.meta.parts[i]).dtype,
    "size_of": lambda t, d: t.meta.shape[d],
    # a term's shape: a fill of the shape a view of one gave (rules/simplify/views.yaml)
    "shape_of": lambda t: tuple(t.meta.shape),
    # a term's shape (or a shape) with a size-1 dim inserted at d, as unsqueeze does
    "unsqueezed": lambda t, d: _unsqueezed(tuple(t.meta.shape) if hasattr(t, "meta")
                                           else tuple(t), d),
    # how many rows or columns make dim d of t a multiple of 8 values (16 bytes in half)
    "align_pad": lambda t, d: -t.meta.shape[d] % 8,
    # the epsilon rms_norm adds when given none: its compute dtype's (f32 for halves)
    "eps_of": lambda t: 2.220446049250313e-16 if t.meta.dtype == "f64" else 1.1920928955078125e-07,
    # (1, ..., -1, ..., 1) that puts a 1-d index on dim d of a tensor like t, every
    # other dim of size 1: the index of a take that reads t along d at those positions
    "index_along": lambda t, d: _index_along(t.meta.rank, d),
    # (-1, 1, 1, ...) that puts a per-channel vector on dim 0 of a tensor like t
    "channel_view": lambda t: (-1,) + (1,) * (t.meta.rank - 1),
    # (-1, 1, ...) that puts a per-channel vector on dim 1 of an activation like t
    "channel_bcast": lambda t: (-1,) + (1,) * (t.meta.rank - 2),
    # every dim of an activation like t but dim 1: what batch norm's statistics reduce over
    "channel_reduce_dims": lambda t: (0, *range(2, t.meta.rank)),
    # how many values each channel (dim 1) of an activation like t holds: numel / size(1)
    "channel_count": lambda t: _channel_count(t),
    # how many values of t a reduction over dims ds (None: all) reads for each result
    "reduced_count": lambda t, ds: _reduced_count(t, ds),
    # the shape operand y of pointwise work t takes when t is viewed as s (guards.py)
    "viewed_as": lambda y, t, s: _viewed_as(y, t, s),
}


def _viewed_as(y: Any, t: Any, s: Any) -> tuple[int, ...]:
    out = broadcast_view(y, t, s)
    if out is None:  # refused: the rule's guard `views_through` says the same
        raise TypeError("viewed_as: no view of the operand reads it so")
    return out


def _index_along(rank: int, d: int) -> tuple[int, ...]:
    d %= rank
    return (1,) * d + (-1,) + (1,) * (rank - 1 - d)


def _swapped_dim(d: int, a: int, b: int, rank: int) -> int:
    d, a, b = d % rank, a % rank, b % rank
    return b if d == a else a if d == b else d


def _swapped_sizes(s: tuple[Any, ...], a: int, b: int) -> tuple[Any, ...]:
    out = list(s)
    a, b = a % len(s), b % len(s)
    out[a], out[b] = s[b], s[a]
    return tuple(out)


def _operand_dim(i: int, ds: Any, rank: int) -> int:
    """Dim i of a reduction's result of `rank` dims (kept dims dropped) in its operand."""
    whole = rank + len(ds)
    i = i % rank
    for r in sorted(d % whole for d in ds):
        if r <= i:
            i += 1
    return i


def _channel_count(t: Any) -> int:
    """numel(t) / t.shape[1], for known sizes only: a symbolic one raises, so a
    replacement that needs the count is refused and the op stays as it was."""
    shape = t.meta.shape
    if len(shape) < 2 or not all(isinstance(s, int) for s in shape) or shape[1] == 0:
        raise TypeError("channel_count: the sizes are not known")
    return math.prod(shape) // shape[1]


def _reduced_count(t: Any, ds: Any) -> int:
    """The product of t's sizes over dims ds (every dim for None or no dims, as the
    reductions read them), for known sizes only: a symbolic one raises, so the
    replacement is refused and the op stays as it was."""
    shape = t.meta.shape
    dims = (ds,) if isinstance(ds, int) else ds or range(len(shape))
    sizes = [shape[d] for d in dims]
    if not all(isinstance(s, int) for s in sizes):
        raise TypeError("reduced_count: the sizes are not known")
    return math.prod(sizes)


def _unsqueezed(shape: tuple[Any, ...], d: int) -> tuple[Any, ...]:
    d = d + len(shape) + 1 if d < 0 else d
    return shape[:d] + (1,) + shape[d:]


@dataclass(frozen=True, eq=False)
class Rule:
    name: str
    doc: str
    kind: str
    pattern: POp | PCat
    pattern_src: str
    replace: S.Node | None
    replace_src: str | None
    guards: tuple[tuple[S.Node, str], ...]
    where: Where
    priority: int = 0
    fp_exact: bool = True
    overrides: bool = False
    kernel: str | None = None  # fuse rules: the kernel kind (kinds/registry.py)
    examples: tuple[dict[str, Any], ...] = ()
    no_match: tuple[dict[str, Any], ...] = ()
    builtin: bool = True
    # fuse rules: the op categories a group grows into from its root's producers
    grow: tuple[str, ...] = ()
    # fuse rules: groups that reduce alike and read a common input merge into one
    # kernel (engine/fuse.py: `_merge_siblings`), each one more output
    siblings: bool = False
    # the replacement launches more kernels than the library call it replaces: used
    # where a launch costs no host time per call (rulesets.py: `for_launches`)
    more_launches: bool = False
    # the `templates/` folder beside a user's rule file, searched before the package's
    template_dir: str | None = None
    # `pattern as p` at the root: the name the matched term is bound to
    root_name: str | None = None

    @functools.cached_property
    def early_guards(self) -> dict[str, tuple[S.Node, ...]]:
        """The parts of its guards (conjuncts of `and`) that read one pattern
        variable only, by that variable: the matcher checks them as soon as it binds
        the variable, so that a sum's operands that fail them are never combined
        (`add(x, c)` with `is_scalar(c)` against a sum of 40 terms). Every guard is
        still checked on the whole match; these only prune."""
        if self.kind == "fuse":
            return {}
        out: dict[str, list[S.Node]] = {}
        for node, _ in self.guards:
            for part in S.conjuncts(node):
                free = {v.name for v in S.variables(part)} - set(DTYPE_NAMES) - {self.root_name}
                if len(free) == 1:
                    out.setdefault(free.pop(), []).append(part)
        return {k: tuple(v) for k, v in out.items()}

    @functools.cached_property
    def reads_graph(self) -> bool:
        """Do its guards read more than the matched terms (`users`: how many terms
        of the graph read one, `pointwise_users`: what they are; another rewrite may
        change either)?"""
        return any(isinstance(n, S.Call) and n.func in ("users", "pointwise_users")
                   for node, _ in self.guards for n in S.walk(node))

    @property
    def root(self) -> str:
        """The op a rule is indexed by; `@category` for category patterns."""
        if isinstance(self.pattern, PCat):
            return f"@{self.pattern.category}"
        return self.pattern.op

    @property
    def location(self) -> str:
        return f"{self.where.file}:{self.where.line}"

    def __repr__(self) -> str:
        return f"<rule {self.name} @ {self.location}>"


def _guard_names(pattern: Pattern, kind: str) -> dict[str, str]:
    """What each name a guard may read holds (engine/guards.py: guard_problem): a
    pattern's variables a term or an attribute value, `p` of `... as p` a term; a fuse
    rule's `root` a term and its counts ints."""
    names = dict.fromkeys(_pattern_vars(pattern), "any")
    stack: list[Pattern] = [pattern]
    while stack:
        q = stack.pop()
        if isinstance(q, PBind):
            names[q.name] = "term"
            stack.append(q.inner)
        elif isinstance(q, POp):
            stack.extend(q.args)
    if kind == "fuse":
        names.update(dict.fromkeys(FUSE_GUARD_NAMES, "int"), root="term")
    return names


def _pattern_vars(p: Pattern) -> set[str]:

    out: set[str] = set()
    stack = [p]
    while stack:
        q = stack.pop()
        if isinstance(q, PVar):
            out.add(q.name)
        elif isinstance(q, PBind):
            out.add(q.name)
            stack.append(q.inner)
        elif isinstance(q, POp):
            stack.extend(q.args)
            stack.extend(v for _, v in q.attrs)
    return out


class RuleLoader:
    """Loads rule files in order. `kernels` maps the kernel kinds a fuse rule may name
    to the kinds its kernels may run as, whose templates a user's folder may give
    (kinds/registry.py: RULE_KINDS, which rulesets.py passes): the engine knows no
    kind itself, and a fuse rule naming one not given is an error. A user's file may
    declare ops (`ops:`, the schema of rules/ops.yaml); they join `self.table`, which
    this file's rules and every later file's are checked against, and which compiles
    with them (rulesets.py)."""

    def __init__(self, table: OpTable | None = None,
                 kernels: Mapping[str, Collection[str]] | None = None) -> None:
        self.table = table or default_op_table()
        self.kernels: Mapping[str, Collection[str]] = kernels or {}

    def load_file(self, path: Path | str, *, builtin: bool = False,
                  text: str | None = None) -> list[Rule]:
        path_s = display_path(Path(path))
        data, lines = load_yaml(path_s if text is not None else path, text=text)
        file_where = Where(path_s, 1)
        if not isinstance(data, dict) or not ("rules" in data or "ops" in data and not builtin):
            raise RuleError("a rule file is a mapping with a `rules:` list (a user's file may "
                            "hold an `ops:` list instead)", file_where)
        unknown = set(data) - FILE_KEYS
        if unknown:
            raise RuleError(f"unknown top-level key(s): {', '.join(sorted(map(str, unknown)))}",
                            file_where)
        if "ops" in data:
            if builtin:
                raise RuleError("the package's ops belong in rules/ops.yaml", file_where)
            self.table = with_user_ops(self.table, parse_ops(data["ops"], path_s, lines,
                                                             user=True))
        template_dir = None if builtin or text is not None else \
            Path(path).resolve().parent / "templates"
        default_kind = data.get("kind")
        if default_kind is not None and default_kind not in KINDS:
            # checked here too: a file whose rules all name their own kind, or that has
            # none, must not carry a bad one silently
            raise RuleError(f"kind must be one of {', '.join(KINDS)}, got {default_kind!r}",
                            _value_where(lines, ("kind",), Where(path_s, lines.get(("kind",), 1))))
        items = data.get("rules", [])
        if not isinstance(items, list):
            raise RuleError("`rules:` must be a list", Where(path_s, lines.get(("rules",), 1)))
        errors: list[RuleError] = []
        rules: list[Rule] = []
        for i, entry in enumerate(items):
            line = lines.get(("rules", i), 0)
            try:
                rule = self._rule(entry, path_s, line, lines, ("rules", i), default_kind,
                                  builtin, template_dir)
            except RuleError as e:
                errors.append(e)
                continue
            first = next((r for r in rules if r.name == rule.name), None)
            if first is not None:
                # `overrides: true` replaces another file's rule, never one in the same file.
                errors.append(RuleError(f"duplicate rule name (first defined at "
                                        f"{first.location})", rule.where))
                continue
            rules.append(rule)
        if errors:
            raise RuleErrors(errors)
        return rules

    # `lines` maps a key path to its line, and ("@", *path) to the (line, col) of its value
    def _rule(self, entry: Any, file: str, line: int, lines: dict[tuple[Any, ...], Any],
              path: tuple[Any, ...], default_kind: str | None, builtin: bool,
              template_dir: Path | None = None) -> Rule:
        where = Where(file, line)
        if not isinstance(entry, dict):
            raise RuleError("each rule is a mapping (name:, doc:, pattern:, ...)", where)
        name = entry.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            raise RuleError("rule name must be a letter, then letters, digits, '-' and '_', "
                            f"got {name!r}", where)
        where = Where(file, line, rule=name)

        def at(key: str) -> Where:
            """Where the value of `key` starts (line:col), for errors about it."""
            ln, col = lines.get(("@",) + path + (key,), (lines.get(path + (key,), line), 1))
            return Where(file, ln, col, name)

        unknown = set(entry) - RULE_KEYS
        if "template" in unknown:  # what fuse rules said before kernel kinds
            raise RuleError("a fuse rule names its kernel kind, `kernel: NAME`, not a "
                            "`template:` (kinds/registry.py)", at("template"))
        if unknown:
            raise RuleError(f"unknown key(s): {', '.join(sorted(map(str, unknown)))}", where)
        doc = entry.get("doc")
        if not isinstance(doc, str) or not doc.strip() or "\n" in doc.strip():
            raise RuleError("every rule needs a one-line `doc:` with its math", where)
        kind = entry.get("kind", default_kind)
        if kind not in KINDS:
            raise RuleError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}", at("kind"))
        src = entry.get("pattern")
        if not isinstance(src, str):
            raise RuleError("missing `pattern:` (an expression string)", where)
        pwhere = _value_where(lines, path + ("pattern",), at("pattern"))
        ast = S.parse_expr(src, pwhere)
        pattern = Compiler(self.table, pwhere).pattern(ast)
        root_name = None
        if isinstance(pattern, PBind) and isinstance(pattern.inner, POp) and kind != "fuse":
            # `view(full(...)) as p`: the matched root itself, for guards and attributes
            root_name, pattern = pattern.name, pattern.inner
        if not (isinstance(pattern, POp) or (kind == "fuse" and isinstance(pattern, PCat))):
            raise RuleError("a pattern must apply an op at its root, not a bare variable "
                            "or constant (`@category` roots are for fuse rules)", at("pattern"))
        bound = _pattern_vars(pattern) | ({root_name} if root_name else set())
        if kind == "fuse":
            bound |= set(FUSE_GUARD_NAMES)  # what engine/fuse.py binds after growing a group
        replace_src = entry.get("replace")
        replace_ast: S.Node | None = None
        if kind != "fuse":
            if not isinstance(replace_src, str | int | float) or isinstance(replace_src, bool):
                raise RuleError("missing `replace:` (an expression)", where)
            replace_src = str(replace_src)
            rwhere = _value_where(lines, path + ("replace",), at("replace"))
            replace_ast = S.parse_expr(replace_src, rwhere)
            self._check_replace(replace_ast, bound, Compiler(self.table, rwhere))
        guards_src = entry.get("where", [])
        if isinstance(guards_src, str):
            guards_src = [guards_src]
        if not isinstance(guards_src, list):
            raise RuleError("`where:` is a guard expression or a list of them", at("where"))
        guards = []
        for gi, g in enumerate(guards_src):
            gwhere = _value_where(lines, path + ("where", gi), at("where"))
            g_ast = S.parse_expr(str(g), gwhere)
            self._check_guard(g_ast, bound, Compiler(self.table, gwhere),
                              _guard_names(pattern, kind))
            guards.append((g_ast, str(g)))
        examples = entry.get("examples")
        if not isinstance(examples, list) or not examples:
            raise RuleError("every rule needs `examples:` (a list of inputs it must fire on)",
                            where)
        no_match = entry.get("no_match", [])
        for ex in [*examples, *no_match]:
            if not isinstance(ex, dict):
                raise RuleError("each example is a mapping of variable -> spec "
                                "(e.g. {x: f32[4, 8]})", at("examples"))
        priority = entry.get("priority", 0)
        if not isinstance(priority, int):
            raise RuleError("priority must be an integer", at("priority"))
        kernel = entry.get("kernel")
        if kind == "fuse" or kernel is not None:
            self._check_kernel(kind, kernel, at("kernel") if "kernel" in entry else where)
        template_dir = _user_templates(self.kernels.get(kernel, ()) if isinstance(kernel, str)
                                       else (), template_dir)
        grow = entry.get("grow", [])
        if not isinstance(grow, list) or any(g not in CATEGORIES for g in grow):
            raise RuleError(f"`grow:` lists op categories ({', '.join(CATEGORIES)})",
                            at("grow"))
        siblings = entry.get("siblings", False)
        if not isinstance(siblings, bool) or (siblings and kind != "fuse"):
            raise RuleError("`siblings:` is true or false, on fuse rules only",
                            at("siblings"))
        more_launches = entry.get("more_launches", False)
        if not isinstance(more_launches, bool):
            raise RuleError("`more_launches:` is true or false", at("more_launches"))
        return Rule(
            name=name, doc=doc.strip(), kind=kind, pattern=pattern, pattern_src=src,
            replace=replace_ast, replace_src=replace_src, guards=tuple(guards), where=where,
            priority=priority, fp_exact=bool(entry.get("fp_exact", True)),
            overrides=bool(entry.get("overrides", False)), kernel=kernel,
            examples=tuple(examples), no_match=tuple(no_match), builtin=builtin,
            grow=tuple(grow), siblings=siblings, more_launches=more_launches,
            template_dir=str(template_dir) if template_dir else None, root_name=root_name,
        )

    def _check_kernel(self, kind: str, kernel: Any, where: Where) -> None:
        """A fuse rule names its kernel kind, one of `self.kernels`; no other rule does."""
        if kind != "fuse":
            raise RuleError("only fuse rules name a `kernel:` kind", where)
        known = ", ".join(sorted(self.kernels)) or "none given to the loader"
        if not isinstance(kernel, str) or not kernel:
            raise RuleError(f"a fuse rule names its kernel kind, `kernel: NAME` ({known})",
                            where)
        if kernel not in self.kernels:
            raise RuleError(f"unknown kernel kind {kernel!r} (known: {known})", where)

    def _check_replace(self, node: S.Node, bound: set[str], compiler: Compiler) -> None:
        for v in S.variables(node):
            if v.name == "_":
                raise compiler.error("`_` cannot appear in a replacement", v)
            if v.name not in bound and v.name not in DTYPE_NAMES:
                raise compiler.error(f"unbound variable `{v.name}` in replace "
                                     f"(the pattern binds: {', '.join(sorted(bound)) or 'none'})",
                                     v)
        self._check_ops(node, compiler, replace=True)

    def _check_ops(self, node: S.Node, compiler: Compiler, replace: bool) -> None:
        """Every op a replacement builds must exist, with the right operands and
        attributes; attribute values may use the functions in ATTR_FUNCS."""

        if isinstance(node, S.Var | S.Lit):
            return
        if isinstance(node, S.Seq):
            raise compiler.error("a list is only allowed as an attribute value", node)
        if replace and isinstance(node, S.Call) and node.func in ATTR_FUNCS \
                and node.func not in self.table:
            # a number computed as an attribute value is (`s / channel_count(x)`)
            self._check_attr_expr(node, compiler)
            return
        try:
            name, args, kwargs = op_name(node, self.table)
        except RuleError as e:
            raise compiler.error(e.message, node) from None
        if name != "getitem":
            compiler.check_call(name, args, kwargs, node)
            for _, value in kwargs:
                self._check_attr_expr(value, compiler)
        for a in args:
            self._check_ops(a, compiler, replace)

    def _check_attr_expr(self, node: S.Node, compiler: Compiler) -> None:
        for n in S.walk(node):
            if isinstance(n, S.Call) and n.func not in ATTR_FUNCS:
                raise compiler.error(f"unknown attribute function {n.func!r} (known: "
                                     f"{', '.join(sorted(ATTR_FUNCS))})", n)
        _literal(node, compiler)

    def _check_guard(self, node: S.Node, bound: set[str], compiler: Compiler,
                     names: dict[str, str]) -> None:
        for v in S.variables(node):
            if v.name not in bound and v.name not in DTYPE_NAMES:
                raise compiler.error(f"unbound variable `{v.name}` in guard", v)

        for n in S.walk(node):
            if isinstance(n, S.Call) and n.func not in GUARD_FUNCTIONS:
                raise compiler.error(f"unknown guard function {n.func!r} (known: "
                                     f"{', '.join(sorted(GUARD_FUNCTIONS))})", n)
        _literal(node, compiler)
        problem = guard_problem(node, names)
        if problem is not None:
            raise compiler.error(problem.message, problem.node)


_NOT_LITERAL = object()


def _literal(node: S.Node, compiler: Compiler) -> Any:
    """The value of `node` if it is literal arithmetic (`9 ** 9 ** 9`), else
    _NOT_LITERAL, looking into every subexpression: literal arithmetic beyond
    engine/arith.py's bounds, or that cannot be computed, is an error here, when
    the rule loads, rather than a hang or a false guard when it is matched."""
    if isinstance(node, S.Lit):
        return node.value
    if isinstance(node, S.Neg):
        v = _literal(node.operand, compiler)
        return -v if isinstance(v, int | float) and not isinstance(v, bool) else _NOT_LITERAL
    if isinstance(node, S.BinOp):
        a, b = _literal(node.left, compiler), _literal(node.right, compiler)
        if a is _NOT_LITERAL or b is _NOT_LITERAL:
            return _NOT_LITERAL
        try:
            return ARITH[node.op](a, b)
        except (ArithmeticError, ValueError, TypeError) as e:
            raise compiler.error(f"`{S.show(node)}` cannot be computed: {e}", node) from None
    children = [getattr(node, f) for f in node.__dataclass_fields__]
    values = []
    for c in children:
        for n in (c if isinstance(c, tuple) else (c,)):
            for m in (n if isinstance(n, tuple) else (n,)):  # kwargs: (name, node)
                if isinstance(m, S.Node):
                    values.append(_literal(m, compiler))
    if isinstance(node, S.Seq) and _NOT_LITERAL not in values:
        return tuple(values)
    return _NOT_LITERAL


TEMPLATE_FILES = ("triton/{}.py.j2", "openmp/{}.cpp.j2")


def _user_templates(kinds: Collection[str], user_dir: Path | None) -> Path | None:
    """The `templates/` folder beside a user's rule file when it holds a template of
    one of `kinds` (the rule's kind and its variants: `templates/openmp/pointwise.cpp.j2`),
    searched before the package's when the kernel renders; None otherwise."""
    if user_dir is None:
        return None
    if any((user_dir / f.format(k)).is_file() for f in TEMPLATE_FILES for k in kinds):
        return user_dir
    return None


def _value_where(lines: dict[tuple[Any, ...], Any], path: tuple[Any, ...], key: Where) -> Where:
    """Where an expression's first character sits in the file."""
    line, col = lines.get(("@",) + path, (key.line, 1))
    return Where(key.file, line, col, key.rule)


def display_path(path: Path) -> str:
    """Paths in messages: relative to the package for built-in rules, else as given."""
    pkg = Path(__file__).resolve().parent.parent
    try:
        return str(path.resolve().relative_to(pkg))
    except ValueError:
        return str(path)


def rule_files(path: Path, builtin: bool = False) -> list[Path]:
    """The rule files of a file or folder. The package's folder holds its op table,
    `ops.yaml`, which is not one; a user's `ops.yaml` is (its `ops:` join the table,
    engine/ops.py)."""
    if path.is_dir():
        return sorted(p for p in path.rglob("*.yaml")
                      if not (builtin and p == path / "ops.yaml"))
    return [path]


def check_unique(rules: list[Rule]) -> list[Rule]:
    """Later files may override an earlier rule only when they say so."""
    by_name: dict[str, Rule] = {}
    errors: list[RuleError] = []
    for r in rules:
        old = by_name.get(r.name)
        if old is not None and not r.overrides:
            errors.append(RuleError(f"duplicate rule name (first defined at {old.location}); "
                                    "add `overrides: true` to replace it", r.where))
            continue
        by_name[r.name] = r
    if errors:
        raise RuleErrors(errors)
    return list(by_name.values())
