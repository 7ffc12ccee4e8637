"""The lines of the train step that write into a traced param group.

NOTE: [lines of param-group writes]
A write into a param group inside the step is refused after the trace (NOTE:
[param-group writes in the step] in ``trace.py``), when the write itself is over: the
refusal of nanoGPT's ``for g in opt.param_groups: g["lr"] = lr`` before its micro-batch
loop named no line of the step, unlike the project's other refusals (a probe,
2027-01). The traced groups are ``GroupWritesSeen`` dicts: each ``group[key] = value``,
``del group[key]`` and ``group.update(...)`` keeps the line of the user's code that ran
it (the innermost frame outside torch and this package: the step's line, or a custom
optimizer's ``step()``), the last one per key, and the refusal names it. The capture's
own writes bypass it (``dict.__setitem__``, or made before the group is wrapped); a
write by other means (``setdefault``, ``pop``) is still refused, without a line.

A module attribute the step changes on every call (``model.it += 1``) is refused after
the probe trace of NOTE: [a step that changes what it reads]; the refusal named the
``def`` line of the step (probe s66). While the probe runs, ``module_writes_seen``
watches ``nn.Module.__setattr__`` for the one attribute the first trace changed and
keeps the line of its last write, which the refusal names. An attribute of a plain
object the step is given (TD3's delayed actor update counted as ``ctr.it += 1``) named the
``def`` line too (sixty-eighth session's probe): its owner, found among the referrers of
its ``__dict__`` (``gc``, some 50 ms, only where that dict is no module's and no
module's globals), has its class's ``__setattr__`` watched the same way while the probe
runs. A write that bypasses both (``obj.__dict__[...]``, a global, an object of a class
that cannot take an attribute: a builtin one) keeps the ``def`` line.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

import torch
import torch.nn as nn

from ..errors import Change, SourceLocation, innermost_model_frame_of_stack
from .optimizers import MomentumGroup

# The hint of a refused learning-rate write in the step.
LR_WRITE_HINT = (
    "set the learning rate outside the compiled step, before calling it, computed there: "
    "`lr = get_lr(it)`, `for g in opt.param_groups: g['lr'] = lr`, then "
    "`loss = step(model, opt, x)`. The learning rate is an input of the compiled program, read from the param group on every call, so a new "
    "value each call costs no recompile (with torch.optim's optimizers). An LR scheduler's "
    "scheduler.step() may also stay in the step: the compiled step replays it."
)


class _WritesSeen:
    """Mixin of a traced param group (a dict): the line of the last write of each key."""

    def lines(self) -> dict[Any, SourceLocation | None]:
        return self.__dict__.setdefault("_written_at", {})

    def __setitem__(self, key: Any, value: Any) -> None:
        self.lines()[key] = innermost_model_frame_of_stack()
        super().__setitem__(key, value)  # type: ignore[misc]

    def __delitem__(self, key: Any) -> None:
        self.lines()[key] = innermost_model_frame_of_stack()
        super().__delitem__(key)  # type: ignore[misc]

    def update(self, *args: Any, **kwargs: Any) -> None:
        where = innermost_model_frame_of_stack()
        entries = dict(*args, **kwargs)
        self.lines().update(dict.fromkeys(entries, where))
        super().update(entries)  # type: ignore[misc]


class GroupWritesSeen(_WritesSeen, dict):
    """A traced param group that keeps the lines of its writes (see the NOTE)."""


class MomentumGroupWritesSeen(_WritesSeen, MomentumGroup):
    """A ``MomentumGroup`` that keeps the lines of its writes (see the NOTE)."""


def written_at(group: Any, keys: list[Any]) -> SourceLocation | None:
    """The line of the last write of the first of ``keys`` the step wrote, or None."""
    lines = group.lines() if isinstance(group, _WritesSeen) else {}
    return next((lines[k] for k in keys if lines.get(k) is not None), None)


@contextlib.contextmanager
def module_writes_seen(
    change: Change | None, optimizers: Sequence[torch.optim.Optimizer] = ()
) -> Iterator[list[SourceLocation | None]]:
    """The lines that write the module or optimizer attribute ``change`` names, while
    the block runs (see the NOTE); nothing watched where ``change`` is no attribute."""
    seen: list[SourceLocation | None] = []
    if change is None or change.place is None:
        yield seen
        return
    container, key = change.place
    # an optimizer's own counter (``self.t += 1`` in its step()): its class's __setattr__
    # is watched, for that object only (NOTE: [counters a custom optimizer keeps])
    of_optimizer = next((type(o) for o in optimizers if vars(o) is container), None)
    owner = nn.Module if _of_a_module(container) else of_optimizer or _class_of_owner(container)
    if owner is None:
        yield seen
        return
    of_class: Any = owner
    set_attribute = of_class.__setattr__  # the class's own function, unbound

    def watched(obj: Any, name: str, value: Any) -> None:
        if name == key and getattr(obj, "__dict__", None) is container:
            seen.append(innermost_model_frame_of_stack())
        set_attribute(obj, name, value)

    try:
        patch = mock.patch.object(owner, "__setattr__", watched)
        patch.__enter__()
    except (TypeError, AttributeError):  # a builtin class: nothing watched
        yield seen
        return
    try:
        yield seen
    finally:
        patch.__exit__(None, None, None)


def _of_a_module(container: object) -> bool:
    """Whether ``container`` is the ``__dict__`` of an ``nn.Module`` (or looks so)."""
    return isinstance(container, dict) and "_parameters" in container and "_modules" in container


def _class_of_owner(container: object) -> type | None:
    """The class of the object whose ``__dict__`` is ``container`` (see the NOTE); None
    for a module's globals or where no such object is found."""
    if not isinstance(container, dict) or "__builtins__" in container:
        return None
    for referrer in gc.get_referrers(container):
        if not isinstance(referrer, (dict, type)) and getattr(referrer, "__dict__", None) is container:
            return type(referrer)
    return None
