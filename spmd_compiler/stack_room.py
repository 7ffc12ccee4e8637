"""Compiles run with room on CPython's frame stack.

NOTE: [room on the Python stack]
CPython 3.11 to 3.13 keep a thread's Python frames in chunks of 16 KiB, each mapped
with ``mmap`` when a call does not fit in the chunk on top and unmapped as soon as the
first frame in it returns. A loop deep in the stack whose calls cross a chunk's edge
maps, faults in and unmaps a chunk on every crossing (CPython issue 142183, "Calls
across stack chunks perform badly"; from 3.14, and in later 3.13 releases, a thread
keeps one spare chunk). A compile is such a loop: capture, expansion and the passes
run every op of the program through 40-100 frames of make_fx, DTensor and fake-tensor
dispatch. Where an edge falls depends on everything below it, so it moved with the
model: measured (CPython 3.11.7, the demo GPT of width 64 under ddp, 2 simulated ranks,
one compile each, `strace`), 76,326 unmapped 16 KiB chunks for 8 layers and 525,096 for
16; the 16-layer compile spent 8.3 s in the kernel with 712,000 page faults, its
expansion took 34 s against 12 s for 8 layers (3x for 2x the nodes), and the compile
77.9 s against 33.2 s.

A compile therefore runs inside ``call_with_room``: a call whose frame has 66,000
unused local slots, so CPython gives it a chunk of its own of 1 MiB (the next power of
two above the frame and 1,000 slots of headroom). The frame takes a little more than
half of it; the compile's frames take the rest (about 508 KiB, thousands of frames)
and no edge lies under its loops. One chunk is mapped per compile, and the frame's
slots are written once (129 pages). Measured the same way, fresh processes alternating
with the code before, two rounds: 16 layers 62.8 / 62.9 s against 66.3 / 81.9 s, 0.7 s in
the kernel against 8.6 / 9.0 s, 94,000 page faults against 710,000; 8 layers 30.4 / 31.9
s against 29.9 / 38.0 s. The steady steps do not cross edges (6 page faults per
simulated step), and are not run this way: the frame's 129 pages would cost more than
they save. An exception raised through the frame keeps a copy of its slots (516 KiB)
with its traceback, until the exception is dropped.

Not applied where it is not needed: CPython 3.10 allocates each frame on its own, and
3.14 keeps a spare chunk. Test: ``tests/unit/test_stack_room.py``; its loop across chunk
edges, run by hand: page faults 5,200 -> 17 on CPython 3.11.7, 5,205 -> 17 on 3.12.1,
5,206 -> 17 on 3.13.0; 116 on 3.10.13 without it.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

ROOM_SLOTS = 66_000  # unused locals: a 516 KiB frame, so a chunk of 1 MiB

NEEDED = sys.implementation.name == "cpython" and (3, 11) <= sys.version_info[:2] < (3, 14)


def _call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def _with_room(func: Callable[..., Any], slots: int) -> Callable[..., Any]:
    """``func`` with ``slots`` more local variables that its code never touches."""
    assert isinstance(func, types.FunctionType)
    code = func.__code__
    names = code.co_varnames + tuple(f"_room{i}" for i in range(slots))
    roomy = code.replace(co_varnames=names, co_nlocals=len(names))
    return types.FunctionType(roomy, func.__globals__, "call_with_room")


@functools.cache
def _roomy_call() -> Callable[..., Any]:
    """Built at the first compile, not at import: its 66,000 names take ~40 ms."""
    return _with_room(_call, ROOM_SLOTS) if NEEDED else _call


def call_with_room(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` with a fresh stack chunk of its own below it (the NOTE)."""
    return _roomy_call()(fn, *args, **kwargs)  # type: ignore[no-any-return]


__all__ = ["NEEDED", "ROOM_SLOTS", "call_with_room"]
