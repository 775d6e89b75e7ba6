"""The graph cache (runtime/graph_cache.py): a graph compiled once is loaded, not
compiled, when TorchDynamo hands it over again; loaded graphs give eager's results,
replay folds on the loading model's own weights, and follow parameter updates;
graphs that AOTAutograd does not pass through unchanged are never stored."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from rewritec import report
from rewritec.runtime import graph_cache
from rewritec.options import Options

TARGETS = ["openmp", "triton"]
# Triton kernels run on the GPU where there is one, else in Triton's interpreter.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("REWRITEC_GRAPH_CACHE", "1")


def _compile_twice(fn, inputs, **options):  # type: ignore[no-untyped-def]
    """Compile `fn` in two fresh TorchDynamo caches; return both results."""
    outs = []
    for _ in range(2):
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="rewritec", options={"strict": True, **options})
        outs.append(compiled(*inputs))
    return outs


def _entries() -> list[Path]:
    return sorted((Path(os.environ["REWRITEC_CACHE_DIR"]) / "graphs").glob("*.pkl"))


def _norm_chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(torch.sin(x) * 2 + 1, (x.shape[-1],), w)


def _softmax_gelu(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.softmax(torch.nn.functional.gelu(x + b), dim=-1)


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("fn", [_norm_chain, _softmax_gelu])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_second_compile_is_loaded_and_matches_eager(fn, dtype, target, aot_calls) -> None:
    device = TRITON_DEVICE if target == "triton" else "cpu"
    x = torch.randn(6, 40, dtype=dtype, device=device)
    w = torch.randn(40, dtype=dtype, device=device)
    with torch.no_grad():
        first, second = _compile_twice(fn, (x, w), target=target)
        expected = fn(x, w)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert len(aot_calls) == 1, "the second compile went through AOTAutograd"
    cold, warm = report.RECORDS
    assert (cold.cached, warm.cached) == (False, True)
    assert warm.rules_fired == cold.rules_fired and warm.kernels == cold.kernels
    assert warm.kernels, "nothing was fused: the test would not load a kernel"
    assert warm.coverage() == cold.coverage() and cold.coverage().in_kernels > 0


@pytest.mark.parametrize("bias", [False, True])
def test_a_half_precision_product_with_its_epilogue_is_loaded(bias, aot_calls) -> None:
    """fuse-matmul's kernel (Triton only): its spec once kept the product's term,
    example tensors included, so no graph with a fused matmul was ever stored."""
    a = torch.randn(64, 96, dtype=torch.half, device=TRITON_DEVICE)
    b = torch.randn(96, 48, dtype=torch.half, device=TRITON_DEVICE)
    c = torch.randn(48, dtype=torch.half, device=TRITON_DEVICE)

    def fn(a, b, c):  # type: ignore[no-untyped-def]
        return torch.nn.functional.gelu((torch.addmm(c, a, b) if bias else a @ b) + 1)

    with torch.no_grad():
        first, second = _compile_twice(fn, (a, b, c), target="triton")
        expected = fn(a, b, c)
    torch.testing.assert_close(first, expected, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(second, expected, rtol=2e-2, atol=2e-2)
    assert len(aot_calls) == 1, "the second compile went through AOTAutograd"
    cold, warm = report.RECORDS
    assert (cold.cached, warm.cached) == (False, True)
    assert any(k["template"] == "triton/matmul" for k in cold.kernels)
    assert warm.kernels == cold.kernels


@pytest.mark.parametrize("fn", [_norm_chain, _softmax_gelu])
def test_a_graph_whose_first_launches_were_predicted_is_loaded(fn, aot_calls, monkeypatch
                                                               ) -> None:
    """On a GPU the compile workers are sent each kernel's first launch, predicted by
    running the launchers on meta tensors before the graph is stored
    (runtime/ahead.py): the launch geometries that leaves on the kernels' specs once
    made every such graph unloadable (torch.Size is no graph-cache value)."""
    from rewritec.runtime import ahead
    from rewritec.runtime.triton_direct import DirectKernel

    predicted: list[Any] = []
    monkeypatch.setattr(ahead, "running", lambda: True)
    monkeypatch.setattr(ahead, "submit_graph", lambda graph, launchers: predicted.extend(
        ahead.predict(graph, launchers, lambda v: isinstance(v, DirectKernel))) or 0)
    x = torch.randn(6, 40, device=TRITON_DEVICE)
    w = torch.randn(40, device=TRITON_DEVICE)
    with torch.no_grad():
        first, second = _compile_twice(fn, (x, w), target="triton")
        expected = fn(x, w)
    assert predicted, "no first launch was predicted"
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert len(aot_calls) == 1, "the second compile went through AOTAutograd"


@pytest.mark.parametrize("layout", [(6, 40), (40, 6)])
def test_other_strides_are_another_entry(layout, aot_calls) -> None:
    w = torch.randn(40)
    base = torch.randn(*layout)
    x = base if layout == (6, 40) else base.t()  # same shape, transposed strides
    with torch.no_grad():
        _compile_twice(_norm_chain, (torch.randn(6, 40), w))
        torch._dynamo.reset()
        out = torch.compile(_norm_chain, backend="rewritec", options={"strict": True})(x, w)
        torch.testing.assert_close(out, _norm_chain(x, w))
    assert len(aot_calls) == (1 if layout == (6, 40) else 2)


def _conv_bn(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()).eval()
    with torch.no_grad():
        m[1].running_mean.uniform_(-1, 1)
        m[1].running_var.uniform_(0.5, 2.0)
    return m


@pytest.mark.parametrize("conv_layout", ["keep", "channels_last"])
def test_folds_replay_on_the_loading_models_weights(conv_layout, aot_calls) -> None:
    """Two models of one structure, other weights: the second loads the first's
    entry, and its folded convolution must use its own weights."""
    x = torch.randn(2, 3, 9, 7)
    a, b = _conv_bn(0), _conv_bn(1)
    with torch.no_grad():
        out_a = torch.compile(a, backend="rewritec",
                              options={"strict": True, "conv_layout": conv_layout,
                                       "freeze": True})(x)
        torch._dynamo.reset()
        out_b = torch.compile(b, backend="rewritec",
                              options={"strict": True, "conv_layout": conv_layout,
                                       "freeze": True})(x)
        torch.testing.assert_close(out_a, a(x))
        torch.testing.assert_close(out_b, b(x))
    assert len(aot_calls) == 1
    assert report.RECORDS[-1].cached
    assert any("affine-fold" in r for r in report.RECORDS[-1].rules_fired)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_loaded_graph_replays_as_a_cuda_graph(aot_calls) -> None:
    x = torch.randn(64, 256, device="cuda")
    w = torch.randn(256, device="cuda")
    with torch.no_grad():
        _compile_twice(_norm_chain, (x, w), cudagraphs="on")
        torch._dynamo.reset()
        compiled = torch.compile(_norm_chain, backend="rewritec",
                                 options={"strict": True, "cudagraphs": "on"})
        for _ in range(3):  # recorded at the second call, replayed from then on
            x = torch.randn(64, 256, device="cuda")
            torch.testing.assert_close(compiled(x, w), _norm_chain(x, w))
    assert len(aot_calls) == 1
    assert "recorded" in report.RECORDS[-1].cudagraphs


def test_loaded_graph_follows_an_in_place_update(aot_calls) -> None:
    x = torch.randn(2, 3, 9, 7)
    m = _conv_bn(0)
    with torch.no_grad():
        _compile_twice(m, (x,), freeze=True)
        torch._dynamo.reset()
        compiled = torch.compile(m, backend="rewritec", options={"strict": True, "freeze": True})
        torch.testing.assert_close(compiled(x), m(x))
        m[0].weight.mul_(2.0)
        m[1].running_var.add_(1.0)
        torch.testing.assert_close(compiled(x), m(x))
    assert len(aot_calls) == 2  # the first compile, then the unfrozen one after the update


def _mutates(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x * 2


def _returns_view(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return x.view(-1), torch.cos(x)


def _view_of_output(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.sin(x)
    return y, y.view(-1)


@pytest.mark.parametrize("fn", [_mutates, _returns_view])
def test_graphs_aot_changes_are_not_stored(fn, aot_calls) -> None:
    """Input mutations and aliased outputs need AOTAutograd's runtime wrapper."""
    for _ in range(2):
        x = torch.randn(5, 7)
        x_eager = x.clone()
        with torch.no_grad():
            torch._dynamo.reset()
            out = torch.compile(fn, backend="rewritec")(x)
            expected = fn(x_eager)
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(x, x_eager)
        if fn is _returns_view:
            assert out[0].data_ptr() == x.data_ptr(), "the view no longer aliases its input"
    assert len(aot_calls) == 2 and not _entries()


