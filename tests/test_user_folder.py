"""A user's rule folder does what the package's does: declare ops, bring templates.

The acceptance case of issue 23: from a folder outside the package, with rewritec
installed read-only (not editable), a user declares `log1p` (missing from
rules/ops.yaml), a fuse rule and its own OpenMP and Triton templates, and compiles
`F.softplus(x) * y`, which AOTAutograd decomposes into exp, log1p, gt and where.
report.json shows one kernel from the user's rule and template, and the results
equal eager, inf and nan included. The Triton template runs on the GPU where there
is one, else under TRITON_INTERPRET=1. Bad user ops and templates are golden
errors in tests/bad_rules/ (op_*, template_*, wrong_op_*).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from rewritec.engine.errors import RuleError, RuleErrors
from rewritec.runtime import graph_cache
from rewritec.options import Options
from rewritec.rulesets import load_rule_files

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE_TEMPLATES = REPO_ROOT / "templates"
HAS_TRITON = importlib.util.find_spec("triton") is not None

def _docs_example() -> str:
    """The rule file of docs/rules.md's "Your own rule folder", as printed there."""
    text = (REPO_ROOT / "docs" / "rules.md").read_text()
    (block,) = re.findall(r"```yaml\n(# my_rules/softplus.yaml\n.*?)```", text, re.DOTALL)
    return block


SOFTPLUS_RULES = _docs_example()
# the fuse rule's line, as a kernel's header and the docs name it
RULE_LINE = SOFTPLUS_RULES.splitlines().index("  - name: fuse-softplus-mul") + 1

SCRIPT = """\
import os
import torch
import torch.nn.functional as F
import rewritec

device = os.environ["DEVICE"]


def f(x, y):
    return F.softplus(x) * y


x = torch.randn(64, 33, device=device)
x[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-9, -0.0, 30.0])
y = torch.randn(64, 33, device=device)
out = torch.compile(f)(x, y)
torch.testing.assert_close(out, f(x, y), equal_nan=True)
print("rewritec from", rewritec.__file__)
print("matches eager")
"""


def _user_folder(root: Path) -> Path:
    """my_rules/ with the rule file and templates/{openmp,triton}/pointwise.*.j2:
    the package's pointwise templates under a comment of the user's."""
    rules = root / "my_rules"
    (rules / "templates" / "openmp").mkdir(parents=True)
    (rules / "templates" / "triton").mkdir(parents=True)
    (rules / "softplus.yaml").write_text(SOFTPLUS_RULES)
    for target, ext, comment in (("openmp", "cpp", "//"), ("triton", "py", "#")):
        body = (PACKAGE_TEMPLATES / target / f"pointwise.{ext}.j2").read_text()
        (rules / "templates" / target / f"pointwise.{ext}.j2").write_text(
            body.replace("{% endfor %}", f"{{% endfor %}}{comment} my own template\n", 1))
    return rules


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """rewritec installed (not editable) into a folder nobody may write."""
    pytest.importorskip("setuptools")
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(
        ".venv", "build", "dist", "*.egg-info", "__pycache__", "rewritec_out", ".git",
        ".*_cache", ".hypothesis", "scratch", "benchmarks"))
    site = tmp / "site"
    res = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                          "--no-build-isolation", "--no-compile", "--target", str(site),
                          str(src)], capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
    assert (site / "rewritec" / "rules" / "ops.yaml").is_file()
    assert (site / "rewritec" / "templates" / "openmp" / "pointwise.cpp.j2").is_file()
    _chmod(site, writable=False)
    yield site
    _chmod(site, writable=True)  # so that pytest can remove it


def _chmod(root: Path, writable: bool) -> None:
    for p in [root, *root.rglob("*")]:
        if p.is_symlink():
            continue
        mode = p.stat().st_mode
        p.chmod(mode | stat.S_IWUSR if writable else mode & ~0o222)


