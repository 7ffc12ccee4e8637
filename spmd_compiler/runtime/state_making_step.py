"""The ``lr=0`` step torch's checkpoint code takes to make an optimizer's state, run so
that it works for any ``step()`` signature and leaves the user's generators alone.

NOTE: [the step that makes an optimizer's state]
``load`` into an optimizer that has not stepped reads into state made for it by torch's
``get_state_dict`` (NOTE: [an optimizer saved before its first step] in checkpoint.py):
``_init_optim_state`` calls ``optim.step(closure=None)`` at ``lr=0`` on zero gradients.
Two things went wrong there for optimizers written from papers:

- most declare ``def step(self):`` with no closure, and the load failed with torch's
  ``TypeError: Lion.step() got an unexpected keyword argument 'closure'`` (a probe,
  sixty-eighth session: saved on 2 simulated ranks, loaded at 4). Where the bound
  ``step``'s signature takes no ``closure`` (and no ``**kwargs``), the instance gets a
  ``step`` of its own for that call, which drops the keyword and calls the real one; it
  is removed afterwards on every path (an instance attribute the optimizer already had
  is put back).
- an optimizer drawing random numbers in ``step()`` (SGLD's noise) moved the user's
  global generator with a step whose update is thrown away (the checkpoint's values
  overwrite it), so a resumed run drew other numbers than the run it continues. The
  step runs under ``torch.random.fork_rng``: the CPU generator and, where CUDA is in
  use, the current device's, come back as they were.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch


def _takes_closure(step: object) -> bool:
    """Whether ``step(closure=None)`` binds: a ``closure`` parameter or ``**kwargs``
    (an unreadable signature counts as taking it: the call is left as torch makes it)."""
    try:
        parameters = inspect.signature(step).parameters.values()  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return True
    return any(p.name == "closure" or p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


@contextlib.contextmanager
def _closure_dropped(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Inside: ``optimizer.step(closure=None)`` calls a ``step()`` that takes no closure."""
    step = optimizer.step
    if _takes_closure(step):
        yield
        return
    own = vars(optimizer)
    had, before = "step" in own, own.get("step")

    def without_closure(closure: object = None) -> object:
        return step()

    own["step"] = without_closure  # the instance's own, found before the class's
    try:
        yield
    finally:
        if had:
            own["step"] = before
        else:
            own.pop("step", None)


@contextlib.contextmanager
def state_making_step(optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Inside: torch's state-making ``step(closure=None)`` of ``optimizer`` works for a
    ``step(self)`` and leaves the global generators as found (NOTE: [the step that makes
    an optimizer's state])."""
    if optimizer is None:
        yield
        return
    devices = [torch.cuda.current_device()] if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices), _closure_dropped(optimizer):
        yield
