"""An output whose direct redistribution torch refuses is moved by way of Replicate
(NOTE: [outputs moved by way of Replicate] in ``spmd_compiler/expand/retrace.py``).

fsdp_tp 2x2 with SGD momentum and a (classes, hidden) table the step builds with as many
rows as the global batch (split as the batch, NOTE: [local batch only]): the momentum
buffer of the row-wise layer came out ``[_StridedShard(0, sf=2), Shard(0)]``, and torch's
move to ``[Shard(0), Shard(1)]`` failed a bare internal check ("Expected cond to be True")
on the first call."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import FullyShardTensorParallel
from spmd_compiler.tools.parity import compare_states, full_state


def step(model, optim, x, y):
    h = model[2](torch.tanh(model[0](x)))
    centers = torch.zeros(8, 8, dtype=h.dtype)  # one row per class: 8, the global batch
    loss = F.cross_entropy(h, y) + (h - centers[y]).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_momentum_buffer_torch_cannot_move_directly_trains_as_eager() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Identity(), nn.Linear(8, 8)).double()
    eager = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_optim = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    mode = FullyShardTensorParallel({"0": ColwiseParallel(), "2": RowwiseParallel()}, mesh_shape=(2, 2))
    compiled = sc.compile(parallel_mode=mode)(step)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 8, (8,), generator=gen))
               for _ in range(3)]
    with sc.simulate(world_size=4) as sim:
        for x, y in batches:
            got, want = compiled(model, optim, x, y), step(eager, eager_optim, x, y)
            assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
        state = full_state(model, optim, sim)
    errors = compare_states(state, full_state(eager, eager_optim, None))
    assert max(errors.values()) < 1e-12, errors
