"""runtime/autotune.py (mode max-autotune): every candidate configuration equals
eager, the fastest measured wins, the winner is stored signed and read back
without timing, a tampered one is ignored, and mode default times nothing.

On a GPU the kernels run on CUDA, every candidate timed with CUDA events;
without one, through Triton's interpreter on the CPU (conftest sets
TRITON_INTERPRET=1), where a candidate is timed by perf_counter and at most
CANDIDATE_LIMIT are tried.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import rewritec
from rewritec.runtime import autotune, recipe
from rewritec.runtime.graph_cache import _options_text
from rewritec.options import Options

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRETED else "cuda"
pytestmark = pytest.mark.skipif(not INTERPRETED and not torch.cuda.is_available(),
                                reason="no Triton device (CPU tensors need TRITON_INTERPRET=1)")


def _rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=DEVICE)


def pointwise(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.relu(x * y + 1.0) - torch.sigmoid(x) * 0.5


def tiled(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(a * 2.0 + b).contiguous()  # NHWC in, NCHW out: 2-d tiles


def softmax(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.softmax(x, dim=-1) * y


def layer_norm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], y, y)


def col_sum(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (torch.tanh(x) * y).sum(0, keepdim=True)


def linear_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(F.linear(x, w, b))


# Kernels with a side output (engine/fuse.py): the grid comes after every output
def pointwise_two(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.exp(x) * y
    return a, torch.tanh(a) + 1.0


def tiled_two(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.relu(a * 2.0 + b).contiguous()
    return z, torch.sigmoid(z) * 3.0


def residual_layer_norm(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = x + y
    return r, F.layer_norm(r, r.shape[-1:], y[0], y[1])


CASES: dict[str, tuple[Callable[..., torch.Tensor], Callable[[], tuple[torch.Tensor, ...]],
                       str, float]] = {
    "pointwise": (pointwise, lambda: (_rand(8, 33), _rand(33, seed=1)), "pointwise", 1e-5),
    "tiled": (tiled, lambda: (_rand(2, 16, 12, 12).contiguous(memory_format=torch.channels_last),
                              _rand(2, 16, 12, 12, seed=1)), "pointwise_tiled", 1e-5),
    "softmax": (softmax, lambda: (_rand(6, 40), _rand(6, 40, seed=1)), "row", 1e-5),
    "layer_norm": (layer_norm, lambda: (_rand(6, 40), _rand(40, seed=1)), "row", 1e-5),
    "col_sum": (col_sum, lambda: (_rand(37, 9), _rand(37, 9, seed=1)), "reduction", 1e-5),
    "matmul": (linear_relu, lambda: (_rand(20, 32, dtype=torch.float16),
                                     _rand(24, 32, dtype=torch.float16, seed=1),
                                     _rand(24, dtype=torch.float16, seed=2)), "matmul", 1e-2),
    "pointwise_two": (pointwise_two, lambda: (_rand(8, 33), _rand(33, seed=1)), "pointwise",
                      1e-5),
    "tiled_two": (tiled_two, lambda: (
        _rand(2, 16, 12, 12).contiguous(memory_format=torch.channels_last),
        _rand(2, 16, 12, 12, seed=1)), "pointwise_tiled", 1e-5),
    "row_two": (residual_layer_norm, lambda: (_rand(6, 40), _rand(6, 40, seed=1)), "row", 1e-5),
}


@pytest.fixture
def tuned(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[Any]:
    """The TunedKernels built from now on, winners stored in a fresh cache folder."""
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path))
    for k in autotune.STATS:
        monkeypatch.setitem(autotune.STATS, k, 0)
    kernels: list[Any] = []

    def record(kernel: Any, spec: Any, source: str) -> Any:
        wrapped = autotune.tuned(kernel, spec, source)
        kernels.append(wrapped)
        return wrapped

    monkeypatch.setattr(recipe, "tuned", record)
    return kernels


def _compile(fn: Callable[..., torch.Tensor], mode: str = "max-autotune") -> Any:
    torch._dynamo.reset()
    return rewritec.compile(fn, target="triton", strict=True, mode=mode)


def _run(case: str, mode: str = "max-autotune") -> None:
    fn, make, _, tol = CASES[case]
    inputs = make()
    torch.testing.assert_close(_compile(fn, mode)(*inputs), fn(*inputs), rtol=tol, atol=tol)


def _winners(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "autotune").glob("*.json"))


@pytest.mark.parametrize("case", list(CASES))
def test_every_candidate_equals_eager(case: str, tuned: list[Any],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Each candidate of the kind's whole space, forced as the winner in turn."""
    monkeypatch.setattr(autotune, "CANDIDATE_LIMIT", 100)
    fn, make, space, tol = CASES[case]
    inputs = make()
    # no CUDA graphs: a replay would not ask the kernel for its winner again
    compiled = _compile(fn, mode="max-autotune-no-cudagraphs")
    torch.testing.assert_close(compiled(*inputs), fn(*inputs), rtol=tol, atol=tol)
    (kernel,) = tuned
    assert autotune.space_name(kernel.spec) == space
    (call,) = kernel.chosen
    configs = autotune.candidates(kernel.spec, dict(call[0]))
    assert len(configs) > 2 and configs[0] == {}
    assert len(kernel.timings[call]) == len(configs), "a candidate failed"
    for config in configs:
        kernel.chosen[call] = config
        torch.testing.assert_close(compiled(*inputs), fn(*inputs), rtol=tol, atol=tol,
                                   msg=lambda m, c=config: f"{case} {c}: {m}")


