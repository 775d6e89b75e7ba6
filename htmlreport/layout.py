"""Graph pictures for the HTML report, laid out by Graphviz's `dot`.

`dot` (the layered, Sugiyama-style layout of Graphviz) suits dataflow graphs:
edges run one way, top to bottom, as the graph executes. A graph is cut into
pages of at most PAGE_NODES nodes in execution order, each laid out on its own,
so GPT-2's few thousand nodes stay quick to lay out and to scroll; an argument
made on another page is drawn as a small dashed stub naming it. Without `dot`
the page lists the nodes as tables instead (page.py). Wide pages are first
narrowed by Graphviz's `unflatten`.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

PAGE_NODES = 250
DOT_SECONDS = 60.0
# Kernel fill colours, given out in order of first use within a graph.
PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fdb462", "#b3de69", "#fccde5", "#80b1d3",
           "#ccebc5", "#ffed6f", "#bc80bd", "#d9d9d9", "#a6cee3", "#fb9a99", "#cab2d6")
FALLBACK_COLOUR = "#d62728"  # the border of an op that runs through ATen


@dataclass(frozen=True)
class Page:
    """One picture: `svg` when dot laid it out, else None (the page shows a table)."""

    nodes: list[dict[str, Any]]
    svg: str | None


def dot_path() -> str | None:
    return shutil.which("dot")


def kernel_colours(nodes: list[dict[str, Any]]) -> dict[str, str]:
    colours: dict[str, str] = {}
    for n in nodes:
        k = n.get("kernel")
        if k is not None and k not in colours:
            colours[k] = PALETTE[len(colours) % len(PALETTE)]
    return colours


def paginate(nodes: list[dict[str, Any]], size: int = PAGE_NODES) -> list[list[dict[str, Any]]]:
    """Nodes in execution order, `size` to a page."""
    return [nodes[i:i + size] for i in range(0, len(nodes), size)] or [[]]


def dot_source(prefix: str, nodes: list[dict[str, Any]], colours: dict[str, str],
               page_of: dict[int, int], inputs: dict[int, str] | None = None) -> str:
    """The dot text of one page; node ids are `<prefix>-<term id>` in the SVG.
    Graph inputs (`inputs`: id -> name) are drawn as small stubs where they are
    used, not as nodes: a backward graph's hundred inputs would make one row
    too wide to read."""
    inputs = inputs or {}
    here = {n["id"] for n in nodes}
    lines = [f'digraph "{_q(prefix)}" {{', "rankdir=TB; ranksep=0.3; nodesep=0.15;",
             # independent pieces (weight transposes and their copies) side by side
             # would make a page thousands of points wide: packed in rows instead
             'pack=true; packmode="array_u";',
             'node [shape=box, style="rounded,filled", fillcolor="#ffffff", fontsize=10, '
             'fontname="Helvetica", height=0.25, margin="0.06,0.02"];',
             'edge [arrowsize=0.5, color="#777777"];']
    stubs: set[int] = set()
    for n in nodes:
        lines.append(f'n{n["id"]} [id="{_q(prefix)}-{n["id"]}", label="{_q(_label(n))}", '
                     f'tooltip="{_q(tooltip(n))}"{_style(n, colours)}];')
        for a in n["args"]:
            if a not in here and a not in stubs:
                stubs.add(a)
                lines.append(_stub(a, page_of, inputs))
            lines.append(f"n{a} -> n{n['id']};")
    lines.append("}")
    return "\n".join(lines)


def _stub(a: int, page_of: dict[int, int], inputs: dict[int, str]) -> str:
    """A value made elsewhere: a graph input, or a node of another page."""
    if a in inputs:
        return (f'n{a} [label="{_q(inputs[a])}", shape=plaintext, style="", '
                f'fontcolor="#1a56b0"];')
    page = page_of.get(a)
    where = f" (page {page + 1})" if page is not None else ""
    return f'n{a} [label="%{a}{where}", shape=plaintext, style="", fontcolor="#888888"];'


def _label(n: dict[str, Any]) -> str:
    op = n["op"]
    if n.get("kernel") and n["cls"] == "kernel":
        op = n["kernel"]
    return f"{op}\n{n['type']}"


def tooltip(n: dict[str, Any]) -> str:
    parts = [f"%{n['id']} {n['op']}", f"{n['type']} strides ({', '.join(n['strides'])})"]
    if n.get("kernel"):
        parts.append(f"kernel {n['kernel']}")
    if n.get("rule"):
        parts.append(n["rule"])
    if n.get("fallback"):
        parts.append(f"ATen: {n['fallback']}")
    if n.get("time"):
        parts.append(f"time: {n['time']}")
    return "\n".join(parts)


def _style(n: dict[str, Any], colours: dict[str, str]) -> str:
    cls = n["cls"]
    if n.get("kernel") in colours:
        style = f', fillcolor="{colours[n["kernel"]]}"'
        return style + (", penwidth=2" if cls == "kernel" else "")
    if cls == "input":  # a frozen constant (inputs proper are stubs)
        return ', shape=ellipse, fillcolor="#e8f0fe"'
    if cls == "extern":  # a library call runs through ATen by design: not marked
        return ', fillcolor="#eeeeee"'
    if n.get("fallback"):
        return f', color="{FALLBACK_COLOUR}", penwidth=2, fillcolor="#fde0dd"'
    if cls == "view":
        return ', style="rounded,dashed", fontcolor="#555555"'
    return ""


def _q(text: str) -> str:
    """A dot string's contents: quotes and backslashes escaped, newlines as \\n."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


