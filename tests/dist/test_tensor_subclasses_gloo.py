"""Tensor subclasses on 2 real gloo ranks (NOTE: [tensor subclasses that override torch]).

A parameter or batch whose class defines ``__torch_function__`` (one doubling
``F.linear``), and a ``__torch_dispatch__`` wrapper parameter, are refused on every rank
naming the place and the class, the model untouched. Before 2026-12-06 the first trained
as the plain model silently (parameters 7.0e-2 off eager) and the wrapper failed after
its compile on every rank with "invalid python storage" and "No other rank recorded a
failure". A subclass that overrides nothing, as a parameter and the batch, trains as the
eager step on the global batch. Worker functions live at module level for ``spawn``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_train_step as train_step

from tests.sim.test_tensor_subclass_state import Logged, Scaled, Tagged

pytestmark = pytest.mark.dist

STYLES = ("replicate", "fully_shard")


def _model(cls: type | None = None) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    if cls is Logged:
        model[0].weight = nn.Parameter(Logged(model[0].weight.detach()))
    elif cls is not None:
        model[0].weight = nn.Parameter(model[0].weight.detach().as_subclass(cls))
    return model


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(3)]


def _worker(rank: int, world_size: int) -> dict:
    out: dict = {}
    x, y = _batches()[0]
    x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    for style in STYLES:
        for what in ("Scaled param", "Logged param", "Scaled batch"):
            model = _model(Scaled if what == "Scaled param" else Logged if what == "Logged param" else None)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            types = [type(p) for p in model.parameters()]
            step = sc.compile(DataParallel(style))(train_step)
            try:
                step(model, optim, x.as_subclass(Scaled) if what == "Scaled batch" else x, y)
                message = None
            except sc.SPMDCompileError as exc:
                message = str(exc)
            untouched = types == [type(p) for p in model.parameters()] and not optim.state
            out[(style, what)] = (message, untouched)
        model = _model(Tagged)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = sc.compile(DataParallel(style))(train_step)
        out[(style, "Tagged")] = [
            float(step(model, optim, bx[rank * 4:(rank + 1) * 4].as_subclass(Tagged), by[rank * 4:(rank + 1) * 4]))
            for bx, by in _batches()
        ]
    return out


def test_overriding_subclasses_are_refused_and_a_plain_one_trains_as_eager_on_gloo():
    reference = _model(Tagged)
    optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = [float(train_step(reference, optim, x.as_subclass(Tagged), y)) for x, y in _batches()]
    for result in sc.launch(_worker, 2, timeout_s=300):
        for style in STYLES:
            for what, place in (("Scaled param", "parameter 0.weight is a Scaled"),
                                ("Logged param", "parameter 0.weight is a Logged"),
                                ("Scaled batch", "argument x of the step is a Scaled")):
                message, untouched = result[(style, what)]
                assert message is not None and place in message, (style, what, message)
                assert untouched, (style, what)
            assert max(abs(a - b) for a, b in zip(result[(style, "Tagged")], expected)) < 1e-10
