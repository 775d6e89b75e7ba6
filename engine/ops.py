"""The op table (`rules/ops.yaml`): names, ATen overloads, operands, categories.

The engine consults it to validate rules (unknown ops, arity, attributes),
to know which ops are commutative, and the code generators read the
pointwise expressions from it. It is plain data: no torch here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import RuleError, RuleErrors, Where
from .opexpr import check_expression
from .yamlio import load_yaml

RULES_DIR = Path(__file__).resolve().parent.parent / "rules"
# indexed: an element reads its operands at other positions (cat, slice_scatter);
# only pointwise kernels compute them (kinds/indexed.py)
CATEGORIES = ("pointwise", "indexed", "reduction", "view", "extern")
# Ops that exist in every graph but not in the table.
BUILTIN_OPS = ("input", "const", "getitem", "aten", "call", "tensor", "kernel")


@dataclass(frozen=True)
class OpInfo:
    name: str
    aten: tuple[str, ...]
    args: tuple[str, ...]
    attrs: dict[str, Any] = field(hash=False)
    category: str
    commutative: bool = False
    associative: bool = False
    infix: str | None = None
    prefix: str | None = None
    triton: str | None = None
    cpp: str | None = None
    outputs: int = 1
    combine: str | None = None
    # The kernel expressions hold only when these attributes have these values.
    kernel_when: dict[str, Any] = field(default_factory=dict, hash=False)
    where: Where | None = None
    # a user's op that replaces the op of this name (or takes its ATen overloads)
    overrides: bool = False

    def overloads(self) -> list[tuple[str, tuple[int, ...]]]:
        """(overload, operand order) pairs: `rsub.Scalar(y, x)` calls rsub with y first."""
        out = []
        for entry in self.aten:
            name, _, rest = entry.partition("(")
            if rest:
                names = [a.strip() for a in rest.rstrip(")").split(",")]
                out.append((name.strip(), tuple(self.args.index(n) for n in names)))
            else:
                out.append((name, tuple(range(len(self.args)))))
        return out


class OpTable:
    def __init__(self, ops: dict[str, OpInfo]) -> None:
        self.ops = ops
        self.by_aten: dict[str, OpInfo] = {}
        self.order: dict[str, tuple[int, ...]] = {}
        for op in ops.values():
            for overload, order in op.overloads():
                self.by_aten[overload] = op
                self.order[overload] = order
        self.infix = {op.infix: op.name for op in ops.values() if op.infix}
        self.prefix = {op.prefix: op.name for op in ops.values() if op.prefix}

    def __contains__(self, name: str) -> bool:
        return name in self.ops or name in BUILTIN_OPS

    def get(self, name: str) -> OpInfo | None:
        return self.ops.get(name)

    def category(self, name: str) -> str:
        op = self.ops.get(name)
        return op.category if op else "extern"


_KNOWN_FIELDS = {f for f in OpInfo.__dataclass_fields__ if f not in ("where", "overrides")}
# What a user's op may be: a reduction or a view needs code of its own in rewritec
# (engine/fuse.py's iteration spaces, the view handling of the wrapper).
USER_CATEGORIES = ("pointwise", "extern")
NAME_RE = re.compile(r"[a-z][a-z0-9_]*")


def load_op_table(path: Path | None = None) -> OpTable:
    path = path or RULES_DIR / "ops.yaml"
    doc, lines = load_yaml(path)
    return OpTable(parse_ops(doc.get("ops", []), str(path), lines))


def parse_ops(entries: Any, file: str, lines: dict[tuple[Any, ...], Any], *,
              user: bool = False) -> dict[str, OpInfo]:
    """The `ops:` list of an op table or, with `user`, of a user's rule file: there
    an op may also say `overrides: true`, its category is pointwise or extern, and
    its kernel expressions are checked (engine/opexpr.py) before anything renders
    them. Returns name -> OpInfo, in file order."""
    if not isinstance(entries, list):
        raise RuleError("`ops:` must be a list", Where(file, lines.get(("ops",), 1)))
    ops: dict[str, OpInfo] = {}
    for i, entry in enumerate(entries):
        where = Where(file, lines.get(("ops", i), 0),
                      rule=entry.get("name") if isinstance(entry, dict) else None)
        if not isinstance(entry, dict):
            raise RuleError("each op is a mapping (name:, aten:, args:, category:, ...)", where)
        info = _op_info(entry, file, lines, ("ops", i), where, user)
        if info.name in ops or info.name in BUILTIN_OPS:
            raise RuleError(f"op {info.name!r} is defined twice", where)
        ops[info.name] = info
    return ops


def _op_info(entry: dict[str, Any], file: str, lines: dict[tuple[Any, ...], Any],
             path: tuple[Any, ...], where: Where, user: bool) -> OpInfo:
    known = _KNOWN_FIELDS | {"overrides"} if user else _KNOWN_FIELDS
    unknown = set(entry) - known
    if unknown:
        raise RuleError(f"unknown op-table field(s): {', '.join(sorted(map(str, unknown)))}",
                        where)
    name = entry.get("name")
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise RuleError(f"an op's name is lowercase letters, digits and '_', got {name!r}",
                        where)
    categories = USER_CATEGORIES if user else CATEGORIES
    if entry.get("category") not in categories:
        raise RuleError(f"category must be one of {', '.join(categories)}"
                        + (" (a user op cannot be a reduction or a view)" if user else ""),
                        _value(lines, path, "category", where))
    aten = entry.get("aten")
    if not isinstance(aten, list) or not aten or not all(isinstance(a, str) for a in aten):
        raise RuleError("`aten:` lists the op's ATen overloads (e.g. [log1p.default])",
                        _value(lines, path, "aten", where))
    args = entry.get("args", [])
    attrs = entry.get("attrs") or {}
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args) \
            or not isinstance(attrs, dict):
        raise RuleError("`args:` lists operand names; `attrs:` maps names to defaults",
                        where)
    info = OpInfo(
        name=name,
        aten=tuple(aten),
        args=tuple(args),
        attrs=dict(attrs),
        category=entry["category"],
        commutative=bool(entry.get("commutative", False)),
        associative=bool(entry.get("associative", False)),
        infix=entry.get("infix"),
        prefix=entry.get("prefix"),
        triton=entry.get("triton"),
        cpp=entry.get("cpp"),
        outputs=int(entry.get("outputs", 1)),
        combine=entry.get("combine"),
        kernel_when=dict(entry.get("kernel_when") or {}),
        where=where,
        overrides=bool(entry.get("overrides", False)),
    )
    try:
        info.overloads()
    except ValueError:
        raise RuleError("an overload's operand order names an operand not in `args:`",
                        _value(lines, path, "aten", where)) from None
    if user:
        _check_user_op(info, entry, lines, path, where)
    return info


def _check_user_op(info: OpInfo, entry: dict[str, Any], lines: dict[tuple[Any, ...], Any],
                   path: tuple[Any, ...], where: Where) -> None:
    """What a user's op may not do that the package's may: operators, several outputs;
    and its kernel expressions are checked before anything renders them."""
    if info.infix or info.prefix or info.combine or info.outputs != 1:
        raise RuleError("a user op is called by name, with one output (no `infix`, "
                        "`prefix`, `combine` or `outputs`)", where)
    for target in ("triton", "cpp"):
        expr = entry.get(target)
        if expr is None:
            continue
        if not isinstance(expr, str):
            raise RuleError(f"`{target}:` is an expression string",
                            _value(lines, path, target, where))
        check_expression(expr, target, info.args, tuple(info.attrs),
                         _value(lines, path, target, where))


def _value(lines: dict[tuple[Any, ...], Any], path: tuple[Any, ...], key: str,
           where: Where) -> Where:
    """Where the value of `key` of the entry at `path` starts."""
    line, col = lines.get(("@",) + path + (key,), (lines.get(path + (key,), where.line), 0))
    return Where(where.file, line, col, where.rule)


def with_user_ops(table: OpTable, user: dict[str, OpInfo]) -> OpTable:
    """`table` with a user's ops added. A user op that takes a name or an ATen overload
    of an op already there is an error, unless it says `overrides: true` (then it
    replaces that op)."""
    ops = dict(table.ops)
    errors: list[RuleError] = []
    for info in user.values():
        old = ops.get(info.name)
        if old is not None and not info.overrides:
            errors.append(RuleError(f"op {info.name!r} exists (defined at {_at(old)}); add "
                                    "`overrides: true` to replace it", info.where))
            continue
        for name, _ in info.overloads():
            owner = table.by_aten.get(name)
            if owner is not None and owner.name != info.name and not info.overrides:
                errors.append(RuleError(f"ATen overload {name} belongs to op {owner.name!r} "
                                        f"(defined at {_at(owner)}); add `overrides: true` "
                                        "to take it", info.where))
        ops[info.name] = info
    if errors:
        raise RuleErrors(errors)
    if any(info.overrides for info in user.values()):
        # an overload a user op took is no longer the old op's
        taken = {name for info in user.values() for name, _ in info.overloads()}
        for op in list(ops.values()):
            if op.name not in user and any(a.partition("(")[0].strip() in taken
                                           for a in op.aten):
                ops[op.name] = replace(op, aten=tuple(
                    a for a in op.aten if a.partition("(")[0].strip() not in taken))
    return OpTable(ops)


def _at(info: OpInfo) -> str:
    return str(info.where) if info.where else "?"


_default: OpTable | None = None


def default_op_table() -> OpTable:
    """The built-in op table (`rules/ops.yaml`): the parsed copy kept with the parsed
    rules when rulesets.py has handed it over, else parsed here once."""
    global _default
    if _default is None:
        _default = load_op_table()
    return _default


def use_default_op_table(table: OpTable) -> None:
    """Serve `table` (parsed from `rules/ops.yaml` as it is now) as the default."""
    global _default
    if _default is None:
        _default = table
