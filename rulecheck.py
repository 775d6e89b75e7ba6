"""Running a rule on its own examples: does it fire, and do results stay equal?

An example is a mapping from the pattern's variables to input specs:

    {x: 4x8xf32}                 random normal tensor, shape 4x8, float32
    {x: 4x8xf32 pos}             random positive values
    {w: const 4x3xf32}           a constant (frozen) tensor, foldable
    {x: [1.0, -2.0, 3.0]}        these values (float32)
    {d: -1}                      an attribute value or python scalar
    {expr: "x * 2", x: 4xf32}    build this expression instead of the pattern

The expression is built as a term graph, rewritten by the rule alone (plus
constant folding), and both graphs are run through ATen and compared.
`rewritec rules check` adds proofs and fp-exactness; `rules test` runs the
examples; tests/test_rule_examples.py makes one pytest test per example.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from .codegen.wrapper import lower
from .engine import syntax as S
from .engine.errors import RewriteStop, RuleError
from .engine.ops import default_op_table
from .engine.pattern import Builder
from .engine.pipeline import run_pipeline
from .engine.prove import prove
from .engine.rules import ATTR_FUNCS, Rule
from .engine.term import Graph, Term, TermStore
from .frontend.aten import Bridge, meta_of
from .frontend.dtypes import TORCH_DTYPES
from .frontend.fold import is_frozen, make_folder, tensor_term
from .options import Options

# A rule's examples are a few terms: a rewrite of one that takes longer than this
# is a rule that does not terminate.
EXAMPLE_SECONDS = 10.0
SPEC_RE = re.compile(r"^(?P<const>const\s+)?(?P<dims>(\d+x)*)(?P<dtype>[a-z]+\d*)"
                     r"(?P<pos>\s+pos)?$")


@dataclass
class ExampleResult:
    rule: str
    index: int
    fired: int
    max_error: float
    ok: bool
    message: str


def make_value(spec: Any, gen: torch.Generator) -> Any:
    """A concrete value for one example spec (see the module docstring)."""
    if isinstance(spec, list):
        return torch.tensor(spec, dtype=torch.float32)
    if not isinstance(spec, str):
        return spec
    m = SPEC_RE.match(spec.strip())
    if m is None or m.group("dtype") not in TORCH_DTYPES:
        return spec  # a string attribute value
    dims = [int(d) for d in m.group("dims").split("x") if d]
    dtype = TORCH_DTYPES[m.group("dtype")]
    if dtype.is_floating_point:
        value = torch.randn(dims, generator=gen, dtype=torch.float32)
        if m.group("pos"):
            value = value.abs() + 0.1
        value = value.to(dtype)
    elif dtype == torch.bool:
        value = torch.randint(0, 2, dims, generator=gen).bool()
    else:
        value = torch.randint(-8, 9, dims, generator=gen, dtype=dtype)
    return _Const(value) if m.group("const") else value


class _Const:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


def _drop_wildcards(node: S.Node) -> S.Node:
    """`momentum=_` in a pattern means "any"; when building it, use the default."""
    if isinstance(node, S.Call):
        return S.Call(node.func, tuple(_drop_wildcards(a) for a in node.args),
                      tuple((k, _drop_wildcards(v)) for k, v in node.kwargs
                            if not (isinstance(v, S.Var) and v.name == "_")),
                      line=node.line, col=node.col)
    if isinstance(node, S.BinOp):
        return S.BinOp(node.op, _drop_wildcards(node.left), _drop_wildcards(node.right),
                       line=node.line, col=node.col)
    if isinstance(node, S.Neg):
        return S.Neg(_drop_wildcards(node.operand), line=node.line, col=node.col)
    if isinstance(node, S.Index):
        return S.Index(_drop_wildcards(node.value), node.index, line=node.line, col=node.col)
    return node


def build_example(rule: Rule, example: dict[str, Any], seed: int = 0,
                  special: bool = False) -> tuple[Graph, TermStore, Bridge, list[Any]]:
    """The example's term graph, its store and bridge, and its input values."""
    gen = torch.Generator().manual_seed(seed)
    src = example.get("expr", rule.pattern_src)
    ast = _drop_wildcards(S.parse_expr(str(src), rule.where))
    bridge = Bridge()
    store = TermStore(bridge.meta_hook)
    env: dict[str, Any] = {}
    inputs: list[Term] = []
    values: list[Any] = []
    for name, spec in example.items():
        if name == "expr":
            continue
        value = make_value(spec, gen)
        if isinstance(value, _Const):
            env[name] = tensor_term(store, bridge, value.value, name)
        elif isinstance(value, torch.Tensor):
            if special and value.dtype.is_floating_point and value.numel() >= 6:
                flat = value.view(-1)
                flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0,
                                         1e30], dtype=value.dtype)
            fake = bridge.fake_mode.from_tensor(value, static_shapes=True)
            term = store.make("input", (), (("name", name), ("index", len(inputs)),
                                            ("kind", "input")), meta=meta_of(fake))
            inputs.append(term)
            values.append(value)
            env[name] = term
        else:
            env[name] = value
    missing = {v.name for v in S.variables(ast)} - set(env) - {"_"}
    missing -= {n for n in missing if n in ("f32", "f16", "bf16", "f64", "i64", "i32", "b8")}
    if missing:
        raise RuleError(f"example gives no value for {', '.join(sorted(missing))}", rule.where)
    root = Builder(default_op_table(), store, ATTR_FUNCS).term(ast, env)
    return Graph(tuple(inputs), (root,)), store, bridge, values