@pytest.mark.parametrize("case", ["pointwise", "softmax", "matmul"])
def test_winner_is_stored_and_read_back_without_timing(case: str, tuned: list[Any],
                                                       tmp_path: Path) -> None:
    _run(case)
    assert autotune.STATS["tuned"] == 1 and autotune.STATS["read"] == 0
    timed = autotune.STATS["timed"]
    assert autotune.STATS["timed"] > 2
    (call,) = tuned[0].chosen
    assert timed == len(autotune.candidates(tuned[0].spec, dict(call[0])))
    assert len(_winners(tmp_path)) == 1
    _run(case)  # a second compile: a fresh launcher, its winner read from disk
    assert autotune.STATS == {"tuned": 1, "timed": timed, "read": 1}
    assert len(tuned) == 2 and tuned[0].chosen == tuned[1].chosen


def test_tampered_winner_is_ignored(tuned: list[Any], tmp_path: Path) -> None:
    _run("pointwise")
    (path,) = _winners(tmp_path)
    path.write_text('{"config": {"BLOCK_SIZE": 16, "num_warps": 1}}')
    _run("pointwise")
    assert autotune.STATS["tuned"] == 2 and autotune.STATS["read"] == 0


def test_stored_winner_outside_the_candidates_is_ignored(tuned: list[Any],
                                                         tmp_path: Path) -> None:
    """Signed, but not a configuration this kernel tries (an older FORMAT's, say)."""
    from rewritec.runtime.disk_cache import store

    _run("pointwise")
    (path,) = _winners(tmp_path)
    path.unlink()
    path.with_name(path.name + ".sha256").unlink()
    store(path, b'{"config": {"BLOCK_SIZE": 16, "num_warps": 1}}')
    _run("pointwise")
    assert autotune.STATS["tuned"] == 2 and autotune.STATS["read"] == 0


def test_fastest_wins_and_ties_keep_the_heuristic(tuned: list[Any],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    times = [5.0, 1.0, 3.0, 1.0] + [9.0] * 100  # one per candidate, in order

    def fake(run: Callable[[], None], device: torch.device) -> float:
        run()
        return times.pop(0)

    monkeypatch.setattr(autotune, "measure", fake)
    _run("pointwise")
    (call,) = tuned[0].chosen
    configs = autotune.candidates(tuned[0].spec, dict(call[0]))
    assert tuned[0].chosen[call] == configs[1]  # the first of the fastest
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(Path(os.environ["REWRITEC_CACHE_DIR"]) / "b"))
    times[:] = [9.0] * 100
    _run("pointwise")
    assert tuned[1].chosen[call] == {}  # all equal: the heuristic


