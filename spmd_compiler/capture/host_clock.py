"""Clock reads by the step's own code while it is traced: refused.

NOTE: [host clock at capture]
A compiled step runs its Python once, at capture. A clock read there
(``t0 = time.perf_counter()`` ... ``return loss, time.perf_counter() - t0``, a
timestamp in a returned dict, a schedule computed from ``time.time()``) is a number of
that moment: every later call returned the capture's elapsed time (measured: 0.0537 s on
every call of a step whose calls took 2 ms), with no error. Like a draw from Python's
``random`` (NOTE: [host random numbers at capture]) it is refused, naming the line,
while the step is traced: ``time.time`` / ``time_ns`` / ``perf_counter`` /
``perf_counter_ns`` / ``monotonic`` / ``monotonic_ns`` / ``process_time`` /
``process_time_ns`` called from the user's own files (not from torch, this project,
the standard library or installed packages, whose clock reads time their own work:
logging's timestamps, a progress bar). A clock imported by name into a user's module
(``from time import perf_counter``, read as ``perf_counter()``) is the same function
bound to another name: the user's modules' globals that hold one are refused the same
way for the trace (found among ``sys.modules`` by their file). Limit: a clock held
elsewhere (a class attribute, a default argument) or a method of a C type
(``datetime.datetime.now()``) is not seen.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn
from unittest import mock

from ..errors import SPMDCompileError, innermost_model_frame_of_stack
from .callers import refusing, users_file, users_globals_holding

CLOCKS = ("time", "time_ns", "perf_counter", "perf_counter_ns", "monotonic", "monotonic_ns",
          "process_time", "process_time_ns")


@contextlib.contextmanager
def refuse_clock_reads() -> Iterator[None]:
    """While the step is traced, a clock read from the user's own code raises (the NOTE)."""

    def refused(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def refuse() -> NoReturn:
            raise SPMDCompileError(
                f"The train step reads the clock (time.{name}()): a compiled step runs its "
                "Python once, at capture, so every call would reuse the time read then "
                "(NOTE: [host clock at capture]).",
                user_line=innermost_model_frame_of_stack(),
                hint="time the call outside the compiled step (t0 = time.perf_counter(); "
                "loss = step(...); elapsed = time.perf_counter() - t0).",
            )
        return refusing(real, refuse, users_file)

    reals = {name: getattr(time, name) for name in CLOCKS if hasattr(time, name)}
    with contextlib.ExitStack() as stack:
        for module, key, name in users_globals_holding(reals):
            stack.enter_context(mock.patch.object(module, key, refused(name, reals[name])))
        for name, real in reals.items():
            stack.enter_context(mock.patch.object(time, name, refused(name, real)))
        yield


__all__ = ["CLOCKS", "refuse_clock_reads"]
