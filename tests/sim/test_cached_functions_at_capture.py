"""The user's own ``functools.lru_cache`` / ``functools.cache`` functions in a step
(module-level, closures, methods, static and class methods).

While the step is traced such a function is called through: its tensor is made in the
program, as eager's first call makes it, and its cache is neither read nor written
(NOTE: [the user's cached functions at capture] in ``capture/python_effects.py``).
Until the sixty-third session the trace's FakeTensor stayed in the cache: eager use of
it after the compile failed (DataDependentOutputException), a smaller last batch's
capture, and a first compiled call after eager had filled the cache, were refused as "a
tensor that is neither an argument nor part of a module". Float64 on 2 simulated ranks
under replicate and fully_shard, against eager on the global batch.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_models

TOL = 1e-12
CLASSES = 4


@functools.lru_cache(maxsize=32)
def class_weights(classes: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, classes, dtype=torch.float64)


class Offsets(nn.Module):
    """A model whose own class caches a tensor by size."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, CLASSES)).double()

    @functools.lru_cache(maxsize=8)  # noqa: B019 - the user's pattern under test
    def offsets(self, classes: int) -> torch.Tensor:
        return torch.arange(classes, dtype=torch.float64) * 0.1

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def shift(classes: int) -> torch.Tensor:  # a static method's cache
        return torch.linspace(0.0, 0.2, classes, dtype=torch.float64)

    @classmethod
    @functools.cache
    def tilt(cls, classes: int) -> torch.Tensor:  # a class method's cache
        return torch.full((classes,), 0.05, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x)
        return out + self.offsets(out.shape[-1]) + self.shift(out.shape[-1]) + self.tilt(out.shape[-1])


def _make_step():  # noqa: ANN202
    @functools.cache
    def scale(classes: int) -> torch.Tensor:  # a closure's cached function
        return torch.full((classes,), 0.9, dtype=torch.float64)

    def step(model, opt, x, y):  # noqa: ANN001, ANN202
        out = model(x) * scale(CLASSES)
        loss = F.cross_entropy(out, y, weight=class_weights(out.shape[-1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step, scale


def _caches(model: Offsets, scale) -> list:  # noqa: ANN001
    return [class_weights, scale, type(model).offsets, type(model).shift, type(model).__dict__["tilt"].__func__]


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize("eager_first", [False, True])
def test_cached_tensor_helpers_match_eager_and_keep_their_caches(style, eager_first):
    """Losses and parameters as eager's, a smaller last batch compiling again; the caches
    hold real tensors only, and as many as before the compiled calls (before: a
    FakeTensor, then a refusal)."""
    torch.manual_seed(0)
    model = Offsets()
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    step, scale = _make_step()
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(b, 16, generator=gen, dtype=torch.float64),
                torch.randint(0, CLASSES, (b,), generator=gen)) for b in (8, 8, 4)]
    expected = [step(reference, reference_opt, x, y) for x, y in batches]
    caches = _caches(model, scale)
    if not eager_first:
        for cached in caches:
            cached.cache_clear()
    found = [cached.cache_info() for cached in caches]
    compiled = sc.compile(parallel_mode=DataParallel(style))(step)
    with sc.simulate(world_size=2) as sim:
        got = [compiled(model, opt, x, y).item() for x, y in batches]
        assert got == pytest.approx([want.item() for want in expected], rel=TOL, abs=0)
        assert max(compare_models(model, reference, sim).values()) < TOL
    assert compiled.compile_count == 2
    assert [cached.cache_info() for cached in caches] == found
    assert class_weights(CLASSES)[1].item() == pytest.approx(0.5 + 1 / 3)  # a real tensor
    assert type(scale(CLASSES)) is torch.Tensor and type(model.offsets(CLASSES)) is torch.Tensor
