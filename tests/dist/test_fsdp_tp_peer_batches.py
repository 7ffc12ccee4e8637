"""Under FSDP x TP the ranks of one dp group (the tp peers) pass one batch slice; ranks
that each pass their own slice are refused on every rank (NOTE: [tp peers pass one
batch slice] in ``runtime/same_inputs.py``).

Before the check, 4 gloo ranks on a (2, 2) mesh each passing its own quarter of the
global batch (as a DistributedSampler over all ranks gives) trained 3 AdamW steps with
no error and ended 1.56 relative off one device. Here 2 ranks on a (1, 2) mesh (the
machine's 2 cores): one dp group, whose two tp ranks each pass their own half.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import FullyShardTensorParallel
from spmd_compiler.tools.parity import launch_timeout

pytestmark = pytest.mark.dist

WORLD_SIZE = 2  # a (dp, tp) = (1, 2) mesh: ranks 0, 1 are dp group 0
BATCH = 8


def _global_batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, 8, generator=gen), torch.randint(0, 4, (BATCH,), generator=gen)


def _slice(t: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    rows = BATCH // parts
    return t[index * rows : (index + 1) * rows]


def _round_worker(rank: int, world_size: int) -> dict:
    """The first call's round alone, on a (dp, tp) mesh: the batch placed S(0) on dp and R
    on tp, a table R on both (the per-call round's), a tensor split on both (no peers)."""
    from torch.distributed.device_mesh import init_device_mesh

    from spmd_compiler.runtime.same_inputs import peer_batches, warn_on_same_shares

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    x, _ = _global_batch()
    names = ["x", "table", "both"]
    placements = [(Shard(0), Replicate()), (Replicate(), Replicate()), (Shard(0), Shard(1))]
    own = torch.full((2, 2), float(rank))  # split on both dimensions: every rank its own
    out: dict = {}
    for case, batch in [("dp slice", x), ("own half", _slice(x, rank, 2))]:
        args = [batch, torch.full((3,), float(rank)), own]
        peers = peer_batches(names, args, placements, mesh)
        out.setdefault("peers", [(p.label, p.group, p.members) for p in peers])
        try:
            warn_on_same_shares([], peers)
            out[case] = None
        except sc.SPMDCompileError as exc:
            out[case] = str(exc)
    return out


def test_tp_peers_passing_their_own_slices_are_refused_by_the_first_round() -> None:
    results = sc.launch(
        _round_worker, WORLD_SIZE, timeout_s=launch_timeout(120), collective_timeout_s=60
    )
    for rank, out in enumerate(results):
        # only the batch has peers: the table is the per-call round's, ``both`` has none
        assert out["peers"] == [("x (input[0])", 0, ((0, 1),))], out["peers"]
        assert out["dp slice"] is None, f"rank {rank}: {out['dp slice']}"
        error = out["own half"]
        assert error is not None, f"rank {rank} was not refused"
        assert "The ranks of one dp group (the tp peers)" in error
        assert "x (input[0]) (4, 8): dp group 0 (ranks 0, 1)" in error
        assert "DistributedSampler(dataset, num_replicas=1, rank=dp_index)" in error
        assert "0 on this rank" in error


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.down(F.gelu(self.up(x))))


def _step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _step_worker(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    model = _Block()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mode = FullyShardTensorParallel(
        {"up": ColwiseParallel(), "down": RowwiseParallel()}, mesh_shape=(1, 2)
    )
    step = sc.compile(mode)(_step)
    x, y = _global_batch()
    try:  # each rank its own half, as a sampler over both ranks gives
        step(model, optim, _slice(x, rank, 2), _slice(y, rank, 2))
    except sc.SPMDCompileError as exc:
        updated = any(
            not torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p, before[k])
            for k, p in model.state_dict().items()
        )
        return {"error": str(exc), "updated": updated, "steps": optim.state_dict()["state"]}
    return {"error": None}


def test_fsdp_tp_step_refuses_tp_peers_with_their_own_batches() -> None:
    """The compiled step on real ranks: refused on its first call, before compiling,
    with nothing updated."""
    results = sc.launch(
        _step_worker, WORLD_SIZE, timeout_s=launch_timeout(240), collective_timeout_s=60
    )
    for rank, out in enumerate(results):
        assert out["error"] is not None, f"rank {rank} trained on its own half without an error"
        assert (
            "x (input[0]) (4, 8): dp group 0 (ranks 0, 1) passed different values" in out["error"]
        )
        assert "the group's ranks must pass the same batch slice" in out["error"]
        assert not out["updated"] and out["steps"] == {}
