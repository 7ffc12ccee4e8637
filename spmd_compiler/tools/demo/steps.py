"""Plain train steps shared by tests, benchmarks and examples.

Top-level functions, so that spawned ranks can unpickle them by name.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def classification_train_step(
    model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """Forward, cross entropy, backward, optimizer step, zero_grad; returns the loss."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def squared_output_train_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    """Forward, the mean square of the output as the loss, backward, optimizer step,
    zero_grad; returns the loss, detached."""
    loss = model(x).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def classification_batches(
    steps: int, batch: int, features: int, classes: int, dtype: torch.dtype, *, seed: int = 1234
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``steps`` global batches of (inputs in ``dtype``, class labels), the same on every
    call with the same arguments (their own generator)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, features, generator=gen).to(dtype),
         torch.randint(0, classes, (batch,), generator=gen))
        for _ in range(steps)
    ]


def eager_classification_losses(
    model: nn.Module, optim: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> list[torch.Tensor]:
    """The undecorated step on one device over ``batches``: the parity reference."""
    return [classification_train_step(model, optim, x, y).detach() for x, y in batches]
