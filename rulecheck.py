"""Running a rule on its own examples: does it fire, and do results stay equal?

An example is a mapping from the pattern's variables to input specs:

    {x: 4x8xf32}                 random normal tensor, shape 4x8, float32
    {x: 4x8xf32 pos}             random positive values
    {i: 4x8xi64 below 50}        random integers in [0, 50) (ids, indices)
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

import contextlib
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TextIO

import torch

from .aten.bridge import Bridge, meta_of
from .aten.dtypes import TORCH_DTYPES
from .aten.fold import is_frozen, make_folder, tensor_term
from .engine import syntax as S
from .engine.errors import RewriteStop, RuleError, RuleErrors
from .engine.ops import OpTable, default_op_table
from .engine.pattern import Builder
from .engine.pipeline import run_pipeline
from .engine.prove import prove
from .engine.rules import ATTR_FUNCS, Rule
from .engine.term import Graph, Term, TermStore
from .kinds import registry
from .kinds.kernels import compilable
from .kinds.registry import SPACES
from .kinds.variants import variants_for
from .runtime.prepare import prepare_kernels
from .runtime.wrapper import lower

# A rule's examples are a few terms: a rewrite of one that takes longer than this
# is a rule that does not terminate.
EXAMPLE_SECONDS = 10.0
SPEC_RE = re.compile(r"^(?P<const>const\s+)?(?P<dims>(\d+x)*)(?P<dtype>[a-z]+\d*)"
                     r"(?P<pos>\s+pos)?(?:\s+below\s+(?P<below>\d+))?$")


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
    elif m.group("below"):
        value = torch.randint(0, int(m.group("below")), dims, generator=gen, dtype=dtype)
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
                  table: OpTable | None = None, device: str = "cpu",
                  ) -> tuple[Graph, TermStore, Bridge, list[Any]]:
    """The example's term graph, its store and bridge, and its input values on
    `device`; `table` holds the ops it may use (the package's, and a user's)."""
    gen = torch.Generator().manual_seed(seed)
    src = example.get("expr", rule.pattern_src)
    ast = _drop_wildcards(S.parse_expr(str(src), rule.where))
    bridge = Bridge(table=table)
    store = TermStore(bridge.meta_hook)
    env: dict[str, Any] = {}
    inputs: list[Term] = []
    values: list[Any] = []
    for name, spec in example.items():
        if name == "expr":
            continue
        value = make_value(spec, gen)
        if isinstance(value, torch.Tensor):
            value = value.to(device)
        if isinstance(value, _Const):
            env[name] = tensor_term(store, bridge, value.value, name)
        elif isinstance(value, torch.Tensor):
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
    root = Builder(bridge.table, store, ATTR_FUNCS).term(ast, env)
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
    Triton for a kind that only Triton renders (the matmul)."""
    forced = os.environ.get("REWRITEC_TARGET", "")
    if forced in ("openmp", "triton"):
        return forced
    if rule is not None and rule.kernel and "openmp" not in registry.kind(rule.kernel).launchers:
        return "triton"
    return "openmp"


def example_device(target: str) -> str:
    """Where an example's values live: Triton kernels run on the GPU unless Triton
    interprets them on the CPU (TRITON_INTERPRET=1)."""
    if target == "triton" and os.environ.get("TRITON_INTERPRET") != "1" \
            and torch.cuda.is_available():
        return "cuda"
    return "cpu"


