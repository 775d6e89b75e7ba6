"""The rule engine alone: how fast it rewrites ATen graphs the size of GPT-2,
and what one match costs against the size of its pattern.

    python -m benchmarks.engine [--quick] [--blocks 1,2,4,8,12]

Captures the forward and backward ATen graphs of a stack of N GPT-2-small
blocks (d=768, 12 heads) once per N, then times, separately:
- convert: FX graph -> term graph (metadata from the captured fake values);
- rewrite: every phase of the whole rule library (fast_math on, so every rule runs).
It prints terms, rewrites, milliseconds and terms per second for each N, so
the growth with graph size can be read off.

Then it times single matches of balanced `+` patterns that fail at their last
leaf (`failing_sum`) against pattern size, with the multiset matching of sums
(engine/acmatch.py) and with the binary matching it replaced (both operand
orders at each node), which is stopped at its step budget.

Both tables go to `benchmarks/results/engine.md`. Timing only; the step
counts are asserted in tests/test_acmatch.py.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int = 768, heads: int = 12) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (d // self.heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        att = F.softmax(att.masked_fill(~mask, float("-inf")), dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


@dataclass
class Captured:
    gm: torch.fx.GraphModule
    inputs: list[Any]
    kind: str


def capture(blocks: int, tokens: int = 16) -> list[Captured]:
    """The forward and backward ATen graphs rewritec would be handed."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from rewritec.frontend.decompositions import decomposition_table

    graphs: list[Captured] = []

    def keep(kind: str) -> Any:
        def compiler(gm: torch.fx.GraphModule, inputs: list[Any]) -> Any:
            graphs.append(Captured(gm, list(inputs), kind))
            # AOTAutograd calls compiled graphs with one list of arguments
            return make_boxed_func(gm.forward)
        return compiler

    torch._dynamo.reset()
    model = nn.Sequential(*[Block() for _ in range(blocks)])
    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"),
                           decompositions=decomposition_table())
    x = torch.randn(1, tokens, 768, requires_grad=True)
    torch.compile(model, backend=backend)(x).sum().backward()
    return graphs


def rewrite_once(c: Captured) -> tuple[int, int, float, float]:
    """(terms before, rewrites, convert seconds, rewrite seconds) for one graph."""
    from torch._guards import detect_fake_mode

    from rewritec.engine.pipeline import run_pipeline
    from rewritec.aten.bridge import Bridge
    from rewritec.aten.convert import fx_to_terms
    from rewritec.aten.fold import is_frozen, make_folder
    from rewritec.options import Options
    from rewritec.rulesets import ruleset_for

    rules = ruleset_for(Options.make(fast_math=True))
    start = time.perf_counter()
    bridge = Bridge(detect_fake_mode(c.inputs))
    conv = fx_to_terms(c.gm, bridge)
    mid = time.perf_counter()
    result = run_pipeline(conv.graph, conv.store, rules, folder=make_folder(conv.store, bridge),
                          is_frozen=is_frozen)
    end = time.perf_counter()
    return len(conv.graph.terms()), sum(result.fired.values()), mid - start, end - mid


def measure(blocks: int, repeats: int) -> dict[str, float]:
    graphs = capture(blocks)
    runs = [[rewrite_once(c) for c in graphs] for _ in range(repeats)]
    terms = sum(t for t, _, _, _ in runs[0])
    fired = sum(f for _, f, _, _ in runs[0])
    convert = statistics.median(sum(r[2] for r in run) for run in runs)
    rewrite = statistics.median(sum(r[3] for r in run) for run in runs)
    return {"blocks": blocks, "graphs": len(graphs), "terms": terms, "rewrites": fired,
            "convert_ms": 1000 * convert, "rewrite_ms": 1000 * rewrite,
            "terms_per_s": terms / rewrite if rewrite else float("inf")}


# ------------------------------------------------------------- one match
SUM_KINDS = {"lit": "x0 + x1 + ... + 1", "var": "x0 + x1 + ... + x0",
             "mul": "x0 * y0 + ... + x0 * 2"}


