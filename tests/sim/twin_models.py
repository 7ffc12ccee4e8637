"""A model and its one-device reference, each with its own AdamW (the parity tests' pair)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
import torch.nn as nn


def adamw_twins(
    make: Callable[[], nn.Module], lr: float = 1e-2
) -> tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """``make()`` in float64 seeded with 0, a deep copy of it, and an AdamW for each."""
    torch.manual_seed(0)
    model = make().double()
    reference = copy.deepcopy(model)
    return (model, reference, torch.optim.AdamW(model.parameters(), lr=lr),
            torch.optim.AdamW(reference.parameters(), lr=lr))


def finish(model: nn.Module, optim: torch.optim.Optimizer, loss: torch.Tensor) -> torch.Tensor:
    """The end of a train step: ``loss`` backward, an optimizer step, the gradients
    cleared; the loss detached."""
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()