def run_example(rule: Rule, example: dict[str, Any], index: int = 0, *,
                expect_fire: bool = True, table: OpTable | None = None) -> ExampleResult:
    """Rewrite the example with `rule` alone; compare with the unrewritten graph.
    A fuse rule's kernels are generated, built and run for `example_target()`."""
    target = example_target(rule)
    # only a fuse rule's kernels need the GPU; other rules' examples (and their
    # guards, such as pow-half's `device(x) == 'cuda'`) are written for the CPU
    device = example_device(target) if rule.kind == "fuse" else "cpu"
    graph, store, bridge, values = build_example(rule, example, seed=index, table=table,
                                                 device=device)
    try:
        result = run_pipeline(graph, store, [rule], table=bridge.table,
                              folder=make_folder(store, bridge), is_frozen=is_frozen,
                              can_compile=compilable(target, bridge.table)
                              if rule.kind == "fuse" else None,
                              spaces=SPACES, variants=variants_for(target, store),
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
        prepared = prepare_kernels(after, store, target, strict=True, out_dir=None,
                                   name=rule.name, bridge=bridge)
        after, launchers = prepared.graph, prepared.launchers
    got = lower(after, bridge, f"{rule.name}_after", launchers=launchers).fn(list(values))[0]
    err = _max_error(got, want)
    try:
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


def loop_check(rule: Rule, library: list[Rule], table: OpTable | None = None) -> str | None:
    """Rewrite the rule's examples with the whole library: a cycle between
    rules (a -> b, b -> a) or a term that keeps growing shows up here."""
    for i, ex in enumerate(rule.examples):
        try:
            graph, store, bridge, _ = build_example(rule, ex, seed=i, table=table)
            run_pipeline(graph, store, library, table=bridge.table,
                         folder=make_folder(store, bridge),
                         is_frozen=is_frozen, seconds=EXAMPLE_SECONDS)
        except RewriteStop as e:
            return str(e)
        except Exception:  # noqa: BLE001 - the example itself is reported elsewhere
            return None
    return None


def rule_report(rule: Rule, library: list[Rule] | None = None,
                table: OpTable | None = None) -> tuple[list[str], list[str]]:
    """(problems, notes) for one rule: examples, no_match, proof, fp-exactness,
    and (given the library it ships with) termination. `table`: the ops the rule
    was loaded with (rulesets.py: op_table_for), the package's by default."""
    problems: list[str] = []
    notes: list[str] = []
    table = table or default_op_table()
    if library:
        loop = loop_check(rule, library, table)
        if loop:
            problems.append(loop)
    for i, ex in enumerate(rule.examples):
        try:
            r = run_example(rule, ex, i, table=table)
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
            r = run_example(rule, ex, i, expect_fire=False, table=table)
        except Exception as e:  # noqa: BLE001
            problems.append(f"no_match {i} cannot run: {type(e).__name__}: {e}")
            continue
        if not r.ok:
            problems.append(f"no_match {i}: {r.message}")
    proof = prove(rule, table)
    notes.append(proof.status + (" (guard must ensure x > 0)" if proof.status ==
                                 "proved-positive" else ""))
    if not problems:
        problems += probe(rule, table)
    return problems, notes


# --------------------------------------------------------------------------- the probe
# Every rule, built-in or user, is run on each dtype its guards admit, with the values
# where floating point and integer arithmetic part from the reals: signed zeros,
# infinities, nan, the largest and smallest numbers, integers at their limits.
# - A simplification claims an identity: it must give what eager gives on all of them,
#   nan, infinities and the sign of zero included, within a few roundings.
# - An `fp_exact: false` rule is probed on the integer dtypes only (fast_math licenses
#   float rounding, never a wrapped integer): no nan or infinity where eager has none.
# - A decomposition, fold or recognition stands in for one ATen kernel whose own
#   rounding and overflow it cannot copy: integer results exactly; float results over
#   every probe value but the infinities, nan and the largest numbers, on nan and
#   infinities alone (the examples hold its rounding to their tolerance, and the
#   differential fuzzer and the OpInfo test hold the rest against eager).
# An input an example marks `pos` is probed with positive values only.
PROBE_DTYPES = ("f32", "f64", "f16", "bf16", "i8", "u8", "i32", "i64")
# Rounding a simplification may change, in units of the dtype's eps, relative to the
# result: reassociating two or three roundings, never a different value.
SIMPLIFY_ULPS = 8
# Rounds of probe values per example and dtype beyond one pass over every value.
EXTRA_ROUNDS = 3


def _float_probes(dtype: torch.dtype, extremes: bool) -> list[float]:
    fi = torch.finfo(dtype)
    tiny, sub = fi.tiny, fi.smallest_normal / 2 ** (fi.bits // 4)
    values = [0.0, -0.0, 1.0, -1.0, 0.5, -0.5, 2.0, -3.0, 20.0, -20.0, 40.0, -40.0, 100.0,
              0.005, -0.005, tiny, -tiny, sub, 1e4]
    if extremes:
        values += [float("inf"), float("-inf"), float("nan"), fi.max, -fi.max]
    return values


def _int_probes(dtype: torch.dtype) -> list[int]:
    ii = torch.iinfo(dtype)
    values = [0, 1, -1, 2, -2, 3, 7, -8, 100, ii.min, ii.max, ii.min + 1, ii.max - 1,
              2 ** 30, -(2 ** 30), ii.max // 2 + 1]
    return [v for v in values if ii.min <= v <= ii.max]


def _probe_values(dtype: torch.dtype, extremes: bool) -> torch.Tensor:
    values = _float_probes(dtype, extremes) if dtype.is_floating_point else _int_probes(dtype)
    return torch.tensor(values, dtype=torch.float64 if dtype.is_floating_point
                        else torch.int64).to(dtype)


def _probe_rounds(values: list[Any], positive: list[bool], dtype: torch.dtype,
                  extremes: bool, kept: list[bool] | None = None) -> list[list[Any]]:
    """Input lists whose tensors of `dtype` hold the probe values: every value at
    every position at least once, different inputs shifted against each other so
    that pairs vary, then a few shuffled rounds. `positive` inputs get the positive
    values only; `kept` ones (indices: `below N`) keep the values they have."""
    every = _probe_values(dtype, extremes)
    pools = [every[every > 0] if pos else every for pos in positive]
    kept = kept or [False] * len(values)
    probed = [isinstance(v, torch.Tensor) and v.dtype == dtype and not keep
              for v, keep in zip(values, kept, strict=True)]
    tensors = [v for v, p in zip(values, probed, strict=True) if p]
    if not tensors:
        return []
    smallest = max(1, min(t.numel() for t in tensors))
    rounds = -(-len(every) // smallest) + EXTRA_ROUNDS
    gen = torch.Generator().manual_seed(len(every))
    out = []
    for r in range(rounds):
        row = []
        for k, v in enumerate(values):
            if probed[k] and v.numel():
                pool = pools[k]
                if r < rounds - EXTRA_ROUNDS:
                    idx = (torch.arange(v.numel()) * (2 * k + 1) + r * smallest + 5 * k)
                else:
                    idx = torch.randint(0, len(pool), (v.numel(),), generator=gen)
                v = pool[idx % len(pool)].reshape(v.shape)
            row.append(v)
        out.append(row)
    return out


def _retyped(example: dict[str, Any], name: str) -> dict[str, Any] | None:
    """The example with every non-constant tensor input in dtype `name`; None when
    it has none. Constants keep their dtype: they are folded, not probed; so do
    indices (`below N`): they say where values are read, and stay in range."""
    out, changed = {}, False
    for key, spec in example.items():
        m = SPEC_RE.match(spec.strip()) if isinstance(spec, str) and key != "expr" else None
        if m is not None and not m.group("const") and not m.group("below") \
                and m.group("dtype") in TORCH_DTYPES:
            spec = f"{m.group('dims')}{name}{m.group('pos') or ''}"
            changed = True
        out[key] = spec
    return out if changed else None


def _difference(got: Any, want: Any, ulps: float | None) -> tuple[str, int] | None:
    """Where `got` parts from eager's `want`: a phrase and the first differing element's
    flat index; None when it does not.
    Integers must be equal; floats must agree on nan and on infinities, and finite
    values within `ulps` of the dtype's eps, the sign of zero included (None: on nan
    and infinities alone; the examples hold the rounding to their tolerance)."""
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        return None if got == want else (f"got {got}, eager {want}", 0)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {got.dtype}{list(got.shape)}, eager {want.dtype}{list(want.shape)}", 0
    g, w = got.reshape(-1), want.reshape(-1)
    if not want.dtype.is_floating_point:
        bad = g != w
    else:
        g, w = g.double(), w.double()
        same_class = (g.isnan() == w.isnan()) & ((g == w) | ~(g.isinf() | w.isinf()))
        zero_sign = (g != 0) | (w != 0) | (g.signbit() == w.signbit()) | (ulps is None)
        finite = g.isfinite() & w.isfinite()
        if ulps is None:
            close = torch.ones_like(finite)
        else:
            eps = torch.finfo(want.dtype).eps
            close = (g - w).abs() <= ulps * eps * torch.maximum(g.abs(), w.abs()) \
                + torch.finfo(want.dtype).tiny
        bad = ~(same_class & zero_sign & (close | ~finite))
    if not bool(bad.any()):
        return None
    i = int(bad.nonzero()[0])
    return f"got {got.reshape(-1)[i].item()!r}, eager {want.reshape(-1)[i].item()!r}", i


def probe(rule: Rule, table: OpTable | None = None) -> list[str]:
    """Problems the probe finds in `rule`, one line each (see PROBE_DTYPES)."""
    if rule.replace is None:
        return []  # fusion rules keep each op; their kernels are checked differentially
    dtypes = PROBE_DTYPES if rule.fp_exact else tuple(d for d in PROBE_DTYPES
                                                      if not d.startswith(("f", "bf")))
    identity = rule.kind == "simplify" and rule.fp_exact
    ulps = SIMPLIFY_ULPS if identity else None
    problems: list[str] = []
    for name in dtypes:
        for i, ex in enumerate(rule.examples):
            found = _probe_one(rule, ex, i, name, ulps, extremes=identity, table=table)
            if found:
                problems.append(found)
                break
    return problems


def _probe_one(rule: Rule, example: dict[str, Any], index: int, name: str,
               ulps: float | None, extremes: bool, table: OpTable | None = None) -> str | None:
    retyped = _retyped(example, name)
    if retyped is None:
        return None
    try:
        with _quiet_meta():
            graph, store, bridge, values = build_example(rule, retyped, seed=index,
                                                         table=table)
        result = run_pipeline(graph, store, [rule], table=bridge.table,
                              folder=make_folder(store, bridge), is_frozen=is_frozen)
        if not result.fired.get(rule.name):
            return None  # its guards (or the type check) leave this dtype alone
        before = lower(graph, bridge, f"{rule.name}_before").fn
        after = lower(result.graph, bridge, f"{rule.name}_after").fn
    except (RuleError, RewriteStop, RuntimeError, TypeError, ValueError):
        return None  # the expression itself does not exist at this dtype
    dtype = TORCH_DTYPES[name]
    specs = [str(retyped.get(n, "")).strip() for n in _input_names(graph)]
    positive = [spec.endswith(" pos") for spec in specs]
    kept = [" below " in spec for spec in specs]
    for inputs in _probe_rounds(values, positive, dtype, extremes, kept):
        try:
            want = before(list(inputs))[0]
        except (RuntimeError, IndexError):
            continue  # eager refuses these values (an id outside its table)
        try:
            got = after(list(inputs))[0]
        except RuntimeError as e:
            return f"{name}: eager runs where the rewrite fails: {e}"
        diff = _difference(got, want, ulps)
        if diff:
            phrase, i = diff
            shown = ", ".join(f"{k}={_shown(v, i, want)}" for k, v in
                              zip(_input_names(graph), inputs, strict=False))
            hint = ("a dtype guard" if not dtype.is_floating_point or not rule.fp_exact
                    else "a dtype guard or `fp_exact: false`")
            return f"{name}: results differ from eager at {shown}: {phrase} (needs {hint})"
    return None


@contextlib.contextmanager
def _quiet_meta() -> Iterator[None]:
    """An op that does not exist at a probed dtype (mean of int8) is skipped; torch's
    fake tensors would log a traceback for it first."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _input_names(graph: Graph) -> list[str]:
    return [t.attr("name") for t in graph.inputs]


def _shown(v: Any, i: int, out: Any) -> str:
    """Input `v`'s value at the differing element `i` of `out` where it has one of
    its own (same shape), else its first probe values."""
    if not isinstance(v, torch.Tensor):
        return repr(v)
    if isinstance(out, torch.Tensor) and v.shape == out.shape:
        return repr(v.reshape(-1)[i].item())
    flat = v.reshape(-1)[:6].tolist()
    return "[" + ", ".join(repr(x) for x in flat) + (", ...]" if v.numel() > 6 else "]")


def verify_user_rules(rules: list[Rule], library: list[Rule] | None = None,
                      table: OpTable | None = None) -> None:
    """Give each user rule the gate every built-in rule passes in the test suite (its
    examples and no_match examples, the probe, and termination with `library`)
    before it is used to compile anything: a rule that fails it is rejected, with its
    file:line, whatever the size of its examples."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    errors: list[RuleError] = []
    for rule in rules:
        try:
            # The first compilation loads the rules under AOTAutograd's fake mode,
            # where the examples' real tensors cannot run (nonzero in assert_close).
            with unset_fake_temporarily():
                problems, _ = rule_report(rule, library, table)
        except RuleError as e:
            problems = [e.message]
        except Exception as e:  # noqa: BLE001 - a broken rule is reported, never raised
            problems = [f"cannot run: {type(e).__name__}: {e}"]
        if problems:
            errors.append(RuleError(f"fails its check, rule not used: {problems[0]}",
                                    rule.where))
    if errors:
        raise RuleErrors(errors)


def check_rules(rules: list[Rule], out: TextIO, table: OpTable | None = None) -> int:
    """`rewritec rules check` over `rules` (rulesets.py gives them, fast-math ones too,
    and the op `table` they were loaded with)."""
    failed = 0
    for rule in rules:
        problems, notes = rule_report(rule, rules, table)
        status = "FAIL" if problems else "ok"
        out.write(f"{status:<4} {rule.name:<28} {', '.join(notes):<18} {rule.location}\n")
        for p in problems:
            out.write(f"     {rule.location}: [{rule.name}] {p}\n")
        failed += bool(problems)
    out.write(f"\n{len(rules) - failed} ok, {failed} failed, {len(rules)} rules\n")
    return 1 if failed else 0


def test_rules(rules: list[Rule], out: TextIO, table: OpTable | None = None) -> int:
    """`rewritec rules test`: every example and no_match example of `rules`."""
    passed = failed = 0
    for rule in rules:
        cases = [(ex, i, True) for i, ex in enumerate(rule.examples)]
        cases += [(ex, i, False) for i, ex in enumerate(rule.no_match)]
        for ex, i, fire in cases:
            try:
                r = run_example(rule, ex, i, expect_fire=fire, table=table)
                ok, msg = r.ok, r.message
            except Exception as e:  # noqa: BLE001
                ok, msg = False, f"{type(e).__name__}: {e}"
            label = "example" if fire else "no_match"
            out.write(f"{'PASS' if ok else 'FAIL'} {rule.name}[{label} {i}] {msg}\n")
            passed += ok
            failed += not ok
    out.write(f"{passed} passed, {failed} failed\n")
    return 1 if failed else 0
