"""float32 recurrent layers on CPU (NOTE: [recurrent layers without oneDNN] in
``spmd_compiler/capture/trace.py``).

A float32 ``nn.LSTM`` / ``nn.GRU`` on CPU runs oneDNN's ``mkldnn_rnn_layer``, which no
DTensor rule shards: every such step was refused at expansion (float64, which takes
torch's own cell ops, compiled). The capture now traces the cell ops; eager keeps
oneDNN, so the two differ by float32 rounding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from spmd_compiler.parallel_modes import DataParallel

FLOAT32_TOLERANCE = 1e-4


class RecurrentClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 16, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(32, 16, batch_first=True)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        _, last = self.gru(out)
        return self.head(last[-1])


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_float32_lstm_and_gru_train_as_eager(run_parity, mode):
    gen = torch.Generator().manual_seed(2)
    batches = [(torch.randn(8, 5, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(3)]
    result = run_parity(
        RecurrentClassifier, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), 2, batches,
        mode=DataParallel(mode),
    )
    result.assert_close(FLOAT32_TOLERANCE)
