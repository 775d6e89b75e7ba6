"""The `rewritec` command line, run as a real subprocess.

Each run that imports torch costs seconds, so there are few of them and each
checks several things.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import rewritec

REPO_ROOT = Path(__file__).resolve().parent.parent
PY_MODULE = [sys.executable, "-m", "rewritec.cli"]
CONSOLE_SCRIPT = Path(sys.executable).parent / "rewritec"


def _run(cmd: list[str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          check=False)


def _explain(res: subprocess.CompletedProcess[str]) -> str:
    return (f"exit {res.returncode}\n--- stdout\n{res.stdout[-4000:]}"
            f"\n--- stderr\n{res.stderr[-4000:]}")


def _check_report(out: Path) -> list[dict]:
    report_file = out / "report.json"
    assert report_file.is_file(), f"no report.json in {out}: {sorted(out.iterdir())}"
    data = json.loads(report_file.read_text())
    graphs = data["graphs"]
    assert isinstance(graphs, list) and graphs, "report.json lists no graphs"
    for g in graphs:
        assert isinstance(g["rules_fired"], dict), g
        assert isinstance(g["kernels"], list), g
        assert isinstance(g["fallback_ops"], dict), g
        assert g["status"] == "compiled", f"graph {g['name']} fell back: {g.get('reason')}"
        for key in ("captured", "final", "wrapper"):
            assert key in g["files"], f"graph {g['name']} has no {key} file: {g['files']}"
            path = Path(g["files"][key])
            path = path if path.is_absolute() else out.parent / path
            assert path.is_file(), f"{key} file of {g['name']} missing: {path}"
    return graphs


@pytest.fixture(scope="module")
def console_script() -> Path:
    if not CONSOLE_SCRIPT.exists():
        pytest.skip(f"no console script next to {sys.executable}")
    return CONSOLE_SCRIPT


def test_compile_example_mlp(tmp_path: Path) -> None:
    out = tmp_path / "out"
    res = _run([*PY_MODULE, "compile", str(REPO_ROOT / "examples" / "mlp.py"), "--out", str(out)],
               cwd=tmp_path)
    assert res.returncode == 0, _explain(res)
    assert "step 4: loss" in res.stdout  # the script itself ran to the end
    graphs = _check_report(out)
    kinds = {g["kind"] for g in graphs}
    assert {"forward", "backward", "export"} <= kinds, kinds
    data = json.loads((out / "report.json").read_text())
    # mlp.py defines `model` and `example_inputs`: exported, compiled and checked.
    assert data["ahead_of_time"]["matches_eager"] is True, data["ahead_of_time"]


SMALL_SCRIPT = """
import torch
import torch.nn.functional as F

torch.manual_seed(0)

@torch.compile
def act(x):
    return F.softmax(torch.tanh(x) * 2.0, dim=-1)

lin = torch.nn.Linear(8, 4)
step = torch.compile(dynamic=False)(lambda x: F.relu(lin(x)).sum(dim=0))

