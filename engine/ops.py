"""The op table (`rules/ops.yaml`): names, ATen overloads, operands, categories.

The engine consults it to validate rules (unknown ops, arity, attributes),
to know which ops are commutative, and the code generators read the
pointwise expressions from it. It is plain data: no torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import RuleError, Where
from .yamlio import load_yaml

RULES_DIR = Path(__file__).resolve().parent.parent / "rules"
CATEGORIES = ("pointwise", "reduction", "view", "extern")
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


_KNOWN_FIELDS = {f for f in OpInfo.__dataclass_fields__ if f not in ("where",)}


def load_op_table(path: Path | None = None) -> OpTable:
    path = path or RULES_DIR / "ops.yaml"
    doc, lines = load_yaml(path)
    ops: dict[str, OpInfo] = {}
    for i, entry in enumerate(doc.get("ops", [])):
        where = Where(str(path), lines.get(("ops", i), 0), rule=entry.get("name"))
        unknown = set(entry) - _KNOWN_FIELDS
        if unknown:
            raise RuleError(f"unknown op-table field(s): {', '.join(sorted(unknown))}", where)
        if entry.get("category") not in CATEGORIES:
            raise RuleError(f"category must be one of {CATEGORIES}", where)
        info = OpInfo(
            name=entry["name"],
            aten=tuple(entry["aten"]),
            args=tuple(entry.get("args", ())),
            attrs=dict(entry.get("attrs") or {}),
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
        )
        if info.name in ops or info.name in BUILTIN_OPS:
            raise RuleError(f"op {info.name!r} is defined twice", where)
        ops[info.name] = info
    return OpTable(ops)


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
