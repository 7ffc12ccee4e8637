"""Tensor constants created inside forward are replicated values of the program.

NOTE: [tensor constants] in capture/trace.py. Before the fix, expansion wrapped the real
constant with ``DTensor.from_local`` inside the fake retrace and failed ("Please convert
all Tensors to FakeTensors first"), in every mode.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from spmd_compiler.parallel_modes import make_mode

TOL = 1e-5


class _WithConstants(nn.Module):
    """``torch.tensor`` constants in forward, as transformers' cache objects make them."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        empty = torch.tensor([])  # transformers' DynamicCache does this
        h = self.fc(x) * torch.tensor(2.0)
        h = h + torch.tensor([0.01 * i for i in range(16)]) + empty.sum()
        return self.out(torch.relu(h))


_PLAN = {"fc": ColwiseParallel(), "out": RowwiseParallel()}
_MODES = {
    "dtensor_expand": ({}, 2),
    "ddp": ({}, 2),
    "fsdp": ({}, 4),
    "tp": ({"plan": _PLAN}, 2),
    "fsdp_tp": ({"plan": _PLAN, "mesh_shape": (2, 2)}, 4),
}


@pytest.mark.parametrize("name", sorted(_MODES))
def test_constants_in_forward_every_mode(name, run_parity, classification_batches):
    kwargs, world = _MODES[name]
    result = run_parity(
        _WithConstants,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        world,
        classification_batches(3, batch_size=8),
        mode=make_mode(name, **kwargs),
    )
    result.assert_close(TOL)
    assert result.compile_counts[-1] == result.compile_counts[-2]  # no recompile per call
    program = result.compiled.last_program.graph_module
    constants = [n for n in program.graph.nodes if n.op == "get_attr"]
    assert constants, "the constants should be stored in the per-rank program"


class _CacheLikeCat(nn.Module):
    """transformers' cache: ``torch.cat([torch.tensor([]), key], dim=-2)``, whose empty
    1-D first input torch's ``cat`` skips; here beside a column-sharded (TP) activation."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).view(x.shape[0], 2, 8)
        h = torch.cat([torch.tensor([]), h], dim=-2)
        return self.out(torch.relu(h.reshape(x.shape[0], 16)))


@pytest.mark.parametrize("name", ["ddp", "tp"])
def test_cat_with_legacy_empty_constant(name, run_parity, classification_batches):
    kwargs, world = _MODES[name]
    result = run_parity(
        _CacheLikeCat,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        world,
        classification_batches(3, batch_size=8),
        mode=make_mode(name, **kwargs),
    )
    result.assert_close(TOL)