def _tolerance(dtype: torch.dtype) -> dict[str, Any]:
    if dtype in (torch.float16, torch.bfloat16):
        return {"rtol": 2e-2, "atol": 2e-2}
    if dtype == torch.float64:
        return {"rtol": 1e-7, "atol": 1e-7}
    return {"rtol": 1e-4, "atol": 1e-5}


def example_target(rule: Rule | None = None) -> str:
    """The kernel target fuse rules' examples are rendered for: REWRITEC_TARGET when
    it names one (triton needs a GPU or TRITON_INTERPRET=1), else OpenMP C++, or
    Triton for a template that only Triton has (the matmul)."""
    import os

    from .codegen.templates import has_template

    forced = os.environ.get("REWRITEC_TARGET", "")
    if forced in ("openmp", "triton"):
        return forced
    if rule is not None and rule.template and not has_template(f"openmp/{rule.template}.cpp.j2"):
        return "triton"
    return "openmp"


def run_example(rule: Rule, example: dict[str, Any], index: int = 0, *,
                expect_fire: bool = True, special: bool = False) -> ExampleResult:
    """Rewrite the example with `rule` alone; compare with the unrewritten graph.
    A fuse rule's kernels are generated, built and run for `example_target()`."""
    from .compiler import compilable

    graph, store, bridge, values = build_example(rule, example, seed=index, special=special)
    target = example_target(rule)
    try:
        result = run_pipeline(graph, store, [rule], folder=make_folder(store, bridge),
                              is_frozen=is_frozen,
                              can_compile=compilable(target) if rule.kind == "fuse" else None,
                              seconds=EXAMPLE_SECONDS)
    except RewriteStop as e:
        return ExampleResult(rule.name, index, 0, float("inf"), False, str(e))
    fired = result.fired.get(rule.name, 0)
    if not expect_fire:
        ok = fired == 0
        return ExampleResult(rule.name, index, fired, 0.0, ok,
                             "did not fire, as expected" if ok else "fired on a no_match example")
    if fired == 0:
        return ExampleResult(rule.name, index, 0, 0.0, False, "did not fire")
    want = lower(graph, bridge, f"{rule.name}_before").fn(list(values))[0]
    after, launchers = result.graph, {}
    if rule.kind == "fuse":
        from .codegen.prepare import prepare_kernels

        prepared = prepare_kernels(after, store, target, strict=True, out_dir=None,
                                   name=rule.name)
        after, launchers = prepared.graph, prepared.launchers
    got = lower(after, bridge, f"{rule.name}_after", launchers=launchers).fn(list(values))[0]
    err = _max_error(got, want)
    try:
        if special:
            torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-3, atol=1e-3)
        else:
            torch.testing.assert_close(got, want, **_tolerance(want.dtype))
        return ExampleResult(rule.name, index, fired, err, True, f"fired x{fired}")
    except AssertionError as e:
        first = str(e).strip().splitlines()[0]
        return ExampleResult(rule.name, index, fired, err, False, f"results differ: {first}")


def _max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    d = (a.double() - b.double()).abs()
    d = d[torch.isfinite(d)]
    return float(d.max()) if d.numel() else 0.0


