"""A small syntax highlighter for generated kernels (Python/Triton and C++).

The page must work offline with no dependency beyond jinja2, so this colours
only what helps reading: comments, strings, numbers and keywords. Every piece
of the source is HTML-escaped.
"""

from __future__ import annotations

import html
import re

PY_KEYWORDS = ("def return if elif else for in range while import from as with None True "
               "False and or not is pass lambda class yield tl constexpr @triton.jit").split()
CPP_KEYWORDS = ("void int float double const return if else for while auto static inline "
                "extern int64_t int32_t uint8_t bool struct template typename unsigned "
                "#pragma #include omp parallel simd").split()

_TOKEN = re.compile(r"""
    (?P<comment>\#(?!pragma|include)[^\n]*|//[^\n]*|/\*.*?\*/)
  | (?P<string>"(?:[^"\\\n]|\\.)*"|'(?:[^'\\\n]|\\.)*')
  | (?P<number>\b\d+(?:\.\d*)?(?:[eE][-+]?\d+)?[fFlLuU]*\b)
  | (?P<word>[@\#]?[A-Za-z_][A-Za-z_0-9.]*)
""", re.VERBOSE | re.DOTALL)


def highlight(source: str, lang: str) -> str:
    """`source` as HTML: escaped, with <span class="hl-..."> around tokens."""
    keywords = set(PY_KEYWORDS if lang == "py" else CPP_KEYWORDS)
    out = []
    pos = 0
    for m in _TOKEN.finditer(source):
        out.append(html.escape(source[pos:m.start()]))
        text = m.group()
        kind = m.lastgroup
        if kind == "word":
            kind = "keyword" if text in keywords else None
        esc = html.escape(text)
        out.append(f'<span class="hl-{kind}">{esc}</span>' if kind else esc)
        pos = m.end()
    out.append(html.escape(source[pos:]))
    return "".join(out)
