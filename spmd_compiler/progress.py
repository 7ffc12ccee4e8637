"""Progress of long compiles on stderr: one line per stage with its time.

A compile that ends within ``SHOW_AFTER_S`` prints nothing. A longer one shows, within
that time, which stage it is in (capture, expand with a node counter, passes with the
pass running, split) and then a line per finished stage with its elapsed time:

    spmd_compiler: compiling gpt_train_step for DataParallel
      capture    2.24 s
      expand     1.34 s  (1455 nodes)
      passes     0.28 s
      compiled in 3.92 s

``SPMD_PROGRESS`` chooses the output (NOTE: [progress output]): ``auto`` (default),
``live`` (a status line rewritten in place), ``plain`` (whole lines only, with a
"still in <stage>" line every ``HEARTBEAT_S``), ``0`` (nothing).

NOTE: [progress output]
Where stderr is a terminal and ``CI`` is not set, ``auto`` is ``live``; otherwise (CI,
logs, pipes, pytest's capture) it is ``plain``, so a log still shows which stage a long
compile is in, without carriage returns. Only rank 0 of a real process group reports
(simulated ranks are one process). Own code rather than tqdm or rich: the stages are a
handful of lines plus one counter, and the package keeps no dependency for it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import TextIO

PROGRESS_ENV = "SPMD_PROGRESS"
SHOW_AFTER_S = 1.5
HEARTBEAT_S = 15.0
_TICK_S = 0.2
_OFF = ("0", "off", "false", "no", "none")
_WARNED: set[str] = set()  # unknown values already warned about

log = logging.getLogger("spmd_compiler.progress")


def progress_style(stream: TextIO | None = None) -> str:
    """``live``, ``plain`` or ``off`` from ``SPMD_PROGRESS``, the stream and ``CI``."""
    raw = os.environ.get(PROGRESS_ENV, "auto").strip().lower()
    if raw in _OFF:
        return "off"
    if raw in ("live", "plain"):
        return raw
    if raw not in ("auto", "") and raw not in _WARNED:  # a typo was silently auto
        _WARNED.add(raw)
        log.warning("%s=%r is not a progress style (auto, live, plain, 0 / off); using auto",
                    PROGRESS_ENV, raw)
    stream = stream if stream is not None else sys.stderr
    is_tty = bool(getattr(stream, "isatty", lambda: False)())
    return "live" if is_tty and not os.environ.get("CI") else "plain"


def _is_reporting_rank() -> bool:
    try:
        import torch.distributed as dist

        return not dist.is_initialized() or dist.get_rank() == 0
    except (ImportError, RuntimeError):
        return True


class CompileProgress:
    """Reports the stages of one compile (use ``compile_progress``)."""

    def __init__(self, title: str, style: str, stream: TextIO, show_after_s: float) -> None:
        self.title, self.style, self.stream = title, style, stream
        self.show_after_s = show_after_s
        self.start = time.perf_counter()
        self.shown = False
        self.done: list[str] = []  # finished stage lines, printed once shown
        self.stage_name: str | None = None
        self.stage_start = self.start
        self.count, self.total, self.detail_text = 0, 0, ""
        self._last_heartbeat = self.start
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- called by the pipeline ------------------------------------------------------
    @contextlib.contextmanager
    def stage(self, name: str, total: int = 0) -> Iterator[CompileProgress]:
        with self._lock:
            self.stage_name, self.stage_start = name, time.perf_counter()
            self.count, self.total, self.detail_text = 0, total, ""
        try:
            yield self
        finally:
            self._end_stage()

    def set_total(self, total: int) -> None:
        self.total = total

    def advance(self, n: int = 1) -> None:
        self.count += n  # read by the ticker thread; a stale value only delays a digit

    def detail(self, text: str) -> None:
        self.detail_text = text

    # -- output ----------------------------------------------------------------------
    def _end_stage(self) -> None:
        with self._lock:
            seconds = time.perf_counter() - self.stage_start
            extra = f"  ({self.total} nodes)" if self.total else ""
            self.done.append(f"  {self.stage_name:<9} {seconds:6.2f} s{extra}")
            self.stage_name = None
            if self.shown:
                self._clear_status()
                self._write(self.done[-1] + "\n")

    def _status(self) -> str:
        now = time.perf_counter()
        text = f"  {self.stage_name} {now - self.stage_start:.1f} s"
        if self.total:
            text += f"  {self.count}/{self.total} nodes"
        if self.detail_text:
            text += f"  {self.detail_text}"
        return text

    def _tick(self) -> None:
        with self._lock:
            now = time.perf_counter()
            if not self.shown and now - self.start >= self.show_after_s:
                self.shown = True
                self._write(f"spmd_compiler: compiling {self.title}\n")
                self._write("".join(line + "\n" for line in self.done))
            if not self.shown or self.stage_name is None:
                return
            if self.style == "live":
                self._write("\r\033[K" + self._status())
            elif now - self._last_heartbeat >= HEARTBEAT_S:
                self._last_heartbeat = now
                self._write(f"  still in{self._status()[1:]}\n")

    def _clear_status(self) -> None:
        if self.style == "live":
            self._write("\r\033[K")

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed stream must not fail a compile
            pass

    def _run(self) -> None:
        while not self._stop.wait(_TICK_S):
            self._tick()

    def __enter__(self) -> CompileProgress:
        self._thread = threading.Thread(target=self._run, name="spmd-progress", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            if self.shown:
                self._clear_status()
                verdict = "failed after" if exc_type else "compiled in"
                self._write(f"  {verdict} {time.perf_counter() - self.start:.2f} s\n")


class _Silent:
    """Stands in for ``CompileProgress`` when nothing is shown."""

    @contextlib.contextmanager
    def stage(self, name: str, total: int = 0) -> Iterator[_Silent]:
        yield self

    def set_total(self, total: int) -> None: ...

    def advance(self, n: int = 1) -> None: ...

    def detail(self, text: str) -> None: ...


_local = threading.local()


def current() -> CompileProgress | _Silent:
    """The progress of the compile running in this thread (a silent one outside)."""
    return getattr(_local, "progress", None) or _Silent()


@contextlib.contextmanager
def compile_progress(
    title: str, stream: TextIO | None = None, show_after_s: float = SHOW_AFTER_S
) -> Iterator[CompileProgress | _Silent]:
    """Report the stages of one compile while the block runs (see the module docstring)."""
    stream = stream if stream is not None else sys.stderr
    style = progress_style(stream)
    if style == "off" or not _is_reporting_rank() or getattr(_local, "progress", None):
        yield current()
        return
    with CompileProgress(title, style, stream, show_after_s) as progress:
        _local.progress = progress
        try:
            yield progress
        finally:
            _local.progress = None
