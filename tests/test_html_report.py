"""report.html: written with report.json, rebuilt by `rewritec report DIR`, and
loaded in headless Chromium (Debian's `chromium`; .ci/run installs it): no console
error, no request outside the file, graph pictures and rule list present, and
the times the demo's profiled run measured. Rule text, paths and docs are escaped."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import rewritec
import torch
from chromium import Chromium, find
from rewritec import cli
from rewritec.htmlreport import layout, page

REPO_ROOT = Path(__file__).resolve().parent.parent
HOSTILE = "<script>alert(1)</script>"
# a folder name a browser would run if it were not escaped (no slash in it)
HOSTILE_DIR = "<img src=x onerror=alert(2)>"


# The demo's calls of each graph: 5 training steps, one call of the exported model
DEMO_CALLS = {"forward": 5, "backward": 5, "export": 1}


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`rewritec compile examples/mlp.py --profile`: forward and backward of a
    training loop, and an exported model, each kernel and ATen call timed."""
    out = tmp_path_factory.mktemp("demo") / "out"
    res = subprocess.run([sys.executable, "-m", "rewritec.cli", "compile",
                          str(REPO_ROOT / "examples" / "mlp.py"), "--out", str(out), "--quiet",
                          "--profile"],
                         capture_output=True, text=True, timeout=300, check=False,
                         cwd=out.parent)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A compilation whose rule's doc and folder hold HTML."""
    root = tmp_path_factory.mktemp("hostile")
    rules = root / HOSTILE_DIR
    rules.mkdir()
    (rules / "double.yaml").write_text(f"""\
kind: simplify
rules:
  - name: add-self
    doc: "{HOSTILE} x + x -> x * 2"
    pattern: x + x
    replace: x * 2.0
    where:
      - is_float(x)
    examples: [{{x: 4x8xf32}}]
""")
    out = root / "out"
    fn = rewritec.compile(lambda x: (x + x).sin(), rules=[str(rules)], out_dir=str(out))
    fn(torch.randn(8))
    return out


@pytest.fixture(scope="module")
def browser():
    exe = find()
    if exe is None:
        pytest.skip("no chromium here (apt-get install chromium; .ci/run does)")
    b = Chromium(exe)
    yield b
    b.close()


def test_compile_writes_the_page_beside_report_json(demo: Path) -> None:
    html = (demo / "report.html").read_text()
    graphs = json.loads((demo / "report.json").read_text())["graphs"]
    assert {g["kind"] for g in graphs} == {"forward", "backward", "export"}
    for g in graphs:
        assert f'id="{g["name"]}"' in html
        assert g["phase_seconds"]["convert"] >= 0
        for k in g["kernels"]:
            assert k["name"] in html
    assert "layer-norm" in html and "rules/decompose/norms.yaml:" in html
    backward = json.loads(next(demo.glob("*_backward.details.json")).read_text())
    marked = {n["op"]: n["fallback"] for n in backward["captured"]["nodes"] if "fallback" in n}
    assert marked["mm"].startswith("library call")  # captured ops ATen still runs
    assert any(n.get("kernel") for n in backward["captured"]["nodes"])
    assert 'class="hl-keyword"' in html  # kernel sources are highlighted
    if layout.dot_path():
        assert html.count("<svg") >= 2 * len(graphs)


def test_the_demo_times_each_kernel_once_per_call(demo: Path) -> None:
    graphs = json.loads((demo / "report.json").read_text())["graphs"]
    assert {g["kind"] for g in graphs} == set(DEMO_CALLS)
    for g in graphs:
        calls, p = DEMO_CALLS[g["kind"]], g["profile"]
        assert p["calls"] == calls
        assert {n: e["calls"] for n, e in p["kernels"].items()} == {
            k["name"]: calls for k in g["kernels"]}
        assert {n: e["calls"] for n, e in p["aten"].items()} == {
            op: n * calls for op, n in g["fallback_ops"].items()}


