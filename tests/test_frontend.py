"""The front end and the compile driver: term interning, FX -> terms, the
report, per-op ATen fallback, whole-graph fallback, strict mode, options."""

from __future__ import annotations

import ast
import copy
import inspect
import json
from pathlib import Path

import pytest
import rewritec
import torch
import torch.nn.functional as F
from models import MLP, check_function, check_module, compile_strict, no_fallback, tol
from rewritec import compiler, report
from rewritec.aten.bridge import Bridge, meta_of
from rewritec.aten.convert import Unsupported, fx_to_terms
from rewritec.compiler import RewritecWarning, compile_fx
from rewritec.engine.errors import CompileError, RewritecError
from rewritec.engine.term import Graph, Meta, TermStore
from rewritec.options import Options
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx


def _chain(exc: BaseException | None) -> list[BaseException]:
    """The exception and everything it was raised from (Dynamo wraps backend errors)."""
    out = []
    while exc is not None and exc not in out:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


# --------------------------------------------------------------------------- term store
def test_termstore_hash_conses_identical_terms() -> None:
    store = TermStore()
    m = Meta(shape=(2, 3))
    x = store.make("input", (), {"name": "x", "index": 0, "kind": "input"}, meta=m)
    assert store.make("input", (), {"name": "x", "index": 0, "kind": "input"}, meta=m) is x
    one = store.const(1.0)
    assert store.const(1.0) is one
    a = store.make("add", (x, one), {"alpha": 1}, meta=m)
    n = len(store)
    b = store.make("add", (x, store.const(1.0)), (("alpha", 1),), meta=m)
    assert b is a and len(store) == n  # same op, args, attrs: the same object, nothing new
    # Lists in attributes are frozen, so [0, 1] and (0, 1) intern alike.
    s1 = store.make("sum", (a,), {"dim": [0, 1]}, meta=Meta())
    assert store.make("sum", (a,), {"dim": (0, 1)}, meta=Meta()) is s1
    # Anything different gives a different term.
    assert store.make("add", (one, x), {"alpha": 1}, meta=m) is not a
    assert store.make("add", (x, one), {"alpha": 2}, meta=m) is not a
    assert store.const(1) is not one  # int 1 and float 1.0 stay distinct
    assert store.const(True) is not store.const(1)
    # A shared subexpression appears once in the graph.
    mul = store.make("mul", (a, b), meta=m)
    g = Graph((x,), (mul,))
    assert g.op_counts() == {"add": 1, "mul": 1}
    assert g.users()[a] == 2


def test_termstore_meta_hook_runs_once_per_distinct_term() -> None:
    bridge = Bridge()
    calls = []

    def hook(op, args, attrs):
        calls.append(op)
        return bridge.meta_hook(op, args, attrs)

    store = TermStore(hook)
    fx = bridge.fake_mode.from_tensor(torch.randn(4, 3))
    fy = bridge.fake_mode.from_tensor(torch.randn(3))
    x = store.make("input", (), {"name": "x", "index": 0, "kind": "input"}, meta=meta_of(fx))
    y = store.make("input", (), {"name": "y", "index": 1, "kind": "input"}, meta=meta_of(fy))
    t1 = store.make("add", (x, y), {"alpha": 1})
    t2 = store.make("add", (x, y), {"alpha": 1})
    assert t1 is t2
    assert calls == ["add"]
    assert t1.meta.shape == (4, 3) and t1.meta.dtype == "f32"  # broadcast, inferred on fakes


def _aten_graph(fn, *inputs):
    gm = make_fx(fn, tracing_mode="fake")(*inputs)
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    return gm, Bridge(detect_fake_mode(vals))


def test_fx_to_terms_shares_common_subexpressions() -> None:
    gm, bridge = _aten_graph(lambda x: (x + 1) * (x + 1), torch.randn(3, 5))
    adds = [n for n in gm.graph.nodes if n.target is torch.ops.aten.add.Tensor]
    assert len(adds) == 2  # two nodes in the FX graph ...
    conv = fx_to_terms(gm, bridge)
    counts = conv.graph.op_counts()
    assert counts.get("add") == 1, counts  # ... one term
    (out,) = conv.graph.outputs
    assert out.args[0] is out.args[1]
    # The lowered wrapper computes the original function.
    from rewritec.runtime.wrapper import lower

    x = torch.randn(3, 5)
    (got,) = lower(conv.graph, bridge, "test_cse").fn([x])
    torch.testing.assert_close(got, (x + 1) * (x + 1))


