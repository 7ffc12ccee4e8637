"""Integer state a step updates from a count over the batch (NOTE: [integer sums made
partial] in ``spmd_compiler/_torch_private.py``).

``model.tokens += (y >= 0).sum()`` adds a pending sum (each rank's count) to a replicated
counter; DTensor made the counter partial by dividing it by the ranks, a float: before
the fifty-fourth session an int64 token count of 2**40 + 1 came back float32 and 25 off
after 3 steps, an int32 per-class count as floats, and a count used as an index failed
the next step. Now every value keeps its dtype and eager's integers, in every mode.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
import spmd_compiler._torch_private as private
from spmd_compiler.parallel_modes import DataParallel, FullyShardTensorParallel, TensorParallel

PLAN = {"up": ColwiseParallel(), "down": RowwiseParallel()}
MODES = {
    "ddp": (lambda: DataParallel("replicate"), 2),
    "fsdp": (lambda: DataParallel("fully_shard"), 2),
    "tp": (lambda: TensorParallel(PLAN), 2),
    "fsdp_tp": (lambda: FullyShardTensorParallel(PLAN, mesh_shape=(2, 2)), 4),
}


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 4)
        self.table = nn.Parameter(torch.randn(5, 4))
        self.register_buffer("seen", torch.zeros(4, dtype=torch.int32))
        self.register_buffer("tokens", torch.tensor(2**40 + 1, dtype=torch.int64))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the count read back as an index: a float there failed the next call
        return self.down(F.relu(self.up(x))) + self.table[self.calls % 5]


def step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    with torch.no_grad():
        model.seen += F.one_hot(y, 4).sum(0).to(torch.int32)
        model.tokens += (y >= 0).sum()
        model.calls += 1
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, (y == 0).sum() + torch.tensor(2**40 + 1)


@pytest.mark.parametrize("mode", list(MODES))
def test_integer_counters_keep_their_dtype_and_eagers_values(mode: str) -> None:
    make, world = MODES[mode]
    torch.manual_seed(0)
    model = Counting().double()
    eager = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optim = torch.optim.SGD(eager.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=make())(step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=world) as sim:
        for _ in range(3):
            x, y = torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)
            (loss, count), (want_loss, want_count) = compiled(model, optim, x, y), step(eager, eager_optim, x, y)
            assert count.dtype == torch.int64 and int(count) == int(want_count)
            assert abs(float(loss) - float(want_loss)) < 1e-12
        buffers = {name: sim.full_tensor(getattr(model, name)) for name in ("seen", "tokens", "calls")}
    for name, value in buffers.items():
        want = getattr(eager, name)
        assert value.dtype == want.dtype, (name, value.dtype)
        assert torch.equal(value, want), (name, value, want)


def test_an_output_whose_dtype_expansion_changed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """DTensor's own partition (without the fix) turns the int64 counter into a float32:
    the expansion's dtype check refuses the program instead of storing it."""
    from torch.distributed.tensor import Partial

    def torch_partition(self, tensor, mesh, mesh_dim):  # noqa: ANN001, ANN202
        return tensor / mesh.size(mesh_dim=mesh_dim) if self.reduce_op == "sum" else tensor

    private.install_dtensor_gap_fills()
    monkeypatch.setattr(Partial, "_partition_value", torch_partition)
    model = Counting().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(step)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError, match="changed the dtype of output"):
        compiled(model, optim, x, y)
