"""A wrapper optimizer that forwards to an inner one (accelerate's ``AcceleratedOptimizer``,
which ``transformers.Trainer`` names in its ``training_step``) is taken as that inner
optimizer (NOTE: [optimizers forwarding to an inner one] in
``capture/forwarding_optimizers.py``). The wrappers here reproduce accelerate's shape
without needing it: a ``torch.optim.Optimizer`` subclass that never runs
``Optimizer.__init__`` and reads ``param_groups`` / ``state`` through properties of the
optimizer in ``.optimizer``. Each runs 3 AdamW steps on 2 simulated ranks against the
same code run eagerly (float64). Before, a step that stepped the wrapper failed capture
(``KeyError: 'parameter not found'``, or "property 'param_groups' ... has no setter"),
and one that only named it crashed with ``AttributeError: ...
'_optimizer_load_state_dict_pre_hooks'``."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import full_state, relative_difference

WORLD, STEPS, TOL = 2, 3, 1e-12
MODES = ["replicate", "fully_shard"]


class Forwarding(torch.optim.Optimizer):
    """accelerate's AcceleratedOptimizer in small: no Optimizer.__init__, forwarding
    properties with setters (as accelerate's have)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.sync_gradients = True

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    def train(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        if self.sync_gradients:
            self.optimizer.step(closure)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)


class ReadOnlyForwarding(Forwarding):
    """The same with read-only properties (the prober's own wrapper)."""

    param_groups = property(lambda self: self.optimizer.param_groups)  # type: ignore[assignment]
    state = property(lambda self: self.optimizer.state)  # type: ignore[assignment]


def _wrapped(kind: str, net: nn.Module) -> Forwarding:
    inner = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
    if kind == "setters":
        return Forwarding(inner)
    if kind == "read-only":
        return ReadOnlyForwarding(inner)
    return Forwarding(Forwarding(inner))  # a wrapper of a wrapper


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, dtype=torch.float64, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(STEPS)
    ]


def _innermost(opt: torch.optim.Optimizer) -> torch.optim.Optimizer:
    while isinstance(opt, Forwarding):
        opt = opt.optimizer
    return opt


def _assert_same_state(net: nn.Module, opt: torch.optim.Optimizer, ref: nn.Module, ref_opt: torch.optim.Optimizer, sim: Any) -> None:
    state, expected = full_state(net, _innermost(opt), sim), full_state(ref, _innermost(ref_opt), None)
    assert state.keys() == expected.keys()
    worst = max(relative_difference(state[k], expected[k]) for k in expected)
    assert worst <= TOL, worst
    assert all(isinstance(p, DTensor) for p in net.parameters())


def full_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("kind", ["setters", "read-only", "nested"])
@pytest.mark.parametrize("mode", MODES)
def test_a_step_stepping_a_forwarding_wrapper_matches_eager(mode, kind):
    net, ref = _net(), _net()
    opt, ref_opt = _wrapped(kind, net), _wrapped(kind, ref)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(full_step)
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            got, want = compiled(net, opt, x, y), full_step(ref, ref_opt, x, y)
            assert abs(got.item() - want.item()) <= TOL, (got, want)
        _assert_same_state(net, opt, ref, ref_opt, sim)
    assert "param_groups" not in vars(opt) and "state" not in vars(opt)  # left as found


class MiniTrainer:
    """transformers.Trainer's shape: training_step does forward and backward and names
    ``self.optimizer`` (``hasattr(self.optimizer, "train")``); the loop steps it."""

    def __init__(self, net: nn.Module, kind: str) -> None:
        self.model = net
        self.optimizer = _wrapped(kind, net)

    def training_step(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        return loss.detach()

    def train(self, step: Any) -> list[float]:
        losses = []
        for x, y in _batches():
            losses.append(step(self.model, x, y).item())
            self.optimizer.step()
            self.optimizer.zero_grad()
        return losses


@pytest.mark.parametrize("kind", ["setters", "read-only"])
@pytest.mark.parametrize("mode", MODES)
def test_a_backward_only_step_naming_a_forwarding_wrapper_matches_eager(mode, kind):
    trainer, twin = MiniTrainer(_net(), kind), MiniTrainer(_net(), kind)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(trainer.training_step)
    with sc.simulate(world_size=WORLD) as sim:
        got, want = trainer.train(compiled), twin.train(twin.training_step)
        assert max(abs(a - b) for a, b in zip(got, want, strict=True)) <= TOL, (got, want)
        _assert_same_state(trainer.model, trainer.optimizer, twin.model, twin.optimizer, sim)


class CopyingWrapper(Forwarding):
    """Forwards param_groups as a new list on each read: not the inner optimizer's."""

    param_groups = property(lambda self: list(self.optimizer.param_groups))  # type: ignore[assignment]


class NotSetUp(torch.optim.Optimizer):
    """Keeps the inner optimizer's groups and state as its own attributes, without
    running Optimizer.__init__ (no hook dicts)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.param_groups, self.state = optimizer.param_groups, optimizer.state
        self.defaults = optimizer.defaults

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)


@pytest.mark.parametrize(
    ("wrapper", "says"),
    [
        (CopyingWrapper, "reads its param_groups through its class"),
        (NotSetUp, "did not run torch.optim.Optimizer.__init__"),
    ],
)
def test_a_wrapper_that_cannot_be_taken_is_refused_naming_it(wrapper, says):
    net = _net()
    opt = wrapper(torch.optim.AdamW(net.parameters(), lr=0.05))
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(full_step)
    x, y = _batches()[0]
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError) as info:
        compiled(net, opt, x, y)
    message = str(info.value)
    assert f"optimizer {__name__}.{wrapper.__qualname__}" in message, message
    assert says in message, message
    assert "pass the torch.optim.Optimizer it wraps to the step instead" in message, message
    assert "full_step" in message or "test_forwarding_optimizers.py" in message, message
    # nothing touched: the model's parameters are the plain ones the inner optimizer holds
    assert all(type(p) is nn.Parameter for p in net.parameters())
    assert all(a is b for a, b in zip(opt.optimizer.param_groups[0]["params"], net.parameters(), strict=True))


def test_a_flag_the_wrappers_step_reads_is_guarded():
    """accelerate's step() steps the inner optimizer only where its gradient state's
    ``sync_gradients`` is set: a wrapper's attributes are guarded as an optimizer's, so
    a call with the flag cleared compiles the step without the update (before the
    wrapper was walked, the update ran anyway: 1.5 relative off eager)."""
    net, ref = _net(), _net()
    opt, ref_opt = _wrapped("setters", net), _wrapped("setters", ref)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(full_step)
    with sc.simulate(world_size=WORLD) as sim:
        for i, (x, y) in enumerate(_batches()):
            opt.sync_gradients = ref_opt.sync_gradients = i != 1
            got, want = compiled(net, opt, x, y), full_step(ref, ref_opt, x, y)
            assert abs(got.item() - want.item()) <= TOL, (i, got, want)
        _assert_same_state(net, opt, ref, ref_opt, sim)