def test_random_draws_are_never_merged() -> None:
    gm, bridge = _aten_graph(lambda x: torch.rand_like(x) - torch.rand_like(x), torch.randn(8))
    conv = fx_to_terms(gm, bridge)
    draws = [t for t in conv.graph.terms() if t.attr("nonce") is not None]
    assert len(draws) == 2
    compiled = compile_strict(lambda x: torch.rand_like(x) - torch.rand_like(x))
    with no_fallback():
        out = compiled(torch.randn(64))
    assert out.shape == (64,)
    assert (out != 0).any(), "two independent random draws were merged into one"


def test_mutating_op_is_unsupported_and_falls_back() -> None:
    def f(x):
        x.add_(1)
        return (x * 2,)  # a tuple, like AOTAutograd's graphs

    gm = make_fx(f)(torch.randn(3))
    assert any(n.target is torch.ops.aten.add_.Tensor for n in gm.graph.nodes)
    with pytest.raises(Unsupported, match="mutating"):
        fx_to_terms(gm, Bridge())

    x = torch.randn(3)
    with pytest.warns(RewritecWarning, match="falls back to eager"):
        fn = compile_fx(gm, [x], Options.make(), kind="forward")
    assert report.RECORDS[-1].status == "fallback"
    assert "mutating" in report.RECORDS[-1].reason
    got, want = x.clone(), x.clone()
    (out,) = fn([got])
    torch.testing.assert_close(out, f(want)[0])
    torch.testing.assert_close(got, want)  # the mutation still happened

    with pytest.raises(CompileError, match="mutating"):
        compile_fx(gm, [x], Options.make(strict=True), kind="forward")


# --------------------------------------------------------------------------- report, per-op ATen
def test_unknown_ops_run_through_aten_and_are_reported() -> None:
    def fn(x):
        values, indices = torch.sort(torch.cumsum(x, dim=1) * 0.5, dim=-1, descending=True)
        return values, indices

    def make():
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(3)).requires_grad_(True)
        return [x], [x]

    check_function(fn, make)  # strict: the graphs compiled, outputs and grads equal eager
    records = report.RECORDS
    assert {r.kind for r in records} >= {"forward", "backward"}
    fw = [r for r in records if r.kind == "forward"]
    ops = set().union(*(r.fallback_ops for r in fw))
    assert any("cumsum" in op for op in ops), ops
    assert any("sort" in op for op in ops), ops
    for r in records:
        j = json.loads(json.dumps(r.to_json()))
        assert isinstance(j["fallback_ops"], dict) and isinstance(j["rules_fired"], dict)
        assert isinstance(j["kernels"], list)
        assert all(isinstance(v, int) and v > 0 for v in j["fallback_ops"].values())


# --------------------------------------------------------------------------- whole-graph fallback
def _fail_graphs(monkeypatch, kind: str) -> None:
    """Make compiling every graph of `kind` fail inside rewritec."""
    real = compiler._compile
    sig = inspect.signature(real)

    def failing(*args, **kwargs):
        name = sig.bind(*args, **kwargs).arguments["name"]
        if name.endswith(kind):
            raise RuntimeError(f"injected failure in {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(compiler, "_compile", failing)


@pytest.mark.parametrize("kind", ["forward", "backward"])
def test_failed_graph_falls_back_with_warning(monkeypatch, kind: str) -> None:
    _fail_graphs(monkeypatch, kind)
    model = MLP()
    eager = copy.deepcopy(model)
    compiled = rewritec.compile(model)
    x = torch.randn(5, 16)
    xc, xe = x.clone().requires_grad_(True), x.clone().requires_grad_(True)

    def run():
        out = compiled(xc)
        out.sum().backward()  # a backward graph is compiled on first use
        return out

    expected = rf"falls back to eager.*injected failure in g\d+_{kind}"
    with pytest.warns(RewritecWarning, match=expected):
        out_c = run()
    out_e = eager(xe)
    out_e.sum().backward()
    t = tol(torch.float32)
    torch.testing.assert_close(out_c, out_e, **t)
    torch.testing.assert_close(xc.grad, xe.grad, **t)
    for (n, pc), (_, pe) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, **t, msg=n)
    failed = [r for r in report.RECORDS if r.status == "fallback"]
    assert failed and all(r.kind == kind for r in failed)
    assert all("injected failure" in r.reason for r in failed)
    assert "fallback" in report.summary_table(report.RECORDS)