def _compile(site: Path, work: Path, rules: Path, device: str,
             env: dict[str, str] | None = None) -> dict:
    (work / "t.py").write_text(SCRIPT)
    # the install first, so `rewritec` is the read-only copy; what the path held
    # before stays after it (where a machine keeps lark or jinja2, say)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    full = {**os.environ, "PYTHONPATH": path, "DEVICE": device, **(env or {})}
    res = subprocess.run([sys.executable, "-m", "rewritec.cli", "compile", "t.py",
                          "--rules", str(rules), "--device", device], cwd=work,
                         env=full, capture_output=True, text=True, timeout=300, check=False)
    log = res.stdout + res.stderr
    assert res.returncode == 0, log[-4000:]
    assert "matches eager" in log, log[-4000:]
    assert f"rewritec from {site}" in log, log[-4000:]  # the install, not the checkout
    return json.loads((work / "rewritec_out" / "report.json").read_text())


def _the_users_kernel(report: dict, rules: Path, target: str, work: Path) -> None:
    (graph,) = report["graphs"]
    assert graph["rules_fired"] == {"fuse-softplus-mul": 1}, graph
    (kernel,) = graph["kernels"]
    ext = "py" if target == "triton" else "cpp"
    template = rules / "templates" / target / f"pointwise.{ext}.j2"
    assert kernel["template"] == str(template.resolve())
    assert kernel["ops"]["log1p"] == 1, kernel
    assert not graph["fallback_ops"], graph
    source = (work / kernel["source"]).read_text()
    header = source.splitlines()[:4]
    comment = "#" if target == "triton" else "//"
    assert header[1] == f"{comment} rule: fuse-softplus-mul @ {rules / 'softplus.yaml'}:{RULE_LINE}"
    assert header[2] == f"{comment} template: {template.resolve()}"
    assert f"{comment} my own template" in source


def test_user_op_rule_and_openmp_template_from_a_read_only_install(
        installed: Path, tmp_path: Path) -> None:
    from rewritec.runtime.build import cxx

    if not cxx():
        pytest.skip("no C++ compiler: the OpenMP target is off")
    rules = _user_folder(tmp_path / "user")
    work = tmp_path / "work"
    work.mkdir()
    report = _compile(installed, work, rules, "cpu", {"REWRITEC_TARGET": "openmp"})
    _the_users_kernel(report, rules, "openmp", work)


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_user_triton_template_from_a_read_only_install(installed: Path, tmp_path: Path) -> None:
    rules = _user_folder(tmp_path / "user")
    work = tmp_path / "work"
    work.mkdir()
    if torch.cuda.is_available():
        report = _compile(installed, work, rules, "cuda", {"REWRITEC_TARGET": "triton"})
    else:
        report = _compile(installed, work, rules, "cpu",
                          {"TRITON_INTERPRET": "1", "REWRITEC_TARGET": "triton"})
    _the_users_kernel(report, rules, "triton", work)


# ------------------------------------------------------------------ in process
def test_the_docs_name_the_rule_line_a_kernel_header_gives() -> None:
    docs = (REPO_ROOT / "docs" / "rules.md").read_text()
    assert f"`my_rules/softplus.yaml:{RULE_LINE}`" in docs


def test_user_ops_join_the_table_and_rules_use_them(tmp_path: Path) -> None:
    rules = _user_folder(tmp_path)
    loaded, table = load_rule_files([rules])
    assert [r.name for r in loaded] == ["fuse-softplus-mul"]
    assert table.get("log1p") is not None and table.by_aten["log1p.default"].name == "log1p"
    assert loaded[0].template_dir == str((rules / "templates").resolve())


def test_a_folder_s_ops_yaml_is_a_user_file(tmp_path: Path) -> None:
    """Only the package's rules/ops.yaml is left out of a folder's rule files."""
    (tmp_path / "ops.yaml").write_text(
        'ops:\n  - {name: log1p, aten: [log1p.default], args: [x], category: pointwise}\n')
    _, table = load_rule_files([tmp_path])
    assert table.get("log1p") is not None


def test_a_user_op_may_replace_a_builtin_one_when_it_says_so(tmp_path: Path) -> None:
    path = tmp_path / "exp.yaml"
    op = '  - {name: exp, aten: [exp.default], args: [x], category: pointwise, ' \
         'cpp: "std::exp({x})"%s}\n'
    path.write_text("ops:\n" + op % "")
    with pytest.raises((RuleError, RuleErrors), match="add `overrides: true`"):
        load_rule_files([path])
    path.write_text("ops:\n" + op % ", overrides: true")
    _, table = load_rule_files([path])
    assert table.get("exp").triton is None  # the user's, which gives no Triton expression


