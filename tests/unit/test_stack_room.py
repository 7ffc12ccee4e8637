"""NOTE: [room on the Python stack]: a loop whose calls cross a frame-stack chunk's
edge maps a chunk per crossing; under ``call_with_room`` it maps none."""

from __future__ import annotations

import resource
import sys

import pytest

from spmd_compiler.stack_room import NEEDED, call_with_room

DEPTH = 600  # ~100-byte frames: several 16 KiB chunks' worth, so edges lie inside
ROUNDS = 400


def down(n: int) -> int:
    return down(n - 1) + 1 if n else 0


def oscillate() -> int:
    """Faults taken by ROUNDS descents to DEPTH and back."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(ROUNDS):
        down(DEPTH)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_call_with_room_returns_and_raises_as_the_call() -> None:
    assert call_with_room(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError):
        call_with_room({}.__getitem__, "missing")


@pytest.mark.skipif(not NEEDED, reason="only CPython 3.11 to 3.13 map frame chunks one by one")
def test_a_loop_across_chunk_edges_maps_no_chunks_with_room() -> None:
    assert sys.getrecursionlimit() > DEPTH + 200
    without = oscillate()
    with_room = call_with_room(oscillate)
    # each crossing faults in at least one fresh page; with room the loop runs in one chunk
    assert without >= ROUNDS, without
    assert with_room < ROUNDS // 10, with_room
