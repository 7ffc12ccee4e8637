"""What to do instead, for an optimizer whose step keeps a Python counter (NOTE:
[counters the optimizer keeps] in trace.py).

NOTE: [counters a custom optimizer keeps]
The refusals of an optimizer's Python counter told every optimizer to switch to
torch.optim's Adam ("use an optimizer that keeps its step count in a tensor"), advice for
a library's class, which the user does not own. For the user's own class (a probe,
sixty-eighth session: a schedule-free AdamW keeping ``k``, ``weight_sum`` and ``lr_max``
in its param groups; an Adam counting in ``self.t``, whose refusal advised a module
buffer and named the train step's line) the form that compiles is the one torch.optim's
optimizers use: the counters as 0-dim float64 tensors in ``self.state``, updated in
place, with tensor arithmetic on them (the probe's schedule-free AdamW so: exact against
eager). The refusals now say that for a class outside an installed package, name every
counter its step keeps in a group, and, for ``self.t``, the line of the write.

NOTE: [transformers' Adafactor]
transformers' ``Adafactor`` (``Trainer(optim="adafactor")``, T5 recipes) counts in a
Python number in its per-parameter state and is refused. ``torch.optim.Adafactor``
compiles (NOTE: [Adafactor in tensor ops] in adafactor.py) and computes the same update
as transformers' with ``relative_step=True, scale_parameter=True`` (its defaults, at
``lr=1e-2``) and with ``relative_step=False, scale_parameter=True`` at the same ``lr``
while ``step < 1 / lr**2`` (torch's step size is ``min(lr, 1 / sqrt(step))``): float64,
200 steps, parameters within 5e-16. It always scales by the parameter's RMS and has no
``beta1``: ``scale_parameter=False`` (the Trainer's setting) or a ``beta1`` compute other
numbers (0.12 apart after one step). The refusal of an ``Adafactor`` (by class name, or
any class of ``transformers.optimization``) says so.
"""

from __future__ import annotations

import torch

TENSOR_COUNT_OPTIMIZERS = (
    "an optimizer that keeps its step count in a tensor: torch.optim's Adam, AdamW, NAdam, "
    "RAdam, ... (timm's Lion, LARS, Adopt and LaProp compile too)"
)

_ADAFACTOR = (
    "torch.optim.Adafactor keeps its step count in a tensor and compiles: "
    "`torch.optim.Adafactor(params, lr=1e-2)` computes transformers' "
    "Adafactor(params) (relative_step=True, scale_parameter=True) and, with "
    "relative_step=False, scale_parameter=True, `lr=` the same lr does up to step 1/lr**2 "
    "(torch's step size is min(lr, 1/sqrt(step))); torch's always scales by the "
    "parameter's RMS and has no beta1, so scale_parameter=False (Trainer(optim='adafactor')) "
    "or a beta1 give other numbers: tune the learning rate again (NOTE: [transformers' "
    "Adafactor])"
)


def _is_transformers_adafactor(opt: torch.optim.Optimizer) -> bool:
    cls = type(opt)
    return (cls.__name__ == "Adafactor" or cls.__module__.startswith("transformers.optimization")) and not (
        cls.__module__.startswith("torch.")
    )


def library_counter_hint(opt: torch.optim.Optimizer) -> str:
    """What to use instead of a library's optimizer that counts in a Python number."""
    cls = type(opt).__name__
    if _is_transformers_adafactor(opt):
        return f"{cls} counts in a Python number, which no compiled program can; {_ADAFACTOR}."
    return f"{cls} counts in a Python number, which no compiled program can; use {TENSOR_COUNT_OPTIMIZERS}."


def group_counters_hint(cls: str, keys: list[str]) -> str:
    """NOTE: [counters a custom optimizer keeps]: counters the user's own class keeps in
    its param groups."""
    names = ", ".join(map(repr, keys))
    first = keys[0]
    return (
        f"keep {names} in {cls}'s state as tensors instead, as torch.optim's optimizers keep "
        f"their step count: per group, in the state of its first parameter (`state = "
        f"self.state[group['params'][0]]`, `state[{first!r}] = torch.zeros((), "
        "dtype=torch.float64)` where the state is made: float64 computes as Python numbers "
        f"do), updated in place (`state[{first!r}] += 1`; `max(lr, m)` as "
        "`state[...].clamp_(min=lr)`), with every use a tensor op (`1 - beta ** "
        f"(state[{first!r}] + 1)`, `.sqrt()`, not math.* or float()); a tensor in the "
        "state is state of the program, updated on every call and saved by checkpoints."
    )


def attribute_counter_hint(name: str) -> str:
    """NOTE: [counters a custom optimizer keeps]: a counter kept as an attribute of the
    optimizer (``self.t += 1`` in its step())."""
    return (
        f"keep the counter in the optimizer's per-parameter state as a tensor, as "
        "torch.optim's optimizers keep their step count: `state['step'] = torch.zeros((), "
        "dtype=torch.float64)` where the state is made (`state = self.state[p]`; float64 "
        "computes as Python numbers do), `state['step'] += 1` in step() instead of "
        f"`self.{name} += 1`, with every use a tensor op (`1 - beta ** state['step']`, not "
        "math.* or float()); the refused call left the value as it found it."
    )
