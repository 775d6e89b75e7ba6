"""runtime/ahead.py and runtime/compile_worker.py: Triton kernels compiled ahead in
a worker process, and launched from the worker's binary only for the call it was
compiled for.

On the CPU: the worker compiles for sm_90 (Triton needs no GPU for that) and is
checked against Triton's JIT compiling the same call in this process; the first
launches predicted on meta tensors are checked against the launches the compiled
graph then makes; a launch takes a finished job's binary through a stand-in for
torch's static launcher. On the GPU, a cold compile is checked against eager and
must not compile in the main process.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch

import rewritec
from rewritec.runtime import ahead, static_launch
from rewritec.runtime.triton_direct import DirectKernel, call_key

SM90 = ("cuda", 90, 32)
# Triton kernels run on the GPU where there is one, else in Triton's interpreter.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

KERNEL = '''\
import triton
import triton.language as tl


@triton.jit
def mixed(x_ptr, y_ptr, out_ptr, n, stride, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs * stride, mask=mask, other=0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0).to(tl.float32)
    r = x * scale + y
    if FLAG:
        r = tl.sigmoid(r)
    tl.store(out_ptr + offs, r.to(out_ptr.dtype.element_ty), mask=mask)
'''


@pytest.fixture(autouse=True)
def _no_worker_left_behind() -> Any:
    """Without CUDA, a worker left in the pool would have every later test's kernels
    sent to it (prepare_kernels asks `ahead.running()`). With CUDA, the first CUDA
    graph starts the pool and it serves every later test, as in any process."""
    yield
    assert torch.cuda.is_available() or not ahead._workers, \
        "a test left a compile worker in the pool"


@pytest.fixture(scope="module")
def triton_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A Triton cache of the module's own: a cached binary names the file its
    kernel was first compiled from, so the user's cache would mix in old paths."""
    import os

    before = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton-cache"))
    yield
    if before is None:
        del os.environ["TRITON_CACHE_DIR"]
    else:
        os.environ["TRITON_CACHE_DIR"] = before


@pytest.fixture(scope="module")
def worker(triton_cache: None) -> Any:
    pytest.importorskip("triton")
    w = ahead.Worker(ahead.triton_key(), None)
    if not w.ready.wait(120):
        pytest.skip(f"the compile worker did not start: {w.dead}")
    yield w
    w.close()


@pytest.fixture(scope="module")
def shared_kernel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file for the worker and the reference: a kernel's line info names it."""
    path = tmp_path_factory.mktemp("kernel") / "mixed_kernel.py"
    path.write_text(KERNEL)
    return path


@pytest.fixture
def kernel_file(tmp_path: Path) -> Path:
    path = tmp_path / "mixed_kernel.py"
    path.write_text(KERNEL)
    return path


CALLS = [  # dtype, offset of x in elements, n, FLAG
    ("float32", 0, 1000, True),
    ("float16", 0, 4096, False),  # n divisible by 16: specialized so
    ("bfloat16", 1, 1, True),  # a misaligned x; n == 1 is compiled in
    ("float32", 3, 4096, False),
]

# Triton's JIT compiling each call of CALLS for sm_90 from real tensors, in a
# process of its own: this one imported Triton under its interpreter.
REFERENCE = """
import importlib.util, json, sys, torch
from triton.backends.compiler import GPUTarget
from triton.runtime import cache, driver
cache.triton_key = lambda: sys.argv[3]  # the worker's, so that the hashes compare
from rewritec.runtime.compile_worker import TargetDriver
from rewritec.runtime.static_launch import describe
spec = importlib.util.spec_from_file_location("reference_kernel", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
stub = TargetDriver()
stub.target = GPUTarget("cuda", 90, 32)
driver.set_active(stub)
for dtype, offset, n, flag in json.loads(sys.argv[2]):
    dtype = getattr(torch, dtype)
    x = torch.zeros(n + 8, dtype=dtype)[offset:offset + n]
    y, out = torch.zeros(n, dtype=dtype), torch.zeros(n, dtype=dtype)
    c = module.mixed.warmup(x, y, out, n, 3, 0.5, FLAG=flag, BLOCK=128, grid=(1,))
    print(json.dumps([dict(c.src.signature), c.metadata.num_warps, c.metadata.hash,
                      describe(c, 6)[0]]))
"""


