"""Which rules a compilation uses: the built-in library plus the user's files.

Built-in rules live in `rules/<family>/*.yaml`. User rules come from
`--rules PATH`, REWRITEC_RULES or the `rules` option; a user rule that
reuses a built-in name is an error unless it says `overrides: true`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import pickle
import sys
from functools import cache
from pathlib import Path

from . import __version__
from .engine.errors import RewritecError, RuleError, RuleErrors
from .engine.ops import RULES_DIR, OpInfo, OpTable, default_op_table, use_default_op_table
from .engine.rewrite import BUILTIN_STEPS
from .kinds.templates import check_user_templates
from .engine.rules import Rule, RuleLoader, check_unique, rule_files
from .kinds.registry import KERNEL_REWRITES, KINDS, RULE_KINDS
from .options import Options, closest
from .runtime.disk_cache import cache_dir, folder_problem, read_verified, store


def _load(paths: list[Path], builtin: bool) -> list[Rule]:
    return load_rule_files(paths, builtin=builtin)[0]


def load_rule_files(paths: list[Path], builtin: bool = False) -> tuple[list[Rule], OpTable]:
    """The rules of `paths` (files or folders, in order) and the op table they were
    checked against: the package's, plus the ops the user's files declare. A user's
    templates are checked here too (kinds/templates.py)."""
    loader = RuleLoader(None if builtin else builtin_op_table(), kernels=RULE_KINDS)
    rules: list[Rule] = []
    errors: list[RuleError] = []
    for root in paths:
        if not root.exists():
            errors.append(RuleError(f"no such rule file or folder: {root}"))
            continue
        for f in rule_files(root, builtin):
            try:
                loaded = loader.load_file(f, builtin=builtin)
                if not builtin:
                    check_user_templates(loaded, KINDS)
                rules.extend(loaded)
            except RuleErrors as e:
                errors.extend(e.errors)
            except RuleError as e:
                errors.append(e)
    if errors:
        raise RuleErrors(errors)
    return rules, loader.table


# Where the parsed built-in rules are kept first (see builtin_rules).
COMPILED_DIR = RULES_DIR / "__pycache__"
# What a kept table holds, (rules, op table); part of its key, so that a table of
# another layout is never read.
TABLE_LAYOUT = "rules+ops"


@cache
def _builtin() -> tuple[tuple[Rule, ...], OpTable]:
    """The library's rules and op table, parsed once per version of the rule files and
    the engine.

    Like Python's bytecode, the parsed table is kept beside its sources, in
    `rules/__pycache__/`, when the installation is writable by this user alone, and
    in the kernel cache otherwise; each copy is unpickled only if its digest, signed
    with this user's key (runtime/disk_cache.py), vouches for it. The table
    depends on no program being compiled, so emptying the compile caches keeps it,
    as it keeps the `.pyc` files. Parsing the YAML and the 230-odd expressions costs
    0.15 s of a cold compile on a 2-core CPU and 0.1-0.2 s on an H100 host; loading the table 2 ms,
    and a compilation then neither imports PyYAML nor reads `rules/ops.yaml`
    (15 ms on the 2-core CPU). The engine's `default_op_table` serves the op table
    loaded here."""
    try:
        rules, table = _load_cached()
    except Exception:  # noqa: BLE001 - a cache problem only costs the parse
        rules, table = tuple(_load([RULES_DIR], builtin=True)), default_op_table()
    use_default_op_table(table)
    return rules, table


def builtin_rules() -> tuple[Rule, ...]:
    return _builtin()[0]


def builtin_op_table() -> OpTable:
    """The op table kept with the built-in rules (engine/ops.py: default_op_table
    serves the same one once this has run)."""
    _builtin()
    return default_op_table()


def _load_cached() -> tuple[tuple[Rule, ...], OpTable]:
    engine = Path(__file__).resolve().parent / "engine"
    kinds = Path(__file__).resolve().parent / "kinds"  # the kernel kinds rules may name
    sources = sorted(RULES_DIR.rglob("*.yaml")) + sorted(engine.glob("*.py")) \
        + sorted(kinds.glob("*.py")) \
        + [engine / "grammar.lark"]
    # keyed as Python keys bytecode: by each source's size and modification time,
    # which a cold start reads without reading the files
    key = hashlib.sha256(f"{__version__} {sys.version} {TABLE_LAYOUT}".encode())
    for f in sources:
        st = f.stat()
        key.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    name = f"rules-{key.hexdigest()[:24]}.pickle"
    # rules/__pycache__ only where it is this user's own folder (as the cache is):
    # a table is unpickled, so one written by someone else is never read
    places = [p for p in (COMPILED_DIR, cache_dir()) if folder_problem(p, create=False) is None]
    for place in places:
        data = read_verified(place / name)
        if data is not None:
            return pickle.loads(data)
    rules = tuple(_load([RULES_DIR], builtin=True))
    table = default_op_table()
    data = pickle.dumps((rules, table))
    for place in [COMPILED_DIR, cache_dir()]:
        try:
            place.mkdir(exist_ok=True, mode=0o700)
            if folder_problem(place, create=False) is not None:
                continue
            store(place / name, data)
            if place == COMPILED_DIR:  # one table per installation, as one .pyc per module
                for old in place.glob("rules-*.pickle*"):
                    if not old.name.startswith(name):
                        old.unlink(missing_ok=True)
            break
        except OSError:  # a read-only installation: the kernel cache then
            continue
    return rules, table


@cache
def _user(user_paths: tuple[str, ...]) -> tuple[tuple[Rule, ...], OpTable]:
    rules, table = load_rule_files([Path(p) for p in user_paths])
    return tuple(rules), table


def user_ops(table: OpTable) -> list[OpInfo]:
    """The ops of `table` that a user's file declared (or replaced)."""
    builtin = builtin_op_table().ops
    return [op for name, op in table.ops.items() if builtin.get(name) is not op]


