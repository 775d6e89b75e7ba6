"""report.json and the graphs' details files -> one self-contained report.html.

Everything the page needs is in the artifact folder, so `rewritec report DIR`
rebuilds it from DIR alone. The page has no external reference: its style,
script and pictures (inline SVG) are all in the file, and every text that
comes from a rule, a path or a source is escaped by jinja2's autoescape.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

from .highlight import highlight
from .layout import FALLBACK_COLOUR, Page, dot_path, pictures

HERE = Path(__file__).resolve().parent
# Rows of the firing list shown per graph; the details file has them all.
MAX_ROWS = 2000


class ReportPageError(Exception):
    """report.html could not be written (report.json was)."""


def write_page(out_dir: str | os.PathLike[str]) -> Path:
    """Write DIR/report.html from DIR/report.json, atomically as report.json is.
    Raises ReportPageError: a page that fails must not fail a compilation."""
    out = Path(out_dir)
    target = out / "report.html"
    tmp = out / f".report.html.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        tmp.write_text(build_page(out), encoding="utf-8")
        os.replace(tmp, target)
    except Exception as e:  # noqa: BLE001 - whatever breaks, the compilation goes on
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise ReportPageError(f"cannot write {target}: {e}") from e
    return target


def build_page(out: Path) -> str:
    data = json.loads((out / "report.json").read_text())
    if not isinstance(data, dict) or not isinstance(data.get("graphs"), list):
        raise ValueError(f"{out / 'report.json'} is not a rewritec report")
    graphs = [_graph(out, g) for g in data["graphs"]]
    laid = pictures({f"{g['name']}-{which}": g["details"][which]["nodes"]
                     for g in graphs if g["details"] for which in ("captured", "final")})
    for g in graphs:
        g["pictures"] = {which: _picture(laid.get(f"{g['name']}-{which}"))
                         for which in ("captured", "final")}
    # Imported here, not with the module: every compilation imports this one, and
    # only those given out_dir write a page.
    import jinja2

    # optional keys (a node's kernel, rule, fallback) are often absent: not strict
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE), autoescape=True)
    return env.get_template("page.html.j2").render(
        report=data, graphs=graphs, dot=dot_path(), max_rows=MAX_ROWS,
        fallback_colour=FALLBACK_COLOUR,
        css=(HERE / "page.css").read_text(), js=(HERE / "page.js").read_text(),
        as_json=_script_json, options=json.dumps(data.get("options"), default=str),
        duration=duration, time_line=time_line, profiled=any(g["times"] for g in graphs))


def _graph(out: Path, g: dict[str, Any]) -> dict[str, Any]:
    """One graph of report.json with what the page adds: its details, its kernels'
    sources, the rules it used."""
    g = dict(g)
    g["details"] = _details(out, g.get("files", {}).get("details"))
    g["captured_text"] = None if g["details"] else _text(out, g.get("files", {}).get("captured"))
    g["kernels"] = [_kernel(out, k) for k in g.get("kernels", [])]
    firings = g["details"]["firings"] if g["details"] else []
    counts = Counter(f["location"] for f in firings)
    names = {f["location"]: f["rule"] for f in firings}
    texts = g["details"]["rule_text"] if g["details"] else {}
    g["rules_used"] = [{"name": names[loc], "location": loc, "count": n,
                        "yaml": texts.get(loc, "")} for loc, n in counts.most_common()]
    g["anchors"] = {loc: f"{g['name']}-rule-{i}" for i, loc in enumerate(counts)}
    g["times"] = _times(g)
    return g


def _times(g: dict[str, Any]) -> list[dict[str, Any]]:
    """The graph's measured kernels and ATen calls, longest first, for its time table
    (empty when the run measured nothing: the page then shows no times); each node
    of its pictures gets the time of its kernel or ATen call for its tooltip."""
    profile = g.get("profile")
    if not isinstance(profile, dict) or not profile.get("calls"):
        return []
    # a key a report of another version lacks reads as not measured
    g["profile"] = profile = {**dict.fromkeys(("timer", "total_s", "median_s", "measured_s")),
                              **profile}
    kernels, aten = profile.get("kernels") or {}, profile.get("aten") or {}
    rows = [_entry("kernel", n, e) for n, e in kernels.items()]
    rows += [_entry("ATen", n, e) for n, e in aten.items()]
    rows.sort(key=lambda r: -r["total_s"])
    nodes = profile.get("nodes", {})
    for which in ("captured", "final") if g["details"] else ():
        for n in g["details"][which]["nodes"]:
            if n.get("kernel") in kernels:
                n["time"] = f"kernel {n['kernel']}: {time_line(kernels[n['kernel']])}"
            elif which == "final" and str(n["id"]) in nodes:
                n["time"] = f"this call: {time_line(nodes[str(n['id'])])}"
    return rows


def _entry(kind: str, name: str, e: dict[str, Any]) -> dict[str, Any]:
    keys = ("calls", "total_s", "mean_s", "median_s", "first_s", "share")
    row = {"kind": kind, "name": name, **dict.fromkeys(keys), **e}
    row["total_s"] = row["total_s"] or 0.0
    return row


def duration(seconds: float | None) -> str:
    """A time as people read it: 12.3 µs, 4.56 ms, 1.23 s."""
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{1e6 * seconds:.1f} µs"
    return f"{1e3 * seconds:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def time_line(e: dict[str, Any]) -> str:
    """One measured entry in a line: median, calls, share of the graph."""
    share = "" if e.get("share") is None else f", {100 * e['share']:.1f}% of the graph"
    return f"median {duration(e.get('median_s'))} x {e.get('calls')} calls{share}"


def _local(out: Path, path: str | None) -> Path | None:
    """A file the report names, found in `out` (the folder may have moved) or where
    the report says."""
    if not path:
        return None
    for p in (out / Path(path).name, Path(path)):
        if p.is_file():
            return p
    return None


def _text(out: Path, path: str | None) -> str | None:
    p = _local(out, path)
    try:
        return p.read_text() if p is not None else None
    except OSError:
        return None


def _details(out: Path, path: str | None) -> dict[str, Any] | None:
    p = _local(out, path)
    if p is None:
        return None
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def _kernel(out: Path, k: dict[str, Any]) -> dict[str, Any]:
    k = dict(k)
    p = _local(out, k.get("source"))
    try:
        source = p.read_text() if p is not None else None
    except OSError:
        source = None
    lang = "py" if str(k.get("source", "")).endswith(".py") else "cpp"
    k["html"] = highlight(source, lang) if source is not None else None
    return k


def _picture(laid: tuple[list[Page], dict[str, str]] | None) -> dict[str, Any] | None:
    if laid is None:
        return None
    pages, colours = laid
    return {"pages": pages, "colours": colours}


def _script_json(value: Any) -> str:
    """JSON safe inside <script type="application/json">: no `<` can close the tag."""
    return (json.dumps(value, default=str).replace("<", "\\u003c").replace(">", "\\u003e")
            .replace("&", "\\u0026"))
