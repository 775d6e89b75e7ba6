"""Debug output goes through the `rewritec` logger, one graph named on every line, and
warnings name the user's line, not rewritec's or torch's."""

from __future__ import annotations

import logging
import re
import warnings

import pytest
import rewritec
import torch
from rewritec import compiler
from rewritec.compiler import RewritecWarning
from rewritec.engine import diag


@pytest.fixture(autouse=True)
def _restore_logger():
    """enable_debug changes process-wide state; give every test the state it found."""
    saved = (diag._handler, diag._our_level, diag.log.level, list(diag.log.handlers),
             list(diag.log.filters))
    yield
    diag._handler, diag._our_level = saved[0], saved[1]
    diag.log.setLevel(saved[2])
    diag.log.handlers[:] = saved[3]
    diag.log.filters[:] = saved[4]


def _compile_and_run(**options) -> None:
    fn = rewritec.compile(lambda x: (x + x).sin(), **options)
    fn(torch.randn(8))


def _ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name.startswith("rewritec")]


def test_debug_lines_are_log_records_naming_their_graph(caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="rewritec")
    _compile_and_run(debug=1)
    records = _ours(caplog)
    assert records, caplog.text
    assert any("phase simplify" in r.getMessage() for r in records), caplog.text
    for r in records:
        assert re.match(r"g\d+_\w+: ", r.getMessage()), r.getMessage()


def test_rewritec_debug_env_prints_with_prefix(monkeypatch, capsys) -> None:
    monkeypatch.setattr(diag, "_handler", None)  # as in a fresh process
    monkeypatch.setenv("REWRITEC_DEBUG", "1")
    _compile_and_run()
    out = capsys.readouterr().out
    assert re.search(r"^\[rewritec\] g\d+_\w+: phase simplify: ", out, re.M), out


def test_a_level_on_the_logger_silences_it(caplog, capsys) -> None:
    caplog.set_level(logging.WARNING, logger="rewritec")
    _compile_and_run(debug=2)
    assert not _ours(caplog), caplog.text
    assert "[rewritec] " not in capsys.readouterr().out


def test_a_filter_on_the_logger_silences_it(caplog, capsys) -> None:
    caplog.set_level(logging.DEBUG, logger="rewritec")
    diag.log.addFilter(lambda record: "phase" not in record.getMessage())
    _compile_and_run(debug=1)
    assert not [r for r in _ours(caplog) if "phase" in r.getMessage()], caplog.text
    assert "phase simplify" not in capsys.readouterr().out


def test_logger_level_alone_turns_debug_on(caplog) -> None:
    """What TORCH_LOGS="rewritec" does: set the logger's level, no REWRITEC_DEBUG."""
    caplog.set_level(logging.INFO, logger="rewritec")
    _compile_and_run()
    assert any("phase simplify" in r.getMessage() for r in _ours(caplog)), caplog.text


def test_fallback_warning_points_at_the_caller(monkeypatch) -> None:
    def failing(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(compiler, "_compile", failing)
    fn = rewritec.compile(lambda x: x.sin())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn(torch.randn(4))
    ours = [w for w in caught if issubclass(w.category, RewritecWarning)]
    assert ours, [str(w.message) for w in caught]
    assert ours[0].filename == __file__, (ours[0].filename, ours[0].lineno)


def test_stacklevel_skips_rewritec_and_torch() -> None:
    level = diag.user_stacklevel()
    assert level == 1  # called from a test: the caller is already user code
