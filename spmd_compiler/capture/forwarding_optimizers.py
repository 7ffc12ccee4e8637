"""Optimizer wrappers that forward to an inner optimizer, taken as that optimizer.

NOTE: [optimizers forwarding to an inner one]
accelerate's ``AcceleratedOptimizer`` (which ``transformers.Trainer`` steps and names as
``self.optimizer`` in its ``training_step``) subclasses ``torch.optim.Optimizer`` without
running its ``__init__``: it keeps no param groups or state of its own, its
``param_groups`` and ``state`` are properties reading (and setting) those of the
optimizer it holds in ``.optimizer``, and its ``step()`` steps that one. Before the
sixty-third session a compiled step took such a wrapper as an optimizer of its own: one
that only named it (a forward/backward step) crashed installing the load hook
(``AttributeError: ... '_optimizer_load_state_dict_pre_hooks'``: torch's hook dicts are
made by ``Optimizer.__init__``), and one that stepped it failed capture (``KeyError:
'parameter not found'``: swapping the wrapper's groups set the inner's through the
property, so the inner's swap met the stand-ins; a forwarding property without a setter
failed with "property 'param_groups' ... has no setter").

A wrapper whose ``param_groups`` is not its own attribute (read through its class: a
property or ``__getattr__``) and is the very list of a ``torch.optim.Optimizer`` it
holds in an attribute, with ``state`` likewise that optimizer's dict, stands for that
optimizer: the step's optimizers hold the inner one in its place (followed through
wrappers of wrappers), which capture swaps and the runtime hooks, and the wrapper, which
only forwards, sees the traced groups and state through it. The wrapper's own ``step()``
runs as written in the trace (accelerate's steps the inner one), and the wrapper is kept
beside the optimizers (``StepBindings.wrappers``) wherever the step's code is walked as
an optimizer's: its attributes and step hooks are guarded (accelerate's step reads
``gradient_state.sync_gradients``: a flag cleared between calls would have run the
update anyway, 1.5 relative off eager), its ``step()`` is walked for tensors it keeps,
and its own ``step()`` is not refused as an optimizer the step was not given. A wrapper sharing the
inner's groups as its own attribute (SAM, Lookahead: ``self.param_groups =
base.param_groups``, after ``Optimizer.__init__``) is an optimizer of its own, as before
(NOTE: [modules and optimizers by name] in ``capture/bindings.py``).

Refused before anything is touched, naming the class, with the advice to pass the inner
optimizer: an optimizer whose ``param_groups`` comes from its class without being an
inner optimizer's list with that optimizer's state (a capture could not point it at the
traced parameters), and one that did not run ``Optimizer.__init__`` and forwards to no
inner optimizer (it has none of the hook dicts the runtime and torch's ``step`` use).
"""

from __future__ import annotations

import torch

from .. import _torch_private as private
from ..errors import SPMDCompileError


def forwarded_optimizer(opt: torch.optim.Optimizer) -> torch.optim.Optimizer | None:
    """The optimizer ``opt`` forwards its param groups and state to (see the NOTE), or
    None where ``opt`` is not such a wrapper."""
    own = vars(opt)
    if "param_groups" in own or "state" in own:
        return None
    groups, state = getattr(opt, "param_groups", None), getattr(opt, "state", None)
    for value in own.values():
        if isinstance(value, torch.optim.Optimizer) and value is not opt:
            if value.param_groups is groups and value.state is state:
                return value
    return None


def inner_optimizers(
    optimizers: list[torch.optim.Optimizer], where: str
) -> tuple[list[torch.optim.Optimizer], list[torch.optim.Optimizer]]:
    """``optimizers`` with each forwarding wrapper replaced by the optimizer it stands
    for (without repeats), and the wrappers replaced.

    Raises:
        SPMDCompileError: an optimizer a compiled step cannot take (see the NOTE).
    """
    taken: list[torch.optim.Optimizer] = []
    wrappers: list[torch.optim.Optimizer] = []
    for given in optimizers:
        opt, chain = given, [given]
        while (inner := forwarded_optimizer(opt)) is not None and all(inner is not c for c in chain):
            if all(opt is not w for w in wrappers):
                wrappers.append(opt)
            opt = inner
            chain.append(inner)
        _refuse_unusable(opt, given, where)
        if all(opt is not t for t in taken):
            taken.append(opt)
    return taken, wrappers


def _refuse_unusable(opt: torch.optim.Optimizer, given: torch.optim.Optimizer, where: str) -> None:
    name = f"{type(opt).__module__}.{type(opt).__qualname__}"
    through = "" if opt is given else f" (wrapped by the step's {type(given).__qualname__})"
    hint = (
        "pass the torch.optim.Optimizer it wraps to the step instead (accelerate's "
        "AcceleratedOptimizer: its .optimizer), or have the wrapper forward both "
        "param_groups and state to an optimizer it holds in an attribute."
    )
    if "param_groups" not in vars(opt):
        raise SPMDCompileError(
            f"The train step's optimizer {name}{through} reads its param_groups through "
            "its class (a property or __getattr__), and they and its state are not those "
            "of a torch.optim.Optimizer it holds in an attribute: a compiled step points "
            "an optimizer's groups and state at the traced parameters, and cannot do so "
            "for this one (NOTE: [optimizers forwarding to an inner one]).",
            user_line=where,
            hint=hint,
        )
    if not private.optimizer_set_up(opt):
        raise SPMDCompileError(
            f"The train step's optimizer {name}{through} did not run "
            "torch.optim.Optimizer.__init__ (it has none of torch's hook dicts) and does "
            "not forward its param_groups and state to an optimizer it holds "
            "(NOTE: [optimizers forwarding to an inner one]).",
            user_line=where,
            hint="call super().__init__(params, defaults) in its __init__, or " + hint,
        )
