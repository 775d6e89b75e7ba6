"""Loading Jinja templates: the package's `templates/`, and a user's beside a rule file.

A fuse rule from a user's folder renders with that folder's `templates/` searched
first (engine/rules.py records it as the rule's `template_dir`), then the package's.
Every template renders in Jinja's sandbox with StrictUndefined, and a user's are
checked when their rule file loads (`check_user_templates`): the target, the
syntax, and every variable they read must be one the kind's render gives
(`Kind.template_variables`), each a `file:line` error. Every kind renders through
templates, so a user's folder may replace any kind's (or a variant's, such as
`row_looped` for a rule of kind `row`).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine.errors import RuleError, RuleErrors, Where

from ..engine.rules import Rule, display_path

if TYPE_CHECKING:
    import jinja2

    from .kind import Kind

TEMPLATES_DIR = Path(__file__).resolve().parent.parent / "templates"

EXTENSIONS = {"triton": "py", "openmp": "cpp"}


@cache
def environment(dirs: tuple[str, ...] = ()) -> jinja2.Environment:
    """The environment that finds templates in `dirs` (a user's folders), then the
    package's."""
    # jinja2 here, not above: `rules list` and a compilation that renders no kernel
    # (target aten) import this module and do not pay for it
    import jinja2
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


def check_user_templates(rules: list[Rule], kinds: Mapping[str, Kind]) -> None:
    """Check the user templates `rules` name, as they load: for a rule of kind K, the
    templates of K and of its variants (those with base K) in the rule's folder. Each
    must be for a target K renders (a kind without an OpenMP render never uses an
    OpenMP template), parse, and read only the variables its render gives
    (Kind.template_variables). Raises RuleErrors naming `template:line [rule]`."""
    errors: list[RuleError] = []
    for rule in rules:
        if rule.kernel is None or rule.template_dir is None:
            continue
        for kind in (k for k in kinds.values() if rule.kernel in (k.name, k.base)):
            for target, ext in EXTENSIONS.items():
                path = Path(rule.template_dir) / target / f"{kind.name}.{ext}.j2"
                if not path.is_file():
                    continue
                try:
                    _check_one(path, target, rule, kind)
                except RuleError as e:
                    errors.append(e)
    if errors:
        raise RuleErrors(errors)


def _check_one(path: Path, target: str, rule: Rule, kind: Kind) -> None:
    import jinja2  # as in `environment`: only where a user's folder has templates
    from jinja2 import meta, nodes

    shown = display_path(path)
    named = f" (the template of {rule.location})"
    known = kind.template_variables.get(target)
    if known is None:
        raise RuleError(f"kind {kind.name!r} renders no {target} kernel (it renders for "
                        f"{', '.join(kind.template_variables)}): this template would never "
                        f"be used{named}", Where(shown, 1, rule=rule.name))
    env = environment((str(path.parent.parent),))  # the folder the rule renders with
    try:
        text = path.read_text(encoding="utf-8")
        tree = env.parse(text, name=shown, filename=str(path))
    except (OSError, UnicodeDecodeError) as e:
        raise RuleError(f"cannot read template: {e}", Where(shown, rule=rule.name)) from None
    except jinja2.TemplateSyntaxError as e:
        raise RuleError(f"template syntax error: {e.message} (the template of "
                        f"{rule.location})", Where(shown, e.lineno, rule=rule.name)) from None
    for node in tree.find_all((nodes.Getattr, nodes.Getitem)):
        key = node.attr if isinstance(node, nodes.Getattr) else getattr(
            getattr(node, "arg", None), "value", "")
        if isinstance(key, str) and key.startswith("_"):
            raise RuleError(f"template reads {key!r}: names starting with '_' are not "
                            f"for templates{named}", Where(shown, node.lineno, rule=rule.name))
    unknown = meta.find_undeclared_variables(tree) - known - set(env.globals)
    if unknown:
        first = min((n.lineno, n.name) for n in tree.find_all(nodes.Name)
                    if n.name in unknown)
        raise RuleError(f"template reads {first[1]!r}, which the {kind.name} renderer does "
                        f"not give (it gives: {', '.join(sorted(known))}){named}",
                        Where(shown, first[0], rule=rule.name))
