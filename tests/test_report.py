"""report.json: written for any compilation given out_dir (not only by the CLI),
`fallback_ops` under one naming scheme, and every key documented in docs/report.md."""

from __future__ import annotations

import json
import re
from pathlib import Path

import rewritec
import torch
from rewritec import report

REPO_ROOT = Path(__file__).resolve().parent.parent
# The op names fallback_ops may hold (docs/report.md): an ATen overload packet
# ("addmm"), or "ns::name" for an op of another namespace.
OP_NAME = re.compile(r"[a-z_][a-z0-9_]*|[a-z_][a-z0-9_]*::[a-z_][a-z0-9_]*")


def _report(out: Path) -> dict:
    path = out / "report.json"
    assert path.is_file(), f"no report.json in {out}: {sorted(out.iterdir())}"
    return json.loads(path.read_text())


def _doc_keys(section: str) -> set[str]:
    """The keys in the first column of the table under `## <section>` of docs/report.md."""
    text = (REPO_ROOT / "docs" / "report.md").read_text()
    body = text.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([a-z_]+)` \|", body, re.MULTILINE))


def _matmul_cumsum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cumsum((x @ w).relu(), dim=1)  # cumsum: no op-table entry, no kernel


def test_out_dir_writes_report_for_rewritec_compile(tmp_path):
    out = tmp_path / "art"
    fn = rewritec.compile(lambda x: (x * 2).sin(), out_dir=str(out))
    x = torch.randn(8)
    torch.testing.assert_close(fn(x), (x * 2).sin())
    data = _report(out)
    assert [g["name"] for g in data["graphs"]] == [r.name for r in report.RECORDS]
    [g] = data["graphs"]
    assert g["status"] == "compiled" and g["files"]["wrapper"].startswith(str(out))
    assert data["script"] is None and "out_dir" not in data["options"]
    assert not list(out.glob(".report.json.*")), "a temp file was left behind"

    # A second graph into the same folder adds itself to the same report.
    g2 = rewritec.compile(lambda x: x.cos() + 1, out_dir=str(out))
    g2(torch.randn(3, 5))
    data = _report(out)
    assert [g["name"] for g in data["graphs"]] == [r.name for r in report.RECORDS]
    assert len(data["graphs"]) == 2


def test_out_dir_writes_report_for_torch_compile_options(tmp_path):
    out = tmp_path / "art"
    fn = torch.compile(_matmul_cumsum, backend="rewritec", options={"out_dir": str(out)})
    x, w = torch.randn(4, 6), torch.randn(6, 5)
    torch.testing.assert_close(fn(x, w), _matmul_cumsum(x, w))
    data = _report(out)
    assert len(data["graphs"]) == 1
    # A new shape is a new graph: the report grows, the first record stays.
    fn(torch.randn(3, 7, 2)[:, :, 0], torch.randn(7, 5))
    names = [g["name"] for g in _report(out)["graphs"]]
    assert len(names) == 2 and names[0] == data["graphs"][0]["name"]
    # Another folder has its own report, listing only its own graphs.
    other = tmp_path / "other"
    rewritec.compile(lambda x: x.exp(), out_dir=str(other))(torch.randn(4))
    assert len(_report(other)["graphs"]) == 1
    assert len(_report(out)["graphs"]) == 2


def test_fallback_ops_use_one_scheme(tmp_path):
    fn = rewritec.compile(_matmul_cumsum, out_dir=str(tmp_path))
    fn(torch.randn(4, 6), torch.randn(6, 5))
    [g] = _report(tmp_path)["graphs"]
    ops = g["fallback_ops"]
    assert "cumsum" in ops, ops
    assert {"mm", "addmm", "matmul"} & set(ops), ops
    bad = [k for k in ops if not OP_NAME.fullmatch(k)]
    assert not bad, f"fallback_ops names outside the scheme: {bad} in {ops}"


def test_every_key_is_documented(tmp_path):
    def f(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _matmul_cumsum(x.sin() * 2 + 1, w).softmax(dim=-1)

    fn = torch.compile(f, backend="rewritec", options={"out_dir": str(tmp_path)})
    fn(torch.randn(4, 6), torch.randn(6, 5))
    data = _report(tmp_path)
    assert set(data) <= _doc_keys("Top level"), set(data) - _doc_keys("Top level")
    graph_keys = _doc_keys("Per graph")
    kernel_keys = _doc_keys("Per kernel")
    for g in data["graphs"]:
        assert set(g) <= graph_keys, set(g) - graph_keys
        for k in g["kernels"]:
            assert set(k) <= kernel_keys, set(k) - kernel_keys
    assert any(g["kernels"] for g in data["graphs"]), "no kernel to check the kernel keys"
    # And the doc lists no key the report does not have.
    assert graph_keys == set(report.GraphRecord(name="g", kind="inference").to_json())
