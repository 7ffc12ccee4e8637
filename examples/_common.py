"""Helpers shared by the example scripts: a tiny model, data and the eager reference.

Not part of the library: each example shows the library calls themselves; this file
only keeps the model and the comparison out of their way.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """A user's own model: two Linear layers with a GELU between them."""

    def __init__(self, width: int = 32, hidden: int = 64, classes: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(F.gelu(self.up(x))))


def train_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def eval_step(model, x, y):
    """A validation step: no optimizer, no gradients; compiled like the train step."""
    with torch.no_grad():
        logits = model(x)
        return F.cross_entropy(logits, y), (logits.argmax(-1) == y).float().mean()


def held_out(batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(batch, 32, generator=gen), torch.randint(0, 8, (batch,), generator=gen)


def reference_validation(seed: int, steps: int, batch: int = 16) -> float:
    """The validation loss after the eager single-device training."""
    model, optim, data = make(seed, batch, steps)
    for x, y in data:
        train_step(model, optim, x, y)
    return eval_step(model, *held_out(batch))[0].item()


def make(seed: int = 0, batch: int = 16, steps: int = 3):
    """Model, AdamW optimizer and ``steps`` global batches, the same for every seed."""
    torch.manual_seed(seed)
    model = MLP()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
    data = [(torch.randn(batch, 32), torch.randint(0, 8, (batch,))) for _ in range(steps)]
    return model, optim, data


def reference_losses(seed: int, steps: int, batch: int = 16) -> list[float]:
    """The undecorated step, eager, one device, on the global batches."""
    model, optim, data = make(seed, batch, steps)
    return [train_step(model, optim, x, y).item() for x, y in data]


def arguments(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=3, help="train steps (default 3)")
    parser.add_argument("--world-size", type=int, default=4, help="simulated ranks (default 4)")
    return parser.parse_args()


def report(losses: list[float], reference: list[float], tolerance: float) -> None:
    for i, (a, b) in enumerate(zip(losses, reference, strict=True)):
        print(f"step {i}: compiled {a:.6f}  single device {b:.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))
    print(f"max relative loss difference {worst:.1e} (tolerance {tolerance:.0e})")
    if worst > tolerance:
        raise SystemExit(1)