def test_a_changed_user_template_changes_the_graph_cache_key(tmp_path: Path) -> None:
    rules = _user_folder(tmp_path)
    opts = Options.make(rules=(str(rules / "softplus.yaml"),))
    before = graph_cache._options_text(opts)
    template = rules / "templates" / "openmp" / "pointwise.cpp.j2"
    template.write_text(template.read_text() + "// changed\n")
    assert graph_cache._options_text(opts) != before


# A user's row and reduction rules (the package's, renamed, ahead of them), for
# templates of other kinds than pointwise: a variant's (row_looped) and a kind with
# its own renderer (reduction)
MY_KINDS_RULES = """\
kind: fuse
rules:
  - name: fuse-my-row
    doc: "pointwise(reduce_d(pointwise(x))) -> one row kernel (rows along dim d)"
    pattern: "@pointwise"
    grow: [pointwise, reduction]
    kernel: row
    priority: 5
    where:
      - reductions >= 1
    examples:
      - {expr: "x - amax(x, dim=[-1], keepdim=True)", x: 6x33xf32}
  - name: fuse-my-reduction
    doc: "pointwise(reduce_dims(pointwise(x))) -> one reduction kernel (any dims)"
    pattern: "@pointwise"
    grow: [pointwise, reduction]
    kernel: reduction
    priority: 5
    where:
      - reductions >= 1
    examples:
      - {expr: "sqrt(sum(x * x, dim=[0, 2], keepdim=False) + 1.0)", x: 3x7x5xf32}
"""


def _kinds_folder(root: Path, target: str, kind: str) -> Path:
    """my_kinds/ with MY_KINDS_RULES and the package's template of `kind` for
    `target` under a comment of the user's."""
    rules = root / "my_kinds"
    ext, comment = ("py", "#") if target == "triton" else ("cpp", "//")
    (rules / "templates" / target).mkdir(parents=True)
    (rules / "kinds.yaml").write_text(MY_KINDS_RULES)
    body = (PACKAGE_TEMPLATES / target / f"{kind}.{ext}.j2").read_text()
    (rules / "templates" / target / f"{kind}.{ext}.j2").write_text(
        body.replace("{% endfor %}", f"{{% endfor %}}{comment} my own {kind} template\n", 1))
    return rules


@pytest.mark.parametrize("target, kind, rule", [
    ("triton", "row_looped", "fuse-my-row"), ("openmp", "reduction", "fuse-my-reduction")])
def test_a_user_template_of_another_kind_or_a_variant_renders(
        target: str, kind: str, rule: str, tmp_path: Path) -> None:
    """Every kind renders through its templates, so a user's folder replaces any:
    here a looped row's (the variant a `kernel: row` rule's wide rows run as on
    Triton) and a reduction's (OpenMP)."""
    import rewritec
    from rewritec import report

    device = "cuda" if target == "triton" and torch.cuda.is_available() else "cpu"
    if device == "cpu" and target == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    rules = _kinds_folder(tmp_path, target, kind)
    if kind == "row_looped":
        def f(x: torch.Tensor) -> torch.Tensor:
            return x - x.amax(-1, keepdim=True)
        x = torch.randn(4, 4096, device=device)
    else:
        def f(x: torch.Tensor) -> torch.Tensor:
            return torch.sqrt((x * x).sum((0, 2)) + 1.0)
        x = torch.randn(3, 7, 5, device=device)
    torch._dynamo.reset()
    report.reset()
    with torch.no_grad():
        got = rewritec.compile(f, target=target, strict=True, rules=[str(rules)])(x)
    torch.testing.assert_close(got, f(x))
    ((graph_kernels),) = [r.kernels for r in report.RECORDS]
    (kernel,) = graph_kernels
    ext = "py" if target == "triton" else "cpp"
    template = (rules / "templates" / target / f"{kind}.{ext}.j2").resolve()
    assert (kernel["kind"], kernel["rules"], kernel["template"]) == (kind, [rule], str(template))
    source = Path(kernel["source"]).read_text()
    assert f"template: {template}" in source.splitlines()[2]
    assert f"my own {kind} template" in source


