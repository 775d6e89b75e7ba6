"""Embedding lookups in kernels: `embedding(w, ids)` is written as a `take` of the
table by the ids (rules/decompose/gathers.yaml; aten/take.py), which a pointwise
kernel computes with what reads it (kinds/indexed.py). Against eager on every
kernel target, over dtypes, shapes, strided tables and ids, int32 and int64 ids,
forward and backward; an id outside the table raises IndexError as eager does,
and a take the kernels do not take runs ATen's embedding again."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import rewritec  # noqa: F401 - registers the backend
from models import kernel_targets, outside_ops, rules_fired
from rewritec import report
from rewritec.aten.take import take, take_shape

DEVICE, TARGETS = kernel_targets()
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


def _compiled(fn: Callable[..., torch.Tensor], target: str) -> Callable[..., torch.Tensor]:
    report.reset()
    torch._dynamo.reset()
    return torch.compile(fn, backend="rewritec", options={"target": target, "strict": True})


def _kernels_compute(target: str, dtype: torch.dtype) -> bool:
    """OpenMP kernels compute no f16 (kinds/kernels.py: CPP_DTYPES): ATen runs it."""
    return not (target == "openmp" and dtype == torch.float16)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    return {} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}


# ------------------------------------------------------------------ the op itself
@pytest.mark.parametrize("ids_shape", [(5,), (2, 7), (2, 3, 4)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_take_of_a_table_is_an_embedding(ids_shape, dtype) -> None:
    w = torch.randn(11, 6)
    ids = torch.randint(0, 11, ids_shape, dtype=dtype)
    got = take(w, ids.unsqueeze(-1), -2)
    torch.testing.assert_close(got, F.embedding(ids, w), rtol=0, atol=0)


def test_take_along_any_dim_is_a_gather_with_broadcasts() -> None:
    x = torch.randn(4, 9, 3)
    index = torch.randint(0, 9, (4, 5, 1))  # broadcast along the last dim
    want = torch.gather(x, 1, index.expand(4, 5, 3))
    torch.testing.assert_close(take(x, index, 1), want, rtol=0, atol=0)
    row = torch.randn(9, 3)  # fewer dims: aligned from the right, broadcast along dim 0
    torch.testing.assert_close(take(row, index, 1),
                               torch.gather(row.expand(4, 9, 3), 1, index.expand(4, 5, 3)))
    assert take_shape([9, 3], [4, 5, 1], 1) == [4, 5, 3]
    with pytest.raises(ValueError, match="do not broadcast"):
        take_shape([4, 9, 3], [2, 5, 1], 1)


def test_an_id_outside_the_table_raises_index_error() -> None:
    w = torch.randn(10, 4)
    for bad in (10, -1):
        with pytest.raises(IndexError):
            take(w, torch.tensor([[1], [bad]]), -2)


# ------------------------------------------------------------------ in kernels
def embeddings(ids: torch.Tensor, pos: torch.Tensor, wte: torch.Tensor,
               wpe: torch.Tensor) -> torch.Tensor:
    """GPT-2's input: token and position embeddings added."""
    return F.embedding(ids, wte) + F.embedding(pos, wpe)


def bert_like(ids: torch.Tensor, pos: torch.Tensor, wte: torch.Tensor,
              wpe: torch.Tensor) -> torch.Tensor:
    """BERT's: three embeddings summed (a padding id), then layer norm."""
    h = F.embedding(ids, wte, padding_idx=0) + F.embedding(pos, wpe) + wpe[0]
    return F.layer_norm(h, h.shape[-1:])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("batch,seq,vocab,width", [(2, 8, 50, 16), (3, 5, 7, 33), (1, 1, 3, 8)])
