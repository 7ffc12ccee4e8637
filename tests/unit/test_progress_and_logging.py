"""Progress lines of long compiles and SPMD_DEBUG logging printed once."""

from __future__ import annotations

import io
import logging
import time

import pytest

from spmd_compiler import progress
from spmd_compiler.passes import debug


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_style_follows_env_terminal_and_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.delenv(progress.PROGRESS_ENV, raising=False)
    assert progress.progress_style(_Tty()) == "live"
    assert progress.progress_style(io.StringIO()) == "plain"
    monkeypatch.setenv("CI", "true")
    assert progress.progress_style(_Tty()) == "plain"
    monkeypatch.setenv(progress.PROGRESS_ENV, "0")
    assert progress.progress_style(_Tty()) == "off"


def test_an_unknown_progress_style_warns_once(monkeypatch, caplog):
    """SPMD_PROGRESS=plian was auto without a word (SPMD_DEBUG=abc warns); now a warning,
    once per value, and auto as before."""
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setenv(progress.PROGRESS_ENV, "Plian-test")
    with caplog.at_level(logging.WARNING, logger="spmd_compiler.progress"):
        assert progress.progress_style(_Tty()) == "live"
        assert progress.progress_style(io.StringIO()) == "plain"
    said = [r.getMessage() for r in caplog.records if r.name == "spmd_compiler.progress"]
    assert said == ["SPMD_PROGRESS='plian-test' is not a progress style (auto, live, plain, "
                    "0 / off); using auto"], said
    caplog.clear()
    for value in ("auto", "live", "plain", "off", "0"):
        monkeypatch.setenv(progress.PROGRESS_ENV, value)
        progress.progress_style(_Tty())
    assert not caplog.records


def test_short_compile_prints_nothing(monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "plain")
    out = io.StringIO()
    with progress.compile_progress("step", stream=out) as p, p.stage("capture"):
        pass
    assert out.getvalue() == ""


def test_long_compile_shows_the_stage_within_the_threshold_then_each_stage(monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "plain")
    out = io.StringIO()
    with progress.compile_progress("step", stream=out, show_after_s=0.3) as p:
        with p.stage("capture"):
            pass
        with p.stage("expand", total=10):
            for _ in range(10):
                progress.current().advance()
            time.sleep(0.8)
            # the header and the finished stages are out before expand ends
            early = out.getvalue()
    assert early.startswith("spmd_compiler: compiling step\n  capture")
    lines = out.getvalue().splitlines()
    assert lines[2].split()[:1] == ["expand"] and lines[2].endswith("(10 nodes)")
    assert lines[-1].startswith("  compiled in")
    assert progress.current().__class__.__name__ == "_Silent"  # reset after the compile


def test_live_style_rewrites_one_status_line(monkeypatch):
    monkeypatch.setenv(progress.PROGRESS_ENV, "live")
    out = _Tty()
    with progress.compile_progress("step", stream=out, show_after_s=0.0) as p:
        with p.stage("expand", total=5):
            p.advance(3)
            time.sleep(0.5)
    assert "\r\033[K  expand" in out.getvalue() and "3/5 nodes" in out.getvalue()


@pytest.mark.parametrize("configure_first", [True, False], ids=["before", "after"])
def test_debug_output_prints_once_with_basic_config(configure_first, capsys):
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    logger = logging.getLogger("spmd_compiler.passes")
    saved_logger = logger.handlers[:], logger.level
    try:
        root.handlers = []
        if configure_first:
            logging.basicConfig(level=logging.INFO, stream=stream, format="%(message)s")
        debug._make_visible(logger)
        debug._make_visible(logger)  # a second compile adds no second handler
        if not configure_first:
            logging.basicConfig(level=logging.INFO, stream=stream, format="%(message)s")
        logger.info("pass pipeline: hello")
        assert stream.getvalue().count("pass pipeline: hello") == 1
        assert "hello" not in capsys.readouterr().err  # not also through our own handler
    finally:
        root.handlers, _ = saved
        root.setLevel(saved[1])
        logger.handlers, _ = saved_logger
        logger.setLevel(saved_logger[1])