def test_the_page_shows_the_times(demo: Path) -> None:
    html = (demo / "report.html").read_text()
    graphs = json.loads((demo / "report.json").read_text())["graphs"]
    assert html.count('class="times sortable"') == len(graphs)
    assert "<th>median per call</th>" in html
    for g in graphs:
        for name, e in g["profile"]["kernels"].items():
            assert f'id="{g["name"]}-kernel-{name}"' in html  # its source and rule
            assert page.time_line(e) in html
    if layout.dot_path():  # the pictures' tooltips: each kernel node's time
        assert "time: kernel k0_" in html


def test_a_page_without_times_says_nothing_of_them(hostile: Path) -> None:
    html = (hostile / "report.html").read_text()
    assert 'class="times' not in html and "median per call" not in html
    assert '"time":' not in html and "time: kernel" not in html  # nodes, tooltips
    assert "<th>time</th>" not in html and 'class="time"' not in html


def test_every_firing_is_listed_in_order(demo: Path) -> None:
    for g in json.loads((demo / "report.json").read_text())["graphs"]:
        details = json.loads(Path(demo / Path(g["files"]["details"]).name).read_text())
        assert details["firings_total"] == sum(g["rules_fired"].values())
        phases = [f["phase"] for f in details["firings"]]
        assert phases == sorted(phases, key=["recognize", "decompose", "simplify",
                                             "fuse"].index)
        for f in details["firings"]:
            assert f["location"] in details["rule_text"] or f["rule"] == "fold-constants"


def test_fallback_reasons_name_the_refusing_guard(tmp_path: Path) -> None:
    # a user's fuse-pointwise that wants two ops leaves a lone relu to ATen
    rules = tmp_path / "rules"
    rules.mkdir()
    (rules / "fuse.yaml").write_text(
        "kind: fuse\nrules:\n  - name: fuse-pointwise\n    doc: two ops or more\n"
        "    overrides: true\n    pattern: \"@pointwise\"\n    grow: [pointwise]\n"
        "    kernel: pointwise\n    where: ['ops >= 2']\n"
        "    examples: [{expr: 'relu(x) * 2.0', x: 4x8xf32}]\n"
        "    no_match: [{expr: 'relu(x)', x: 4x8xf32}]\n")
    out = tmp_path / "out"
    fn = rewritec.compile(lambda x, w: (x @ w).relu(), out_dir=str(out), rules=[str(rules)])
    fn(torch.randn(8, 8), torch.randn(8, 8))
    (details,) = out.glob("*.details.json")
    why = {f["op"]: f["reason"] for f in json.loads(details.read_text())["fallbacks"]}
    assert why["mm"].startswith("library call")
    assert "fuse-pointwise (" in why["relu"] and "fuse.yaml:" in why["relu"]
    assert "guard `ops >= 2` is false" in why["relu"]


def test_a_kernel_that_fails_to_build_is_the_reason_given(tmp_path: Path, monkeypatch) -> None:
    from rewritec.kinds.kernels import RenderError
    from rewritec.runtime import prepare

    def broken(*args, **kwargs):  # whatever prepare._render takes
        raise RenderError("no template today")

    monkeypatch.setattr(prepare, "_render", broken)
    fn = rewritec.compile(lambda x: (x.sin() * 2).cos(), out_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="falls back to ATen"):
        fn(torch.randn(8))
    (details,) = tmp_path.glob("*.details.json")
    data = json.loads(details.read_text())
    assert [f["rule"] for f in data["kernel_failures"]] == ["fuse-pointwise"]
    why = {f["op"]: f["reason"] for f in data["fallbacks"]}
    assert "failed to build: no template today" in why["sin"]
    assert "no template today" in (tmp_path / "report.html").read_text()
    for graph in ("captured", "final"):
        assert not any(n.get("kernel") for n in data[graph]["nodes"])