def test_a_loaded_graph_keeps_views_among_its_outputs(aot_calls) -> None:
    """An output that views another is the compiled graph's own doing (AOTAutograd
    marks both fresh under no_grad), so the graph is stored, and loads with it."""
    x = torch.randn(5, 7)
    with torch.no_grad():
        outs = _compile_twice(_view_of_output, (x,))
    for y, flat in outs:
        torch.testing.assert_close(y, torch.sin(x))
        assert flat.shape == (35,) and flat.data_ptr() == y.data_ptr()
    assert len(aot_calls) == 1


def test_training_and_dynamic_graphs_are_not_stored(aot_calls) -> None:
    m = nn.Sequential(nn.Linear(6, 5), nn.Tanh())
    x = torch.randn(4, 6)
    for _ in range(2):
        torch._dynamo.reset()
        torch.compile(m, backend="rewritec")(x).sum().backward()
    with torch.no_grad():
        for _ in range(2):
            torch._dynamo.reset()
            out = torch.compile(_norm_chain, backend="rewritec", dynamic=True)(
                torch.randn(3, 8), torch.randn(8))
            assert out.shape == (3, 8)
    assert not _entries()


def test_debug_and_option_off_do_not_use_the_cache(aot_calls, monkeypatch) -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    with torch.no_grad():
        _compile_twice(_norm_chain, (x, w), graph_cache=False)
        assert len(aot_calls) == 2 and not _entries()
        monkeypatch.setenv("REWRITEC_GRAPH_CACHE", "0")
        _compile_twice(_norm_chain, (x, w))
        assert len(aot_calls) == 4 and not _entries()