@pytest.fixture(scope="module")
def reference(shared_kernel: Path, triton_cache: None) -> list[Any]:
    import json
    import os

    path = shared_kernel
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", REFERENCE, str(path), json.dumps(CALLS),
                           str(ahead.triton_key())],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    if proc.returncode != 0:  # a Triton without the CUDA backend's tools
        pytest.skip(f"Triton cannot compile for sm_90 here: {proc.stderr[-500:]}")
    return [json.loads(line) for line in proc.stdout.splitlines()]


@pytest.mark.parametrize("index", range(len(CALLS)))
def test_the_worker_compiles_what_the_jit_would(worker, shared_kernel, reference, index) -> None:
    dtype, offset, n, flag = CALLS[index]
    x = torch.zeros(n + 8, dtype=getattr(torch, dtype))[offset:offset + n]
    y, out = torch.zeros(n, dtype=x.dtype), torch.zeros(n, dtype=x.dtype)
    args = (x, y, out, n, 3, 0.5)
    job = worker.submit(str(shared_kernel), "mixed", SM90, [ahead.encode(a) for a in args],
                        {"FLAG": flag, "BLOCK": 128})
    got = job.wait(120)
    assert got is not None, job.error
    # Triton's hash of everything its compiler is given: source, specialization,
    # options, target (the cubin itself names the file it was first compiled from)
    signature, warps, compiled_hash, described = reference[index]
    assert [dict(got.src.signature), got.metadata.num_warps, got.metadata.hash] == [
        signature, warps, compiled_hash]
    assert got.asm["cubin"][:4] == b"\x7fELF"
    # what the static launcher is told comes out the same too
    assert static_launch.describe(got, len(args))[0] == described


def test_a_job_the_worker_cannot_compile_fails_alone(worker, kernel_file, tmp_path) -> None:
    broken = tmp_path / "broken_kernel.py"
    broken.write_text(KERNEL.replace("tl.sigmoid(r)", "tl.no_such_function(r)"))
    args = [{"tensor": "float32", "align": 0}] * 3 + [{"int": 64}, {"int": 1}, {"float": 1.0}]
    bad = worker.submit(str(broken), "mixed", SM90, args, {"FLAG": True, "BLOCK": 64})
    assert bad.wait(120) is None and "no_such_function" in (bad.error or "")
    good = worker.submit(str(kernel_file), "mixed", SM90, args, {"FLAG": True, "BLOCK": 64})
    assert good.wait(120) is not None, good.error


def test_a_worker_that_dies_fails_its_jobs_at_once() -> None:
    w = ahead.Worker(None, None, command=[sys.executable, "-c",
                                          "import sys; sys.stdin.readline(); sys.stdin.readline()"])
    job = w.submit("k.py", "k", SM90, [{"int": 1}], {})
    assert job.wait(30) is None and job.error is not None and "exited" in job.error
    assert w.submit("k.py", "k", SM90, [], {}).wait(1) is None  # refused, not waited for
    w.close()