x = torch.randn(5, 8, requires_grad=True)
ok = torch.allclose(act(x), F.softmax(torch.tanh(x) * 2.0, dim=-1), atol=1e-5)
y = step(x)
y.sum().backward()
ok = ok and torch.allclose(y, F.relu(lin(x)).sum(dim=0), atol=1e-5)
assert ok, "compiled result differs from eager"
print("SMALL SCRIPT DONE")
"""


def test_console_script_compiles_a_small_script_strictly(tmp_path: Path,
                                                         console_script: Path) -> None:
    script = tmp_path / "small_script.py"
    script.write_text(textwrap.dedent(SMALL_SCRIPT))
    res = _run([str(console_script), "compile", script.name, "--out", "arts", "--strict"],
               cwd=tmp_path)
    assert res.returncode == 0, _explain(res)
    assert "SMALL SCRIPT DONE" in res.stdout
    graphs = _check_report(tmp_path / "arts")
    assert {"forward", "backward"} <= {g["kind"] for g in graphs}


def test_raising_script_shows_its_own_traceback(tmp_path: Path, console_script: Path) -> None:
    script = tmp_path / "failing_user_script.py"
    script.write_text(textwrap.dedent("""
        def inner():
            raise ValueError("boom from the user script 4711")

        inner()
    """))
    res = _run([str(console_script), "compile", str(script), "--out", str(tmp_path / "o")],
               cwd=tmp_path)
    assert res.returncode != 0, _explain(res)
    err = res.stderr
    assert "ValueError: boom from the user script 4711" in err, _explain(res)
    frames = [line.strip() for line in err.splitlines() if line.strip().startswith("File ")]
    assert frames, _explain(res)
    # The traceback is the script's: it starts in the script and reaches `inner`.
    assert script.name in frames[0], frames
    assert any(script.name in f and "in inner" in f for f in frames), frames
    assert not (tmp_path / "o" / "report.json").exists()


def test_missing_script_is_a_one_line_error(tmp_path: Path) -> None:
    res = _run([*PY_MODULE, "compile", "no_such_script_here.py"], cwd=tmp_path)
    assert res.returncode != 0, _explain(res)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, _explain(res)
    assert "no_such_script_here.py" in lines[0]
    assert "Traceback" not in res.stderr


def test_help_and_version(tmp_path: Path, console_script: Path) -> None:
    res = _run([str(console_script), "--version"], cwd=tmp_path, timeout=60)
    assert res.returncode == 0, _explain(res)
    assert rewritec.__version__ in res.stdout
    res = _run([*PY_MODULE, "--help"], cwd=tmp_path, timeout=60)
    assert res.returncode == 0, _explain(res)
    assert "compile" in res.stdout and "usage" in res.stdout.lower()
    res = _run([*PY_MODULE, "compile", "--help"], cwd=tmp_path, timeout=60)
    assert res.returncode == 0, _explain(res)
    assert "--out" in res.stdout and "--strict" in res.stdout
    res = _run([*PY_MODULE], cwd=tmp_path, timeout=60)  # no command: a usage error
    assert res.returncode != 0 and "usage" in res.stderr.lower(), _explain(res)


# In-process (no torch import to pay for): how `rewritec compile` reroutes the
# script's own torch.compile calls and their keyword arguments.
ROUTED_SCRIPT = """
import torch
f = torch.compile(lambda x: torch.sin(x) * 2 + 1{kwargs})
x = torch.randn(4, 3)
result = f(x)
expected = torch.sin(x) * 2 + 1
"""


@pytest.mark.parametrize("kwargs", [
    pytest.param("", id="plain"),
    pytest.param(", fullgraph=True", id="fullgraph"),
    pytest.param(", dynamic=True", id="dynamic"),
    pytest.param(", mode='max-autotune'", id="mode"),
    pytest.param(", disable=False", id="disable"),
])
def test_run_script_routes_torch_compile(tmp_path: Path, kwargs: str) -> None:
    import torch
    from rewritec import report
    from rewritec.frontend.script import run_script

    script = tmp_path / "routed_script.py"
    script.write_text(ROUTED_SCRIPT.format(kwargs=kwargs))
    real_compile = torch.compile
    scope, code = run_script(str(script), {"strict": True})
    assert torch.compile is real_compile  # restored afterwards
    assert code == 0 and scope is not None
    torch.testing.assert_close(scope["result"], scope["expected"])
    assert report.RECORDS, "the script's torch.compile did not reach rewritec"
    assert all(r.status == "compiled" for r in report.RECORDS)



API_SCRIPT = """
import torch
import rewritec
x = torch.randn(4, 3)
by_api = rewritec.compile(lambda x: torch.cos(x) + 1)
by_name = torch.compile(lambda x: torch.exp(x) * 3, backend="rewritec")
results = (by_api(x), by_name(x))
expected = (torch.cos(x) + 1, torch.exp(x) * 3)
"""


def test_run_script_options_reach_rewritec_compile_and_the_named_backend(tmp_path: Path
                                                                         ) -> None:
    """A script calling rewritec.compile or torch.compile(backend="rewritec") itself
    still gets the command line's options: its graphs are written to --out."""
    import torch
    from rewritec import report
    from rewritec.frontend.script import run_script
    from rewritec.options import PROCESS_DEFAULTS

    script = tmp_path / "api_script.py"
    script.write_text(API_SCRIPT)
    out = tmp_path / "out"
    report.reset()
    scope, code = run_script(str(script), {"out_dir": str(out), "strict": True})
    assert code == 0 and scope is not None and not PROCESS_DEFAULTS
    for got, want in zip(scope["results"], scope["expected"], strict=True):
        torch.testing.assert_close(got, want)
    assert len(report.RECORDS) == 2 and all(r.status == "compiled" for r in report.RECORDS)
    assert len(list(out.glob("*.final.txt"))) == 2

