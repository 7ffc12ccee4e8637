"""``torch.optim.Adafactor`` traced: its per-parameter update with tensor scalars.

NOTE: [Adafactor in tensor ops]
torch's Adafactor step (``_single_tensor_adafactor``, the path a traced step takes: NOTE:
[capture in two traces]) reads three values in Python for every parameter: the step
counter (``step_t.item()``), the parameter's RMS (``param.norm(2).item()``) and the
update's (``update.norm(2).item()``), and combines them with ``min`` / ``max``. A traced
program has no values, so the step was refused. While an Adafactor's ``step()`` is
traced, this function runs in its place: the same update, line for line, with those
scalars kept as 0-d float64 tensors (Python's float arithmetic is double precision, so
every scalar goes through the same IEEE operations in the same order):

    step_float ** beta2_decay          ->  step ** beta2_decay         (float64 counter)
    min(lr, 1 / step_float ** 0.5)     ->  where(1 / step ** 0.5 < lr, 1 / step ** 0.5, lr)
    max(eps2, norm.item() / sqrt(n))   ->  where(rms > eps2, rms, eps2)
    max(1.0, update_rms / d)           ->  where(u > 1.0, u, 1.0)

``where`` keeps Python's ``min`` / ``max``: the first argument unless the second is
strictly smaller / larger (a NaN norm leaves ``eps2`` and ``1.0``, as eager does). The
float64 scalars meet the parameter's tensors where eager's Python floats do: ``lerp_``'s
weight and ``add_``'s ``alpha`` (rewritten by NOTE: [tensor hyper-parameters in Scalar
arguments]) are cast to the op's compute dtype, as the kernels cast a Python float.
torch 2.11 to 2.14 have the same update (2.14 spells ``torch.norm(grad, dim)`` as
``torch.linalg.vector_norm``, the op ``torch.norm`` dispatches to); a torch whose
``_single_tensor_adafactor`` takes other arguments keeps its own, and the step is refused
as before. Under fsdp the norms of sharded parameters are partial sums reduced across
ranks (as in gradient clipping), so they round as a sum in another order does.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

# The signature this mirrors (torch 2.11-2.14); another one is left to torch.
EXPECTED_PARAMETERS = (
    "params", "grads", "row_vars", "col_vars", "variances", "state_steps", "grad_scale",
    "found_inf", "d", "lr", "beta2_decay", "weight_decay", "eps1", "eps2", "maximize",
    "has_complex",
)


def mirrors(torch_function: Any) -> bool:
    """Whether ``torch_function`` takes the arguments ``single_tensor_adafactor`` does."""
    try:
        return tuple(inspect.signature(torch_function).parameters) == EXPECTED_PARAMETERS
    except (TypeError, ValueError):
        return False


def _scalar(value: Any) -> torch.Tensor:
    """A 0-d float64 tensor of a Python number or a 0-d tensor (the traced lr)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64)
    return torch.tensor(float(value), dtype=torch.float64)


def _lerp_(state: torch.Tensor, end: torch.Tensor, weight: torch.Tensor) -> None:
    """``state.lerp_(end, weight)`` for a float64 0-d ``weight``, computed as eager's
    kernel computes it with a Python float weight: in the op's compute dtype (float32
    for 16-bit states, where a weight of the state's dtype would be rounded to 16 bits),
    rounded once to the state's dtype."""
    compute = torch.float32 if state.dtype in (torch.float16, torch.bfloat16) else state.dtype
    if compute == state.dtype:
        state.lerp_(end, weight.to(compute))
    else:
        state.copy_(torch.lerp(state.to(compute), end.to(compute), weight.to(compute)))


def single_tensor_adafactor(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    row_vars: list[torch.Tensor | None],
    col_vars: list[torch.Tensor | None],
    variances: list[torch.Tensor | None],
    state_steps: list[torch.Tensor],
    grad_scale: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    *,
    d: float,
    lr: torch.Tensor | float,
    beta2_decay: float,
    weight_decay: float,
    eps1: float | None,
    eps2: float,
    maximize: bool,
    has_complex: bool,
) -> None:
    """torch's ``_single_tensor_adafactor`` with its Python scalars as tensors (NOTE:
    [Adafactor in tensor ops])."""
    if grad_scale is not None or found_inf is not None:
        raise AssertionError("Grad scaling should occur outside of optimizer.step()")
    lr_t = _scalar(lr)
    for i, param in enumerate(params):
        grad = grads[i] if not maximize else -grads[i]
        step_t = state_steps[i]
        row_var, col_var, variance = row_vars[i], col_vars[i], variances[i]
        if eps1 is None:  # as torch: the first parameter's dtype decides for the rest
            eps1 = torch.finfo(param.dtype).eps

        step_t += 1
        step = _scalar(step_t)
        one_minus_beta2_t = step**beta2_decay
        inverse_root = 1 / step**0.5
        rho_t = torch.where(inverse_root < lr_t, inverse_root, lr_t)
        rms = _scalar(param.norm(2)) / (param.numel() ** 0.5)
        alpha = torch.where(rms > eps2, rms, eps2) * rho_t

        if weight_decay != 0:
            param.mul_(1 - lr_t * weight_decay)

        if grad.dim() > 1:
            if row_var is None or col_var is None:
                raise AssertionError("row_var and col_var should be defined when grad is multidimensional")
            row_mean = torch.linalg.vector_norm(grad, dim=-1, keepdim=True).square_().div_(grad.size(-1))
            _lerp_(row_var, row_mean, one_minus_beta2_t)
            col_mean = torch.linalg.vector_norm(grad, dim=-2, keepdim=True).square_().div_(grad.size(-2))
            _lerp_(col_var, col_mean, one_minus_beta2_t)
            var_estimate = row_var @ col_var
            var_estimate.div_(row_var.mean(dim=-2, keepdim=True).clamp_(min=eps1))
        else:
            if variance is None:
                raise AssertionError("variance should be defined when grad is a vector")
            _lerp_(variance, grad * grad, one_minus_beta2_t)
            var_estimate = variance.clone()

        update = var_estimate.clamp_(min=eps1 * eps1).rsqrt_()
        update.mul_(grad)
        update_rms = _scalar(update.norm(2)) / ((update.numel() ** 0.5) * d)
        denom = torch.where(update_rms > 1.0, update_rms, 1.0)
        param.add_(update, alpha=-alpha / denom)  # type: ignore[arg-type]  # rewritten: a tensor alpha
