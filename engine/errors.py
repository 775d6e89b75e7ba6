"""Errors that point back at a rule file: `rules/x.yaml:LINE:COL: [rule] message`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Where:
    """A place in a rule file. Every rule, pattern and error carries one."""

    file: str
    line: int = 0
    col: int = 0
    rule: str | None = None

    def __str__(self) -> str:
        loc = self.file
        if self.line:
            loc += f":{self.line}"
            if self.col:
                loc += f":{self.col}"
        return loc


class RewritecError(Exception):
    """Base class: anything rewritec reports to a user without a traceback."""


class RuleError(RewritecError):
    """A rule file that cannot be used; the message names file, line and rule."""

    def __init__(self, message: str, where: Where | None = None) -> None:
        self.message = message
        self.where = where
        super().__init__(self.format())

    def format(self) -> str:
        if self.where is None:
            return self.message
        rule = f" [{self.where.rule}]" if self.where.rule else ""
        return f"{self.where}:{rule} {self.message}"


class RuleErrors(RewritecError):
    """Several rule errors found at once, reported together."""

    def __init__(self, errors: list[RuleError]) -> None:
        self.errors = errors
        super().__init__("\n".join(e.format() for e in errors))


class RewriteStop(RewritecError):
    """The rewriter stopped before a fixed point (a cycle or the step budget)."""


class CompileError(RewritecError):
    """A graph rewritec could not compile; raised only in strict mode."""


class PackageError(RewritecError):
    """A package (runtime/package.py) that cannot be written or loaded; the message
    names the file and, where two values disagree, both."""