@pytest.mark.parametrize("fn", [embeddings, bert_like])
def test_embeddings_run_in_one_kernel_and_equal_eager(target, dtype, batch, seq, vocab, width,
                                                      fn) -> None:
    torch.manual_seed(0)
    wte = torch.randn(vocab, width, dtype=dtype, device=DEVICE)
    wpe = torch.randn(seq + 3, width, dtype=dtype, device=DEVICE)
    ids = torch.randint(0, vocab, (batch, seq), device=DEVICE)
    pos = torch.arange(seq, device=DEVICE).expand(batch, seq)
    compiled = _compiled(fn, target)
    for _ in range(3):  # the second call records, the third runs a written variant
        torch.testing.assert_close(compiled(ids, pos, wte, wpe), fn(ids, pos, wte, wpe),
                                   **_tol(dtype))
    assert rules_fired()["embedding-as-take"] >= 2
    assert "embedding" not in outside_ops()
    assert ("rewritec::take" in outside_ops()) != _kernels_compute(target, dtype)


@pytest.mark.parametrize("target", TARGETS)
def test_strided_tables_and_ids_int32(target) -> None:
    torch.manual_seed(0)
    table = torch.randn(12, 32, device=DEVICE)[:, ::2]  # [12, 16], a step along each row
    wpe = torch.randn(16, 12, device=DEVICE).t()  # [12, 16], transposed
    ids = torch.randint(0, 12, (4, 6), device=DEVICE, dtype=torch.int32)
    ids_t = torch.randint(0, 12, (6, 4), device=DEVICE).t()  # strided ids

    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.embedding(a, table) * 2.0 + F.embedding(b, wpe)

    compiled = _compiled(fn, target)
    for _ in range(3):
        torch.testing.assert_close(compiled(ids, ids_t), fn(ids, ids_t))


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU a bad id is a device-side assert "
                    "(test_a_bad_id_on_a_gpu_stops_at_a_device_assert)")
@pytest.mark.parametrize("target", TARGETS)
def test_an_id_outside_the_table_raises_in_every_call(target) -> None:
    wte = torch.randn(20, 8, device=DEVICE)
    wpe = torch.randn(20, 8, device=DEVICE)
    compiled = _compiled(embeddings, target)
    ids = torch.randint(0, 20, (2, 5), device=DEVICE)
    pos = torch.arange(5, device=DEVICE).expand(2, 5)
    for call in range(4):  # plain, recording, written variant: each checks its ids
        bad = ids.clone()
        bad[1, call] = 20 + call
        with pytest.raises(IndexError):
            compiled(bad, pos, wte, wpe)
        torch.testing.assert_close(compiled(ids, pos, wte, wpe), embeddings(ids, pos, wte, wpe))
    negative = ids.clone()
    negative[0, 0] = -1
    with pytest.raises(IndexError):
        compiled(negative, pos, wte, wpe)


@pytest.mark.parametrize("target", TARGETS)
def test_a_language_model_step_with_embeddings_in_kernels(target) -> None:
    """Forward and backward: the lookups run in kernels, the tables' gradients are
    ATen's embedding backward, and both equal eager's."""
    torch.manual_seed(0)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = torch.nn.Embedding(30, 16, padding_idx=1)
            self.wpe = torch.nn.Embedding(12, 16)
            self.norm = torch.nn.LayerNorm(16)
            self.head = torch.nn.Linear(16, 30)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(ids.shape[1], device=ids.device)
            return self.head(self.norm(self.wte(ids) + self.wpe(pos)))

    model = Tiny().to(DEVICE)
    compiled = _compiled(model, target)
    for _ in range(3):
        ids = torch.randint(0, 30, (3, 10), device=DEVICE)
        grads = []
        for f in (model, compiled):
            model.zero_grad(set_to_none=True)
            F.cross_entropy(f(ids).flatten(0, 1), ids.flatten()).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for got, want in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(got, want)
    assert "embedding" not in outside_ops() and "rewritec::take" not in outside_ops()


def test_a_take_no_kernel_takes_runs_atens_embedding() -> None:
    """Kernels off: the rewritten graph still runs, through rewritec::take's eager
    meaning, an embedding."""
    w = torch.randn(9, 4)
    ids = torch.randint(0, 9, (2, 3))
    torch._dynamo.reset()
    compiled = torch.compile(lambda i: F.embedding(i, w) * 3.0, backend="rewritec",
                             options={"target": "aten"})
    torch.testing.assert_close(compiled(ids), F.embedding(ids, w) * 3.0)


