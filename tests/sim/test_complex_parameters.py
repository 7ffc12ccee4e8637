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