def test_a_graph_that_falls_back_shows_its_captured_graph(tmp_path: Path, monkeypatch) -> None:
    from rewritec import compiler

    def broken(*args, **kwargs):
        raise RuntimeError("conversion broke today")

    monkeypatch.setattr(compiler, "fx_to_terms", broken)
    fn = rewritec.compile(lambda x: x.sin() + 1, out_dir=str(tmp_path))
    with pytest.warns(UserWarning, match="falls back to eager"):
        fn(torch.randn(8))
    html = (tmp_path / "report.html").read_text()
    assert "conversion broke today" in html
    assert "the captured graph, as it runs" in html and "torch.ops.aten.sin" in html


def test_out_dir_option_writes_the_page_too(hostile: Path) -> None:
    html = (hostile / "report.html").read_text()
    assert "add-self" in html
    assert "<svg" in html or 'class="nodes"' in html


def test_report_command_rebuilds_from_the_folder_alone(demo: Path, tmp_path: Path) -> None:
    moved = tmp_path / "moved"
    shutil.copytree(demo, moved)
    (moved / "report.html").unlink()
    for f in moved.glob("*"):  # the files report.json names are gone from where it says
        assert f.is_file()
    assert cli.main(["report", str(moved)]) == 0
    html = (moved / "report.html").read_text()
    assert html.count('class="source"') == sum(
        len(g["kernels"]) for g in json.loads((moved / "report.json").read_text())["graphs"])


def test_report_command_without_report_json_is_an_error(tmp_path: Path, capsys) -> None:
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "no report.json" in capsys.readouterr().err


def test_without_dot_the_graphs_are_tables(demo: Path, monkeypatch) -> None:
    monkeypatch.setattr(layout, "dot_path", lambda: None)
    monkeypatch.setattr(page, "dot_path", lambda: None)
    html = page.build_page(demo)
    assert "<svg" not in html
    assert 'class="nodes"' in html and "is not installed" in html
    assert "<th>time</th>" in html  # the profiled demo's nodes list their times


def test_large_graphs_are_laid_out_a_page_at_a_time() -> None:
    nodes = [{"id": i, "op": "add", "args": [i - 1] if i else [], "consts": [],
              "type": "f32[8]", "dtype": "f32", "shape": ["8"], "strides": ["1"], "cls": "op"}
             for i in range(2 * layout.PAGE_NODES + 10)]
    pages = layout.paginate(nodes)
    assert [len(p) for p in pages] == [layout.PAGE_NODES, layout.PAGE_NODES, 10]
    page_of = {n["id"]: i for i, p in enumerate(pages) for n in p}
    src = layout.dot_source("g", pages[1], {}, page_of)
    # the argument made on page 1 is a stub naming its page
    assert f'%{layout.PAGE_NODES - 1} (page 1)' in src


def test_nothing_in_the_page_fetches_from_the_network(demo: Path, hostile: Path) -> None:
    for out in (demo, hostile):
        html = (out / "report.html").read_text()
        assert not re.search(r"""(src|href|xlink:href|action)\s*=\s*["']?(?!#)[a-z]+:""",
                             html, re.IGNORECASE), "a link or resource with a scheme"
        assert not re.search(r"""(src|href)\s*=\s*["']?//""", html, re.IGNORECASE)
        assert not re.search(r"url\(\s*['\"]?(?!data:|#)", html, re.IGNORECASE)
        for call in ("fetch(", "XMLHttpRequest", "import(", "@import", "WebSocket",
                     "EventSource", "sendBeacon"):
            assert call not in html, call
        assert "default-src 'none'" in html  # and the browser is told so


def test_hostile_rule_text_is_escaped(hostile: Path) -> None:
    html = (hostile / "report.html").read_text()
    assert HOSTILE not in html and "<img src=x" not in html
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    if layout.dot_path():  # Graphviz escaped the rule's path in its tooltips too
        assert "<svg" in html


