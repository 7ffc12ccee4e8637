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
