"""LR schedulers stepped between compiled calls: parity with eager, no recompilation.

The learning rate is a graph input (a HYPERPARAM placeholder) read from the param group
on every call, so a scheduler changing it between calls must neither recompile nor be
ignored. The first call compiles the program that creates optimizer state, the second
the steady-state program; after that the count must stay at 2.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc

FLOAT32_TOLERANCE = 1e-5
STEPS = 5


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


SCHEDULERS = {
    "lambda": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1 / (1 + epoch)),
    "cosine": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS),
}

OPTIMIZERS = {
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.2, momentum=0.9),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=2e-2, weight_decay=0.1),
}


@pytest.mark.parametrize("world_size", [1, 4])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("scheduler", list(SCHEDULERS))
def test_scheduler_between_steps(
    run_parity, classification_batches, scheduler, optimizer, world_size
):
    result = run_parity(
        mlp,
        OPTIMIZERS[optimizer],
        world_size,
        classification_batches(STEPS),
        make_scheduler=SCHEDULERS[scheduler],
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 2, 2, 2]
    # The schedule really changed the rate each step (same on both optimizers).
    lrs = [g["lr"] for g in result.optimizer.param_groups]
    assert lrs == [g["lr"] for g in result.reference_optimizer.param_groups]
    base = OPTIMIZERS[optimizer](mlp()).param_groups[0]["lr"]
    expected = (
        base / (1 + STEPS)
        if scheduler == "lambda"
        else base * (1 + math.cos(math.pi * STEPS / STEPS)) / 2
    )
    assert lrs[0] == pytest.approx(expected, abs=1e-12)


def test_lr_changed_by_hand_is_used_without_recompiling(run_parity, classification_batches):
    """A large lr change between calls: a baked-in lr would break parity at once."""

    class SetLR:
        def __init__(self, opt):
            self.opt, self.calls = opt, 0

        def step(self):
            self.calls += 1
            for group in self.opt.param_groups:
                group["lr"] = [0.5, 0.0, 0.05, 0.3, 0.1][self.calls % 5]

    result = run_parity(
        mlp,
        OPTIMIZERS["sgd_momentum"],
        2,
        classification_batches(STEPS),
        make_scheduler=SetLR,
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts == [1, 2, 2, 2, 2]


def test_compiled_call_keeps_the_schedulers_step_wrapper(train_step, classification_batches):
    model = mlp()
    optimizer = OPTIMIZERS["adamw"](model)
    scheduler = SCHEDULERS["lambda"](optimizer)
    wrapper = vars(optimizer).get("step")
    assert getattr(wrapper, "_wrapped_by_lr_sched", False)
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2):
        compiled(model, optimizer, *classification_batches(1)[0])
    assert vars(optimizer).get("step") is wrapper
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()