STRICT_WAYS = ["rewritec.compile(strict=True)", "torch.compile(options={'strict': True})",
               "REWRITEC_STRICT=1"]


@pytest.mark.parametrize("way", STRICT_WAYS)
def test_strict_mode_raises_instead_of_falling_back(monkeypatch, way: str) -> None:
    _fail_graphs(monkeypatch, "forward")

    def fn(x):
        return torch.sin(x) + 1

    if way == STRICT_WAYS[0]:
        compiled = rewritec.compile(fn, strict=True)
    elif way == STRICT_WAYS[1]:
        compiled = torch.compile(fn, backend="rewritec", options={"strict": True})
    else:
        monkeypatch.setenv("REWRITEC_STRICT", "1")
        compiled = rewritec.compile(fn)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, requires_grad=True))
    errors = [e for e in _chain(info.value) if isinstance(e, CompileError)]
    assert errors, f"no CompileError in {[type(e).__name__ for e in _chain(info.value)]}"
    assert "injected failure" in str(errors[0])


def test_strict_mode_raises_for_a_failed_backward_graph(monkeypatch) -> None:
    _fail_graphs(monkeypatch, "backward")
    compiled = rewritec.compile(lambda x: torch.sin(x) * 2, strict=True)
    out = compiled(torch.randn(4, requires_grad=True))  # the forward graph is fine
    with pytest.raises(Exception) as info:
        out.sum().backward()
    assert any(isinstance(e, CompileError) for e in _chain(info.value))


def test_constant_tensor_in_graph_compiles() -> None:
    def fn(x):
        return x * torch.tensor([1.0, -2.0, 3.0])

    def make():
        x = torch.randn(4, 3, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
        return [x], [x]

    check_function(fn, make)


# --------------------------------------------------------------------------- options
def test_unknown_options_are_rejected() -> None:
    with pytest.raises(RewritecError, match="no_such_option"):
        rewritec.compile(MLP(), no_such_option=1)  # at compile time, before any call
    with pytest.raises(RewritecError, match="target"):
        rewritec.compile(MLP(), target="gpu")
    with pytest.raises(RewritecError, match="bogus"):
        Options.make({"bogus": True})
    compiled = torch.compile(MLP(), backend="rewritec", options={"bogus": True})
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 16))
    errors = [e for e in _chain(info.value) if isinstance(e, RewritecError)]
    assert errors and "bogus" in str(errors[0])


@pytest.mark.parametrize("options, error", [
    ({"strict": "no"}, "strict must be True or False, not 'no'"),
    ({"fast_math": 1}, "fast_math must be True or False"),
    ({"debug": "lots"}, "debug must be an int 0-3, not 'lots'"),
    ({"debug": 7}, "debug must be an int 0-3"),
    ({"device": "gpu"}, "device must be one of"),
    ({"compile_budget": "soon"}, "compile_budget must be a number"),
    ({"stict": True}, "'stict' (did you mean 'strict'?)"),
    ({"disable": ["mul-on"]}, "disable names no rule: 'mul-on' (did you mean 'mul-one'?)"),
    ({"disable": ["no-such-rule"]}, "disable names no rule: 'no-such-rule'"),
])
def test_option_values_are_checked(options: dict, error: str) -> None:
    """A wrong value is an error when the options are given, never read as something
    else (strict="no" as on) or left to make the graph fall back (debug="lots")."""
    with pytest.raises(RewritecError) as info:
        rewritec.compile(MLP(), **options)
    assert error in str(info.value)
    compiled = torch.compile(MLP(), backend="rewritec", options=options)
    with pytest.raises(Exception) as info:  # noqa: PT011 - Dynamo wraps ours
        compiled(torch.randn(2, 16))
    errors = [e for e in _chain(info.value) if isinstance(e, RewritecError)]
    assert errors and error in str(errors[0]), info.value


