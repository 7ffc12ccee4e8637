"""LR schedulers stepped inside the compiled train step.

NOTE: [schedulers stepped in the step]
``optimizer.step(); scheduler.step()`` at the end of the train step is the everyday
pattern. A scheduler is a Python state machine: ``step()`` counts an epoch and assigns
``param_group["lr"]``, which the compiled program reads as an input on every call
(NOTE: [learning rates as graph inputs] in ``capture/optimizers.py``). A program cannot
hold that Python, so the runtime replays it:

- **Capture.** While the step is traced, ``step()`` of every ``LRScheduler`` (torch's
  own and subclasses, a user's included) is recorded, not run: which scheduler, and
  whether its optimizer had stepped yet in the step.
- **Calls.** A scheduler stepped before its optimizer's first ``step()`` in the train
  step is stepped before the program reads the learning rates (the update uses the new
  rate, as eagerly); one stepped after its optimizer's last ``step()`` (or whose
  optimizer is not stepped in the train step) is stepped after the program ran. Each is
  the user's own scheduler object, stepped by its own code on the real optimizer, once
  per call, in the order the step called them: after every call the scheduler and the
  learning rates are exactly eager's, and nothing recompiles.
- **Found by name.** The scheduler must be reachable as the optimizer is: an argument,
  a global or a closure variable of the step, or an attribute of the object whose bound
  method is the step (``code_names.reachable_by_name``), itself or an entry of a dict,
  list or tuple held so (Parallel WaveGAN's ``self.scheduler["generator"]``, NOTE:
  [optimizers held in containers]); a new scheduler passed on a later call is the one
  stepped.
- **Refused, with the line:** ``step(...)`` with arguments (``ReduceLROnPlateau.step
  (metric)`` reads a tensor's value; ``step(epoch)`` is deprecated in torch); a
  scheduler stepped between two ``step()`` calls of its optimizer; ``get_last_lr()`` in
  the step (a Python list that changes every call would be baked into the program); a
  learning rate read from the optimizer after its scheduler stepped (the value the
  program would read is the one from before the step); a scheduler the step reaches
  only through an attribute of an object that is not an argument (a global holder's).
- **Run as eager:** a scheduler over an optimizer the step makes over tensors made in
  the call (NOTE: [schedulers of optimizers made in the call]).

The scheduler's attributes are not guards of the program (NOTE: [guards on Python
values]): they change on every call by design. Attributes the step's own code names
(``scheduler.last_epoch``) still are; one read after the scheduler stepped in the step
is refused, as the learning rate is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from ..errors import SourceLocation, SPMDCompileError, innermost_model_frame_of_stack
from .code_names import names_in, reachable_by_name

HINT = (
    "call scheduler.step() with no arguments, after optimizer.step(), and read "
    "scheduler.get_last_lr() / param_group['lr'] outside the compiled step (after the call)."
)
_ACTIVE: list[SchedulerSteps] = []


@dataclass(frozen=True)
class SchedulerStep:
    """One ``scheduler.step()`` the runtime replays every call."""

    index: int  # in ``StepBindings.schedulers``
    before: bool  # before the program reads the learning rates
    where: str  # the train-step line


def find_schedulers(func: Callable[..., Any], flat_args: list[Any]) -> list[Any]:
    """The LR schedulers a step can reach by name (see the NOTE), an object argument's
    included (``agent.sched.step()``)."""
    return reachable_by_name(func, flat_args, LRScheduler, holders=flat_args)


class LRReadAfterSchedulerStep:
    """Stands in for ``param_group["lr"]`` once the group's scheduler stepped in the
    traced step: any use refuses (see the NOTE)."""

    def __init__(self, original: Any, where: str, key: str = "lr", by: str = "scheduler.step()") -> None:
        self.original = original
        self.where = where
        self.key = key
        self.by = by

    def refuse(self, *args: Any, **kwargs: Any) -> Any:
        self.refuse_at(innermost_model_frame_of_stack())

    def refuse_at(self, line: SourceLocation | None, returned: bool = False) -> Any:
        """Refuse the read, naming ``line`` (the step's ``return`` where the step returns
        the value: it is read after the step's frame is gone, and before the sixty-seventh
        session the error named no line of the step, ``<string>:1: ""``)."""
        what = "learning rate" if self.key == "lr" else self.key
        raise SPMDCompileError(
            f"The train step {'returns' if returned else 'reads'} param_group['{self.key}'] after "
            f"scheduler.step() stepped its optimizer's schedule ({self.where}); a compiled step "
            f"reads the {what} once, before the scheduler steps, and replays the scheduler "
            "after the call.",
            user_line=line,
            hint=HINT,
        )

    __float__ = __int__ = __index__ = __bool__ = __neg__ = __pos__ = __abs__ = refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = refuse
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __format__ = refuse
    __lt__ = __le__ = __gt__ = __ge__ = __getitem__ = __iter__ = __len__ = refuse
    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<param_group['{self.key}'] after scheduler.step() at {self.where}: read it outside the compiled step>"


def learning_rate_of(value: Any) -> Any:
    """``param_group["lr"]`` as the capture set it (the stand-in's original)."""
    return value.original if isinstance(value, LRReadAfterSchedulerStep) else value


class SchedulerSteps:
    """While one trace runs: records the schedulers the step steps (running none) and the
    ``step()`` calls of its optimizers."""

    def __init__(
        self,
        schedulers: list[Any],
        optimizers: list[torch.optim.Optimizer],
        made_in_the_call: Callable[[torch.optim.Optimizer], bool] = lambda opt: False,
    ) -> None:
        self.schedulers = schedulers
        self.optimizers = optimizers
        # NOTE: [schedulers of optimizers made in the call]
        self.made_in_the_call = made_in_the_call
        self.optimizer_steps = [0] * len(optimizers)
        # (scheduler index, optimizer index or None, that optimizer's steps so far, line)
        self.calls: list[tuple[int, int | None, int, str]] = []
        self._patched: list[tuple[type, str, Any]] = []

    def __enter__(self) -> SchedulerSteps:
        for cls in _scheduler_classes():
            for name, replacement in (("step", self._step), ("get_last_lr", self._last_lr)):
                if name in vars(cls):
                    self._patched.append((cls, name, vars(cls)[name]))
                    setattr(cls, name, replacement)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        for cls, name, original in reversed(self._patched):
            setattr(cls, name, original)
        self._patched.clear()

    @property
    def _step(self) -> Callable[..., None]:
        recorder = self

        def step(scheduler: Any, *args: Any, **kwargs: Any) -> Any:
            if recorder._runs_as_eager(scheduler):
                return recorder._original(scheduler, "step")(scheduler, *args, **kwargs)
            recorder.record(scheduler, args, kwargs)
            return None

        return step

    @property
    def _last_lr(self) -> Callable[..., Any]:
        recorder = self

        def get_last_lr(scheduler: Any) -> Any:
            if recorder._runs_as_eager(scheduler):
                return recorder._original(scheduler, "get_last_lr")(scheduler)
            return _refused_last_lr(scheduler)

        return get_last_lr

    def _runs_as_eager(self, scheduler: Any) -> bool:
        """NOTE: [schedulers of optimizers made in the call]
        A scheduler over an optimizer the step makes over tensors made in the call (NOTE:
        [optimizers over tensors made in the call]; an inner loop's ``StepLR``) is made in
        the call too, and dies with it: its ``step()`` (torch runs one when it is made)
        and ``get_last_lr()`` run as eager runs them, on that optimizer's Python numbers,
        the same on every call. Before the sixty-ninth session it was refused as a
        scheduler the step "reaches only through another object", with the hint to pass
        it to the step, which a scheduler made in the call cannot be."""
        opt = getattr(scheduler, "optimizer", None)
        return (
            isinstance(opt, torch.optim.Optimizer)
            and all(opt is not o for o in self.optimizers)
            and self.made_in_the_call(opt)
        )

    def _original(self, scheduler: Any, name: str) -> Callable[..., Any]:
        """The method ``name`` of ``scheduler``'s class as it was before ``__enter__``."""
        for cls in type(scheduler).__mro__:
            for patched, patched_name, original in self._patched:
                if patched is cls and patched_name == name:
                    return original
            if name in vars(cls):
                return vars(cls)[name]
        raise AttributeError(name)

    def record(self, scheduler: Any, args: tuple, kwargs: dict) -> None:
        location = innermost_model_frame_of_stack()
        where = str(location) if location is not None else "the train step"
        name = f"{type(scheduler).__name__}.step()"
        if args or kwargs:
            raise SPMDCompileError(
                f"{name} is called with arguments inside the compiled train step; a "
                "compiled step replays a scheduler's step() after every call, which it can "
                "only do without arguments (ReduceLROnPlateau.step(metric) reads a tensor's "
                "value).",
                user_line=location,
                hint="call scheduler.step(metric) outside the compiled step, with the "
                "metric the step returns (return loss.item() works).",
            )
        index = next((i for i, s in enumerate(self.schedulers) if s is scheduler), None)
        if index is None:
            raise SPMDCompileError(
                f"{name} of a scheduler the train step reaches only through another object "
                "is called inside the compiled step; its step() is replayed after every "
                "call, so it must be found by name.",
                user_line=location,
                hint="pass the scheduler to the step as an argument, or an object holding it "
                "(agent.scheduler.step() of an argument `agent` is found), or keep it in a global "
                "or an attribute of the step's object (itself, or in a dict, list or tuple there).",
            )
        opt = getattr(scheduler, "optimizer", None)
        oi = next((i for i, o in enumerate(self.optimizers) if o is opt), None)
        self.calls.append((index, oi, self.optimizer_steps[oi] if oi is not None else 0, where))
        if oi is not None and self.optimizer_steps[oi] > 0:  # reads after this would be stale
            # OneCycleLR / CyclicLR cycle the momentum or the first beta too
            cycled = ("momentum", "betas") if getattr(scheduler, "cycle_momentum", False) else ()
            for group in self.optimizers[oi].param_groups:
                for key in ("lr", *cycled):
                    # dict's own methods: not a read (MomentumGroup); a scheduler stepped
                    # twice wraps once (each step is replayed)
                    value = dict.get(group, key)
                    if key in dict.keys(group) and not isinstance(value, LRReadAfterSchedulerStep):
                        dict.__setitem__(group, key, LRReadAfterSchedulerStep(value, where, key, name))

    def optimizer_stepped(self, opt: torch.optim.Optimizer) -> None:
        for i, o in enumerate(self.optimizers):
            if o is opt:
                self.optimizer_steps[i] += 1

    def steps(self) -> list[SchedulerStep]:
        """The replays, once the trace ended. Raises SPMDCompileError for a scheduler
        stepped between two steps of its optimizer."""
        found = []
        for index, oi, done, where in self.calls:
            total = self.optimizer_steps[oi] if oi is not None else 0
            if 0 < done < total:
                raise SPMDCompileError(
                    f"{type(self.schedulers[index]).__name__}.step() runs between two "
                    f"step() calls of optimizer[{oi}] inside the compiled train step ({where}); "
                    "the program reads each learning rate once per call.",
                    hint=HINT,
                )
            found.append(SchedulerStep(index, before=done == 0 and total > 0, where=where))
        return found

    def check_reads(self, step_code: Any) -> None:
        """Refuse a step whose own code names a stepped scheduler's state (see the NOTE)."""
        names = set(names_in(step_code)) - {"optimizer"}
        for index, _, _, where in self.calls:
            read = sorted(names & vars(self.schedulers[index]).keys())
            if read:
                raise SPMDCompileError(
                    f"The train step reads scheduler attribute(s) {read} and steps the "
                    f"scheduler ({where}); the compiled program holds the value read while it "
                    "was traced, which changes every call.",
                    hint=HINT,
                )


# NOTE: [a scheduler stepped between two optimizer steps]
# CleanRL-style loops take several optimizer steps per call over minibatch slices, with
# ``opt.step(); sched.step()`` in the loop. A compiled step reads each learning rate once
# per call and replays the scheduler after it, so this stays refused; but the second
# ``opt.step()`` read the stand-in the first ``sched.step()`` left in the group, and the
# refusal said the step "reads param_group['lr']", which the user never wrote, with the
# hint to call ``scheduler.step()`` after ``optimizer.step()``, which they do. An
# optimizer step that finds its group's learning rate already stepped by a scheduler in
# this call is refused before it reads it, naming both lines and the forms that work.


def refuse_step_after_its_scheduler(opt: torch.optim.Optimizer, oi: int) -> None:
    """Refuse ``opt.step()`` after a ``scheduler.step()`` of the same optimizer that
    followed an earlier ``opt.step()`` in this call (NOTE: [a scheduler stepped between
    two optimizer steps])."""
    for group in opt.param_groups:
        value = dict.get(group, "lr")
        if isinstance(value, LRReadAfterSchedulerStep):
            raise SPMDCompileError(
                f"{value.by} ({value.where}) runs between two step() calls of optimizer[{oi}] "
                "inside the compiled train step: this step() would take the learning rate the "
                "scheduler just set, but a compiled step reads each learning rate once per "
                "call and replays the scheduler after the call.",
                user_line=innermost_model_frame_of_stack(),
                hint=(
                    "compile a step that takes one optimizer step and call it once per "
                    "minibatch, so the scheduler steps after each as in eager; or step the "
                    "scheduler once per call, after the loop of optimizer steps (a schedule "
                    "counted in calls: the call's optimizer steps then share one rate)."
                ),
            )


def note_optimizer_step(opt: torch.optim.Optimizer) -> None:
    """Called by the capture's optimizer ``step()`` (NOTE: [schedulers stepped in the step])."""
    for recorder in _ACTIVE:
        recorder.optimizer_stepped(opt)


def _refused_last_lr(scheduler: Any) -> Any:
    raise SPMDCompileError(
        f"{type(scheduler).__name__}.get_last_lr() is called inside the compiled train step; "
        "it returns a Python list that changes every call, which a program would hold "
        "fixed.",
        user_line=innermost_model_frame_of_stack(),
        hint=HINT,
    )


def _scheduler_classes() -> list[type]:
    found: list[type] = []
    todo: list[type] = [LRScheduler]
    while todo:
        cls = todo.pop()
        if cls not in found:
            found.append(cls)
            todo.extend(cls.__subclasses__())
    return found


def scheduler_state(schedulers: list[Any], optimizers: list[torch.optim.Optimizer]) -> Callable[[], None]:
    """How to set ``schedulers`` and the settings of ``optimizers``' param groups (what
    a scheduler's ``step()`` writes: the learning rate, a cycled momentum or beta) back
    to what they are now: a program whose ``if`` on a tensor's value went the other way
    wrote nothing, so the scheduler steps replayed before it are taken back
    (``CompiledTrainStep._run_branches``)."""
    states = [s.state_dict() for s in schedulers]
    groups = [[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] for opt in optimizers]

    def restore() -> None:
        for scheduler, state in zip(schedulers, states, strict=True):
            scheduler.load_state_dict(state)
        for opt, saved in zip(optimizers, groups, strict=True):
            for group, entries in zip(opt.param_groups, saved, strict=True):
                group.update(entries)

    return restore


def step_replayed(
    steps: list[SchedulerStep], schedulers: list[Any], *, before: bool,
    settings: Callable[[], dict[str, Any]] | None = None,
) -> None:
    """Step the schedulers a compiled call replays: those the step ran before its
    optimizer's step (``before``) ahead of the program, the others after it completed.
    ``settings``: the optimizers' settings of the program (``StepBindings.
    optimizer_settings``), read around the ``before`` steps (NOTE: [settings a scheduler
    changes before the update])."""
    held = settings() if settings is not None else None
    for s in steps:
        if s.before == before:
            schedulers[s.index].step()
    if held is not None and settings is not None:
        _refuse_changed_settings(held, settings(), [(schedulers[s.index], s) for s in steps if s.before == before])


# NOTE: [settings a scheduler changes before the update]
# A program holds the optimizers' settings (weight decay, eps, a beta or momentum that is
# no graph input) as constants, chosen by the call's key before the call replays the
# schedulers the step steps before its optimizer's step. Torch's own schedulers set only
# the learning rate and a cycled momentum / beta, whose settings the capture refuses
# (``_refuse_schedules_of_settings`` in trace.py); a user's ``LRScheduler`` subclass can
# set anything in ``get_lr()`` (a weight-decay schedule): the program then updated with
# the weight decay from before the scheduler's step, every call one step behind (a probe:
# parameters 6e-3 relative off after 4 AdamW calls, no sign). The settings are read
# around the replay; a change is refused, naming it, and the call's caller sets the
# schedule back (nothing was updated).
def _refuse_changed_settings(held: dict[str, Any], now: dict[str, Any], stepped: list[tuple[Any, SchedulerStep]]) -> None:
    changed = [k for k in now.keys() | held.keys() if held.get(k) != now.get(k)]
    if not changed:
        return
    name = sorted(changed)[0]
    names = ", ".join(f"{type(sch).__name__}.step() ({s.where})" for sch, s in stepped)
    raise SPMDCompileError(
        f"{names} ran before the optimizer's step inside the compiled train step and "
        f"changed {name} from {held.get(name)!r} to {now.get(name)!r}"
        + (f" (and {len(changed) - 1} more setting(s))" if len(changed) > 1 else "")
        + ": a setting of the program, chosen before the scheduler steps, so the update "
        "would use the value from before its step. Nothing was updated.",
        hint="step the scheduler after optimizer.step() (the program then holds the value "
        "the update uses), or set that value outside the compiled step, before the call.",
    )


__all__ = [
    "HINT", "LRReadAfterSchedulerStep", "SchedulerStep", "SchedulerSteps", "find_schedulers",
    "learning_rate_of", "note_optimizer_step", "refuse_step_after_its_scheduler", "scheduler_state", "step_replayed",
]
