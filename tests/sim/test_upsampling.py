"""``F.interpolate`` / ``nn.Upsample`` on batch-sharded feature maps (a segmentation
decoder, an FPN, a U-Net's skip path) and on replicated weights (BEiT's relative position
bias resized), every mode, float64, against one device.

torch 2.13's DTensor has rules for the upsample ops and rewrites their backward's
``input_size`` argument to the local shape; torch 2.11 (the GPU machines') had rules for
some forwards only: BEiT under ddp was refused (``upsample_bilinear2d_backward does not
have a sharding strategy``), and so was every model upsampling a batch-sharded feature
map. NOTE: [upsampling rules] in ``spmd_compiler/_torch_private.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spmd_compiler.parallel_modes import make_mode

UPSAMPLES = {
    "nearest": dict(scale_factor=2, mode="nearest"),
    "nearest_exact": dict(scale_factor=2, mode="nearest-exact"),
    "bilinear": dict(scale_factor=2, mode="bilinear", align_corners=False),
    "bilinear_aligned_size": dict(size=(7, 9), mode="bilinear", align_corners=True),
    "bicubic": dict(scale_factor=2, mode="bicubic", align_corners=False),
    "bilinear_antialias_down": dict(size=(3, 3), mode="bilinear", antialias=True),
}


class Decoder(nn.Module):
    """Features from a conv, upsampled, mixed back with a skip path, a class per pixel;
    and a learned grid resized (a parameter: replicated on every rank)."""

    def __init__(self, upsample: dict) -> None:
        super().__init__()
        self.upsample = upsample
        self.encode = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.table = nn.Parameter(torch.randn(1, 4, 3, 3))
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.encode(x))  # (N, 4, 4, 4)
        up = F.interpolate(h, **self.upsample)
        bias = F.interpolate(self.table, size=up.shape[-2:], mode="bilinear", align_corners=False)
        return self.head(up + bias)


def segmentation_step(model, optim, x, y):
    logits = model(x)
    loss = F.cross_entropy(logits, y[:, : logits.shape[2], : logits.shape[3]])
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", sorted(UPSAMPLES))
def test_upsampling_matches_one_device(run_parity, name, mode):
    gen = torch.Generator().manual_seed(4)
    batches = [
        (torch.randn(8, 3, 8, 8, generator=gen, dtype=torch.float64),
         torch.randint(0, 2, (8, 9, 9), generator=gen))
        for _ in range(2)
    ]
    result = run_parity(
        lambda: Decoder(UPSAMPLES[name]).double(),
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        2,
        batches,
        step=segmentation_step,
        mode=make_mode(mode),
    )
    result.assert_close(1e-12)
