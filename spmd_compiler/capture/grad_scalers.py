"""``torch.amp.GradScaler`` inside a compiled train step.

NOTE: [loss scaling in the program]
The float16 recipe scales the loss before ``backward()`` (``scaler.scale(loss)``), then
``scaler.step(optimizer)`` divides the gradients by the scale, looks for inf / NaN in
them and skips ``optimizer.step()`` when it finds any, and ``scaler.update()`` halves
the scale after a skipped step or doubles it after ``growth_interval`` good ones. Eagerly
that is a ``.item()`` read and a scale tensor the scaler creates on first use, kept in
the scaler object. In a compiled step:

- **State.** The scale and the growth tracker are training state of the program
  (``Kind.SCALER``, replicated in every mode), read from the scaler and written back
  into the same tensors after every completed call, as ``update()`` writes them. A
  scaler that has none yet gets them at the first compiled call, on the parameters'
  device, as its first ``scale()`` would make them. The growth and backoff factors and
  the growth interval are constants of the program (a change recompiles it).
- **The skip.** ``scaler.step`` asks ``if not sum(found_inf.item() ...)``. While the step
  is traced that question is asked of the tensor instead (``found_inf == 0``), which
  makes it a branch of the program (NOTE: [value checks]): the program of the finite
  way is compiled first; a call whose gradients hold inf or NaN writes nothing and runs
  the program without ``optimizer.step()`` on the same inputs, compiled on first need.
  Both programs update the scale. On more than one rank the inf check reads every
  rank's gradients (a reduction over the sharded or reduced gradients), so all ranks
  take the same way, as one device does on the global batch.
- **Kernels.** ``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_``
  have no DTensor rule; at capture they are written in plain ops with their kernels'
  arithmetic (the unscale multiplies by ``1 / scale``; a new scale is computed in
  float64 and rounded to float32, as the kernels multiply a float by a double).
- **Refused, by name:** a scaler the step uses that is not an argument, a global or a
  closure variable of it (the program could not write its state back); a step that
  runs ``scaler.step()`` or ``unscale_()`` but not ``update()`` (the scaler's
  per-optimizer stages would have to carry over between calls); a scaler stepped or
  unscaled outside the step before a call; a fused optimizer (``fused=True``), whose
  own step unscales and leaves the gradients scaled.
"""

from __future__ import annotations

import contextlib
import functools
import operator
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from .. import _torch_private as private
from ..errors import SPMDCompileError
from ..ir.signature import Kind, StateRef
from .code_names import reachable_by_name

SCALER_HINT = (
    "pass the scaler to the step (train_step(model, optimizer, scaler, batch)) or keep it "
    "in a global, and call scaler.scale(loss).backward(), scaler.step(optimizer) and "
    "scaler.update() inside the step."
)


def find_scalers(func: Callable[..., Any], flat_args: list[Any]) -> list[Any]:
    """The GradScalers a step can reach by name (``code_names.reachable_by_name``; a
    scaler met twice is listed twice; ``find_bindings`` keeps the first), an object
    argument's included (``agent.scaler.step(agent.opt)``)."""
    return reachable_by_name(func, flat_args, private.grad_scaler_type(), holders=flat_args)


def scaler_state(scalers: list[Any], device: torch.device) -> list[tuple[StateRef, torch.Tensor]]:
    """The state refs of the enabled scalers, with their current values (created where a
    scaler has none yet); refuses a scaler left between ``step()`` and ``update()``."""
    refs: list[tuple[StateRef, torch.Tensor]] = []
    for si, scaler in enumerate(scalers):
        if not private.grad_scaler_enabled(scaler):
            continue
        if not private.grad_scaler_between_steps(scaler):
            raise SPMDCompileError(
                f"GradScaler {si} of the step was unscaled or stepped since its last "
                "update(), outside the compiled step; the compiled step starts every call "
                "from an updated scaler.",
                hint=SCALER_HINT,
            )
        for key, value in private.grad_scaler_state(scaler, device).items():
            refs.append((StateRef(Kind.SCALER, key=key, index=si), value))
    return refs


def scaler_key(scalers: list[Any]) -> tuple:
    """What of the scalers a program depends on besides their state tensors (a scaler
    left between ``step()`` and ``update()`` changes it, so that capture refuses it)."""
    return tuple(
        (private.grad_scaler_settings(s), private.grad_scaler_between_steps(s))
        if private.grad_scaler_enabled(s) else None
        for s in scalers
    )


class _UnboundScaler(Exception):
    """A GradScaler the step did not name was used while it was traced."""


