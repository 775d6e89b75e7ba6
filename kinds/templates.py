"""Loading Jinja templates from `templates/` (package data)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import jinja2

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"


@cache
def environment() -> jinja2.Environment:
    import jinja2  # here, not above: a graph loaded from the graph cache renders nothing

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(TEMPLATES_DIR)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        autoescape=False,
    )


def has_template(template: str) -> bool:
    return (TEMPLATES_DIR / template).is_file()


def render_template(template: str, /, **context: Any) -> str:
    return environment().get_template(template).render(**context)