def test_a_damaged_entry_is_a_miss(aot_calls) -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    with torch.no_grad():
        _compile_twice(_norm_chain, (x, w))
        (entry,) = _entries()
        entry.write_bytes(entry.read_bytes()[:-7])  # no longer matches its .sha256
        torch._dynamo.reset()
        out = torch.compile(_norm_chain, backend="rewritec", options={"strict": True})(x, w)
    torch.testing.assert_close(out, _norm_chain(x, w))
    assert len(aot_calls) == 2


def test_an_entry_naming_a_foreign_class_is_refused(aot_calls) -> None:
    """Entries hold plain data, torch ops by name and rewritec's own classes; an
    entry whose hash matches but which names anything else is a miss, not a load."""
    import hashlib
    import pickle

    x, w = torch.randn(4, 8), torch.randn(8)
    with torch.no_grad():
        _compile_twice(_norm_chain, (x, w))
        (entry,) = _entries()
        entry.write_bytes(pickle.dumps({"source": os.system}))
        entry.with_name(entry.name + ".sha256").write_text(
            hashlib.sha256(entry.read_bytes()).hexdigest())
        torch._dynamo.reset()
        out = torch.compile(_norm_chain, backend="rewritec", options={"strict": True})(x, w)
    torch.testing.assert_close(out, _norm_chain(x, w))
    assert len(aot_calls) == 2


