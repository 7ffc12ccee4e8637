"""Draws from Python's and NumPy's generator objects inside a step are refused (NOTE:
[host random generator objects at capture]).

An augmentation object holding its own ``random.Random(seed)`` or
``np.random.default_rng(seed)`` drew once, at capture, and every compiled call reused that
number: the losses were eager's with the first draw reused, silently. The module
functions (``random.random``, ``np.random.beta``) were refused already
(tests/sim/test_kept_tensors.py).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.capture import python_effects
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode


class Augment:
    """An augmentation with its own seeded generator (``how`` picks which)."""

    def __init__(self, how: str) -> None:
        self.how = how
        self.rng = {"random": random.Random(0), "generator": np.random.default_rng(0),
                    "random_state": np.random.RandomState(0)}[how]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "random":
            scale = self.rng.uniform(0.5, 1.5)
        elif self.how == "generator":
            scale = float(self.rng.uniform(0.5, 1.5))
        else:
            scale = float(self.rng.rand())
        return x * scale


def _make_step(augment: Augment):  # noqa: ANN202
    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        loss = F.cross_entropy(model(augment(x)), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return step


@pytest.mark.parametrize(
    "how,named",
    [("random", "random.Random.uniform()"), ("generator", "NumPy Generator object (augment.rng)"),
     ("random_state", "NumPy RandomState object (augment.rng)")],
)
def test_a_generator_object_drawn_in_the_step_is_refused(how, named, monkeypatch):
    # threads an earlier test left (an Inductor compile pool) would turn the state check off
    monkeypatch.setattr(python_effects, "_other_threads", lambda: False)
    torch.manual_seed(0)
    model = nn.Linear(8, 4).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    augment = Augment(how)
    state = augment.rng.getstate() if how == "random" else (
        augment.rng.bit_generator.state if how == "generator" else augment.rng.get_state())
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
    step = sc.compile(make_mode("ddp"))(_make_step(augment))
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        step(model, optim, x, y)
    message = str(info.value)
    assert named in message and "torch.rand" in message
    if how == "random":
        assert "self.rng.uniform(0.5, 1.5)" in message  # the line
        assert augment.rng.getstate() == state
    elif how == "generator":
        assert augment.rng.bit_generator.state == state  # put back
    else:
        assert np.array_equal(augment.rng.get_state()[1], state[1])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert optim.state == {}


def test_a_generator_made_in_the_step_with_a_fixed_seed_goes_through():
    """Eagerly the same numbers every call, as the program's: not refused."""

    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        scale = float(np.random.default_rng(3).uniform(0.5, 1.5))
        loss = F.cross_entropy(model(x * scale), y)
        loss.backward()
        optim.step()
        return loss

    model = nn.Linear(8, 4).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
    with sc.simulate(world_size=2):
        assert torch.isfinite(sc.compile(make_mode("ddp"))(step)(model, optim, x, y))


def test_the_standard_librarys_own_generator_objects_go_through():
    """``tempfile`` names files with a ``random.Random`` of its own (a lazy import of
    torch's inductor reached it on gloo ranks): not the step's draw."""
    import tempfile

    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        next(tempfile._get_candidate_names())  # type: ignore[attr-defined]
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        return loss

    model = nn.Linear(8, 4).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
    with sc.simulate(world_size=2):
        assert torch.isfinite(sc.compile(make_mode("ddp"))(step)(model, optim, x, y))


class _Lazy(dict):
    """transformers' lazy registry idiom: reading it through its own code imports."""

    def _load(self, *args):  # noqa: ANN001, ANN202
        raise AssertionError("the generator scan read a dict through its class's code")

    __getitem__ = __iter__ = __len__ = items = keys = values = _load


REGISTRY = _Lazy()


def test_the_generator_scan_reads_no_object_through_its_own_code():
    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        _ = REGISTRY  # named by the step's code: its globals are looked into
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        return loss

    model = nn.Linear(8, 4).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
    with sc.simulate(world_size=2):
        assert torch.isfinite(sc.compile(make_mode("ddp"))(step)(model, optim, x, y))