def _readme_rule() -> str:
    """The rule file of the README's 'Add your first rule' walkthrough, as printed."""
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("# my_rules/double.yaml")
    block = text[text.rindex("\n", 0, start) + 1:text.index("```", start)]
    return textwrap.dedent(block)


def test_readme_first_rule_walkthrough(tmp_path: Path) -> None:
    """The README's walkthrough as a newcomer runs it: the user rule is checked
    against its examples while the first graph compiles (under AOTAutograd's fake
    mode, where its example tensors must still be real), fires, and is reported
    with its file:line."""
    import torch
    from rewritec.testing import assert_fires

    rules = tmp_path / "my_rules"
    rules.mkdir()
    (rules / "double.yaml").write_text(_readme_rule())
    assert_fires("add-self", lambda x: (x + x).sin(), torch.randn(8), rules=[str(rules)])

    (tmp_path / "t.py").write_text(
        "import torch\ny = torch.compile(lambda x: (x + x).sin())(torch.randn(8))\n")
    env_cmd = [*PY_MODULE, "compile", "t.py", "--rules", "my_rules/", "--out", "out"]
    import os

    res = subprocess.run(env_cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                         check=False, env={**os.environ, "REWRITEC_DEBUG": "2"})
    assert res.returncode == 0, _explain(res)
    line = ("[rewritec] g0_inference: add-self @ my_rules/double.yaml:4: "
            "add(arg0_1, arg0_1, alpha=1) -> mul(arg0_1, 2.0)")
    assert line in res.stdout + res.stderr, _explain(res)
    assert line in (REPO_ROOT / "README.md").read_text()  # the README shows what runs
    graphs = _check_report(tmp_path / "out")
    assert all(g["status"] == "compiled" for g in graphs), graphs
    assert any(g["rules_fired"].get("add-self") for g in graphs), graphs


def test_rules_list_counts_what_check_counts(capsys: pytest.CaptureFixture[str]) -> None:
    """`rules list` shows the fast-math rules too (tagged), so its count is the
    library's; fold-constants, named under "rules fired", is listed as a built-in
    step and `explain` says what it is."""
    from rewritec.engine.errors import RuleError
    from rewritec.options import Options
    from rewritec.rulesets import find_rule, list_rules, ruleset_for

    opts = Options.make()
    assert list_rules(opts) == 0
    out = capsys.readouterr().out
    every = ruleset_for(Options.make(fast_math=True))
    assert f"\n{len(every)} rules (" in out, out[-300:]
    fast = [r.name for r in every if not r.fp_exact]
    assert fast, "the library has fp_exact: false rules"
    for line in out.splitlines():
        if any(f" {name} " in line for name in fast):
            assert line.endswith("(fast-math)"), line
    assert "built-in steps (not rules): fold-constants, online-softmax, welford-variance" in out
    with pytest.raises(RuleError, match="fold-constants is a built-in step"):
        find_rule("fold-constants", opts)
    with pytest.raises(RuleError, match="welford-variance is a built-in kernel rewrite.*"
                                        r"kinds/row_looped\.py"):
        find_rule("welford-variance", opts)


def test_rules_list_into_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """`rewritec rules list | head`: the reader is gone before the writing starts."""
    import os

    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        res = subprocess.run([*PY_MODULE, "rules", "list"], cwd=tmp_path, stdout=write_end,
                             stderr=subprocess.PIPE, text=True, timeout=120, check=False)
    finally:
        os.close(write_end)
    assert res.stderr == "", res.stderr
    assert res.returncode == 141, res.returncode


RAN_SCRIPT = "print('the script ran')\n"
BAD_RULES = REPO_ROOT / "tests" / "bad_rules"