def test_a_kernel_failing_in_a_loaded_graph_recompiles(aot_calls, monkeypatch) -> None:
    from rewritec.runtime import launch

    x, w = torch.randn(4, 8), torch.randn(8)
    options = {"target": "openmp"}  # not strict: a failed launch falls back to ATen
    with torch.no_grad():
        _compile_twice(_norm_chain, (x, w), strict=False, **options)
        torch._dynamo.reset()
        compiled = torch.compile(_norm_chain, backend="rewritec", options=options)

        def broken(self, *inputs):  # type: ignore[no-untyped-def]
            raise RuntimeError("launch failed")

        monkeypatch.setattr(launch.CppLauncher, "launch", broken)
        with pytest.warns(launch.KernelFallback):
            out = compiled(x, w)
            again = compiled(x, w)
    torch.testing.assert_close(out, _norm_chain(x, w))
    torch.testing.assert_close(again, _norm_chain(x, w))
    assert len(aot_calls) == 2


def test_the_key_covers_the_bytes_of_given_rule_files(tmp_path: Path) -> None:
    rules = tmp_path / "mine.yaml"
    rules.write_text("rules: []\n")
    before = graph_cache._options_text(Options.make(rules=[str(rules)]))
    rules.write_text("rules: []\n# edited\n")
    assert graph_cache._options_text(Options.make(rules=[str(rules)])) != before


NEW_PROCESS_GRAPHS = {
    # a row kernel, OpenMP on the CPU
    "layer_norm": """
        x, w = torch.linspace(-2, 2, 96).reshape(4, 24), torch.linspace(0, 1, 24)
        f = lambda x, w: torch.nn.functional.layer_norm(torch.exp(x) - 1, (24,), w)
        args, options, tol = (x, w), {"strict": True}, {}
    """,
    # a looped row kernel (Triton; its interpreter on a CPU): rows wider than 2K
    "row_looped": """
        d = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator().manual_seed(0)
        x, w = torch.randn(2, 4096, generator=g).to(d), torch.ones(4096).to(d)
        f = lambda x, w: torch.nn.functional.layer_norm(x * 2, (4096,), w)
        args, options = (x, w), {"strict": True, "target": "triton"}
        tol = {"rtol": 1e-4, "atol": 1e-4}
    """,
    # a cross entropy: its row kernel computes rewritec::iota (aten/iota.py), which
    # the loading process must define before it reads the graph
    "cross_entropy": """
        d = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator().manual_seed(0)
        x, t = torch.randn(6, 50, generator=g).to(d), torch.randint(0, 50, (6,), generator=g).to(d)
        f = lambda x, t: torch.nn.functional.cross_entropy(x, t, ignore_index=-100)
        args, options = (x, t), {"strict": True, "target": "triton" if d == "cuda" else "openmp"}
        tol = {"rtol": 1e-4, "atol": 1e-4}
    """,
    # embedding lookups in a kernel: rewritec::take (aten/take.py), a loaded kernel
    # that checks its ids (IndexError out of range)
    "embedding": """
        d = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator().manual_seed(0)
        w, p = torch.randn(40, 8, generator=g).to(d), torch.randn(6, 8, generator=g).to(d)
        ids = torch.randint(0, 40, (3, 6), generator=g).to(d)
        pos = torch.arange(6).to(d)
        emb = torch.nn.functional.embedding
        f = lambda ids, w, p: torch.relu(emb(ids, w) + emb(pos, p))
        target = "triton" if d == "cuda" else "openmp"
        args, options, tol = (ids, w, p), {"strict": True, "target": target}, {}
        if d == "cpu":
            bad = ids.clone()
            bad[0, 0] = 40
            try:
                torch.compile(f, backend="rewritec", options=options)(bad, w, p)
                raise AssertionError("an id outside the table ran")
            except IndexError:
                pass
    """,
    # fuse-matmul's kernel (Triton; its interpreter on a CPU)
    "matmul": """
        d = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(s, generator=g).half().to(d) for s in ((32, 48), (48, 16)))
        f = lambda a, b: torch.nn.functional.gelu(a @ b + 1)
        args, options = (a, b), {"strict": True, "target": "triton"}
        tol = {"rtol": 2e-2, "atol": 2e-2}
    """,
}


