"""What a frame's current instruction is part of (``capture/source_sites.py``): the
condition of a ``while`` (NOTE: [while loops on tensor values]), a call of the builtin
max() / min() (NOTE: [max and min of an .item() value]). A value whose ``__bool__``
looks at its caller's frame stands in for a traced tensor."""

from __future__ import annotations

import sys

from spmd_compiler.capture.source_sites import builtin_called, while_of_condition


class Seen:
    """Truthy ``times`` times; each ``bool()`` / comparison records what the asking frame
    is running."""

    def __init__(self, times: int = 1) -> None:
        self.times = times
        self.loops: list[int | None] = []
        self.builtins: list[str | None] = []

    def __bool__(self) -> bool:
        frame = sys._getframe(1)
        loop = while_of_condition(frame)
        self.loops.append(None if loop is None else loop.lineno)
        self.builtins.append(builtin_called(frame))
        self.times -= 1
        return self.times >= 0

    def __lt__(self, other: object) -> Seen:
        return self

    __gt__ = __lt__


def _line(function: object, offset: int) -> int:
    return function.__code__.co_firstlineno + offset  # type: ignore[attr-defined]


def while_loop(seen: Seen) -> None:
    while seen:
        pass


def while_not_loop(seen: Seen) -> None:
    k = 0
    while not (seen or k >= 5):
        k += 1


def ifs_in_loops(seen: Seen) -> None:
    for _ in range(2):
        if seen:
            pass
    k = 0
    while k < 2:
        k += 1
        if seen:
            break


def clamped(seen: Seen) -> None:
    max(seen, 1)
    min(1, seen)
    sorted([seen, 1])


def test_a_while_condition_is_found_at_its_top_and_end_tests():
    seen = Seen(times=2)
    while_loop(seen)  # tested 3 times: the top test, then the end test twice
    assert seen.loops == [_line(while_loop, 1)] * 3


def while_not_alone(seen: Seen) -> None:
    while not seen:
        pass


def test_a_negated_while_condition_is_found():
    seen = Seen(times=1)  # truthy at once: the loop ends at its first test
    while_not_alone(seen)
    assert seen.loops == [_line(while_not_alone, 1)]


def test_a_combined_while_condition_is_none():
    """``k >= 5`` bounds the loop in Python: its ways are branches, as before."""
    seen = Seen(times=0)
    while_not_loop(seen)
    assert seen.loops and set(seen.loops) == {None}


def bounded_loops(seen: Seen) -> None:
    k = 0
    while seen:
        k += 1
        if k >= 2:
            break
    k = 0
    while True:
        k += 1
        if not seen:
            break
        if k >= 2:
            raise RuntimeError("no convergence")


def test_a_while_with_another_way_out_is_none():
    """A ``break`` or ``raise`` beside the condition may bound the loop in Python."""
    seen = Seen(times=10)
    try:
        bounded_loops(seen)
    except RuntimeError:  # the second loop's Python bound
        pass
    assert len(seen.loops) == 4 and set(seen.loops) == {None}, seen.loops


def test_ifs_in_a_for_or_while_body_are_no_loop_condition():
    seen = Seen(times=10)
    ifs_in_loops(seen)
    assert len(seen.loops) == 3 and seen.loops == [None, None, None]


def test_max_and_min_are_named_and_other_calls_are_not():
    seen = Seen(times=10)
    clamped(seen)
    assert seen.builtins[:2] == ["max", "min"] and set(seen.builtins[2:]) == {None}, seen.builtins


def loop_until_break(seen: Seen) -> None:
    k = 0
    while True:
        k += 1
        if not seen:
            break
        for _ in range(1):
            if seen:
                break


def test_a_break_of_a_while_true_loop_is_its_condition():
    """torch's trunc_normal_ form; a `break` of a `for` inside it is not."""
    seen = Seen(times=2)
    loop_until_break(seen)
    while_line = _line(loop_until_break, 2)
    assert seen.loops == [while_line, None, while_line], seen.loops