def test_failing_candidate_is_skipped(tuned: list[Any],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = autotune.measure

    def flaky(run: Callable[[], None], device: torch.device) -> float:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of resources")
        return 0.0 if len(calls) == 3 else real(run, device) + 1.0

    monkeypatch.setattr(autotune, "measure", flaky)
    _run("softmax")
    (call,) = tuned[0].chosen
    configs = autotune.candidates(tuned[0].spec, dict(call[0]))
    assert [c for _, c in tuned[0].timings[call]] == [configs[0], *configs[2:]]
    assert tuned[0].chosen[call] == configs[2]


@pytest.mark.parametrize("case", ["pointwise", "matmul"])
def test_mode_default_times_nothing(case: str, tuned: list[Any], tmp_path: Path) -> None:
    _run(case, mode="default")
    assert tuned == []  # no kernel wrapped: today's launchers as they were
    assert autotune.STATS == {"tuned": 0, "timed": 0, "read": 0}
    assert _winners(tmp_path) == []


def test_no_cudagraphs_variant_autotunes_too(tuned: list[Any]) -> None:
    _run("pointwise", mode="max-autotune-no-cudagraphs")
    assert autotune.STATS["tuned"] == 1


def test_graph_cache_key_holds_the_mode() -> None:
    assert _options_text(Options.make(mode="default")) != _options_text(
        Options.make(mode="max-autotune"))


def test_graph_cache_load_reads_the_winner(tuned: list[Any], aot_calls: list[int],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph loaded from the graph cache (runtime/graph_cache.py) rebuilds its
    launchers tuned, and they read the winner stored by the first compile."""
    monkeypatch.setenv("REWRITEC_GRAPH_CACHE", "1")
    _run("softmax")
    _run("softmax")
    assert len(aot_calls) == 1, "the second compile was not a graph-cache load"
    assert len(tuned) == 2 and autotune.STATS["tuned"] == 1 and autotune.STATS["read"] == 1


def test_meta_launch_is_not_predicted(tuned: list[Any]) -> None:
    """runtime/ahead.py runs launchers on meta tensors to predict their first launch;
    an autotuned kernel refuses rather than launch its kernel on them."""
    launched: list[Any] = []

    class Inner:
        def __getitem__(self, grid: Any) -> Any:
            return lambda *args, **kw: launched.append(grid)

    _run("pointwise")
    kernel = autotune.TunedKernel(Inner(), tuned[0].spec, "source", "k")
    x = torch.empty(8, 33, device="meta")
    with pytest.raises(NotImplementedError):
        kernel[(1,)](x, x, x, 264, BLOCK_SIZE=1024)
    assert launched == []


def test_plan_learning_watches_the_wrapped_kernel(tuned: list[Any]) -> None:
    """runtime/launch.py: Launcher._learn sets `kernel.watch` and learns a plan from
    a launch that ran one runner: a tuning launch runs many, a later one the winner."""

    class Inner:  # stands for a DirectKernel: each launch appends to `watch`
        watch: list[Any] | None = None

        def __getitem__(self, grid: Any) -> Any:
            def run(*args: Any, **kw: Any) -> None:
                if self.watch is not None:
                    self.watch.append((grid, kw))

            return run

    _run("pointwise")
    kernel = autotune.TunedKernel(Inner(), tuned[0].spec, "source", "k")
    x = torch.zeros(8, 33, device=DEVICE)
    for expect_one in (False, True):
        kernel.watch = seen = []
        kernel[(1,)](x, x, x, 264, BLOCK_SIZE=1024)
        kernel.watch = None
        assert (len(seen) == 1) == expect_one, seen
    (call,) = kernel.chosen
    winner = kernel.chosen[call]
    assert seen[0][1] == {"BLOCK_SIZE": 1024, **winner}


def test_each_kind_s_space_is_found_by_the_name_a_spec_carries() -> None:
    """kinds/tuning.py: a stored spec carries its space's name (plain data), and a
    launcher built from it finds the kind's space by that name."""
    from rewritec.kinds import tuning
    from rewritec.kinds.registry import KINDS

    tuned = [k for k in KINDS.values() if k.tuning is not None]
    assert tuned and all(tuning.space(k.tuning.name) == k.tuning for k in tuned)
    assert {k.name for k in KINDS.values() if k.tuning is None} == {"attention"}