_memo: dict[str, str | None] = {}
MEMO_PAGES = 512  # a long training run compiling graph after graph keeps only these


def render_svg(source: str, dot: str) -> str | None:
    """dot -Tsvg of `source`, the XML prologue dropped; None if dot fails."""
    try:
        res = subprocess.run([dot, "-Tsvg"], input=_unflatten(source.encode(), dot),
                             capture_output=True, timeout=DOT_SECONDS, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    svg = res.stdout.decode("utf-8", "replace")
    start = svg.find("<svg")
    return _safe(svg[start:]) if start >= 0 else None


def _memoized(sources: list[str], dot: str, workers: int) -> list[str | None]:
    """render_svg of each source, several at once; a page laid out before in this
    process is not laid out again (a report rewritten after each graph lays out only
    the new graph's pages)."""
    keys = [hashlib.sha256(src.encode()).hexdigest() for src in sources]
    todo = {k: src for k, src in zip(keys, sources, strict=True) if k not in _memo}
    if todo:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            _memo.update(zip(todo, pool.map(lambda src: render_svg(src, dot), todo.values()),
                             strict=True))
    out = [_memo[k] for k in keys]
    while len(_memo) > MEMO_PAGES:
        del _memo[next(iter(_memo))]
    return out


def _unflatten(source: bytes, dot: str) -> bytes:
    """Graphviz's `unflatten` (installed beside dot) staggers the many independent
    leaves of a page (a backward graph's weight transposes, its kernels' inputs)
    over a few rows: a page 14,000 points wide becomes about 1,000."""
    tool = Path(dot).with_name("unflatten")
    if not tool.is_file():
        return source
    try:
        return subprocess.run([str(tool), "-f", "-l", "4", "-c", "6"], input=source,
                              capture_output=True, timeout=DOT_SECONDS, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return source


class _Active(HTMLParser):
    """Finds anything in markup that could run: a script element, an on* handler,
    a javascript: or external link."""

    def __init__(self) -> None:
        super().__init__()
        self.found = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag in ("script", "foreignobject", "iframe", "object", "embed"):
            self.found = True
        for name, value in attrs:
            link = name in ("href", "xlink:href", "src") and not (value or "").startswith("#")
            if name.startswith("on") or link:
                self.found = True


def _safe(svg: str) -> str | None:
    """The SVG if nothing in it could run or fetch, else None (the page shows a
    table). Graphviz escapes the text it writes; this checks that it did."""
    parser = _Active()
    parser.feed(svg)
    parser.close()
    return None if parser.found else svg


def pictures(graphs: dict[str, list[dict[str, Any]]], workers: int = 2
             ) -> dict[str, tuple[list[Page], dict[str, str]]]:
    """prefix -> (its pages, its kernel colours), for every graph picture at once:
    dot runs on several pages side by side."""
    dot = dot_path()
    jobs: list[tuple[str, int, str]] = []
    paged: dict[str, tuple[list[list[dict[str, Any]]], dict[str, str]]] = {}
    for prefix, nodes in graphs.items():
        inputs = {n["id"]: n["op"].removeprefix("input ") for n in nodes if n["cls"] == "input"}
        pages = paginate([n for n in nodes if n["id"] not in inputs])
        colours = kernel_colours(nodes)
        paged[prefix] = (pages, colours)
        page_of = {n["id"]: i for i, p in enumerate(pages) for n in p}
        if dot is not None:
            for i, p in enumerate(pages):
                jobs.append((prefix, i, dot_source(prefix, p, colours, page_of, inputs)))
    svgs: dict[tuple[str, int], str | None] = {}
    if dot is not None and jobs:
        done = _memoized([src for _, _, src in jobs], dot, workers)
        svgs = {(prefix, i): svg for (prefix, i, _), svg in zip(jobs, done, strict=True)}
    return {prefix: ([Page(p, svgs.get((prefix, i))) for i, p in enumerate(pages)], colours)
            for prefix, (pages, colours) in paged.items()}
