"""``leaves_loop``: which `if`s leave their loop, from the bytecode (NOTE: [the guess
for later ifs] in ``capture/value_checks.py``)."""

from __future__ import annotations

import dis
from typing import Any

from spmd_compiler.capture.value_checks import leaves_loop


def _ifs(function: Any) -> list[bool]:
    """``leaves_loop`` of each `if` of ``function`` that pops its condition, in order."""
    return [
        leaves_loop(function.__code__, ins.offset)
        for ins in dis.get_instructions(function)
        if ins.opname.startswith("POP_JUMP") and ins.argval is not None
    ]


def per_parameter(params, refresh):  # noqa: ANN001, ANN201
    for p in params:
        if p is None:
            continue
        if refresh(p):  # both ways go on to the next parameter
            p.refresh()
        p.step += 1


def halting(x, halted):  # noqa: ANN001, ANN201
    for _ in range(4):
        x = x + 1
        if halted(x):
            break
    return x


def until(x, halted):  # noqa: ANN001, ANN201
    while True:
        x = x + 1
        if halted(x):
            return x


def converging(x, busy):  # noqa: ANN001, ANN201
    while busy(x):  # its test before the loop, then at the loop's end
        x = x + 1
    return x


def outside(x, c):  # noqa: ANN001, ANN201
    if c(x):
        x = x + 1
    return x


def test_an_if_whose_ways_both_go_on_in_its_loop_does_not_leave_it():
    assert _ifs(per_parameter) == [False, False]


def test_break_return_and_the_test_of_a_while_leave_their_loop():
    assert _ifs(halting) == [True]
    assert _ifs(until) == [True]
    assert _ifs(converging)[-1] is True


def test_an_if_in_no_loop_does_not_leave_one():
    assert _ifs(outside) == [False]
