"""A Fourier neural operator layer: complex parameters, ``torch.fft.rfft2`` / ``irfft2``
and a complex ``einsum``, trained with AdamW (which steps complex parameters through
``view_as_real``), on 2 simulated ranks against the undecorated step on one device:
every parameter and optimizer-state tensor within 1e-12 in complex128 / float64, real
and imaginary parts both (``tools.parity.relative_difference`` compared the real part
alone before).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import relative_difference

TOL = 1e-12
BATCH, CHANNELS, SIZE, MODES = 4, 4, 16, 4


class SpectralBlock(nn.Module):
    """``x + irfft2(W * rfft2(x))`` on the lowest modes, between 1x1 convolutions."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(
            torch.randn(CHANNELS, CHANNELS, MODES, MODES, dtype=torch.complex128) * 0.1
        )
        self.lift = nn.Conv2d(1, CHANNELS, 1, dtype=torch.float64)
        self.project = nn.Conv2d(CHANNELS, 1, 1, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x)
        spectrum = torch.fft.rfft2(h)
        mixed = torch.zeros_like(spectrum)
        mixed[:, :, :MODES, :MODES] = torch.einsum(
            "bixy,ioxy->boxy", spectrum[:, :, :MODES, :MODES], self.weight
        )
        return self.project(F.gelu(torch.fft.irfft2(mixed, s=h.shape[-2:]) + h))


def operator_step(model, optim, x, y):  # noqa: ANN001
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [tuple(torch.randn(BATCH, 1, SIZE, SIZE, generator=gen, dtype=torch.float64)
                  for _ in range(2)) for _ in range(3)]


def test_complex_values_are_compared_in_both_parts():
    a = torch.tensor([1.0 + 1.0j, 2.0 - 1.0j], dtype=torch.complex128)
    assert relative_difference(a.conj(), a) == 1.0  # imaginary parts 2 apart; the real part alone: 0
    assert relative_difference(a, a.clone()) == 0.0


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_fourier_layer_with_complex_parameters_trains_as_one_device(mode, run_parity):
    result = run_parity(
        SpectralBlock, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2), 2, _batches(),
        step=operator_step, mode=make_mode(mode),
    )
    result.assert_close(TOL)
    assert result.model.weight.dtype == torch.complex128
    assert "param.weight" in result.state_differences


class Phases(nn.Module):
    """A real activation's spectrum, its phase worked on with a Python complex number:
    ``* 1j`` (autograd's gradient conjugates the number: a view of it, NOTE: [views of a
    Python number]), ``Tensor.angle()`` and ``torch.polar`` (their gradients multiply by
    ``1j``: a complex number DTensor's native dispatch cannot key, NOTE: [complex numbers
    in DTensor's dispatch]). Before 2026-12-06 the first failed at its first call on
    simulated ranks, the others were refused at expansion."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(16, 16, dtype=torch.float64)
        self.shift = nn.Parameter(torch.linspace(-0.5, 0.5, 9, dtype=torch.float64))
        self.head = nn.Linear(18, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(self.lin(x))
        if self.kind == "times_1j":
            z = spectrum * 1j * self.shift
        elif self.kind == "angle":
            z = torch.complex(spectrum.abs(), (spectrum + self.shift).angle())
        else:  # polar
            z = torch.polar(spectrum.abs(), spectrum.angle() + self.shift)
        return self.head(torch.cat([z.real, z.imag], -1))


def _phase_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 16, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(3)]


def _classify(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize(("kind", "mode", "world"), [
    ("times_1j", "ddp", 2), ("times_1j", "fsdp", 2), ("angle", "ddp", 2), ("angle", "fsdp", 4),
    ("polar", "ddp", 4), ("polar", "fsdp", 2),
])
def test_phase_ops_with_python_complex_numbers_match_one_device(kind, mode, world, run_parity):
    result = run_parity(
        lambda: Phases(kind), lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), world,
        _phase_batches(), step=_classify, mode=make_mode(mode),
    )
    result.assert_close(TOL)