# (rule, what changes in its first example, target, the kind that renders): every kind
# and variant of kinds/registry.py, for each target it renders
RENDER_CASES = [
    ("fuse-pointwise", None, "openmp", "pointwise"),
    ("fuse-pointwise", None, "triton", "pointwise"),
    ("fuse-pointwise", {"expr": "clone(permute(x, dims=[1, 0]), memory_format='contiguous_format')",
                   "x": "16x32xf32"}, "triton", "pointwise_tiled"),
    ("fuse-row", None, "openmp", "row"),
    ("fuse-row", {"x": "4x1500xf32"}, "triton", "row"),
    ("fuse-row", None, "triton", "row_multi"),
    ("fuse-row", {"x": "4x4096xf32"}, "triton", "row_looped"),
    ("fuse-reduction", None, "openmp", "reduction"),
    ("fuse-reduction", None, "triton", "reduction"),
    ("fuse-matmul", None, "triton", "matmul"),
    ("fuse-attention", None, "triton", "attention"),
]


def test_the_render_cases_cover_every_kind_and_target() -> None:
    from rewritec.kinds.registry import KINDS

    declared = {(t, k.name) for k in KINDS.values() for t in k.template_variables}
    assert declared == {(target, kind) for _, _, target, kind in RENDER_CASES}
    assert all(set(k.template_variables) == set(k.launchers) for k in KINDS.values())


@pytest.mark.parametrize("rule_name, example, target, kind", RENDER_CASES,
                         ids=[f"{c[3]}-{c[2]}" for c in RENDER_CASES])
def test_template_variables_are_what_the_renderers_give(
        rule_name: str, example: dict | None, target: str, kind: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Kind.template_variables, which a user's template is checked against, is what
    the kind's render passes to its template."""
    from rewritec.engine.pipeline import run_pipeline
    from rewritec.kinds import registry, templates
    from rewritec.kinds.kernels import compilable
    from rewritec.kinds.variants import variants_for
    from rewritec.rulecheck import build_example
    from rewritec.rulesets import builtin_rules
    from rewritec.runtime.prepare import _render

    if target == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU tensors need TRITON_INTERPRET=1")
    given: dict[str, set[str]] = {}
    real = templates.environment

    class Spy:  # the environment, noting what each template is rendered with
        def __init__(self, dirs: tuple[str, ...] = ()) -> None:
            self.env = real(dirs)

        def get_template(self, name: str) -> Any:
            template = self.env.get_template(name)

            class Rendering:
                def render(self, **context: object) -> str:
                    given[name] = set(context)
                    return template.render(**context)
            return Rendering()

    monkeypatch.setattr(templates, "environment", Spy)
    rule = next(r for r in builtin_rules() if r.name == rule_name)
    graph, store, bridge, _ = build_example(rule, {**rule.examples[0], **(example or {})})
    result = run_pipeline(graph, store, [rule], table=bridge.table,
                          can_compile=compilable(target, bridge.table),
                          spaces=registry.SPACES, variants=variants_for(target, store))
    (kernel,) = [t for t in result.graph.terms() if t.op == "kernel"]
    assert kernel.attr("kind") == kind
    _render(kernel, 0, target, bridge.table)
    ((template, keys),) = given.items()
    assert keys == registry.kind(kind).template_variables[target], template


def test_a_user_op_s_overloads_are_not_decomposed(tmp_path: Path) -> None:
    """AOTAutograd keeps a user op's ATen overloads whole, as it keeps the package's:
    declare softplus and the graph holds softplus, not exp, log1p and where."""
    from rewritec.frontend.decompositions import decomposition_table, kept_whole

    path = tmp_path / "softplus.yaml"
    path.write_text("ops:\n  - {name: softplus, aten: [softplus.default], args: [x], "
                    "attrs: {beta: 1, threshold: 20}, category: extern}\n")
    keep = kept_whole(Options.make(rules=(str(path),)))
    assert keep == ("softplus.default",)
    assert torch.ops.aten.softplus.default in decomposition_table()
    assert torch.ops.aten.softplus.default not in decomposition_table(keep)
    import rewritec

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.softplus(x) * 2.0

    x = torch.randn(16)
    torch.testing.assert_close(rewritec.compile(f, rules=[str(path)])(x), f(x))