def loop_check(rule: Rule, library: list[Rule]) -> str | None:
    """Rewrite the rule's examples with the whole library: a cycle between
    rules (a -> b, b -> a) or a term that keeps growing shows up here."""
    for i, ex in enumerate(rule.examples):
        try:
            graph, store, bridge, _ = build_example(rule, ex, seed=i)
            run_pipeline(graph, store, library, folder=make_folder(store, bridge),
                         is_frozen=is_frozen, seconds=EXAMPLE_SECONDS)
        except RewriteStop as e:
            return str(e)
        except Exception:  # noqa: BLE001 - the example itself is reported elsewhere
            return None
    return None


def rule_report(rule: Rule, library: list[Rule] | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes) for one rule: examples, no_match, proof, fp-exactness,
    and (given the library it ships with) termination."""
    problems: list[str] = []
    notes: list[str] = []
    if library:
        loop = loop_check(rule, library)
        if loop:
            problems.append(loop)
    for i, ex in enumerate(rule.examples):
        try:
            r = run_example(rule, ex, i)
        except RuleError as e:
            problems.append(e.message)
            continue
        except Exception as e:  # noqa: BLE001 - report, never crash the checker
            problems.append(f"example {i} cannot run: {type(e).__name__}: {e}")
            continue
        if not r.ok:
            problems.append(f"example {i}: {r.message}")
    for i, ex in enumerate(rule.no_match):
        try:
            r = run_example(rule, ex, i, expect_fire=False)
        except Exception as e:  # noqa: BLE001
            problems.append(f"no_match {i} cannot run: {type(e).__name__}: {e}")
            continue
        if not r.ok:
            problems.append(f"no_match {i}: {r.message}")
    proof = prove(rule, default_op_table())
    notes.append(proof.status + (" (guard must ensure x > 0)" if proof.status ==
                                 "proved-positive" else ""))
    if rule.fp_exact and rule.replace is not None and rule.examples and not problems:
        try:
            r = run_example(rule, rule.examples[0], 0, special=True)
            if r.fired and not r.ok:
                problems.append("holds over the reals but not under inf/nan (say "
                                "`fp_exact: false` if that is intended): " + r.message)
        except Exception:  # noqa: BLE001 - the plain examples already report this
            pass
    return problems, notes


def verify_user_rules(rules: list[Rule]) -> None:
    """Run each user rule's examples before it is used to compile anything: a rule
    whose replacement changes results is rejected, with its file:line."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from .engine.errors import RuleErrors

    errors: list[RuleError] = []
    for rule in rules:
        for i, ex in enumerate(rule.examples):
            try:
                # The first compilation loads the rules under AOTAutograd's fake mode,
                # where the examples' real tensors cannot run (nonzero in assert_close).
                with unset_fake_temporarily():
                    r = run_example(rule, ex, i)
                problem = None if r.ok else r.message
            except RuleError as e:
                problem = e.message
            except Exception as e:  # noqa: BLE001
                problem = f"cannot run: {type(e).__name__}: {e}"
            if problem:
                errors.append(RuleError(f"example {i} fails its check, rule not used: {problem}",
                                        rule.where))
                break
    if errors:
        raise RuleErrors(errors)


def check_rules(opts: Options, out: TextIO) -> int:
    from .rulesets import ruleset_for

    rules = ruleset_for(Options.make(rules=opts.rules, fast_math=True))
    failed = 0
    for rule in rules:
        problems, notes = rule_report(rule, rules)
        status = "FAIL" if problems else "ok"
        out.write(f"{status:<4} {rule.name:<28} {', '.join(notes):<18} {rule.location}\n")
        for p in problems:
            out.write(f"     {rule.location}: [{rule.name}] {p}\n")
        failed += bool(problems)
    out.write(f"\n{len(rules) - failed} ok, {failed} failed, {len(rules)} rules\n")
    return 1 if failed else 0


def test_rules(opts: Options, out: TextIO) -> int:
    from .rulesets import ruleset_for

    passed = failed = 0
    for rule in ruleset_for(Options.make(rules=opts.rules, fast_math=True)):
        cases = [(ex, i, True) for i, ex in enumerate(rule.examples)]
        cases += [(ex, i, False) for i, ex in enumerate(rule.no_match)]
        for ex, i, fire in cases:
            try:
                r = run_example(rule, ex, i, expect_fire=fire)
                ok, msg = r.ok, r.message
            except Exception as e:  # noqa: BLE001
                ok, msg = False, f"{type(e).__name__}: {e}"
            label = "example" if fire else "no_match"
            out.write(f"{'PASS' if ok else 'FAIL'} {rule.name}[{label} {i}] {msg}\n")
            passed += ok
            failed += not ok
    out.write(f"{passed} passed, {failed} failed\n")
    return 1 if failed else 0
