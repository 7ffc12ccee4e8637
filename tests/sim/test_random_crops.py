"""Random crops of an image batch by unfolded patches, ``patches[torch.arange(B), ys,
xs]``, fed to a convolution (NOTE: [convolution operands placed first] in
``spmd_compiler/_torch_private.py``).

With the offsets drawn in the step (replicated), DTensor's rule for ``aten.index`` moves
the batch shard of the unfolded image to a patch dimension (an all-to-all), and the
convolution's handler kept that spatial shard as if it were an argument split along
time: the step was refused by the local shape check ("(8, 4, 3, 6) ... [R] ... (8, 4, 6,
6)"), its hint naming ``input_batch_dim``. Now gathered; the neighbouring forms (a
depthwise convolution, a transposed one, a Linear after flatten, offsets passed as
batch-split arguments) are compared with eager too. float64, simulated ranks.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel

TOL = 1e-11
P = 6


def _crop(lr: torch.Tensor, ys: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    patches = lr.unfold(2, P, 1).unfold(3, P, 1)  # B, C, n, n, P, P
    return patches.permute(0, 2, 3, 1, 4, 5)[torch.arange(lr.shape[0]), ys, xs]  # B, C, P, P


def drawn_step(model, optim, lr):
    b, _, h, w = lr.shape
    ys, xs = torch.randint(0, h - P + 1, (b,)), torch.randint(0, w - P + 1, (b,))
    loss = model(_crop(lr, ys, xs)).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def given_step(model, optim, lr, ys, xs):
    loss = model(_crop(lr, ys, xs)).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


_MODELS = {
    "conv": lambda: nn.Conv2d(3, 4, 3, padding=1),
    "depthwise": lambda: nn.Sequential(nn.Conv2d(3, 6, 3, padding=1, groups=3), nn.Tanh(), nn.Conv2d(6, 2, 1)),
    "conv_transpose": lambda: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1),
    "linear": lambda: nn.Sequential(nn.Flatten(), nn.Linear(3 * P * P, 5)),
}


def _batches(offsets: bool) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for _ in range(3):
        lr = torch.rand(8, 3, 10, 10, generator=gen, dtype=torch.float64)
        ys, xs = (torch.randint(0, 10 - P + 1, (8,), generator=gen) for _ in range(2))
        out.append((lr, ys, xs) if offsets else (lr,))
    return out


def _drawn_parity(model_name: str, mode: str, world: int) -> tuple[list[float], float]:
    """Loss and largest parameter difference from eager, each run from the same seed (the
    compiled step draws the offsets as eager does)."""
    torch.manual_seed(0)
    model = _MODELS[model_name]().double()
    reference = copy.deepcopy(model)
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    batches = _batches(False)
    torch.manual_seed(7)
    expected = [drawn_step(reference, reference_optim, *b) for b in batches]
    compiled = sc.compile(parallel_mode=DataParallel(mode))(drawn_step)
    torch.manual_seed(7)
    with sc.simulate(world_size=world):
        losses = [compiled(model, optim, *b) for b in batches]
        state = sc.checkpoint.full_state_dict(model)["model"]
    differences = [abs((a - e).item()) for a, e in zip(losses, expected, strict=True)]
    want = reference.state_dict()
    return differences, max((state[k] - want[k]).abs().max().item() for k in want)


@pytest.mark.parametrize("model", list(_MODELS))
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("world", [2, 4])
def test_a_crop_with_offsets_drawn_in_the_step_is_eagers(model, mode, world):
    losses, parameters = _drawn_parity(model, mode, world)
    assert max(losses) < TOL and parameters < TOL, (losses, parameters)


@pytest.mark.parametrize("model", list(_MODELS))
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_crop_with_offsets_passed_in_is_eagers(run_parity, model, mode):
    result = run_parity(
        lambda: _MODELS[model]().double(), lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 2,
        _batches(True), step=given_step, mode=DataParallel(mode),
    )
    result.assert_close(TOL)