@pytest.mark.parametrize("graph", sorted(NEW_PROCESS_GRAPHS))
def test_a_new_process_loads_the_entry(graph: str, tmp_path: Path) -> None:
    """The second process loads the graph without importing the compile side: the
    rule engine, the renderers, lark, jinja2 (runtime/launch.py, kinds/spec.py and
    the *_launch.py modules are what a load needs; a warm compile's first call pays
    every import)."""
    script = textwrap.dedent("""
        import sys
        import torch
        from rewritec import report
    """) + textwrap.dedent(NEW_PROCESS_GRAPHS[graph]) + textwrap.dedent("""
        with torch.no_grad():
            out = torch.compile(f, backend="rewritec", options=options)(*args)
        torch.testing.assert_close(out, f(*args), **tol)
        heavy = ("rewritec.compiler", "rewritec.engine.rules", "rewritec.engine.pipeline",
                 "rewritec.engine.fuse", "rewritec.kinds.kernels", "rewritec.runtime.prepare",
                 "rewritec.kinds.row_looped", "rewritec.kinds.templates", "lark", "jinja2")
        print("cached", report.RECORDS[-1].cached, len(report.RECORDS[-1].kernels),
              ",".join(m for m in heavy if m in sys.modules) or "-")
    """)
    env = dict(os.environ, REWRITEC_GRAPH_CACHE="1", REWRITEC_CACHE_DIR=str(tmp_path))
    if graph not in ("layer_norm", "embedding") and not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    seen = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(proc.stdout.split()[-3:])
    kernels = seen[0][1]
    assert seen[0][0] == "False" and kernels != "0" and "rewritec.compiler" in seen[0][2]
    assert seen[1] == ["True", kernels, "-"]


def test_a_cache_that_cannot_be_written_does_not_fail_the_compile(aot_calls, monkeypatch
                                                                   ) -> None:
    def full(*args, **kw):  # type: ignore[no-untyped-def]
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(graph_cache, "_dir", full)
    x, w = torch.randn(4, 8), torch.randn(8)
    with torch.no_grad():
        first, second = _compile_twice(_norm_chain, (x, w))
    torch.testing.assert_close(first, _norm_chain(x, w))
    torch.testing.assert_close(second, _norm_chain(x, w))
    assert len(aot_calls) == 2 and not _entries()
    assert all(r.status == "compiled" for r in report.RECORDS)



def _run_twice(argv: list[str], tmp_path: Path, **env_extra: str) -> list[str]:
    """Run python ARGV twice in new processes sharing one graph cache; the outputs."""
    env = dict(os.environ, REWRITEC_GRAPH_CACHE="1", REWRITEC_CACHE_DIR=str(tmp_path / "c"),
               **env_extra)
    outs = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        outs.append(proc.stdout)
    return outs


_DIAG_SCRIPT = textwrap.dedent("""
    import torch
    with torch.no_grad():
        y = torch.compile(lambda x: (x + 0.0).sin() + x, backend="rewritec")(torch.randn(8))
""")


def test_explain_on_a_repeat_run_compiles_again(tmp_path: Path) -> None:
    """`rewritec explain` watches the rewriter, so a graph loaded from the cache
    would answer `tried on 0 term(s)`: explaining never uses the cache."""
    (tmp_path / "t.py").write_text(_DIAG_SCRIPT)
    argv = ["-m", "rewritec.cli", "explain", "t.py", "--rule", "add-zero-float"]
    first, second = _run_twice(argv, tmp_path)
    assert "tried on 0" not in first, first
    assert second == first


def test_rule_statistics_on_a_repeat_run_are_the_same(tmp_path: Path) -> None:
    """REWRITEC_STATS counts the rewriter's work, which a cache hit skips."""
    (tmp_path / "t.py").write_text(_DIAG_SCRIPT)
    first, second = _run_twice(["t.py"], tmp_path, REWRITEC_STATS="1")

    def counts(out: str) -> list[list[str]]:  # the table less its time column
        return [line.split()[:-1] for line in out.splitlines() if line.startswith("add-zero")]

    assert counts(first), first
    assert counts(second) == counts(first), second