def failing_sum(kind: str, nodes: int) -> tuple[Any, Any]:
    """(pattern, term): a balanced sum pattern of `nodes` nodes (SUM_KINDS) and a
    term that it matches at every leaf but its last."""
    from rewritec.engine.errors import Where
    from rewritec.engine.ops import default_op_table
    from rewritec.engine.pattern import Compiler
    from rewritec.engine.syntax import parse_expr
    from rewritec.engine.term import Meta, TermStore

    def balanced(leaves: list[Any], join: Any) -> Any:
        while len(leaves) > 1:
            leaves = [join(leaves[i], leaves[i + 1]) for i in range(0, len(leaves), 2)]
        return leaves[0]

    store, meta = TermStore(), Meta((4,), "f32")
    leaves = (nodes + 1) // (4 if kind == "mul" else 2)
    names = [f"x{i}" for i in range(leaves)]
    if kind == "mul":
        names = [f"(x{i} * y{i})" for i in range(leaves - 1)] + ["(x0 * 2)"]
    else:
        names[-1] = "1" if kind == "lit" else "x0"
    text = balanced(names, lambda a, b: f"({a} + {b})")
    pattern = Compiler(default_op_table(), Where("bench", 1)).pattern(parse_expr(text))

    def leaf(name: str) -> Any:
        return store.make("input", (), (("name", name),), meta=meta)

    terms = [leaf(f"a{i}") for i in range(leaves)]
    if kind == "mul":
        terms = [store.make("mul", (t, leaf(f"b{i}")), meta=meta) for i, t in enumerate(terms)]
    term = balanced(terms, lambda a, b: store.make("add", (a, b), (("alpha", 1),), meta=meta))
    return pattern, term


def time_match(kind: str, nodes: int, multiset: bool, budget: int) -> tuple[int, float, bool]:
    """(steps, seconds, stopped by the budget) of one failing root match."""
    from rewritec.engine.acmatch import MatchBudget
    from rewritec.engine.ops import default_op_table
    from rewritec.engine.pattern import Matcher

    pattern, term = failing_sum(kind, nodes)
    matcher = Matcher(default_op_table(), budget=budget, multiset=multiset)
    start = time.perf_counter()
    try:
        found = next(matcher.match_root(pattern, term, {}), None)
        assert found is None
        stopped = False
    except MatchBudget:
        stopped = True
    return matcher.steps, time.perf_counter() - start, stopped


def match_table(sizes: list[int], budget: int = 2_000_000) -> str:
    lines = ["| pattern | nodes | multiset steps | multiset ms | binary steps | binary ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for kind, shape in SUM_KINDS.items():
        for n in sizes:
            steps, secs, _ = time_match(kind, n, True, budget)
            b_steps, b_secs, stopped = time_match(kind, n, False, budget)
            binary = (f"> {budget:,} (stopped) | > {1000 * b_secs:,.0f}" if stopped
                      else f"{b_steps:,} | {1000 * b_secs:,.2f}")
            lines.append(f"| `{shape}` | {n} | {steps:,} | {1000 * secs:,.2f} | {binary} |")
    return "\n".join(lines)


def table(rows: list[dict[str, float]]) -> str:
    lines = ["| GPT-2 blocks | graphs | terms | rewrites | convert ms | rewrite ms | terms/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['blocks']} | {r['graphs']} | {r['terms']} | {r['rewrites']} | "
                     f"{r['convert_ms']:.1f} | {r['rewrite_ms']:.1f} | {r['terms_per_s']:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 and 2 blocks, one repeat")
    p.add_argument("--blocks", default="1,2,4,8,12")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "engine.md"))
    args = p.parse_args(argv)
    sizes = [1, 2] if args.quick else [int(b) for b in args.blocks.split(",")]
    rows = [measure(n, 1 if args.quick else args.repeats) for n in sizes]
    nodes = [7, 15, 31] if args.quick else [7, 15, 31, 63]
    text = (f"# rewritec rule engine\n\n- torch {torch.__version__}; forward + backward ATen "
            f"graphs of N GPT-2-small blocks; whole library with fast_math; median of "
            f"{1 if args.quick else args.repeats}\n"
            f"- {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
            f"\n\n{table(rows)}\n"
            f"\n## One match against pattern size\n\nA balanced sum pattern of N nodes "
            f"that fails at its last leaf, matched once at the root of a term of the same "
            f"shape: multiset matching (engine/acmatch.py) against binary matching (both "
            f"operand orders at each node, as before), stopped at its step budget.\n\n"
            f"{match_table(nodes)}\n")
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    return 0


def engine_step(blocks: int) -> Any:
    """A zero-argument callable that rewrites the graphs of `blocks` blocks once
    (used by the harness's `engine` case)."""
    graphs = capture(blocks)
    return lambda: [rewrite_once(c) for c in graphs]


if __name__ == "__main__":
    raise SystemExit(main())
