"""Optimizer state the train step takes out, or replaces with a new dict.

NOTE: [optimizer state removed in the step]
A FedAvg client starts each round with a fresh local optimizer: ``opt.state.clear()``
(or ``opt.state = defaultdict(dict)``, ``opt.state.pop(p, None)``) inside the step, then
``opt.step()``, which makes the state again. Until the sixty-sixth session three things
went wrong silently:

- The prediction of Adam's first state (NOTE: [Adam's first state predicted]) took a
  cleared dict for "no gradient": the predicted entries were read by no op (they were
  thrown away), so they were dropped from the program, with the state Adam made again
  inside it: the optimizer was left empty after every such call where eager holds 4
  entries, and the next call without a reset started from nothing (Adam, 4 calls reset
  True, False, False, True: call 3 loss 1.4523 against eager's 1.4162, parameters 0.242
  off). ``RecordedStates`` noted reads but not ``clear`` / ``pop`` / ``popitem`` /
  ``del``: they now note the user's line (``removed_at``, on the whole state and on
  each parameter's dict), and a step that takes state out is neither predicted nor
  made before its first program (``initial_state._recorded_entries``): its first call
  compiles the program of an empty optimizer, exact.
- ``opt.state = defaultdict(dict)`` escaped the records altogether: the optimizer then
  made its state in the new dict, and the program wrote the old entries back unchanged
  (with state present: Adam's state 2.4 relative off from the first call). The new dict's
  entries are now taken into the traced state after the step (``settle_removed_state``):
  the program writes the state the step leaves, as for ``clear()``.
- An entry taken out and not made again (``clear()`` in a call that does not step, or
  of a parameter that gets no gradient) kept its old value, since a program writes the
  state it makes and cannot take entries out of the optimizer. That is refused, naming
  the line, with the forms that compile: the state zeroed in place (torch Adam's fresh
  state), or cleared between calls, outside the step.

Entries taken out and made again by the step (``clear()`` before ``opt.step()`` with a
gradient for every parameter) compile to a program that writes the new values: eager's
entries and values after each call (the dicts keep their identity, as for all state the
program writes). ``tests/sim/test_optimizer_state_removed.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import SourceLocation, SPMDCompileError
from .initial_state import RecordedState, RecordedStates

_REPLACED = "optimizer.state set to another dict in the step"


def settle_removed_state(
    optimizers: list[torch.optim.Optimizer],
    swapped: list[tuple[RecordedStates, dict[str, tuple[int, torch.Tensor]]]],
) -> None:
    """After the traced step: take a replaced ``optimizer.state``'s entries into the
    traced state dict, and refuse entries the step took out and did not make again."""
    for oi, (opt, (states, by_param)) in enumerate(zip(optimizers, swapped, strict=True)):
        if opt.state is not states:
            _take_replaced(oi, opt, states)
        for name, (_, traced_p) in by_param.items():
            entries = dict.get(states, traced_p) or {}
            gone = sorted((key for key in states.before.get(id(traced_p), ()) if key not in entries), key=repr)
            if gone:
                raise _removed(oi, opt, name, gone, states, entries)


def _take_replaced(oi: int, opt: torch.optim.Optimizer, states: RecordedStates) -> None:
    new = opt.state
    if not isinstance(new, dict) or not all(isinstance(v, dict) for v in new.values()):
        raise SPMDCompileError(
            f"The train step sets optimizer[{oi}].state ({type(opt).__name__}) to a "
            f"{type(new).__name__}, not a dict of dicts.",
            hint="clear the state (`optimizer.state.clear()`) instead of replacing it.",
        )
    entries = {p: v if isinstance(v, RecordedState) else RecordedState(v) for p, v in new.items()}
    dict.clear(states)
    for p, v in entries.items():
        dict.__setitem__(states, p, v)
    if states.removed_at is None:
        states.removed_at = _REPLACED
    opt.state = states


def _removed(
    oi: int, opt: torch.optim.Optimizer, name: str, gone: list[Any], states: RecordedStates,
    entries: dict[Any, Any],
) -> SPMDCompileError:
    where = getattr(entries, "removed_at", None) or states.removed_at
    line = where if isinstance(where, SourceLocation) else None
    how = f" ({where})" if isinstance(where, str) else ""
    return SPMDCompileError(
        f"The train step takes optimizer[{oi}] ({type(opt).__name__}) state "
        f"{', '.join(map(repr, gone))} of {name} out{how} and does not make it again (a "
        "call that does not step, or a parameter without a gradient): a compiled step "
        "writes the state its program makes and cannot take entries out of the "
        "optimizer, so they would keep their old values where eager has none (NOTE: "
        "[optimizer state removed in the step]).",
        user_line=line,
        hint="start the optimizer afresh in a form that compiles: zero its state in place "
        "inside the step (`for s in opt.state.values(): [v.zero_() for v in s.values()]`, "
        "which is torch Adam's and AdamW's fresh state), or clear it outside the compiled "
        "step, between calls (`opt.state.clear()`); a clear() inside the step compiles "
        "where the step then steps every parameter, making its state again.",
    )
