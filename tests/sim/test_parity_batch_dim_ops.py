"""Ops that mix samples across the (sharded) batch dimension keep single-device results.

With the batch Shard(0), an op along dimension 0 needs the whole batch: expansion gathers
it, and the backward then re-shards a replicated value (Replicate -> Shard), where each
rank must take its own slice. A program traced on one rank that bakes in that rank's
slice index is wrong on every other rank; these tests catch it at world 2 and 4.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

FLOAT32_TOLERANCE = 1e-5

OPS = {
    "roll_batch": lambda h: torch.roll(h, 1, 0),
    "flip_batch": lambda h: torch.flip(h, [0]),
    "cumsum_batch": lambda h: torch.cumsum(h, 0),
    "sort_batch": lambda h: torch.sort(h, 0).values,
    "cummax_batch": lambda h: torch.cummax(h, 0).values,
    "cumsum_features": lambda h: torch.cumsum(h, 1),
}


class MixBatch(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.inp = nn.Linear(8, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.op(self.inp(x)))


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("op", list(OPS))
def test_batch_mixing_op_parity(run_parity, classification_batches, op, world_size):
    result = run_parity(
        lambda: MixBatch(OPS[op]),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        world_size,
        classification_batches(2),
    )
    result.assert_close(FLOAT32_TOLERANCE)
