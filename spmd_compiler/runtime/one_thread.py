"""Compiled steps and simulations, one thread at a time.

NOTE: [one thread at a time]
A compiled call patches process-wide state while it captures (``builtins.print``, the
random-number setters, the clock: NOTE: [Python effects at capture]; torch's fake mode and
dispatch patches), and a simulation owns the process's one (fake) process group: entering
one destroys the group there is. Two threads doing either at once broke each other (the
sixtieth session's probes: "AssertionError: CURRENT_PATCHER ...", "Could not resolve the
process group registered under the name 0", "Unexpectedly not in LocalTensorMode", the
other thread's optimizer named as not passed) and could leave the patches installed
after both ended (a later compile refused; plain prints warned about as traced).
Serializing the calls behind a lock would not make two threads compute as eager: the
process group and the simulation's LocalTensorMode are the process's, not the thread's.
So a compiled call (``CompiledTrainStep.__call__``) or a ``simulate()`` block entered
while another thread is inside one is refused before it touches anything, with
``SPMDCompileError`` ("compiled steps are not thread-safe"); the thread that is inside
goes on undisturbed. One thread after another works as before (a thread that ran its
simulation and calls to the end, then the next). The same thread may nest them (calls
inside its own simulation, a step calling another compiled step).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from ..errors import SPMDCompileError

_LOCK = threading.Lock()
# thread -> how deep it is in compiled calls and simulate blocks
_INSIDE: dict[threading.Thread, int] = {}


def _other_thread_inside(me: threading.Thread) -> threading.Thread | None:
    for thread, depth in _INSIDE.items():
        if thread is not me and depth > 0:
            return thread
    return None


def enter(what: str) -> None:
    """Mark this thread inside a compiled call or simulation; refuse it when another thread
    is inside one (see the NOTE). Pair with ``leave``."""
    me = threading.current_thread()
    with _LOCK:
        other = _other_thread_inside(me)
        if other is None:
            _INSIDE[me] = _INSIDE.get(me, 0) + 1
            return
    raise SPMDCompileError(
        f"compiled steps are not thread-safe: {what} in thread {me.name!r} while thread "
        f"{other.name!r} is inside a compiled step or a simulate() block (they share the "
        "process's patches and process group). Nothing was done (NOTE: [one thread at a "
        "time]).",
        hint="call compiled steps, and enter simulate(), from one thread at a time: let the "
        "other thread finish (join it) first, or run the ranks as processes "
        "(spmd_compiler.launch / torchrun).",
    )


def leave() -> None:
    me = threading.current_thread()
    with _LOCK:
        depth = _INSIDE.get(me, 0) - 1
        if depth > 0:
            _INSIDE[me] = depth
        else:
            _INSIDE.pop(me, None)


@contextlib.contextmanager
def one_thread(what: str) -> Iterator[None]:
    """``enter`` / ``leave`` around the block."""
    enter(what)
    try:
        yield
    finally:
        leave()
