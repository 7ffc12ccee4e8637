"""Parameters that are non-contiguous tensors (``nn.Parameter(w.T)``, or the ``Vh[:r]`` a
low-rank parametrization's ``right_inverse`` takes from ``torch.linalg.svd``) whose sharded
dimension the ranks do not divide, on simulated ranks, float64 against one device on the
global batch (NOTE: [contiguous simulated shards]).

The ranks holding a shard as ``distribute_tensor`` left it kept the transposed strides;
the rank whose shard is zero-padded (NOTE: [uneven shards]) got a contiguous copy; and a
simulated ``reshape`` decides once for all ranks whether to view: the first call failed
with "view size is not compatible with input tensor's size and stride" (fsdp of 3 rows
over 2 ranks; tensor parallel of a width of 30 over 4). Two real gloo ranks trained it
exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.utils.parametrize as parametrize
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel, TensorParallel
from spmd_compiler.tools.parity import compare_models, compare_optimizers, max_difference

TOL = 1e-12


class _Transposed(nn.Module):
    """``B`` is a (rows, 16) parameter with strides (1, rows)."""

    def __init__(self, rows: int) -> None:
        super().__init__()
        self.B = nn.Parameter(torch.randn(16, rows, dtype=torch.float64).T)
        self.down = nn.Linear(rows, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(x @ self.B.T)


class _TransposedMLP(nn.Module):
    """Both Linear weights transposed views of a fresh tensor, hidden width ``hidden``."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(16, hidden, dtype=torch.float64)
        self.down = nn.Linear(hidden, 4, dtype=torch.float64)
        self.up.weight = nn.Parameter(torch.randn(16, hidden, dtype=torch.float64).T * 0.2)
        self.down.weight = nn.Parameter(torch.randn(hidden, 4, dtype=torch.float64).T * 0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class _LowRank(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a @ b

    def right_inverse(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        u, s, vh = torch.linalg.svd(w, full_matrices=False)
        return u[:, :3] * s[:3], vh[:3]  # vh[:3]: 3 rows, strides (1, 3)


def _low_rank_mlp() -> nn.Module:
    model = _TransposedMLP(32)
    parametrize.register_parametrization(model.up, "weight", _LowRank(), unsafe=True)
    return model


def _step(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _run(model: nn.Module, mode, world_size: int) -> float:  # noqa: ANN001
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = sc.compile(mode)(_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=world_size) as sim:
        for _ in range(3):
            x = torch.randn(8, 16, generator=gen, dtype=torch.float64)
            y = torch.randint(0, 4, (8,), generator=gen)
            got, want = compiled(model, optim, x, y), _step(reference, ref_optim, x, y)
            assert float(got) == pytest.approx(float(want), rel=TOL, abs=TOL)
        return max_difference(
            compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim)
        )


@pytest.mark.parametrize("rows", [3, 5])
def test_fully_shard_transposed_parameter_uneven_rows(rows):
    """3 or 5 rows with strides (1, rows) over 2 ranks: rank 1's shard is padded."""
    torch.manual_seed(0)
    assert _run(_Transposed(rows), DataParallel("fully_shard"), 2) < TOL


def test_tensor_parallel_transposed_weights_uneven_width():
    """A hidden width of 30 over 4 ranks (8, 8, 8, 6 rows / columns, the last padded)."""
    torch.manual_seed(0)
    mode = TensorParallel({"up": ColwiseParallel(), "down": RowwiseParallel()})
    assert _run(_TransposedMLP(30), mode, 4) < TOL


def test_fully_shard_low_rank_parametrization():
    """The ``Vh[:3]`` factor (3 rows, strides (1, 3)) over 2 ranks."""
    torch.manual_seed(0)
    assert _run(_low_rank_mlp(), DataParallel("fully_shard"), 2) < TOL