def test_good_option_values_pass() -> None:
    opts = Options.make(disable="mul-one", out_dir=Path("out"), compile_budget=3)
    assert opts.disable == ("mul-one",) and opts.out_dir == "out"
    rewritec.compile(MLP(), disable=["mul-one"], debug=0, strict=False)


def test_rewrite_false_only_captures_and_runs_aten() -> None:
    check_module(MLP(), [torch.randn(5, 16)], lambda m: rewritec.compile(
        m, strict=True, rewrite=False), steps=1)
    assert report.RECORDS
    for r in report.RECORDS:
        assert r.status == "compiled"
        assert not r.rules_fired
        assert r.nodes_out == r.nodes_in > 0
        assert sum(r.fallback_ops.values()) > 0  # everything ran as ATen calls


def test_out_dir_receives_captured_final_and_wrapper(tmp_path: Path) -> None:
    compiled = rewritec.compile(lambda x: F.gelu(x) * 2 + 1, strict=True, out_dir=str(tmp_path))
    x = torch.randn(3, 4, requires_grad=True)
    with no_fallback(("forward", "backward")):
        out = compiled(x)
        out.sum().backward()
    torch.testing.assert_close(out, F.gelu(x) * 2 + 1)
    for r in report.RECORDS:
        # details: what report.html is rebuilt from (`rewritec report DIR`)
        assert set(r.files) == {"captured", "final", "wrapper", "details"}, r.files
        for key, path in r.files.items():
            p = Path(path)
            assert p.is_file() and p.parent == tmp_path, path
            assert p.read_text().strip(), f"{key} file is empty"
        ast.parse(Path(r.files["wrapper"]).read_text())  # valid python
        assert "aten" in Path(r.files["captured"]).read_text()


def test_export_and_compile_matches_eager() -> None:
    """The compiled exported program equals eager, and exporting prints no FutureWarning:
    `rewritec compile`'s output is read by people, and torch 2.13's warning about its
    own LeafSpecs is noise to them (frontend/export.py filters it)."""
    import warnings

    from rewritec.frontend.export import export_and_compile

    model = MLP().eval()
    x = torch.randn(6, 16)
    with no_fallback(("export",)), torch.no_grad():
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            compiled = export_and_compile(model, (x,), Options.make(strict=True))
        torch.testing.assert_close(compiled(x), model(x), **tol(torch.float32))
        y = torch.randn(6, 16)  # other values, same shape
        torch.testing.assert_close(compiled(y), model(y), **tol(torch.float32))