def test_markup_that_could_run_is_never_inlined() -> None:
    assert layout._safe('<svg><a xlink:title="&lt;script&gt; onerror=1"><text>x</text></a></svg>')
    for bad in ("<svg><script>alert(1)</script></svg>", '<svg><g onload="alert(1)"/></svg>',
                '<svg><a xlink:href="javascript:alert(1)">x</a></svg>',
                '<svg><image href="https://example.com/x.png"/></svg>'):
        assert layout._safe(bad) is None, bad


def test_browser_harness_sees_errors_and_requests(browser: Chromium, tmp_path: Path) -> None:
    """The checks below mean something only if the harness catches what they forbid."""
    bad = tmp_path / "bad.html"
    bad.write_text('<img src="http://example.invalid/x.png"><script>nope();</script>')
    browser.open(bad)
    assert any("nope" in e for e in browser.errors())
    assert any(u.startswith("http://example.invalid") for u in browser.requests())
    browser.events.clear()


def test_page_renders_in_chromium(browser: Chromium, demo: Path) -> None:
    browser.events.clear()
    browser.open(demo / "report.html")
    assert browser.errors() == []
    assert browser.evaluate("window.REPORT_ERRORS") == []
    assert set(browser.requests()) == {(demo / "report.html").resolve().as_uri()}
    graphs = json.loads((demo / "report.json").read_text())["graphs"]
    rendered = browser.evaluate("""({
        svgs: document.querySelectorAll('.picture svg').length,
        tables: document.querySelectorAll('.picture table.nodes').length,
        firings: document.querySelectorAll('table.firings tbody tr').length,
        rules: document.querySelectorAll('.rules details').length,
        kernels: document.querySelectorAll('details.kernel').length,
        width: document.querySelector('.picture svg, .picture table').getBoundingClientRect().width,
    })""")
    assert rendered["svgs"] + rendered["tables"] >= 2 * len(graphs)
    assert rendered["width"] > 100  # laid out, not collapsed
    assert rendered["firings"] >= sum(sum(g["rules_fired"].values()) for g in graphs)
    assert rendered["rules"] > 0
    assert rendered["kernels"] == sum(len(g["kernels"]) for g in graphs)
    # the time table lists every kernel and ATen op, longest first; a click sorts it
    times = browser.evaluate("""(() => {
        const table = document.querySelector('table.times');
        const totals = () => Array.from(table.tBodies[0].rows, r => +r.cells[3].dataset.v);
        const first = totals();
        table.querySelectorAll('th')[2].click();
        const calls = Array.from(table.tBodies[0].rows, r => +r.cells[2].dataset.v);
        return {rows: first.length, first: first, calls: calls};
    })()""")
    profile = graphs[0]["profile"]
    assert times["rows"] == len(profile["kernels"]) + len(profile["aten"])
    assert times["first"] == sorted(times["first"], reverse=True)
    assert times["calls"] == sorted(times["calls"], reverse=True)
    # clicking a node of the final graph shows its op, strides and the rule behind it
    info = browser.evaluate("""(() => {
        const node = document.querySelector('.picture[data-graph$="-final"] '
                                            + '[id].node, .picture tr.node-row');
        node.dispatchEvent(new MouseEvent('click', {bubbles: true}));
        return node.closest('section').querySelector('.node-info').textContent;
    })()""")
    assert "strides" in info and "dtype" in info
    browser.screenshot(demo / "report.png")
    assert (demo / "report.png").stat().st_size > 10_000
    assert browser.errors() == []


def test_hostile_page_runs_nothing_injected(browser: Chromium, hostile: Path) -> None:
    browser.events.clear()
    browser.open(hostile / "report.html")
    assert browser.errors() == []  # no alert dialog, no error
    text = browser.evaluate("document.body.textContent")
    assert HOSTILE in text and HOSTILE_DIR in text  # as text
    assert HOSTILE_DIR in browser.evaluate("document.querySelector('.firings').innerText")
    assert browser.evaluate("document.querySelectorAll('img').length") == 0
