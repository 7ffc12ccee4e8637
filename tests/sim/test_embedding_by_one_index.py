"""An embedding looked up by a 0-d index (``self.cls(torch.tensor(2))``), and a view of
a vocabulary-sharded lookup inside its module: float64, 2 simulated ranks, against the
undecorated step on one device (NOTE: [views of a masked embedding] in
``spmd_compiler/expand/local_rules.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from spmd_compiler.parallel_modes import TensorParallel, make_mode
from spmd_compiler.tools.demo.steps import classification_train_step

TOL = 1e-13
VOCAB, WIDTH, CLASSES, BATCH, SEQ = 16, 8, 4, 8, 5


class _FlatEmbedding(nn.Embedding):
    """A lookup viewed inside its own module: under RowwiseParallel the view meets the
    rows before the module's output is reduced."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids).flatten(1)


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = _FlatEmbedding(VOCAB, WIDTH)
        self.cls = nn.Embedding(CLASSES, WIDTH)
        self.head = nn.Linear(WIDTH * SEQ, CLASSES)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        token = self.cls(torch.tensor(2))  # a 0-d index: one row, shape (WIDTH,)
        return self.head(self.emb(ids) + token.repeat(SEQ))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(3)
    ]


MODES = {
    "ddp": lambda: make_mode("ddp"),
    "fsdp": lambda: make_mode("fsdp"),
    # vocabulary sharded: each rank owns half the rows, a lookup is masked and summed
    "tp_rowwise": lambda: TensorParallel({"emb": RowwiseParallel(), "cls": RowwiseParallel()}),
    "tp_colwise": lambda: TensorParallel({"emb": ColwiseParallel(), "cls": ColwiseParallel()}),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_lookups_by_one_index_and_viewed_lookups_match_one_device(mode, run_parity):
    result = run_parity(
        lambda: _Model().double(), lambda m: torch.optim.AdamW(m.parameters(), lr=0.05), 2,
        _batches(), step=classification_train_step, mode=MODES[mode](),
    )
    result.assert_close(TOL)
    assert result.state_differences["param.cls.weight"] < TOL  # only row 2 moves, on one rank's shard
    assert result.compile_counts[-1] == 1
