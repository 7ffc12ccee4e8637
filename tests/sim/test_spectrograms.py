"""A spectrogram front end in the step (``torch.stft``, NOTE: [short-time Fourier
transforms at capture]): float64, 2 simulated ranks, against the undecorated step on one
device on the global batch; the signal's frames stay on their rank (no all-gather of the
batch under ddp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spmd_compiler.ir.collectives import collective_kind, is_collective
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step as plain_step

TOL = 1e-12
BATCH, SAMPLES, CLASSES = 8, 64, 4


class _Spectrogram(nn.Module):
    """Log-magnitude spectrogram (a Hann window shorter than the FFT, method call) and
    a learned filter bank on it, then a convolution over time."""

    def __init__(self, method: bool) -> None:
        super().__init__()
        self.method = method
        self.register_buffer("window", torch.hann_window(12, dtype=torch.float64))
        self.bank = nn.Linear(9, 6)
        self.conv = nn.Conv1d(6, 8, 3)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        options = dict(n_fft=16, hop_length=4, win_length=12, window=self.window, return_complex=True)
        spec = wave.stft(**options) if self.method else torch.stft(wave, **options)
        power = spec.abs().pow(2).log1p().transpose(1, 2)  # (batch, frames, frequencies)
        features = F.gelu(self.conv(self.bank(power).transpose(1, 2)))
        return self.head(features.mean(-1))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(BATCH, SAMPLES, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(3)
    ]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("method", [False, True], ids=["torch_stft", "tensor_stft"])
def test_spectrogram_front_end_matches_one_device(mode, method, run_parity):
    result = run_parity(
        lambda: _Spectrogram(method).double(),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        2, _batches(), step=plain_step, mode=make_mode(mode),
    )
    result.assert_close(TOL)
    if mode == "ddp":
        graph = result.compiled.last_program.graph_module.graph
        kinds = {collective_kind(n) for n in graph.nodes if is_collective(n)}
        assert kinds == {"all_reduce"}, kinds
