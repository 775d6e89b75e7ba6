"""Training under torch.distributed with rewritec: DDP and FSDP2 on the CPU (gloo).

Two spawned processes train a small transformer for a few steps, once eagerly and
once compiled with rewritec, from the same weights and data. Each worker saves its
losses, gradients and parameters with torch.save; the parent compares them, so a
mismatch fails here and not inside a child. A worker that hangs is killed after
`TIMEOUT_S` and the test fails.
"""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available(),
    reason="torch.distributed with the gloo backend is not available")

WORLD = 2
STEPS = 3
TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Block(nn.Module):
    """A pre-norm transformer block. Defined here, not nn.TransformerEncoderLayer:
    Dynamo traces frames of torch's own files only when inlined from user code, so
    after FSDP2's hooks break the graph it would run torch's layer eagerly."""

    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, num_heads=4, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class Tiny(nn.Module):
    """Two transformer blocks and a linear head; no dropout, so eager and compiled
    runs see the same numbers."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # different data per rank, so the gradients' all-reduce matters
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(4, 8, 32, generator=g), torch.randn(4, 8, 1, generator=g))
            for _ in range(STEPS)]


def _train(model: nn.Module, params: list[nn.Parameter], rank: int) -> dict[str, Any]:
    opt = torch.optim.SGD(params, lr=0.1)
    losses = []
    for x, y in _batches(rank):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grads = [p.grad.detach().clone() for p in params]
        opt.step()
        losses.append(loss.detach())
    return {"losses": losses, "grads": grads, "params": [p.detach().clone() for p in params]}


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor); a plain tensor as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _ddp_run(rank: int, compiled: bool) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    # Tiny buckets: Dynamo's DDPOptimizer splits the graph at each bucket boundary.
    # It requires the first bucket (1 MiB by default, this whole model 70 kB) to be
    # no larger than the others; DDP and DDPOptimizer both read this constant.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 16 * 1024
    ddp = DDP(Tiny(), bucket_cap_mb=0.02)
    model = torch.compile(ddp, backend="rewritec") if compiled else ddp
    return _train(model, list(ddp.parameters()), rank)


def _fsdp2_run(rank: int, compiled: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net = Tiny()
    mesh = init_device_mesh("cpu", (WORLD,))
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    model = torch.compile(net, backend="rewritec") if compiled else net
    out = _train(model, list(net.parameters()), rank)
    out["grads"] = [_full(g) for g in out["grads"]]
    out["params"] = [_full(p) for p in out["params"]]
    return out


RUNS = {"ddp": _ddp_run, "fsdp2": _fsdp2_run}


def _worker(rank: int, port: int, mode: str, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    out = Path(out_dir)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        import rewritec.report as report

        eager = RUNS[mode](rank, compiled=False)
        report.reset()
        compiled = RUNS[mode](rank, compiled=True)
        records = [(r.name, r.kind, r.status, r.reason) for r in report.RECORDS]
        torch.save({"eager": eager, "compiled": compiled, "records": records},
                   out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def _spawn(mode: str, tmp_path: Path) -> list[dict[str, Any]]:
    """Run `_worker` in WORLD processes; return each rank's saved results."""
    ctx = torch.multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(rank, port, mode, str(tmp_path)))
             for rank in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.kill()
        p.join()
    errors = "\n".join(f.read_text() for f in sorted(tmp_path.glob("*.err")))
    assert not hung, f"{len(hung)} worker(s) still running after {TIMEOUT_S} s\n{errors}"
    assert all(p.exitcode == 0 for p in procs), errors or [p.exitcode for p in procs]
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _assert_same_training(results: list[dict[str, Any]]) -> None:
    for res in results:
        eager, compiled = res["eager"], res["compiled"]
        for key in ("losses", "grads", "params"):
            assert len(eager[key]) == len(compiled[key])
            for e, c in zip(eager[key], compiled[key], strict=True):
                torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5, msg=key)
        fell_back = [r for r in res["records"] if r[2] != "compiled"]
        assert not fell_back, fell_back


def test_ddp_matches_eager_with_a_graph_per_bucket(tmp_path: Path) -> None:
    results = _spawn("ddp", tmp_path)
    _assert_same_training(results)
    for res in results:
        forwards = [r for r in res["records"] if r[1] == "forward"]
        assert len(forwards) > 1, res["records"]  # split at DDP's bucket boundaries


def test_fsdp2_matches_eager(tmp_path: Path) -> None:
    results = _spawn("fsdp2", tmp_path)
    _assert_same_training(results)
    for res in results:
        forwards = [r for r in res["records"] if r[1] == "forward"]
        assert len(forwards) > 1, res["records"]  # FSDP2's hooks break at each block