def op_table_for(opts: Options) -> OpTable:
    """The op table a compilation with `opts` uses: the package's, plus the ops its
    rule files declare."""
    if not opts.rules:
        return builtin_op_table()
    return _user(tuple(opts.rules))[1]


@cache
def _ruleset(user_paths: tuple[str, ...], disabled: tuple[str, ...],
             verify: bool = True) -> tuple[Rule, ...]:
    user, table = _user(user_paths)
    rules = check_unique(list(builtin_rules()) + list(user))
    _check_disabled(disabled, rules)
    if (user or user_ops(table)) and verify:
        # Built-in rules and ops are checked by the test suite; a user's get the same
        # gate here, once per process, so an unsound rule or an op whose kernel
        # expression parts from ATen never reaches a compiled graph.
        # here, as in cmd_rules: they import torch, which `rules list` needs not
        from .opcheck import verify_user_ops
        from .rulecheck import verify_user_rules

        verify_user_ops(user_ops(table), table, rules)
        verify_user_rules(list(user), rules, table)
    return tuple(r for r in rules if r.name not in disabled)


def _check_disabled(disabled: tuple[str, ...], rules: list[Rule]) -> None:
    names = {r.name for r in rules}
    unknown = [n for n in disabled if n not in names]
    if unknown:
        raise RuleError("disable names no rule: " + "; ".join(
            f"{n!r}{closest(n, names)}" for n in unknown))


def check_disabled(opts: Options) -> None:
    """Raise if `opts.disable` names a rule that does not exist, as soon as the options
    are given. The user's rule files' own errors are left to the first compilation,
    which reports them (and falls back, or fails under strict)."""
    if not opts.disable:
        return
    try:
        rules = check_unique(list(builtin_rules()) + _load([Path(p) for p in opts.rules],
                                                           builtin=False))
    except RewritecError:
        return
    _check_disabled(tuple(opts.disable), rules)


def ruleset_for(opts: Options, verify: bool = True) -> list[Rule]:
    """The rules a compilation with `opts` uses; `verify=False` (for `rules check`
    and `rules test`, which report each rule's problems themselves) skips the gate
    that rejects a failing user rule outright."""
    rules = _ruleset(tuple(opts.rules), tuple(opts.disable), verify)
    return [r for r in rules if r.fp_exact or opts.fast_math]


def for_launches(rules: list[Rule], target: str, opts: Options) -> list[Rule]:
    """`rules` less those marked `more_launches`, but for Triton kernels replayed as
    CUDA graphs (cudagraphs on, as mode reduce-overhead sets), where a launch costs
    no host time. Elsewhere the library call stays: on the GPU each launch costs host
    time; on the CPU the written-out kernels are no faster than ATen's batch norm (a
    ResNet-like training step, 2 cores: 24.9 ms against 16.3, about even since the
    OpenMP reductions read in runs)."""
    if target == "triton" and opts.cudagraphs == "on":
        return rules
    return [r for r in rules if not r.more_launches]


def find_rule(name: str, opts: Options) -> Rule:
    for r in ruleset_for(opts):
        if r.name == name:
            return r
    if name in BUILTIN_STEPS:
        raise RuleError(f"{name} is a built-in step of the rewriter, not a rule: "
                        f"{BUILTIN_STEPS[name]}")
    if name in KERNEL_REWRITES:
        rw = KERNEL_REWRITES[name]
        raise RuleError(f"{name} is a built-in kernel rewrite of the variants pass, not a "
                        f"rule: {rw.doc} ({rw.location})")
    raise RuleError(f"no rule named {name!r} (see `rewritec rules list`)")


def list_rules(opts: Options) -> int:
    """Every rule, those marked `fp_exact: false` (run only with --fast-math) too,
    tagged, so that the count agrees with `rules check`; then the built-in steps
    that "rules fired" can also name."""
    rules = ruleset_for(dataclasses.replace(opts, fast_math=True))
    width = max(len(r.name) for r in rules)
    for r in sorted(rules, key=lambda r: (r.kind, r.where.file, r.where.line)):
        tag = "" if r.fp_exact else "  (fast-math)"
        print(f"{r.kind:<10} {r.name:<{width}}  {r.doc:<44}  {r.location}{tag}")
    fast = sum(not r.fp_exact for r in rules)
    print(f"\n{len(rules)} rules ({fast} fast-math: applied only with --fast-math)")
    print(f"built-in steps (not rules): "
          f"{', '.join(sorted([*BUILTIN_STEPS, *KERNEL_REWRITES]))}")
    return 0


def cmd_rules(args: argparse.Namespace) -> int:
    opts = Options.make(rules=tuple(args.rules))
    if args.action == "list":
        return list_rules(opts)

    import torch  # here: `rules list` runs without torch

    if not torch.cuda.is_available() and "triton" not in sys.modules:
        # Examples of Triton-only templates (the matmul) run through Triton's
        # interpreter on a machine without a GPU; it must be chosen before import.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .opcheck import check_ops  # imports torch, which `list` needs not
    from .rulecheck import check_rules, test_rules

    # each rule's problems are reported, not gated: every rule, fast-math ones too
    rules = ruleset_for(Options.make(rules=opts.rules, fast_math=True), verify=False)
    table = op_table_for(opts)
    if args.action == "check":
        failed_ops = check_ops(user_ops(table), table, rules, sys.stdout)
        return check_rules(rules, out=sys.stdout, table=table) or int(failed_ops > 0)
    return test_rules(rules, out=sys.stdout, table=table)
