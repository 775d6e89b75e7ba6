"""The accumulators of the OpenMP reductions: the lines that
templates/openmp/{row,reduction}.cpp.j2 put around and inside their loops.

A sum (sum, mean, and so the variances and norms decomposed into them) is taken
pairwise, as ATen's cascade sum is. The reduced index runs in chunks of
PAIRWISE_CHUNK elements; a vectorized loop sums each chunk into a fresh
accumulator, and the chunk sums are the leaves of a binary tree
(templates/openmp/pairwise.h.j2). Rounding error then grows with log2 of the
length, not with the length over the vector lanes: one accumulator per lane
stalled at 2**24 on `torch.ones(2**28).sum()` and drifted by 0.3-1% on ten
million 0.1s. Where threads share one output's reduction, each takes whole
chunks and its own tree, and the threads' totals are added at the end.

amax and amin need no chunks' care (they are exact) but run in the same loops;
they keep a nan flag, since std::max drops nan and torch.amax does not.

The phases, in the order the templates use them, per output (or row):
`declare`; per thread `thread_init`; per chunk `chunk_init`, the vectorized loop
with `clauses` and `update`, then `chunk_end`; per thread `thread_end`;
`finish`. A reduction of one chunk (a short row) skips the tree: `chunk_init`, the
loop, `single_end`, as fast as a plain loop. The column loop of the reduction
template (outputs side by side) keeps COLUMN_BLOCK outputs in arrays instead:
the `column_*` methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast, get_args

# Elements per chunk of a sum: the vectorized loop adds 32 (AVX-512) or 64 (AVX2)
# f32 values per lane before its lanes are added, so the error of a chunk stays
# below ATen's; long enough that the tree's adds cost nothing measurable.
PAIRWISE_CHUNK = 512
# Rows per chunk of the column loop, where each output's lane adds one value a row.
COLUMN_CHUNK = 64

ReductionOp = Literal["sum", "mean", "amax", "amin"]
START = {"sum": "0", "mean": "0", "amax": "-INFINITY", "amin": "INFINITY"}


@dataclass(frozen=True)
class CppAccumulator:
    """One reduction's accumulator `name`, of C++ type `ctype`."""

    op: ReductionOp
    name: str
    ctype: str

    @property
    def pairwise(self) -> bool:
        return self.op in ("sum", "mean")

    @property
    def _fn(self) -> str:
        return "max" if self.op == "amax" else "min"

    def declare(self) -> list[str]:
        """Before the output's reduction: what its threads combine into."""
        if self.pairwise:
            return [f"{self.ctype} {self.name}_total = 0;"]
        return [f"{self.ctype} {self.name} = {START[self.op]};",
                f"int {self.name}_nan = 0;  // an int: a bool reduction does not vectorize"]

    def shared_clauses(self) -> list[str]:
        """An `omp parallel` region's clauses, where threads share the reduction."""
        if self.pairwise:
            return [f"reduction(+:{self.name}_total)"]
        return self.clauses()

    def thread_init(self) -> list[str]:
        return [f"PairwiseSum<{self.ctype}> {self.name}_sums;"] if self.pairwise else []

    def chunk_init(self) -> list[str]:
        return [f"{self.ctype} {self.name} = 0;"] if self.pairwise else []

    def clauses(self) -> list[str]:
        """The vectorized loop's clauses."""
        if self.pairwise:
            return [f"reduction(+:{self.name})"]
        return [f"reduction({self._fn}:{self.name})", f"reduction(|:{self.name}_nan)"]

    def update(self, value: str) -> list[str]:
        if self.pairwise:
            return [f"{self.name} += {value};"]
        return [f"{self.name} = std::{self._fn}({self.name}, {value});",
                f"{self.name}_nan |= ({value} != {value});"]

    def chunk_end(self) -> list[str]:
        return [f"{self.name}_sums.add({self.name});"] if self.pairwise else []

    def single_end(self) -> list[str]:
        """After the loop, where the whole reduction was one chunk."""
        return [f"{self.name}_total = {self.name};"] if self.pairwise else []

    def thread_end(self) -> list[str]:
        return [f"{self.name}_total += {self.name}_sums.total();"] if self.pairwise else []

    def finish(self, result: str, divisor: str | None = None) -> list[str]:
        """`const {ctype} {result}` = the reduced value (divided by `divisor`: a mean)."""
        div = f" / {divisor}" if divisor else ""
        if self.pairwise:
            return [f"const {self.ctype} {result} = {self.name}_total{div};"]
        return [f"if ({self.name}_nan) {self.name} = NAN;",
                f"const {self.ctype} {result} = {self.name}{div};"]

    # ---------------------------------------------------------- the column loop
    def column_arrays(self, block: int) -> list[str]:
        """A block of outputs' accumulators (chunk sums, or running max/min and flags)."""
        if self.pairwise:
            return [f"PairwiseSum<{self.ctype}, {block}> {self.name}_sums;",
                    f"{self.ctype} {self.name}_v[{block}];"]
        return [f"{self.ctype} {self.name}_v[{block}];", f"int {self.name}_nan_v[{block}];"]

    def column_fill(self) -> list[str]:
        """Output k's start, before the block's first chunk."""
        return [] if self.pairwise else [f"{self.name}_v[k] = {START[self.op]};",
                                         f"{self.name}_nan_v[k] = 0;"]

    def column_chunk_fill(self) -> list[str]:
        """Output k's start, before each chunk."""
        return [f"{self.name}_v[k] = 0;"] if self.pairwise else []

    def column_take(self) -> list[str]:
        """Output o's accumulators out of the arrays, in the loop over a row's outputs."""
        lines = [f"{self.ctype} {self.name} = {self.name}_v[o - o0];"]
        if not self.pairwise:
            lines.append(f"int {self.name}_nan = {self.name}_nan_v[o - o0];")
        return lines

    def column_keep(self) -> list[str]:
        lines = [f"{self.name}_v[o - o0] = {self.name};"]
        if not self.pairwise:
            lines.append(f"{self.name}_nan_v[o - o0] = {self.name}_nan;")
        return lines

    def column_chunk_end(self) -> list[str]:
        return [f"{self.name}_sums.add({self.name}_v);"] if self.pairwise else []

    def column_totals(self) -> list[str]:
        """After the last chunk: each output's total into its array slot."""
        return [f"{self.name}_sums.total({self.name}_v);"] if self.pairwise else []

    def column_result(self) -> list[str]:
        """Output o's accumulators for `finish`, in the loop storing the outputs."""
        if self.pairwise:
            return [f"const {self.ctype} {self.name}_total = {self.name}_v[o - o0];"]
        return self.column_take()


def cpp_accumulator(op: str, name: str, ctype: str) -> CppAccumulator:
    """The accumulator of reduction `op`; an op that is not a reduction is an error."""
    if op not in get_args(ReductionOp):
        raise ValueError(f"no accumulator for {op!r}")
    return CppAccumulator(cast(ReductionOp, op), name, ctype)
