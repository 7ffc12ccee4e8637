"""Single-device equivalence, measured: the shared helper of tests and the demo.

The reference is the user's own (undecorated) step run eagerly on one device with the
global batch; the compiled step runs on N ranks with each rank's share. ``compare_*``
return the largest relative difference over every parameter and optimizer-state tensor,
relative error being ``max|a - b| / max|b|`` per tensor (0 when both are zero).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .simulate import Simulation


def relative_difference(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual = actual.detach().to(torch.float64)
    expected = expected.detach().to(torch.float64)
    if actual.shape != expected.shape:
        raise AssertionError(f"shape {tuple(actual.shape)} != {tuple(expected.shape)}")
    scale = expected.abs().max().item() if expected.numel() else 0.0
    diff = (actual - expected).abs().max().item() if expected.numel() else 0.0
    if scale == 0.0:
        return diff
    return diff / scale


def full_value(t: Any, sim: Simulation | None) -> Any:
    """A plain tensor with the full value of ``t`` (DTensor, per-rank or plain)."""
    if not isinstance(t, torch.Tensor):
        return t
    if sim is not None:
        return sim.full_tensor(t)
    if isinstance(t, DTensor):
        return t.full_tensor()
    return t


def compare_models(
    model: torch.nn.Module, reference: torch.nn.Module, sim: Simulation | None
) -> dict[str, float]:
    """Relative difference of every parameter and buffer, by FQN."""
    ref = dict(reference.named_parameters())
    ref.update(dict(reference.named_buffers()))
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = relative_difference(full_value(t, sim), ref[name])
    return out


def compare_optimizers(
    optimizer: torch.optim.Optimizer,
    reference: torch.optim.Optimizer,
    sim: Simulation | None,
) -> dict[str, float]:
    """Relative difference of every optimizer-state tensor, matched by position."""
    out = {}
    for gi, (group, ref_group) in enumerate(zip(optimizer.param_groups, reference.param_groups, strict=True)):
        for pi, (p, rp) in enumerate(zip(group["params"], ref_group["params"], strict=True)):
            state, ref_state = optimizer.state.get(p, {}), reference.state.get(rp, {})
            if set(state) != set(ref_state):
                raise AssertionError(
                    f"group {gi} param {pi}: state keys {sorted(state)} != {sorted(ref_state)}"
                )
            for key, value in state.items():
                expected = ref_state[key]
                if isinstance(expected, torch.Tensor):
                    got = full_value(value, sim)
                    out[f"group{gi}.param{pi}.{key}"] = relative_difference(
                        got.reshape(expected.shape).to(expected.device), expected
                    )
    return out


def max_difference(*diffs: dict[str, float]) -> float:
    return max((v for d in diffs for v in d.values()), default=0.0)