_BAD_ID_ON_GPU = """
import torch, torch.nn.functional as F
import rewritec
wte, wpe = torch.randn(20, 8, device="cuda"), torch.randn(20, 8, device="cuda")
g = lambda i, p: NORM(F.embedding(i, wte) + F.embedding(p, wpe))
f = torch.compile(g, backend="rewritec", options={"strict": True})
ids, pos = torch.randint(0, 20, (2, 5), device="cuda"), torch.arange(5, device="cuda")
torch.testing.assert_close(f(ids, pos), g(ids, pos))
print("good ids: equal", flush=True)
ids[1, 3] = 25
out = f(ids, pos)
torch.cuda.synchronize()
print("bad id: no error", out.abs().max().item(), flush=True)
"""


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
@pytest.mark.parametrize("norm", ["torch.relu", "lambda h: F.layer_norm(h, (8,))"])
def test_a_bad_id_on_a_gpu_stops_at_a_device_assert(norm) -> None:
    """As eager's CUDA embedding does: the kernel's assert (a pointwise kernel's, a row
    kernel's) stops the process (a CUDA context cannot go on after one), rather than
    reading past the table."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _BAD_ID_ON_GPU.replace(
        "import rewritec\n", f"import rewritec\nNORM = {norm}\n", 1)], capture_output=True,
        text=True, timeout=300)
    assert "good ids: equal" in done.stdout, done.stderr[-2000:]
    assert "bad id: no error" not in done.stdout
    assert done.returncode != 0 and "device-side assert" in done.stderr, done.stderr[-2000:]


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the kernels run there, not interpreted")
def test_a_triton_take_kernel_compiles_for_sm90_with_its_asserts(tmp_path) -> None:
    """The Triton kernel of a take, compiled for an H100 by Triton itself (no GPU
    needed) with the options every launch passes (runtime/recipe.py:
    triton_options): Triton's `debug` keeps the index assert in the binary."""
    triton = pytest.importorskip("triton")
    import importlib.util

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from rewritec.runtime.recipe import triton_options

    wte, wpe = torch.randn(50, 16), torch.randn(8, 16)
    compiled = _compiled(embeddings, "triton")
    ids, pos = torch.randint(0, 50, (2, 8)), torch.arange(8).expand(2, 8)
    torch.testing.assert_close(compiled(ids, pos, wte, wpe), embeddings(ids, pos, wte, wpe))
    (kernel,) = [k for r in report.RECORDS for k in r.kernels if k["target"] == "triton"]
    source = open(kernel["source"]).read()
    options = triton_options(source, contract=False)
    assert options["debug"] is True and "tl.device_assert(" in source
    module = importlib.util.spec_from_file_location("take_kernel", kernel["source"])
    loaded = importlib.util.module_from_spec(module)
    module.loader.exec_module(loaded)  # type: ignore[union-attr]
    from triton.runtime.jit import JITFunction

    fn = getattr(loaded, next(n for n in dir(loaded) if n.startswith("fuse_")))
    # under TRITON_INTERPRET the decorator gave an interpreted function: compile its own
    jit = fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)
    ptrs = {"in0_ptr": "*fp32", "in1_ptr": "*i64", "in2_ptr": "*fp32", "in3_ptr": "*i64",
            "out_ptr": "*fp32"}
    sizes = {"size0": 2, "size1": 8, "size2": 16, "BLOCK_SIZE": 1024}
    signature = {a: ptrs.get(a, "constexpr" if a in sizes else "i64") for a in jit.arg_names}
    constants = {(i,): sizes[a] for i, a in enumerate(jit.arg_names) if a in sizes}
    try:
        binary = triton.compile(ASTSource(jit, signature, constants, {}),
                                target=GPUTarget("cuda", 90, 32),
                                options=options)
    except Exception as e:  # noqa: BLE001 - a Triton without the CUDA backend's tools
        pytest.skip(f"Triton cannot compile for sm_90 here: {type(e).__name__}: {e}")
    assert "__assertfail" in binary.asm["ptx"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("width", [16, 33, 2050])
def test_a_norm_reads_its_rows_straight_from_the_tables(target, dtype, width) -> None:
    """Embeddings summed, then layer norm: one row kernel reads each row from the
    tables by id (kinds/row.py: RowSpace._take), the sum a side output; positions
    shared by the batch broadcast. Rows wider than one pass keeps in registers read
    no take: the takes are a kernel of their own there, and stay right."""
    torch.manual_seed(0)
    wte = torch.randn(40, width, dtype=dtype, device=DEVICE)
    wpe = torch.randn(9, width, dtype=dtype, device=DEVICE)
    w, b = torch.randn(width, dtype=dtype, device=DEVICE), torch.randn(width, dtype=dtype,
                                                                       device=DEVICE)

    def fn(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = F.embedding(ids, wte) + F.embedding(torch.arange(ids.shape[1], device=DEVICE), wpe)
        return h, F.layer_norm(h, (width,), w, b)

    compiled = _compiled(fn, target)
    ids = torch.randint(0, 40, (3, 7), device=DEVICE)
    for _ in range(3):
        for got, want in zip(compiled(ids), fn(ids), strict=True):
            torch.testing.assert_close(got, want, **_tol(dtype))
    takes: dict[str, int] = {}
    for k in (k for r in report.RECORDS for k in r.kernels if k["ops"].get("take")):
        kind = k["name"].split("_")[2]
        takes[kind] = takes.get(kind, 0) + k["ops"]["take"]
    if _kernels_compute(target, dtype):
        assert takes == ({"row": 2} if width <= 2048 else {"indexed": 2}), takes
        assert "rewritec::take" not in outside_ops()
    if DEVICE != "cuda":  # on a GPU: test_a_bad_id_on_a_gpu_stops_at_a_device_assert
        bad = ids.clone()
        bad[2, 6] = 40
        with pytest.raises(IndexError):
            compiled(bad)


# --------------------------------------------------------------------------- gather
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
@pytest.mark.parametrize("case", [((1, 128), (1, 32), 1), ((6, 5), (9, 5), 0),
                                  ((2, 3, 7), (2, 3, 4), -1), ((4, 6, 5), (4, 2, 5), 1)],
                         ids=str)
def test_a_gather_is_a_take_inside_a_kernel(target, dtype, case) -> None:
    """torch.gather with an index of the input's sizes off `dim` (BERT's token-type
    buffer read at the positions): rules/decompose/gathers.yaml, gather-as-take."""
    x_shape, i_shape, dim = case
    torch.manual_seed(len(x_shape))
    x = (torch.randn(x_shape, device=DEVICE) * 10).to(dtype)
    index = torch.randint(0, x_shape[dim], i_shape, device=DEVICE)

    def fn(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return torch.gather(x * 2, dim, index) + 1

    compiled = _compiled(fn, target)
    for _ in range(2):
        torch.testing.assert_close(compiled(x, index), fn(x, index))
    assert rules_fired()["gather-as-take"] == 1
    assert "gather" not in outside_ops()


def test_a_gather_of_a_smaller_index_stays_atens() -> None:
    # gather allows an index smaller than x off `dim`; a take does not
    x, index = torch.randn(4, 8), torch.randint(0, 8, (2, 3))
    fn = lambda x, i: torch.gather(x + 1, 1, i)  # noqa: E731
    torch.testing.assert_close(_compiled(fn, TARGETS[0])(x, index), fn(x, index))
    assert "gather" in outside_ops()


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU a bad index is a device-side assert")
@pytest.mark.parametrize("target", TARGETS)
def test_a_gather_index_outside_raises_runtime_error_as_eager(target) -> None:
    fn = lambda x, i: torch.gather(x * 2, 1, i)  # noqa: E731
    compiled = _compiled(fn, target)
    x, index = torch.randn(3, 8), torch.randint(0, 8, (3, 5))
    torch.testing.assert_close(compiled(x, index), fn(x, index))
    bad = index.clone()
    bad[2, 4] = 8
    with pytest.raises(RuntimeError):
        fn(x, bad)
    with pytest.raises(RuntimeError):
        compiled(x, bad)
