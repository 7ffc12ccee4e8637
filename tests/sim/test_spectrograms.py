"""A spectrogram front end in the step (``torch.stft``), and a spectral mask turned back
into a waveform (``torch.istft``; NOTE: [short-time Fourier transforms at capture]):
float64, 2 simulated ranks, against the undecorated step on one device on the global
batch; the frames stay on their rank (no all-gather of the batch under ddp)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDRuntimeError
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


class _MaskEnhancer(nn.Module):
    """Speech-enhancement shape: a mask predicted from the magnitude spectrum multiplies
    the complex spectrum, and the inverse transform gives the waveform back."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(16, dtype=torch.float64))
        self.mask = nn.Linear(9, 9)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wave, 16, hop_length=4, window=self.window, return_complex=True)
        gain = torch.sigmoid(self.mask(spec.abs().transpose(1, 2))).transpose(1, 2)
        return (spec * gain).istft(16, hop_length=4, window=self.window, length=wave.shape[-1])


def enhancement_step(model, optim, noisy, clean):  # noqa: ANN001, ANN201
    loss = F.l1_loss(model(noisy), clean)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _wave_pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    pairs = []
    for _ in range(3):
        clean = torch.randn(BATCH, SAMPLES, generator=gen, dtype=torch.float64)
        pairs.append((clean + 0.3 * torch.randn(BATCH, SAMPLES, generator=gen, dtype=torch.float64), clean))
    return pairs


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_spectral_mask_and_inverse_match_one_device(mode, run_parity):
    result = run_parity(
        lambda: _MaskEnhancer().double(),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        2, _wave_pairs(), step=enhancement_step, mode=make_mode(mode),
    )
    result.assert_close(TOL)


def test_a_window_that_stops_overlapping_is_refused_on_the_call():
    """ATen refuses a window whose overlapped squares vanish somewhere (NOLA); the
    compiled step checks it on every call, and a call that fails it writes nothing."""
    model = _MaskEnhancer().double()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode("ddp"))(enhancement_step)
    noisy, clean = _wave_pairs()[0]
    with sc.simulate(world_size=2):
        compiled(model, optim, noisy, clean)
        weight = model.mask.weight.full_tensor().clone()
        with torch.no_grad():
            model.window.zero_()
        with pytest.raises(SPMDRuntimeError, match="window overlap add"):
            compiled(model, optim, noisy, clean)
        assert torch.equal(model.mask.weight.full_tensor(), weight)


class _LongSignal(nn.Module):
    """A window grid of over a million samples per signal (1,025 frames of 1,024): the
    frames are indexed directly, without a per-element check or size cap."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("window", torch.hann_window(1024, dtype=torch.float64))
        self.head = nn.Linear(513, CLASSES)

    def forward(self, wave: torch.Tensor) -> torch.Tensor:
        spec = torch.stft(wave, 1024, hop_length=16, window=self.window, center=False, return_complex=True)
        return self.head(spec.abs().mean(-1))


def test_a_long_signal_compiles(run_parity):
    gen = torch.Generator().manual_seed(5)
    batches = [
        (torch.randn(4, 1024 + 16 * 1024, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (4,), generator=gen))
    ]
    result = run_parity(
        lambda: _LongSignal().double(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        2, batches, step=plain_step, mode=make_mode("ddp"),
    )
    result.assert_close(TOL)
