"""Guards read the objects of the call, not those of the call that compiled the program.

NOTE: [guards follow the call's objects] in ``capture/guards.py``. Each test compiles a
step on one set of objects, then calls it with another whose Python settings differ (a
new model instance, a submodule or config object put in place of another, a global
rebound, another object argument) and checks the compiled step against the eager step
on those objects. Before the guards followed the call's objects, each of these silently
ran the first program (one compile; a new model with ``scale=3.0`` got the loss of
``scale=1.0``). Objects whose settings are the same reuse the program.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel

WORLD = 2
TOL = 1e-12
SETTINGS = types.SimpleNamespace(shift=0.0)


class Scaled(nn.Module):
    """Python settings read three ways: its own attribute, a config object's attribute
    and a torch submodule's attribute; plus a global config object's."""

    def __init__(self, scale: float = 1.0, slope: float = 0.1, bias: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.act = nn.LeakyReLU(slope)
        self.out = nn.Linear(8, 3)
        self.scale = scale
        self.config = types.SimpleNamespace(bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc(x)) * self.scale + self.config.bias
        return self.out(h) + SETTINGS.shift


def step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g)


def _pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """``model`` (compiled) and an eager twin with the same weights and settings."""
    model = model.double()
    return model, copy.deepcopy(model)


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


def _check(compiled, model: nn.Module, twin: nn.Module, seed: int) -> None:
    """One compiled step on ``model`` against one eager step on ``twin``."""
    x, y = _batch(seed)
    got = compiled(model, _sgd_of[id(model)], x, y).item()
    want = step(twin, _sgd_of[id(twin)], x, y).item()
    assert abs(got - want) <= TOL * max(1.0, abs(want)), (got, want)


_sgd_of: dict[int, torch.optim.Optimizer] = {}


def _with_optimizers(*models: nn.Module) -> None:
    for m in models:
        _sgd_of[id(m)] = _sgd(m)


def _compiled():
    return sc.compile(parallel_mode=DataParallel("replicate"))(step)


def test_a_new_model_with_other_settings_recompiles():
    compiled = _compiled()
    with sc.simulate(world_size=WORLD):
        a, a_twin = _pair(Scaled(scale=1.0))
        _with_optimizers(a, a_twin)
        _check(compiled, a, a_twin, 0)
        b, b_twin = _pair(Scaled(scale=3.0, slope=0.2, bias=0.5))
        _with_optimizers(b, b_twin)
        _check(compiled, b, b_twin, 1)
        assert compiled.compile_count == 2
        _check(compiled, b, b_twin, 2)  # and stays on its own program
        _check(compiled, a, a_twin, 3)  # the first model still gets its own
        assert compiled.compile_count == 2


def test_a_new_model_with_the_same_settings_reuses_the_program():
    compiled = _compiled()
    with sc.simulate(world_size=WORLD):
        a, a_twin = _pair(Scaled(scale=2.0))
        b, b_twin = _pair(Scaled(scale=2.0))
        _with_optimizers(a, a_twin, b, b_twin)
        _check(compiled, a, a_twin, 0)
        _check(compiled, b, b_twin, 1)
        _check(compiled, a, a_twin, 2)
        assert compiled.compile_count == 1


def _set_act(act_type: type[nn.Module]):
    def change(m: nn.Module) -> None:
        m.act = act_type()

    return change


@pytest.mark.parametrize(
    ("before", "after"),
    [
        (None, lambda m: setattr(m, "act", nn.LeakyReLU(0.4))),
        # stateless: nothing in the program key differs, no attribute either
        (_set_act(nn.Tanh), _set_act(nn.Sigmoid)),
        (None, lambda m: setattr(m, "config", types.SimpleNamespace(bias=0.7))),
    ],
    ids=["submodule", "submodule_of_another_class", "config_object"],
)
def test_a_replaced_object_with_other_settings_recompiles(before, after):
    compiled = _compiled()
    with sc.simulate(world_size=WORLD):
        a, a_twin = _pair(Scaled())
        for m in (a, a_twin):
            if before is not None:
                before(m)
        _with_optimizers(a, a_twin)
        _check(compiled, a, a_twin, 0)
        after(a)
        after(a_twin)
        _check(compiled, a, a_twin, 1)
        assert compiled.compile_count == 2


def test_a_config_object_with_the_same_settings_reuses_the_program():
    compiled = _compiled()
    with sc.simulate(world_size=WORLD):
        a, a_twin = _pair(Scaled(bias=0.7))
        _with_optimizers(a, a_twin)
        _check(compiled, a, a_twin, 0)
        a.config = types.SimpleNamespace(bias=0.7)  # another object, the same settings
        _check(compiled, a, a_twin, 1)
        assert compiled.compile_count == 1


def test_a_rebound_global_config_object_recompiles():
    global SETTINGS
    compiled = _compiled()
    saved = SETTINGS
    try:
        with sc.simulate(world_size=WORLD):
            a, a_twin = _pair(Scaled())
            _with_optimizers(a, a_twin)
            _check(compiled, a, a_twin, 0)
            SETTINGS = types.SimpleNamespace(shift=0.25)
            _check(compiled, a, a_twin, 1)
            assert compiled.compile_count == 2
    finally:
        SETTINGS = saved


class Options:
    def __init__(self, weight: float) -> None:
        self.weight = weight


def weighted_step(model, optim, x, y, options: Options):
    loss = F.cross_entropy(model(x), y) * options.weight
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_another_object_argument_gets_its_own_settings():
    """An object argument is keyed by its class (``keyed_by_class``): a new one with
    the settings of a program already compiled runs that program, and none runs
    another's settings."""
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(weighted_step)
    with sc.simulate(world_size=WORLD):
        a, a_twin = _pair(Scaled())
        _with_optimizers(a, a_twin)
        for seed, weight in enumerate([1.0, 3.0, 3.0, 1.0]):
            x, y = _batch(seed)
            got = compiled(a, _sgd_of[id(a)], x, y, Options(weight)).item()
            want = weighted_step(a_twin, _sgd_of[id(a_twin)], x, y, Options(weight)).item()
            assert abs(got - want) <= TOL * max(1.0, abs(want)), (weight, got, want)
    assert compiled.compile_count == 2


CRITERION = nn.CrossEntropyLoss()


def criterion_step(model, optim, x, y):
    loss = CRITERION(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_a_module_the_step_reaches_by_name_is_guarded():
    """A global loss module (not an argument): its settings changed, then the global
    rebound to another one. Before, neither recompiled: its label smoothing stayed the
    capture's."""
    global CRITERION
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(criterion_step)
    saved = CRITERION
    try:
        with sc.simulate(world_size=WORLD):
            a, a_twin = _pair(Scaled())
            _with_optimizers(a, a_twin)
            for seed in range(4):
                if seed == 1:
                    CRITERION.label_smoothing = 0.3
                if seed == 2:
                    CRITERION = nn.CrossEntropyLoss(label_smoothing=0.6)
                x, y = _batch(seed)
                got = compiled(a, _sgd_of[id(a)], x, y).item()
                want = criterion_step(a_twin, _sgd_of[id(a_twin)], x, y).item()
                assert abs(got - want) <= TOL * max(1.0, abs(want)), (seed, got, want)
            assert compiled.compile_count == 3
    finally:
        saved.label_smoothing = 0.0
        CRITERION = saved
