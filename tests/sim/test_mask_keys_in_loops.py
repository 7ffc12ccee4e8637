"""Masks selected in a Python loop whose each mask reads the previous step's values twice
(NOTE: [mask keys interned]).

Farthest point sampling as PointNet++ code copies it (``mask = dist < distance;
distance[mask] = dist[mask]``) doubled the nested tuple keying each mask at every
step, and each lookup hashed it whole: the first call took 28 s for 9 points and never
finished for 512. The keys are interned now: the hashing is linear in the loop's length,
and the result is still eager's (float64, 2 simulated ranks, replicated data parallel).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from twin_models import finish

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_models, relative_difference

TOL = 1e-12
BATCH, POINTS = 4, 32


def farthest_points(xyz: torch.Tensor, count: int) -> torch.Tensor:
    """yanx27/Pointnet_Pointnet2_pytorch's ``farthest_point_sample``."""
    batch, points, _ = xyz.shape
    distance = torch.ones(batch, points, dtype=xyz.dtype) * 1e10
    farthest = torch.zeros(batch, dtype=torch.long)
    rows = torch.arange(batch)
    found = []
    for _ in range(count):
        found.append(farthest)
        centroid = xyz[rows, farthest, :].view(batch, 1, 3)
        dist = torch.sum((xyz - centroid) ** 2, -1)
        mask = dist < distance
        distance[mask] = dist[mask]
        farthest = torch.max(distance, -1)[1]
    return torch.stack(found, 1)


class Sampled(nn.Module):
    def __init__(self, count: int) -> None:
        super().__init__()
        self.count = count
        self.embed = nn.Linear(3, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, xyz: torch.Tensor) -> torch.Tensor:
        at = farthest_points(xyz, self.count)
        picked = xyz[torch.arange(xyz.shape[0])[:, None], at]
        return self.head(F.relu(self.embed(picked)).max(1)[0])


def step(model, optim, xyz, labels):  # noqa: ANN001
    return finish(model, optim, F.cross_entropy(model(xyz), labels))


def _first_call_op_hashes(count: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Hashes of ATen ops during the first (capturing) call with ``count`` points sampled;
    the result and the model after it are eager's."""
    torch.manual_seed(0)
    model = Sampled(count).double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    xyz, labels = torch.rand(BATCH, POINTS, 3, dtype=torch.float64), torch.randint(0, 4, (BATCH,))
    hashed: list[torch._ops.OpOverload] = []
    original = torch._ops.OpOverload.__hash__
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(step)
    with sc.simulate(world_size=2) as sim:
        with monkeypatch.context() as patch:
            patch.setattr(torch._ops.OpOverload, "__hash__", lambda op: hashed.append(op) or original(op))
            got = compiled(model, optim, xyz, labels)
        want = step(reference, reference_optim, xyz, labels)
        assert relative_difference(got, want) < TOL, (got, want)
        assert max(compare_models(model, reference, sim).values()) < TOL
    return len(hashed)


def test_farthest_point_sampling_keys_its_masks_in_linear_time(monkeypatch):
    """Twice the points, about twice the hashing: before, 8 points hashed ops ~600 times
    as often as 4 (each mask's key a tree doubling per step, hashed whole per lookup)."""
    few, many = _first_call_op_hashes(4, monkeypatch), _first_call_op_hashes(8, monkeypatch)
    assert many < 3 * few, (few, many)