def test_decomposition_table_is_export_default_without_implicit_ops() -> None:
    """frontend/decompositions.py builds core ATen's table without export's
    CompositeImplicitAutograd entries (those decompose while tracing anyway):
    every other entry, and the same function for each, must be there."""
    from rewritec.frontend.decompositions import _core_aten
    from torch._decomp import core_aten_decompositions

    ours, export = _core_aten(), dict(core_aten_decompositions())
    assert not [op for op in ours if op not in export]
    explicit = [op for op in export if not torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd")]
    assert [op for op in explicit if op not in ours] == []
    assert all(ours[op] is export[op] for op in ours)


NO_INDUCTOR_SCRIPT = """
import sys, torch, rewritec
w = torch.randn(8, 8, requires_grad=True)
train = rewritec.compile(lambda x: (torch.tanh(x @ w) * 2).sum(), strict=True)
train(torch.randn(4, 8)).backward()
with torch.no_grad():
    out = rewritec.compile(lambda x: torch.sin(x) + 1, strict=True)(torch.randn(16))
torch.testing.assert_close(out.shape, torch.Size([16]))
assert w.grad is not None
print("INDUCTOR", sorted(m for m in sys.modules if m.startswith("torch._inductor.")
                         and m.split(".")[2] in ("debug", "ir", "scheduler", "graph")))
"""


def test_compiling_does_not_import_inductor(tmp_path: Path) -> None:
    """Forward, backward and inference graphs go through AOTAutograd without torch's
    backend helper, which imports torch._inductor.debug (and Inductor's IR and
    scheduler with it) for its logging: 0.05 s of every cold compile."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, REWRITEC_CACHE_DIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", NO_INDUCTOR_SCRIPT], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("INDUCTOR")[-1].strip() == "[]", proc.stdout


@pytest.mark.parametrize("rows,reads", [(32, 4096), (1000, 64)])
def test_embedding_backward_stays_atens_sorted_op(rows: int, reads: int) -> None:
    """embedding's backward is kept whole (not an accumulating index_put) and its
    gradient matches eager's, duplicates and padding_idx included."""
    from rewritec.frontend.decompositions import decomposition_table

    assert torch.ops.aten.embedding_dense_backward.default not in decomposition_table()
    for padding_idx in (None, 0):
        emb = torch.nn.Embedding(rows, 16, padding_idx=padding_idx)
        idx = torch.randint(rows, (4, reads))
        compiled = rewritec.compile(lambda i, emb=emb: (emb(i) * 2.0).tanh().sum(), strict=True)
        compiled(idx).backward()
        got = emb.weight.grad.clone()
        emb.weight.grad = None
        (emb(idx) * 2.0).tanh().sum().backward()
        # sums of up to 512 terms near 1000: ATen and the kernels round in another order
        torch.testing.assert_close(got, emb.weight.grad, rtol=1e-4, atol=2e-3)


def _tensors_in_closures(fn, depth: int = 0) -> list[torch.Tensor]:
    """Tensors a function's closure holds, directly or in a list, tuple or closure."""
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # not yet bound
            continue
        values = value if isinstance(value, list | tuple) else [value]
        found += [v for v in values if isinstance(v, torch.Tensor)]
        if depth < 2 and inspect.isfunction(value):
            found += _tensors_in_closures(value, depth + 1)
    return found


def test_the_compilers_torch_keeps_hold_no_tensor_of_the_first_call(monkeypatch) -> None:
    """AOTAutograd keeps the compilers it was given for as long as the compiled
    function lives (torch 2.11 did, through its backward's closures): whatever they
    close over must not be the first call's tensors (a GPT-2 training step kept the
    first step's 393 MB of logits, the loss graph's example input, on an H200)."""
    from rewritec.frontend import backend

    kept = []
    real = backend._aot

    def capturing(gm, example_inputs, compilers):
        kept.append(compilers)
        return real(gm, example_inputs, compilers)

    monkeypatch.setattr(backend, "_aot", capturing)
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(16, 96), torch.nn.Linear(16, 96)
    ref.load_state_dict(model.state_dict())

    def loss_of(m, x, t):
        logits = m(x) * 1.5
        torch._dynamo.graph_break()
        return F.cross_entropy(logits.float(), t)

    compiled = torch.compile(loss_of, backend="rewritec")
    for _ in range(2):
        x, t = torch.randn(32, 16), torch.randint(96, (32,))
        got, want = compiled(model, x, t), loss_of(ref, x, t)
        got.backward()
        want.backward()
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(model.weight.grad, ref.weight.grad)
    assert len(kept) == 2  # the model's graph and the loss's
    for compilers in kept:
        for name, fn in compilers.items():
            if callable(fn):
                assert not _tensors_in_closures(fn), name


def test_a_frozen_graph_keeps_no_input_of_its_first_call() -> None:
    """An inference graph with parameters folded in (aten/fold.py: FrozenGuard)
    compiles its unfrozen version, should a parameter change, for the call that
    needs it: it keeps no input of the first call (the activations a graph after a
    graph break takes), and the unfrozen version still equals eager."""
    import gc
    import weakref

    from rewritec.aten.fold import FrozenGuard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU()).eval()
    compiled = torch.compile(model, backend="rewritec", options={"freeze": True})
    x = torch.randn(8, 16)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        guards = [g for g in gc.get_objects() if not isinstance(g, weakref.ProxyTypes)
                  and isinstance(g, FrozenGuard)]
        assert guards
        for g in guards:
            assert not _tensors_in_closures(g.make_slow)
        model[0].weight.data.mul_(2.0)  # the folded weight changes: the unfrozen path
        y = torch.randn(8, 16)
        torch.testing.assert_close(compiled(y), model(y))