@contextlib.contextmanager
def traced_scalers(
    scalers: list[Any], values: dict[StateRef, torch.Tensor]
) -> Iterator[Callable[[], list[tuple[StateRef, torch.Tensor]]]]:
    """While the step is traced, each enabled scaler holds its traced state and asks the
    skip question of a tensor (see the NOTE); any other scaler refuses to run. Yields a
    function that gives the scalers' final state and refuses a step that left one
    between ``step()`` and ``update()``."""
    scaler_type = private.grad_scaler_type()
    with contextlib.ExitStack() as stack:
        finals: list[tuple[int, Callable[[], dict[str, torch.Tensor]], Any]] = []
        for si, scaler in enumerate(scalers):
            if not private.grad_scaler_enabled(scaler):
                continue
            state = {
                key: values[StateRef(Kind.SCALER, key=key, index=si)]
                for key in private.GRAD_SCALER_STATE
            }
            final = stack.enter_context(private.traced_grad_scaler(scaler, state, _step_unless_non_finite))
            finals.append((si, final, scaler))
        for method in ("scale", "unscale_", "step", "update"):
            stack.enter_context(mock.patch.object(
                scaler_type, method, _only_bound(getattr(scaler_type, method), scalers)
            ))

        def collect() -> list[tuple[StateRef, torch.Tensor]]:
            out: list[tuple[StateRef, torch.Tensor]] = []
            for si, final, scaler in finals:
                if not private.grad_scaler_between_steps(scaler):
                    raise SPMDCompileError(
                        f"The train step runs scaler.step() or scaler.unscale_() of GradScaler "
                        f"{si} but not scaler.update(): the scaler would carry which "
                        "optimizers it stepped into the next call.",
                        hint=SCALER_HINT,
                    )
                out += [(StateRef(Kind.SCALER, key=k, index=si), v) for k, v in final().items()]
            return out

        yield collect


def _only_bound(method: Callable[..., Any], scalers: list[Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if all(self is not s for s in scalers):
            raise _UnboundScaler(
                "The train step uses a torch.amp.GradScaler that its code does not name: "
                "not an argument, nor an attribute path or a global or closure variable the "
                "step's code names (one held by another object that drives it in its own "
                "methods, as timm's NativeScaler holds self._scaler, is not found); a "
                "compiled step reads and writes the scale of the scalers it can name. Name it "
                "in the step (scaler = loss_scaler._scaler) or pass it as an argument."
            )
        if method.__name__ == "step" and args and private.steps_with_amp_scaling(args[0]):
            raise SPMDCompileError(
                f"scaler.step() of a fused {type(args[0]).__name__} (fused=True): its own "
                "step unscales the gradients and leaves them scaled, which a compiled step "
                "does not reproduce.",
                hint="construct the optimizer without fused=True; the compiled program fuses "
                "the update itself (backend=\"inductor\").",
            )
        return method(self, *args, **kwargs)

    return run


def unbound_scaler_error() -> type[Exception]:
    return _UnboundScaler


def _step_unless_non_finite(
    scaler: Any, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any],
    *args: Any, **kwargs: Any,
) -> Any:
    """``GradScaler._maybe_opt_step`` asking its question of the tensor (see the NOTE)."""
    found = list(optimizer_state["found_inf_per_device"].values())
    total = functools.reduce(operator.add, [f.to(found[0].device) for f in found])
    if total == 0:  # a branch of the program (NOTE: [value checks])
        return optimizer.step(*args, **kwargs)
    return None


def _non_finite_check_and_unscale(
    grads: list[torch.Tensor], found_inf: torch.Tensor, inv_scale: torch.Tensor
) -> None:
    """``_amp_foreach_non_finite_check_and_unscale_``: ``found_inf`` becomes 1 where any
    gradient holds inf or NaN; every gradient is multiplied by ``inv_scale``."""
    if not grads:
        return
    non_finite = torch.stack([g.isfinite().logical_not().any() for g in grads]).any()
    found_inf.copy_(torch.where(non_finite, torch.ones_like(found_inf), found_inf))
    for g in grads:
        g.mul_(inv_scale)


def _update_scale(
    scale: torch.Tensor, growth_tracker: torch.Tensor, found_inf: torch.Tensor,
    growth_factor: float, backoff_factor: float, growth_interval: int,
) -> torch.Tensor:
    """``_amp_update_scale_``: back off after a skipped step, grow after
    ``growth_interval`` good ones (unless the grown scale is not finite)."""
    found = found_inf != 0
    successful = growth_tracker + 1
    grows = successful == growth_interval
    wide = scale.to(torch.float64)
    backed_off = (wide * backoff_factor).to(scale.dtype)
    grown = (wide * growth_factor).to(scale.dtype)
    grown = torch.where(grown.isfinite(), grown, scale)
    new_scale = torch.where(found, backed_off, torch.where(grows, grown, scale))
    new_tracker = torch.where(found | grows, torch.zeros_like(growth_tracker), successful)
    growth_tracker.copy_(new_tracker)
    return scale.copy_(new_scale)


def loss_scaling_decompositions() -> dict[Any, Callable[..., Any]]:
    aten = torch.ops.aten
    return {
        aten._amp_foreach_non_finite_check_and_unscale_.default: _non_finite_check_and_unscale,
        aten._amp_update_scale_.default: _update_scale,
    }


__all__ = [
    "SCALER_HINT", "find_scalers", "loss_scaling_decompositions", "scaler_key", "scaler_state",
    "traced_scalers", "unbound_scaler_error",
]