def test_the_worker_imports_neither_torch_nor_rewritec(kernel_file) -> None:
    pytest.importorskip("triton")
    worker_path = Path(ahead.__file__).with_name("compile_worker.py")
    code = textwrap.dedent(f"""
        import runpy, sys
        sys.argv = [{str(worker_path)!r}]
        try:
            runpy.run_path({str(worker_path)!r}, run_name="__main__")
        except SystemExit:
            pass
        bad = [m for m in ("torch", "rewritec") if m in sys.modules]
        sys.stderr.write("IMPORTED:" + ",".join(bad) + "\\n")
    """)
    job = {"id": 1, "path": str(kernel_file), "symbol": "mixed", "target": list(SM90),
           "args": [{"tensor": "float32", "align": 0}] * 3 + [{"int": 64}, {"int": 1},
                                                              {"float": 1.0}],
           "kwargs": {"FLAG": True, "BLOCK": 64}}
    import json

    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], input=json.dumps({}) + "\n"
                          + json.dumps(job) + "\n", capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert replies[0] == {"ready": True} and replies[1]["id"] == 1
    assert "IMPORTED:\n" in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------- predicted launches

def _graphs(fn: Any, *inputs: torch.Tensor, monkeypatch: pytest.MonkeyPatch
            ) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]], Any]:
    """(predicted, actual) first launches of `fn` compiled for Triton: each as
    (kernel, grid, call key)."""
    predicted: list[tuple[Any, ...]] = []

    def capture(graph: Any, launchers: dict[Any, Any]) -> int:
        for k, grid, args, kwargs in ahead.predict(graph, launchers,
                                                   lambda v: isinstance(v, DirectKernel)):
            predicted.append((k, grid, call_key(args, kwargs)))
        return 0

    monkeypatch.setattr(ahead, "running", lambda: True)
    monkeypatch.setattr(ahead, "submit_graph", capture)
    actual: list[tuple[Any, ...]] = []
    original = DirectKernel.launch

    def record(self: DirectKernel, grid: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
               ) -> Any:
        actual.append((self, grid, call_key(args, kwargs)))
        return original(self, grid, args, kwargs)

    monkeypatch.setattr(DirectKernel, "launch", record)
    compiled = rewritec.compile(fn, target="triton", strict=True)
    result = compiled(*inputs)
    torch.testing.assert_close(result, fn(*inputs), rtol=1e-4, atol=1e-4)
    return predicted, actual, result


def _gelu_bias(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x + b)


def _softmax_then_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.softmax(x, -1)
    return a, (a * 2).sum(0)


def _layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.layer_norm(x, x.shape[-1:], w, b)


