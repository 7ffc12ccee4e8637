"""passes/checks.py: check_local_batch catches a program that holds the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from passes.checks import check_local_batch, global_batch_sizes
from spmd_compiler.expand.local_rules import LocalRules
from spmd_compiler.parallel_modes import DataParallel, DTensorExpandMode, TensorParallel
from spmd_compiler.passes import PipelineError


def sum_step(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _compile(mode, batch=64, width=10, out=12):
    torch.manual_seed(0)
    # a Linear(64, 64) layer: its replicated gradient is (64, 64), the global batch's size,
    # and must not be mistaken for a batch
    model = nn.Sequential(nn.Linear(width, batch), nn.ReLU(), nn.Linear(batch, out))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(parallel_mode=mode)(sum_step)
    with sc.simulate(4):
        step(model, optim, torch.randn(batch, width))
    return step.last_program


@pytest.mark.parametrize("mode", [DTensorExpandMode(), DataParallel("replicate")], ids=lambda m: m.name)
def test_old_expansion_is_caught(mode, monkeypatch):
    """Without the local rule for expand (the behaviour before the fix), the .sum()
    loss's gradient is expanded to the global (64, 12) on every rank: compiling fails.
    (torch 2.11's trace holds one more expand before it: the node is ``expand_1`` there.)"""
    monkeypatch.setattr(LocalRules, "_expand", lambda self, value, size: None)
    with pytest.raises(PipelineError, match=r"node expand(_\d+)? .*global batch.*local shape \[64, 12\]"):
        _compile(mode)


@pytest.mark.parametrize("mode", [DTensorExpandMode(), DataParallel("replicate")], ids=lambda m: m.name)
def test_fixed_expansion_passes(mode):
    program = _compile(mode)
    assert global_batch_sizes(program) == {0: {64}}
    check_local_batch(program)  # and it ran after every pass of the compile


def test_no_op_without_sharded_arguments():
    program = _compile(TensorParallel({}))
    assert global_batch_sizes(program) == {}
    check_local_batch(program)
