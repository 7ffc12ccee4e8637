"""Dropout in compiled steps: one global draw per seed, whatever the mode and world size
(NOTE: [random numbers] in capture/random_draws.py)."""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.tools.demo.gpt import gpt_train_step
from spmd_compiler.tools.demo.run import DemoConfig, build, demo_mode


def _losses(mode: str, world_size: int, *, seed: int = 123, steps: int = 2, mesh=()) -> list[float]:
    config = DemoConfig(steps=steps, n_layer=1, dropout=0.2, mode=mode, world_size=world_size, mesh=mesh)
    model, optim, data = build(config)
    step = sc.compile(demo_mode(config))(gpt_train_step)
    torch.manual_seed(seed)
    with sc.simulate(world_size):
        return [step(model, optim, x, y).item() for x, y in data]


@pytest.fixture(scope="module")
def single_device() -> list[float]:
    return _losses("ddp", 1)


def test_same_seed_same_run(single_device):
    assert _losses("ddp", 1) == single_device


def test_other_seed_other_masks(single_device):
    assert _losses("ddp", 1, seed=7) != single_device


@pytest.mark.parametrize(
    "mode,world_size",
    [("ddp", 4), ("fsdp", 4), ("tp", 2), ("tp", 4)],
)
def test_shards_take_their_slice_of_one_global_draw(mode, world_size, single_device):
    """Batch shards (ddp/fsdp) and replicas (tp) see the world-1 masks: same losses."""
    got = _losses(mode, world_size)
    assert got == pytest.approx(single_device, rel=1e-5)


def test_two_d_mode_draws_the_same_masks(single_device):
    got = _losses("fsdp_tp", 4, steps=1, mesh=(2, 2))
    assert got == pytest.approx(single_device[:1], rel=1e-5)