def _total(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum()


def _side_output_read_by_a_kernel(x: torch.Tensor, r: torch.Tensor
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """y is a side output of one kernel (engine/fuse.py) and an input of the next."""
    y = x + r
    return torch.nn.functional.layer_norm(y, y.shape[-1:]), (y * 3.0).sum(0)


def _randn(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


CASES = {
    "pointwise": (_gelu_bias, lambda: (_randn(16, 96), _randn(96))),
    "pointwise_transposed": (_gelu_bias, lambda: (_randn(96, 16).t(), _randn(96))),
    "row_then_column": (_softmax_then_sum, lambda: (_randn(8, 300),)),
    "looped_row": (_layer_norm, lambda: (_randn(3, 2500), _randn(2500), _randn(2500))),
    "split_reduction": (_total, lambda: (_randn(64, 1024),)),
    "side_output": (_side_output_read_by_a_kernel, lambda: (_randn(8, 300), _randn(8, 300))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_predicted_first_launches_are_the_launches(case, monkeypatch) -> None:
    fn, make = CASES[case]
    predicted, actual, _ = _graphs(fn, *make(), monkeypatch=monkeypatch)
    assert predicted, "no kernel was predicted"
    assert predicted == actual


def test_a_misaligned_input_is_not_the_predicted_call(monkeypatch) -> None:
    x = _randn(16 * 96 + 1)[1:].view(16, 96)  # 4 bytes past an aligned address
    predicted, actual, _ = _graphs(_gelu_bias, x, _randn(96), monkeypatch=monkeypatch)
    (p_kernel, p_grid, p_call), = predicted
    (a_kernel, a_grid, a_call), = actual
    assert p_kernel is a_kernel and p_grid == a_grid and p_call != a_call


# ----------------------------------------------------------------- a launch takes the binary

class FakeLauncher:
    loads: list[Any] = []
    launches: list[Any] = []

    @staticmethod
    def _load_kernel(path: str, name: str, shared: int, device: int) -> tuple[int, int, int]:
        FakeLauncher.loads.append((Path(path).read_bytes(), name))
        return (99, 32, 0)

    @staticmethod
    def _launch_kernel(*args: Any) -> None:
        FakeLauncher.launches.append(args)


@pytest.fixture
def fake_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> type[FakeLauncher]:
    monkeypatch.setenv("REWRITEC_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", FakeLauncher, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    FakeLauncher.loads, FakeLauncher.launches = [], []
    return FakeLauncher


def _finished(target: tuple[str, int, int] = SM90, ok: bool = True) -> ahead.Job:
    import base64

    job = ahead.Job(target)
    reply = {"ok": ok, "error": "compile error", "cubin": base64.b64encode(b"\x7fELF-w").decode(),
             "arg_names": ["x", "out", "n", "BLOCK"],
             "signature": {"x": "*fp32", "out": "*fp32", "n": "i32", "BLOCK": "constexpr"},
             "metadata": {"name": "scale_kernel", "num_warps": 4, "shared": 0, "num_ctas": 1,
                          "global_scratch_size": 0, "profile_scratch_size": 0}}
    job.finish(reply)
    return job


def _never_loaded() -> Any:
    raise AssertionError("the JIT was loaded")


def test_a_first_launch_takes_the_workers_binary(fake_gpu) -> None:
    kernel = DirectKernel(load=_never_loaded, binaries=static_launch.Binaries("src", "k"),
                          device=lambda: 0)
    x, out = torch.ones(8), torch.zeros(8)
    kernel.pending[call_key((x, out, 8), {"BLOCK": 4})] = _finished()
    kernel[(2,)](x, out, 8, BLOCK=4)
    kernel[(2,)](x, out, 8, BLOCK=4)
    assert kernel.from_worker == 1 and kernel.direct == 2 and kernel.jitted == 0
    assert fake_gpu.loads == [(b"\x7fELF-w", "scale_kernel")]
    assert [launch[6] for launch in fake_gpu.launches] == ["OOiOO", "OOiOO"]
    assert not kernel.pending
    # and the binary was stored as any binary is: a later process finds it
    again = DirectKernel(load=_never_loaded, binaries=static_launch.Binaries("src", "k"),
                         device=lambda: 0)
    again[(2,)](x, out, 8, BLOCK=4)
    assert again.stored == 1


@pytest.mark.parametrize("why", ["other_call", "failed_job", "other_capability"])
def test_the_jit_compiles_what_the_worker_did_not(fake_gpu, why) -> None:
    log: list[Any] = []

    class Jit:
        params = None

        def warmup(self, *args: Any, grid: Any, **kwargs: Any) -> Any:
            log.append("warmup")
            return static_launch_compiled()

    def static_launch_compiled() -> Any:
        compiled = _finished().compiled
        compiled.asm = {"cubin": b"\x7fELF-jit"}
        return compiled

    def load() -> Any:
        log.append("load")
        return Jit()

    kernel = DirectKernel(load=load, binaries=static_launch.Binaries("src2", "k"),
                          device=lambda: 0)
    kernel.params = [("x", False), ("out", False), ("n", False), ("BLOCK", True)]
    x, out = torch.ones(8), torch.zeros(8)
    predicted = call_key((x, out, 8), {"BLOCK": 4})
    if why == "other_call":
        kernel.pending[call_key((x, out, 16), {"BLOCK": 4})] = _finished()
    elif why == "failed_job":
        kernel.pending[predicted] = _finished(ok=False)
    else:
        kernel.pending[predicted] = _finished(target=("cuda", 80, 32))
    kernel[(2,)](x, out, 8, BLOCK=4)
    assert log == ["load", "warmup"] and kernel.from_worker == 0 and kernel.ahead == 1
    assert fake_gpu.loads == [(b"\x7fELF-jit", "scale_kernel")]


def test_no_worker_on_a_machine_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(static_launch, "available", lambda: False)
    assert not ahead.enabled()
    monkeypatch.setattr(static_launch, "available", lambda: True)
    monkeypatch.setenv("REWRITEC_COMPILE_WORKER", "0")
    assert not ahead.enabled()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cold_cuda_compile_compiles_nothing_in_this_process(tmp_path) -> None:
    code = textwrap.dedent("""
        import sys, torch
        import triton.compiler, triton.compiler.compiler
        compiles = []
        original = triton.compiler.compiler.compile
        def counted(*a, **k):
            compiles.append(1)
            return original(*a, **k)
        # the JIT takes `compile` from the package, others from the module
        triton.compiler.compile = triton.compiler.compiler.compile = counted
        x, b = torch.randn(4096, 1000, device="cuda"), torch.randn(1000, device="cuda")
        def f(x, b):
            return torch.softmax(torch.nn.functional.gelu(x + b), -1)
        got = torch.compile(f, backend="rewritec")(x, b)
        torch.testing.assert_close(got, f(x, b))
        from rewritec.runtime import ahead
        print("RESULT", ahead.running(), len(compiles))
    """)
    env = {**__import__("os").environ, "REWRITEC_CACHE_DIR": str(tmp_path / "rw"),
           "TRITON_CACHE_DIR": str(tmp_path / "tr"), "REWRITEC_GRAPH_CACHE": "0"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")), None)
    assert line == "RESULT True 0", proc.stdout[-1000:] + proc.stderr[-3000:]


def test_job_answers_read_as_compiled_kernels() -> None:
    job = _finished()
    assert job.wait(0) is not None
    described = static_launch.describe(job.compiled, 3)
    assert described is not None and described[0]["codes"] == "OOiOO"
    failed = _finished(ok=False)
    assert failed.wait(0) is None and failed.error == "compile error"


LISTENER = [sys.executable, "-c", "import sys\nfor line in sys.stdin: pass"]
ANSWERING = [sys.executable, "-c", textwrap.dedent("""
    import json, sys, time
    sys.stdin.readline()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        time.sleep(0.05)
        job = json.loads(line)
        print(json.dumps({"id": job["id"], "ok": False, "error": "by the ready one"}),
              flush=True)
""")]


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Workers of stand-in commands in a pool of their own."""
    made: list[ahead.Worker] = []
    monkeypatch.setattr(ahead, "_workers", made)
    monkeypatch.setattr(ahead, "_queue", __import__("collections").deque())

    def add(command: list[str]) -> ahead.Worker:
        worker = ahead.Worker(None, None, command=command, on_idle=ahead._dispatch)
        made.append(worker)
        return worker

    yield add
    for w in made:
        w.close()


def test_jobs_wait_for_the_ready_worker_rather_than_one_still_starting(pool) -> None:
    ready, starting = pool(ANSWERING), pool(LISTENER)  # the second never gets ready
    assert ready.ready.wait(30)
    jobs = [ahead.submit("k.py", "k", SM90, [], {}) for _ in range(3)]
    for job in jobs:
        assert job is not None and job.wait(30) is None and job.error == "by the ready one"
    assert not starting.jobs


def test_a_closed_worker_leaves_no_pipe_open(pool) -> None:
    worker = pool(ANSWERING)
    assert worker.ready.wait(30)
    worker.close()
    assert worker.proc.poll() is not None
    assert worker.proc.stdin.closed and worker.proc.stdout.closed


def test_before_any_worker_is_ready_each_idle_one_takes_a_job(pool) -> None:
    workers = [pool(LISTENER), pool(LISTENER)]
    jobs = [ahead.submit("k.py", "k", SM90, [], {}) for _ in range(3)]
    assert [len(w.jobs) for w in workers] == [1, 1] and len(ahead._queue) == 1
    for w in workers:  # both die: what they had, and what waited, fails at once
        w.proc.kill()
    for job in jobs:
        assert job is not None and job.wait(30) is None and job.error
    assert not ahead._queue


def test_a_forked_child_does_not_use_its_parents_workers(pool) -> None:
    worker = pool(LISTENER)
    assert ahead.running()
    worker.pid += 1  # as a forked child sees its parent's worker
    assert not ahead.running() and ahead.submit("k.py", "k", SM90, [], {}) is None


def test_a_graph_of_several_kernels_grows_the_pool(monkeypatch) -> None:
    started: list[Any] = []

    class Started:
        def __init__(self, key: Any, warm: Any, on_idle: Any = None) -> None:
            started.append(warm)
            self.dead, self.pid, self.jobs = None, ahead.os.getpid(), {}

        def close(self) -> None:
            pass

    monkeypatch.setattr(ahead, "Worker", Started)
    monkeypatch.setattr(ahead, "_workers", [])
    monkeypatch.setattr(ahead, "triton_key", lambda: None)
    monkeypatch.setattr(ahead, "pool_size", lambda: 3)
    monkeypatch.setattr(ahead, "enabled", lambda: True)
    monkeypatch.setattr(ahead, "current_target", lambda: SM90)
    ahead.grow(8)
    assert started == []  # no pool to grow: only start starts one
    assert ahead.start() and started == [SM90]  # one, warmed up, to begin with
    ahead.grow(1)
    assert len(started) == 1
    ahead.grow(8)  # the rest, up to the pool's size, without a warm-up: jobs wait
    assert started == [SM90, None, None]


@pytest.mark.parametrize("setting,cpus,size", [("", 16, 4), ("", 2, 1), ("", 5, 2),
                                               ("3", 2, 3), ("0", 16, 4)])
def test_pool_size(monkeypatch, setting, cpus, size) -> None:
    monkeypatch.setenv("REWRITEC_COMPILE_WORKERS", setting)
    monkeypatch.setattr(ahead.os, "cpu_count", lambda: cpus)
    assert ahead.pool_size() == size


def _linear_relu(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.relu(torch.nn.functional.linear(x, w, b))


def _cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax((q @ k.transpose(-2, -1)) * 0.3, dim=-1) @ v


TEMPLATES = {
    **CASES,
    "matmul": (_linear_relu, lambda: (_randn(24, 16, dtype=torch.float16),
                                      _randn(32, 16, dtype=torch.float16),
                                      _randn(32, dtype=torch.float16))),
    "attention": (_cross_attention, lambda: tuple(
        _randn(2, 3, t, 16, dtype=torch.float16) for t in (9, 21, 21))),
}


def test_every_templates_predicted_launch_compiles_in_the_worker(worker, monkeypatch) -> None:
    """What a graph sends the worker, for each kind of kernel rewritec renders: the
    worker compiles it (for sm_90) from the predicted arguments alone."""
    sent: list[tuple[str, Any]] = []

    def capture(graph: Any, launchers: dict[Any, Any]) -> int:
        for k, _, args, kwargs in ahead.predict(graph, launchers,
                                                lambda v: isinstance(v, DirectKernel)):
            encoded = [ahead.encode(a) for a in args]
            assert None not in encoded and k.path is not None
            sent.append((k.symbol, worker.submit(str(k.path), k.symbol, SM90, encoded, kwargs)))
        return 0

    monkeypatch.setattr(ahead, "running", lambda: True)
    monkeypatch.setattr(ahead, "submit_graph", capture)
    for fn, make in TEMPLATES.values():
        rewritec.compile(fn, target="triton", strict=True)(*make())
    failed = {symbol: job.error for symbol, job in sent if job.wait(300) is None}
    assert not failed
    kinds = {symbol.rsplit("_", 1)[0] for symbol, _ in sent if not symbol.endswith("combine")}
    assert {"fuse_pointwise", "fuse_row", "fuse_reduction", "fuse_matmul",
            "fuse_attention"} <= kinds, kinds


def test_the_worker_sees_a_job_waiting_behind_the_line_it_read() -> None:
    """The worker skips its warm-up compile when a job is already waiting."""
    import os

    from rewritec.runtime.compile_worker import Lines

    read, write = os.pipe()
    lines = Lines(read)
    assert not lines.waiting()
    os.write(write, b'{"hello": 1}\n{"id": 1}\n')
    assert lines.readline() == '{"hello": 1}\n' and lines.waiting()  # buffered already
    assert lines.readline() == '{"id": 1}\n' and not lines.waiting()
    os.write(write, b'{"id": 2}')
    assert lines.waiting()  # on the pipe, not yet read
    os.close(write)
    assert lines.readline() == '{"id": 2}' and lines.readline() == ""
    os.close(read)


def test_a_graphs_kernels_wait_for_their_jobs_under_the_calls_they_are_launched_with(
        monkeypatch) -> None:
    """submit_graph: one job per predicted launch, filed on the kernel under the key its
    launch then looks it up by; kernels without binaries (no static launcher) get none."""
    import weakref

    from rewritec.runtime import recipe

    # kernels of their own: one an earlier test made from the same source would launch
    # through its remembered binary, and the launcher replay it as a plan
    monkeypatch.setattr(recipe, "_SHARED", weakref.WeakValueDictionary())
    captured: list[tuple[Any, Any]] = []
    monkeypatch.setattr(ahead, "running", lambda: True)
    monkeypatch.setattr(ahead, "submit_graph", lambda g, ls: captured.append((g, ls)) or 0)
    fn, make = CASES["row_then_column"]
    compiled = rewritec.compile(fn, target="triton", strict=True)
    inputs = make()
    compiled(*inputs)
    monkeypatch.undo()
    (graph, launchers), = captured
    kernels = [k for launcher in launchers.values() for k in vars(launcher).values()
               if isinstance(k, DirectKernel)]
    kernels[0].binaries = object()  # as on a GPU; the others have none (no static launcher)
    for k in kernels[1:]:
        k.binaries = None
    sent: list[Any] = []
    monkeypatch.setattr(ahead, "running", lambda: True)
    monkeypatch.setattr(ahead, "current_target", lambda: SM90)
    monkeypatch.setattr(ahead, "submit", lambda *a: sent.append(a) or ahead.Job(SM90))
    assert ahead.submit_graph(graph, launchers) == 1
    ((path, symbol, target, args, kwargs),) = sent
    assert (path, symbol, target) == (str(kernels[0].path), kernels[0].symbol, SM90)
    assert all(a is not None for a in args)
    launched: list[Any] = []
    monkeypatch.setattr(DirectKernel, "launch", lambda self, grid, a, kw: launched.append(
        (self, call_key(a, kw))))
    for launcher in launchers.values():
        # the full path: on a GPU the first call may have launched a binary an earlier
        # test stored, and learned a plan that launches it without the DirectKernel
        launcher.plans = None
    compiled(*inputs)
    assert (kernels[0], next(iter(kernels[0].pending))) in launched
    assert not any(k.pending for k in kernels[1:])


def test_workers_that_cannot_start_leave_compiling_as_it_was(monkeypatch) -> None:
    """The backend starts the workers when it is imported: nothing there may raise."""
    monkeypatch.setattr(ahead, "_workers", [])
    monkeypatch.setattr(ahead, "enabled", lambda: True)
    monkeypatch.setattr(ahead, "current_target", lambda: SM90)

    def broken() -> str:
        raise OSError("Triton's files went away")

    monkeypatch.setattr(ahead, "triton_key", broken)
    assert ahead.start() is False and not ahead.running()
