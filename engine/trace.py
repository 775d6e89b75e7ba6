"""A record of one rewriting run, for the HTML report (htmlreport/collect.py).

It keeps every firing in order with the term before and after, what each term
of the graph as given became, and why fuse rules that matched a term refused
it. Only a compilation with out_dir asks for one; an untraced run passes None
and pays one check per firing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .rules import Rule
from .term import Graph, Term


@dataclass(frozen=True)
class Firing:
    """One rule firing. A fuse rule's `after` is its kernel term, and `members`
    the terms the kernel computes."""

    phase: str
    rule: str
    location: str
    before: Term
    after: Term
    members: frozenset[Term] = frozenset()


@dataclass
class Trace:
    phase: str = ""  # the phase running now (engine/pipeline.py sets it)
    firings: list[Firing] = field(default_factory=list)
    # each term of the graph first given -> the term it is now
    became: dict[Term, Term] = field(default_factory=dict)
    # a term fuse rules matched but did not take -> why, one line per rule
    refused: dict[Term, list[str]] = field(default_factory=dict)

    def start(self, graph: Graph) -> None:
        self.became = {t: t for t in graph.terms()}

    def fired(self, rule: str, location: str, before: Term, after: Term) -> None:
        self.firings.append(Firing(self.phase, rule, location, before, after))

    def kernel(self, rule: Rule, root: Term, members: frozenset[Term], kernel: Term) -> None:
        self.firings.append(Firing(self.phase, rule.name, rule.location, root, kernel, members))

    def refuse(self, term: Term, rule: Rule, why: str) -> None:
        self.refused.setdefault(term, []).append(f"{rule.name} ({rule.location}): {why}")

    def moved(self, now: Mapping[Term, Term]) -> None:
        """A pass rebuilt the graph: `now` maps its terms to their new ones."""
        for t, was in self.became.items():
            self.became[t] = now.get(was, was)
        self.refused = {now.get(t, t): why for t, why in self.refused.items()}
