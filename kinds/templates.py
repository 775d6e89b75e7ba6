"""Loading Jinja templates: the package's `templates/`, and a user's beside a rule file.

A fuse rule from a user's folder renders with that folder's `templates/` searched
first (engine/rules.py records it as the rule's `template_dir`), then the package's.
Every template renders in Jinja's sandbox with StrictUndefined, and a user's are
checked when their rule file loads (`check_user_templates`): the syntax, and every
variable they read must be one the kernel's renderer gives (TEMPLATE_VARIABLES),
each a `file:line` error.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.errors import RuleError, RuleErrors, Where

if TYPE_CHECKING:
    import jinja2

    from ..engine.rules import Rule

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"

# What each renderer passes to a template of its kind (codegen/kernels.py); a user's
# template may read these and nothing else. tests/test_user_folder.py holds this table
# to what the renderers pass.
_TRITON = frozenset({"header", "name", "params", "loads", "stmts", "stores", "out_offset",
                     "tile_y", "tile_x"})
TEMPLATE_VARIABLES: dict[tuple[str, str], frozenset[str]] = {
    ("triton", "pointwise"): _TRITON,
    ("triton", "row"): _TRITON,
    ("openmp", "pointwise"): frozenset({"header", "name", "params", "body", "stores", "rows",
                                        "row_body", "unit_stride", "unit_body",
                                        "simd_decls"}),
    ("openmp", "row"): frozenset({"header", "name", "params", "row_steps", "chunk",
                                  "elem_body", "row_stores", "elem_stores", "simd_decls"}),
}
# Package templates whose renderers are not driven by the rule's template name: a
# user's folder cannot replace them.
# Kinds whose templates a user's folder cannot replace (their renderers are checked
# against the package's templates only).
FIXED_TEMPLATES = ("reduction", "attention", "matmul", "row_looped", "pointwise_tiled")
EXTENSIONS = {"triton": "py", "openmp": "cpp"}


@cache
def environment(dirs: tuple[str, ...] = ()) -> jinja2.Environment:
    """The environment that finds templates in `dirs` (a user's folders), then the
    package's."""
    import jinja2  # here, not above: a graph loaded from the graph cache renders nothing
    from jinja2.sandbox import SandboxedEnvironment

    return SandboxedEnvironment(
        loader=jinja2.FileSystemLoader([*dirs, str(TEMPLATES_DIR)]),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        trim_blocks=False,
        autoescape=False,
    )


def template_path(template: str, dirs: tuple[str, ...] = ()) -> Path | None:
    """The file `template` (`openmp/pointwise.cpp.j2`) names: the first of `dirs`
    that holds it, else the package's; None when none does."""
    for d in (*dirs, str(TEMPLATES_DIR)):
        if (Path(d) / template).is_file():
            return Path(d) / template
    return None


def has_template(template: str, dirs: tuple[str, ...] = ()) -> bool:
    return template_path(template, dirs) is not None


def render_template(template: str, dirs: tuple[str, ...] = (), /, **context: Any) -> str:
    return environment(dirs).get_template(template).render(**context)


def template_kind(name: str) -> str:
    """The kernel kind a template renders: the one it is named after
    (kinds/registry.py)."""
    return name


def check_user_templates(rules: list[Rule]) -> None:
    """Check the user templates `rules` name, as they load: each parses, and reads only
    the variables its renderer gives. Raises RuleErrors naming `template:line [rule]`."""
    errors: list[RuleError] = []
    for rule in rules:
        if rule.kernel is None or rule.template_dir is None:
            continue
        for target, ext in EXTENSIONS.items():
            path = Path(rule.template_dir) / target / f"{rule.kernel}.{ext}.j2"
            if not path.is_file():
                continue
            try:
                _check_one(path, target, rule, rule.kernel, rule.template_dir)
            except RuleError as e:
                errors.append(e)
    if errors:
        raise RuleErrors(errors)


def _check_one(path: Path, target: str, rule: Rule, template: str, folder: str) -> None:
    import jinja2
    from jinja2 import meta, nodes

    from ..engine.rules import display_path

    shown = display_path(path)
    if template in FIXED_TEMPLATES:
        raise RuleError(f"the package's {template!r} template cannot be replaced from a "
                        "user folder (its renderer is not the pointwise or row one); name "
                        f"yours otherwise ({rule.location})", Where(shown, 1, rule=rule.name))
    env = environment((str(Path(folder)),))
    try:
        text = path.read_text(encoding="utf-8")
        tree = env.parse(text, name=shown, filename=str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise RuleError(f"cannot read template: {e}", Where(shown, rule=rule.name)) from None
    except jinja2.TemplateSyntaxError as e:
        raise RuleError(f"template syntax error: {e.message} (the template of "
                        f"{rule.location})", Where(shown, e.lineno, rule=rule.name)) from None
    named = f" (the template of {rule.location})"
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        key = node.attr if isinstance(node, nodes.Getattr) else getattr(
            getattr(node, "arg", None), "value", "")
        if isinstance(key, str) and key.startswith("_"):
            raise RuleError(f"template reads {key!r}: names starting with '_' are not "
                            f"for templates{named}", Where(shown, node.lineno, rule=rule.name))
    known = TEMPLATE_VARIABLES[(target, template_kind(template))]
    unknown = meta.find_undeclared_variables(tree) - known - set(env.globals)
    if unknown:
        first = min((n.lineno, n.name) for n in tree.find_all(nodes.Name)
                    if n.name in unknown)
        raise RuleError(f"template reads {first[1]!r}, which the "
                        f"{template_kind(template)} renderer does not give (it gives: "
                        f"{', '.join(sorted(known))}){named}",
                        Where(shown, first[0], rule=rule.name))