@pytest.mark.parametrize("rules, error", [
    (str(BAD_RULES / "two_errors.yaml"), "two_errors.yaml:5: [mul-one-no-doc]"),
    (str(BAD_RULES / "unsound_sin_cos.yaml"), "unsound_sin_cos.yaml:4: [sin-is-cos] fails"),
    ("no_such_rules.yaml", "no such rule file or folder: no_such_rules.yaml"),
])
def test_compile_with_unusable_rules_stops_before_the_script(tmp_path: Path, rules: str,
                                                             error: str) -> None:
    """The user asked for these rules: a malformed, failing or missing file is a
    file:line error (exit 2), not the whole script run in eager."""
    (tmp_path / "t.py").write_text(RAN_SCRIPT)
    res = _run([*PY_MODULE, "compile", "t.py", "--rules", rules, "--quiet"], cwd=tmp_path)
    assert res.returncode == 2, _explain(res)
    assert "the script ran" not in res.stdout, _explain(res)
    assert res.stderr.startswith("rewritec: error: "), _explain(res)
    assert error in res.stderr, _explain(res)
    assert "Traceback" not in res.stderr, _explain(res)


def test_strict_fallback_is_one_error_not_a_traceback(tmp_path: Path) -> None:
    bad = BAD_RULES / "two_errors.yaml"
    (tmp_path / "t.py").write_text(
        "import torch, rewritec\n"
        f"f = rewritec.compile(lambda x: (x + x).sin(), rules=[{str(bad)!r}])\n"
        "f(torch.randn(8))\n")
    res = _run([*PY_MODULE, "compile", "t.py", "--strict", "--quiet"], cwd=tmp_path)
    assert res.returncode == 1, _explain(res)
    assert "Traceback" not in res.stderr, _explain(res)
    lines = res.stderr.strip().splitlines()
    assert lines[0].startswith("rewritec: error: rewritec could not compile graph"), lines
    assert len(lines) == 2, lines  # the two rule errors of the file, one line each


@pytest.mark.parametrize("flags, error", [
    (["--device", "cuda"], "--device cuda, but torch sees no CUDA GPU"),
    (["--target", "triton"], "--target triton needs a CUDA GPU, or TRITON_INTERPRET=1"),
])
def test_device_or_target_this_machine_lacks_is_an_error(tmp_path: Path, flags: list[str],
                                                         error: str) -> None:
    """Not "compiled" with 0 kernels and exit 0: one line and exit 2, script unrun."""
    import os

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    (tmp_path / "t.py").write_text(RAN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([*PY_MODULE, "compile", "t.py", *flags], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, check=False, env=env)
    assert res.returncode == 2, _explain(res)
    assert res.stderr.startswith(f"rewritec: error: {error}"), _explain(res)
    assert len(res.stderr.strip().splitlines()) == 1, _explain(res)
    assert "the script ran" not in res.stdout, _explain(res)


def test_explain_watches_the_exported_graph_too(tmp_path: Path) -> None:
    """`rewritec compile` also exports a script's module-level `model`; `explain` must
    watch that graph as well, or a rule that fires only there reads as never tried."""
    (tmp_path / "m.py").write_text(
        "import torch\n"
        "model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()\n"
        "example_inputs = (torch.randn(4, 8),)\n")
    res = _run([*PY_MODULE, "compile", "m.py", "--out", "out"], cwd=tmp_path)
    assert res.returncode == 0, _explain(res)
    graphs = _check_report(tmp_path / "out")
    res = _run([*PY_MODULE, "explain", "m.py", "--rule", "fuse-pointwise"], cwd=tmp_path)
    assert res.returncode == 0, _explain(res)
    assert f"in {len(graphs)} graph(s)" in res.stdout, _explain(res)


def test_explain_of_a_fuse_rule_lists_its_kernels(tmp_path: Path) -> None:
    """A fuse rule groups ops; it has no root term to count, so `explain` names the
    kernels it made instead of saying it was tried on 0 `@pointwise` terms."""
    (tmp_path / "t.py").write_text(
        "import torch\ny = torch.compile(lambda x: (x.sin() * 2 + 1).exp())(torch.randn(64))\n")
    res = _run([*PY_MODULE, "explain", "t.py", "--rule", "fuse-pointwise"], cwd=tmp_path)
    assert res.returncode == 0, _explain(res)
    assert "tried on 0" not in res.stdout, _explain(res)
    assert "1 kernel(s) it grouped" in res.stdout and "pointwise" in res.stdout, _explain(res)
