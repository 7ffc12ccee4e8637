"""Weight norm under fully_shard where a rank's shard of the normalized weight is one row
(or one row of padding), on simulated ranks, float64 against one device on the global
batch (NOTE: [bucket results stay contiguous] in ``passes/bucket_collectives.py``).

Both ``torch.nn.utils.weight_norm`` (a forward pre-hook) and
``torch.nn.utils.parametrizations.weight_norm`` call ``aten._weight_norm_interface``,
whose eager backward refuses a non-contiguous ``v``. ``bucket_collectives`` handed a
gathered member whose shard is one row a strided view of the bucket's buffer, so the
first step failed with "saved_v must be contiguous" (``Linear(16, 4)`` at 4 ranks,
``Linear(16, 2)`` at 2, ``Linear(16, 3)`` at 4 with one padded row, ``Conv1d(4, 4, 3)`` at
4); two rows per rank (``Linear(16, 8)`` at 4) and ``replicate`` trained fine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_models, compare_optimizers, max_difference

# the hook API is deprecated in favour of the parametrization; both are still in use
pytestmark = pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated")

TOL = 1e-12
BATCH = 8

APIS = {
    "hook": torch.nn.utils.weight_norm,
    "parametrization": torch.nn.utils.parametrizations.weight_norm,
}


class _Conv(nn.Module):
    """Linear into a weight-normed Conv1d, whose (4, 4, 3) weight is one row a rank at 4."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(8, 4 * 5, dtype=torch.float64)
        self.conv = nn.Conv1d(4, 4, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(torch.tanh(self.up(x)).view(-1, 4, 5)).sum(-1)


def _model(api: str, out: int) -> nn.Module:
    torch.manual_seed(0)
    if out == 0:
        model: nn.Module = _Conv()
        APIS[api](model.conv)
        return model
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, out)).double()
    APIS[api](model[2])
    return model


def _step(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _train(api: str, out: int, world_size: int) -> float:
    model, reference = _model(api, out), _model(api, out)  # the hook's model has no deepcopy
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = sc.compile(parallel_mode=DataParallel("fully_shard"))(_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=world_size) as sim:
        for _ in range(3):
            x = torch.randn(BATCH, 8, generator=gen, dtype=torch.float64)
            y = torch.randn(BATCH, out or 4, generator=gen, dtype=torch.float64)
            got, want = compiled(model, optim, x, y), _step(reference, ref_optim, x, y)
            assert float(got) == pytest.approx(float(want), rel=TOL, abs=TOL)
        return max_difference(
            compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim)
        )


@pytest.mark.parametrize("api", list(APIS))
@pytest.mark.parametrize(
    ("out", "world_size"),
    [(2, 2), (4, 4), (3, 4), (8, 4)],
    ids=["one_row_at_2", "one_row_at_4", "padded_at_4", "two_rows_at_4"],
)
def test_weight_normed_linear_one_row_shards(api, out, world_size):
    assert _train(api, out, world_size) < TOL


def test_weight_normed_conv_one_row_shards():
    """A 3-D weight: each rank's (1, 4, 3) shard gathers to a (4, 4, 3) view."""
    assert _train("parametrization", 0, 4) < TOL
