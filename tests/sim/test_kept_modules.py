"""A module the step makes and keeps (NOTE: [modules made in the step and kept]).

``self.fast = copy.deepcopy(self.model)`` on a trainer object held the trace's fake
parameters after every compiled call (its forward then failed in torch with
``DataDependentOutputException``). Such a module, alone or in a list or dict the step
stores or appends, is refused naming the place, which is put back as it was; the same
step deleting it before it returns, or keeping it in a local variable, matches eager
(float64, 2 simulated ranks, within 1e-12).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-12


class _Trainer:
    def __init__(self, form: str) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.form = form
        self.fast: object = None
        self.snapshots: list = []

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.form == "attribute":
            self.fast = copy.deepcopy(self.model)
        elif self.form == "made":
            self.fast = nn.Linear(4, 2, dtype=torch.float64)
        elif self.form == "dict":
            self.fast = {"aux": copy.deepcopy(self.model)}
        elif self.form == "appended":
            self.snapshots.append(copy.deepcopy(self.model))
        elif self.form in ("deleted", "local"):
            fast = copy.deepcopy(self.model)
            if self.form == "deleted":
                self.fast = fast
            anchor = ((fast(x) - y) ** 2).mean().detach()
            if self.form == "deleted":
                del self.fast
        loss = ((self.model(x) - y) ** 2).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss + 0 * anchor if self.form in ("deleted", "local") else loss


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(8, 4, generator=gen, dtype=torch.float64),
            torch.randn(8, 2, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("form", ["attribute", "made", "dict", "appended"])
def test_a_module_made_in_the_step_and_kept_is_refused_and_put_back(form: str) -> None:
    trainer = _Trainer(form)
    before = copy.deepcopy(trainer.model.state_dict())
    x, y = _batch()
    with sc.simulate(world_size=2):
        step = sc.compile(parallel_mode=make_mode("ddp"))(trainer.step)
        with pytest.raises(SPMDCompileError, match="made in the step") as info:
            step(x, y)
    text = str(info.value)
    assert ("snapshots" if form == "appended" else ".fast") in text, text
    assert "local variable" in text and "modules made in the step and kept" in text
    assert trainer.fast is None and trainer.snapshots == []
    for name, t in trainer.model.state_dict().items():
        assert type(t) is torch.Tensor and torch.equal(t, before[name]), name


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("form", ["deleted", "local"])
def test_a_module_made_in_the_step_and_not_kept_matches_eager(form: str, mode: str) -> None:
    eager, compiled = _Trainer(form), _Trainer(form)
    x, y = _batch()
    expected = [eager.step(x, y) for _ in range(3)]
    with sc.simulate(world_size=2) as sim:
        step = sc.compile(parallel_mode=make_mode(mode))(compiled.step)
        got = [step(x, y) for _ in range(3)]
        for a, b in zip(got, expected, strict=True):
            assert abs(float(a) - float(b)) <= TOL
        for (name, p), q in zip(compiled.model.named_parameters(), eager.model.parameters(), strict=True):
            assert torch.allclose(sim.full_tensor(p), q.detach(), rtol=0, atol=TOL), name
    assert hasattr(compiled, "fast") == hasattr(eager, "fast")
