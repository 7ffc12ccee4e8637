"""The grad mode a compiled step is called in (NOTE: [grad mode around the step]).

One step serves training and evaluation (``if loss.requires_grad: loss.backward();
opt.step()``), its evaluation calls under an outer ``torch.no_grad()`` or
``torch.inference_mode()``. The grad mode is part of the program key: each mode has its
own program, both stay cached, and every call computes what eager computes (float64,
checked against the eager step on one device with the global batch). Before, the first
call's program served the other mode: an evaluation first left the model untrained
(0.375 relative off after three training calls), a training call first trained on the
evaluation batches (0.227 off).
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, max_difference

TOL = 1e-12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)


def train_or_eval(model, opt, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    if loss.requires_grad:  # a training call; under no_grad an evaluation
        loss.backward()
        opt.step()
        opt.zero_grad()
    return loss.detach()


def plain_step(model, opt, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def grad_inside(model, opt, x, y):  # noqa: ANN001
    with torch.enable_grad():  # trains under any outer mode, eagerly too
        loss = F.cross_entropy(model(x), y)
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


OUTER: dict[str, Callable[[], AbstractContextManager]] = {
    "no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("outer", sorted(OUTER))
@pytest.mark.parametrize("evaluations", [(0, 3), (2, 3)], ids=["eval_first", "train_first"])
def test_evaluation_calls_under_an_outer_mode_match_eager(mode: str, outer: str, evaluations: tuple) -> None:
    model, optim_of = _model(), lambda m: torch.optim.Adam(m.parameters(), lr=0.05)
    reference = copy.deepcopy(model)
    optim, reference_optim = optim_of(model), optim_of(reference)
    step = sc.compile(make_mode(mode))(train_or_eval)
    with sc.simulate(world_size=2) as sim:
        compiled = 0
        for i in range(8):
            if i == 6:
                compiled = len(step.records)
            evaluation = i in (*evaluations, 6)
            with OUTER[outer]() if evaluation else torch.enable_grad():
                loss = step(model, optim, *_batch(i))
                expected = train_or_eval(reference, reference_optim, *_batch(i))
            assert float(loss) == pytest.approx(float(expected), rel=TOL, abs=TOL), i
            assert not loss.requires_grad
            assert torch.is_inference_mode_enabled() is False
            assert max_difference(
                compare_models(model, reference, sim), compare_optimizers(optim, reference_optim, sim)
            ) < TOL, i
        # one program per mode, both kept: an evaluation and a training call again (6, 7)
        # compile nothing
        assert len(step.records) == compiled
    assert not any(p.is_inference() for p in model.parameters())
    assert not any(t.is_inference() for s in optim.state.values() for t in s.values() if torch.is_tensor(t))


@pytest.mark.parametrize("outer", sorted(OUTER))
def test_a_train_step_under_an_outer_mode_fails_as_eager_does(outer: str) -> None:
    """After a training call, the same step under no_grad fails (eager: "element 0 of
    tensors does not require grad"), leaving the model and optimizer as they were."""
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    step = sc.compile(make_mode("ddp"))(plain_step)
    with sc.simulate(world_size=2) as sim:
        step(model, optim, *_batch(0))
        before_model, before_optim = copy.deepcopy(model), copy.deepcopy(optim)
        with OUTER[outer](), pytest.raises(SPMDCompileError, match="does not require grad"):
            step(model, optim, *_batch(1))
        assert max_difference(
            compare_models(model, before_model, sim), compare_optimizers(optim, before_optim, sim)
        ) == 0.0
        step(model, optim, *_batch(1))  # training again runs the first program
        assert len(step.records) == 1


def test_grad_enabled_inside_the_step_under_an_outer_no_grad() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = sc.compile(make_mode("fsdp"))(grad_inside)
    with sc.simulate(world_size=2) as sim:
        for i in range(3):
            with torch.no_grad() if i == 0 else torch.enable_grad():
                loss = step(model, optim, *_batch(i))
                expected = grad_inside(reference, reference_optim, *_batch(i))
            assert float(loss) == pytest.approx(float(expected), rel=TOL, abs=TOL), i
        assert max_difference(compare_models(model, reference, sim)) < TOL


def test_a_call_in_the_other_grad_mode_says_why_it_compiles(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(make_mode("ddp"))(train_or_eval)
    with sc.simulate(world_size=2), caplog.at_level(logging.INFO, logger="spmd_compiler"):
        with torch.inference_mode():
            step(model, optim, *_batch(0))
        step(model, optim, *_batch(1))
    changes = [r.getMessage() for r in caplog.records if "recompiling" in r.getMessage()]
    assert changes == ["recompiling train_or_eval: the grad mode around the call was no_grad, now enabled"]
