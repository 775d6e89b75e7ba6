"""Safe YAML loading that remembers the line of every key and list item.

Only safe loaders are used (no python tags, no code), and duplicate keys are
an error instead of silently keeping the last one. Anchors and aliases are
refused (ten levels of ten aliases would expand to 1e9 nodes, and `&r [*r]`
to an endless one), and so is nesting deeper than MAX_DEPTH, before the file
is composed, whose recursion would exhaust the stack. libyaml's `CSafeLoader`
reads the files when PyYAML has it (the built-in rules: 0.5 s -> 0.05 s on a cold
start); a file it rejects is read again with the pure-Python `SafeLoader`, whose
messages the golden errors in tests/bad_rules/ hold.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import RuleError, Where

if TYPE_CHECKING:
    import yaml

Lines = dict[tuple[Any, ...], int]

# Rule files nest five or six levels (rules, a rule, examples, an example, a list).
MAX_DEPTH = 32


def load_yaml(path: Path | str, text: str | None = None) -> tuple[Any, Lines]:
    """Parse a YAML file; return the data and a map from key path to line."""
    import yaml  # here: a compilation reads parsed tables (rulesets.py), not YAML

    path = str(path)
    if text is None:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise RuleError(f"cannot read rule file: {e}", Where(path)) from None
    fast = getattr(yaml, "CSafeLoader", None)
    if fast is not None:
        try:
            return _load(fast, text, path)
        except yaml.YAMLError:
            pass  # the pure-Python loader below says what is wrong, with its own words
    try:
        return _load(yaml.SafeLoader, text, path)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (0, 0)
        problem = e.problem or e.context or "syntax error"
        cm = e.context_mark
        if e.problem and e.context and cm is not None and cm is not mark:
            # Say where the unfinished construct began: that is where the fix goes.
            problem += f" ({e.context} opened at line {cm.line + 1}, column {cm.column + 1})"
        raise RuleError(f"malformed YAML: {problem}", Where(path, line, col)) from None
    except yaml.YAMLError as e:
        raise RuleError(f"malformed YAML: {e}", Where(path)) from None


def _load(loader_class: Any, text: str, path: str) -> tuple[Any, Lines]:
    _check_events(loader_class, text, path)
    lines: Lines = {}
    loader = loader_class(text)
    try:
        node = loader.get_single_node()
        data = _build(loader, node, (), lines, path) if node is not None else {}
    finally:
        loader.dispose()
    return data, lines


def _check_events(loader_class: Any, text: str, path: str) -> None:
    """Refuse anchors, aliases and deep nesting, reading the parser's events
    (a flat stream: nothing is expanded or recursed into)."""
    import yaml  # as in load_yaml

    loader = loader_class(text)
    depth = 0
    try:
        while loader.check_event():
            event = loader.get_event()
            mark = event.start_mark
            where = Where(path, mark.line + 1, mark.column + 1)
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
                raise RuleError(f"YAML anchors and aliases ({sign}{event.anchor}) are not "
                                "allowed in rule files: write the value out", where)
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise RuleError(f"YAML nested deeper than {MAX_DEPTH} levels", where)
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    finally:
        loader.dispose()


# The tags plain YAML data resolves to; any other (!!python/..., custom) is refused.
_PLAIN_TAGS = {f"tag:yaml.org,2002:{t}" for t in
               ("str", "int", "float", "bool", "null", "map", "seq")}


def _rule_name(node: yaml.MappingNode) -> str | None:
    """The `name:` of a rule mapping, read before building it, for error messages."""
    import yaml  # as in load_yaml

    for key_node, value_node in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.value == "name" \
                and isinstance(value_node, yaml.ScalarNode):
            return str(value_node.value)
    return None


def _where(file: str, node: yaml.Node, rule: str | None) -> Where:
    return Where(file, node.start_mark.line + 1, node.start_mark.column + 1, rule)


def _build(loader: yaml.SafeLoader, node: yaml.Node, path: tuple[Any, ...], lines: Lines,
           file: str, rule: str | None = None) -> Any:
    import yaml  # as in load_yaml

    lines[path] = node.start_mark.line + 1
    if node.tag not in _PLAIN_TAGS:
        tag = node.tag.replace("tag:yaml.org,2002:", "!!")
        raise RuleError(f"YAML tag {tag!r} is not allowed: rule files hold plain data only",
                        _where(file, node, rule))
    if isinstance(node, yaml.MappingNode):
        if len(path) == 2 and path[0] == "rules":
            rule = _rule_name(node)
        out: dict[Any, Any] = {}
        key_lines: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = _build(loader, key_node, path + ("<key>",), {}, file, rule)
            if not isinstance(key, str | int | float | bool):
                raise RuleError("mapping keys must be plain scalars",
                                _where(file, key_node, rule))
            if key in out:
                raise RuleError(f"duplicate key {key!r} (first at line {key_lines[key]})",
                                _where(file, key_node, rule))
            key_lines[key] = key_node.start_mark.line + 1
            out[key] = _build(loader, value_node, path + (key,), lines, file, rule)
            lines[path + (key,)] = key_node.start_mark.line + 1
            # Where a scalar value's text starts (after its quote), for expression errors.
            quoted = isinstance(value_node, yaml.ScalarNode) and value_node.style in ("'", '"')
            lines[("@",) + path + (key,)] = (value_node.start_mark.line + 1,  # type: ignore
                                             value_node.start_mark.column + 1 + int(quoted))
        return out
    if isinstance(node, yaml.SequenceNode):
        items = []
        for i, item in enumerate(node.value):
            quoted = isinstance(item, yaml.ScalarNode) and item.style in ("'", '"')
            lines[("@",) + path + (i,)] = (item.start_mark.line + 1,  # type: ignore
                                           item.start_mark.column + 1 + int(quoted))
            items.append(_build(loader, item, path + (i,), lines, file, rule))
        return items
    return loader.construct_object(node, deep=True)
