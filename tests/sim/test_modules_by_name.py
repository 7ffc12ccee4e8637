"""A step that reaches its model and optimizer by name trains as one that is given them
(NOTE: [modules and optimizers by name] in ``capture/bindings.py``): a script's
``def train_step(x, y)`` over a global model and optimizer, closure variables, a trainer's
method over ``self.model``, a model's own method. Each runs 3 AdamW steps on 2 simulated
ranks against the same code run eagerly on one device (float64). Before, each was
refused on its first call ("called without an nn.Module argument", or "calls step() of
a ... that is not one of its arguments")."""

from __future__ import annotations

from collections.abc import Callable

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

model: nn.Module | None = None
optimizer: torch.optim.Optimizer | None = None
criterion = nn.CrossEntropyLoss()  # parameterless: not trained, not a prefix of the names


def script_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    assert model is not None and optimizer is not None
    loss = criterion(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss


def _net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, dtype=torch.float64, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(STEPS)
    ]


def _assert_matches(
    mode: str,
    compiled_call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    eager_call: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    trained: tuple[nn.Module, torch.optim.Optimizer],
    reference: tuple[nn.Module, torch.optim.Optimizer],
) -> None:
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            got, want = compiled_call(x, y), eager_call(x, y)
            assert abs(got.item() - want.item()) <= TOL, (got, want)
        state = full_state(*trained, sim)
    expected = full_state(*reference, None)
    assert state.keys() == expected.keys()
    worst = max(relative_difference(state[k], expected[k]) for k in expected)
    assert worst <= TOL, worst
    assert all(isinstance(p, DTensor) for p in trained[0].parameters())


def _pair(net: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    return net, torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)


@pytest.mark.parametrize("mode", MODES)
def test_a_global_model_and_optimizer(mode):
    global model, optimizer
    trained, reference = _pair(_net()), _pair(_net())
    compiled = sc.compile(parallel_mode=DataParallel(mode))(script_step)

    def eager(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        global model, optimizer
        model, optimizer = reference
        try:
            return script_step(x, y)
        finally:
            model, optimizer = trained

    model, optimizer = trained
    try:
        _assert_matches(mode, compiled, eager, trained, reference)
    finally:
        model = optimizer = None
    assert len(compiled.records) == 1


@pytest.mark.parametrize("mode", MODES)
def test_closure_variables_and_an_optimizer_beside_a_model_argument(mode):
    (net, opt), reference = _pair(_net()), _pair(_net())

    def make(opt: torch.optim.Optimizer) -> Callable[..., torch.Tensor]:
        def step(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss

        return step

    compiled = sc.compile(parallel_mode=DataParallel(mode))(make(opt))
    eager = make(reference[1])
    _assert_matches(
        mode, lambda x, y: compiled(net, x, y), lambda x, y: eager(reference[0], x, y), (net, opt), reference
    )


class Trainer:
    def __init__(self, net: nn.Module) -> None:
        self.model = net
        self.head = net[2]  # inside the model: not trained twice
        self.criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
        self.optimizer = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = self.criterion(self.model(x), y) + 0.01 * self.head.weight.square().sum()
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return loss


@pytest.mark.parametrize("mode", MODES)
def test_a_trainer_method_over_its_attributes(mode):
    trainer, twin = Trainer(_net()), Trainer(_net())
    compiled = sc.compile(parallel_mode=DataParallel(mode))(trainer.step)
    _assert_matches(
        mode, compiled, twin.step, (trainer.model, trainer.optimizer), (twin.model, twin.optimizer)
    )
    assert trainer.head is trainer.model[2]


class Optimizers:
    """An RL agent's optimizers, one per head, held by an object the step is given."""

    def __init__(self, net: nn.Module) -> None:
        self.body = torch.optim.AdamW(net[0].parameters(), lr=0.05, weight_decay=0.1)
        self.head = torch.optim.SGD(net[2].parameters(), lr=0.1)


def two_optimizer_step(net: nn.Module, opts: Optimizers, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(net(x), y)
    loss.backward()
    opts.body.step()
    opts.head.step()
    opts.body.zero_grad()
    opts.head.zero_grad()
    return loss


@pytest.mark.parametrize("mode", MODES)
def test_optimizers_an_object_argument_holds(mode):
    """Refused before: "calls step() of a AdamW that is not among its optimizers", though
    every parameter it updates belongs to the trained module."""
    net, twin = _net(), _net()
    opts, twin_opts = Optimizers(net), Optimizers(twin)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(two_optimizer_step)
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            got, want = compiled(net, opts, x, y), two_optimizer_step(twin, twin_opts, x, y)
            assert abs(got.item() - want.item()) <= TOL
        state = full_state(net, opts.body, sim) | full_state(net, opts.head, sim)
    expected = full_state(twin, twin_opts.body, None) | full_state(twin, twin_opts.head, None)
    assert max(relative_difference(state[k], expected[k]) for k in expected) <= TOL


class SelfTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def train_step(self, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss


@pytest.mark.parametrize("mode", MODES)
def test_a_method_of_the_model(mode):
    trained, reference = _pair(SelfTraining()), _pair(SelfTraining())
    compiled = sc.compile(parallel_mode=DataParallel(mode))(trained[0].train_step)
    _assert_matches(
        mode,
        lambda x, y: compiled(trained[1], x, y),
        lambda x, y: reference[0].train_step(reference[1], x, y),
        trained,
        reference,
    )


def test_a_global_rebound_to_another_model_trains_the_new_one():
    global model, optimizer
    first, second = _pair(_net(0)), _pair(_net(1))
    twins = [_pair(_net(0)), _pair(_net(1))]
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(script_step)
    try:
        with sc.simulate(world_size=WORLD) as sim:
            for i, (x, y) in enumerate(_batches()):
                k = 0 if i == 0 else 1  # the first model, then another one
                model, optimizer = (first, second)[k]
                got = compiled(x, y)
                model, optimizer = twins[k]
                want = script_step(x, y)
                assert abs(got.item() - want.item()) <= TOL, (i, got, want)
            state = full_state(*second, sim)
    finally:
        model = optimizer = None
    expected = full_state(*twins[1], None)
    assert max(relative_difference(state[k], expected[k]) for k in expected) <= TOL


def test_an_optimizer_over_other_parameters_is_not_taken():
    """A named optimizer whose parameters the step's modules do not own is left out; its
    step() in the step is refused with the user's line, nothing changed."""
    net, other = _net(), _net(1)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)

    def step(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        other_opt.step()
        return loss

    before = [p.detach().clone() for p in (*net.parameters(), *other.parameters())]
    x, y = _batches()[0]
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError) as info:
        sc.compile()(step)(net, x, y)
    assert "that is not among its optimizers" in str(info.value)
    assert "other_opt.step()" in str(info.value)
    after = [p.detach() for p in (*net.parameters(), *other.parameters())]
    assert all(torch.equal(a, b) and not isinstance(a, DTensor) for a, b in zip(after, before, strict=True))


class _LazyTrainer:
    """A trainer that makes its optimizer on the first step, inside the step."""

    def __init__(self, net: nn.Module) -> None:
        self.model, self.opt = net, None

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.opt is None:
            self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.05)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss


def test_an_optimizer_created_inside_the_step_is_refused_saying_to_create_it_before():
    """NOTE: [optimizers created inside the step]: the message said "not among its
    optimizers ... pass the optimizer to the step", which a trainer with no optimizer
    before its first call could not do."""
    net = _net()
    trainer = _LazyTrainer(net)
    before = [p.detach().clone() for p in net.parameters()]
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError) as info:
        sc.compile()(trainer.step)(*_batches()[0])
    message = str(info.value)
    assert "that was created inside the step" in message, message
    assert "create the optimizer before the first call" in message, message
    assert "self.opt.step()" in message, message
    assert trainer.opt is None
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before, strict=True))


class _SAM(torch.optim.Optimizer):
    """davda54/sam's wrapper: it builds its inner optimizer itself, keeps it as an
    attribute and shares its param groups."""

    def __init__(self, params, base, rho: float = 0.05, **kwargs) -> None:  # noqa: ANN001
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        norm = torch.stack([p.grad.norm() for g in self.param_groups for p in g["params"]]).norm()
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["old_p"] = p.detach().clone()
                p.add_(p.grad * (group["rho"] / (norm + 1e-12)))

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                p.copy_(self.state[p]["old_p"])
        self.base_optimizer.step()


def _sam_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.first_step()
    optim.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optim.second_step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", MODES)
def test_an_optimizer_held_by_a_given_optimizer_is_taken(mode):
    """SAM's inner optimizer, reached only as ``optimizer.base_optimizer``, was refused
    as "not among ... those its code names whose every parameter belongs to the modules
    it trains", which it does; it is taken as a named optimizer is (NOTE: [modules and
    optimizers by name]) and the step matches eager."""
    net, reference = _net(), _net()
    optim = _SAM(net.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    reference_optim = _SAM(reference.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    step = sc.compile(DataParallel(mode))(_sam_step)
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            loss = step(net, optim, x, y)
            assert relative_difference(loss, _sam_step(reference, reference_optim, x, y)) <= TOL
        state = full_state(net, optim.base_optimizer, sim)
    expected = full_state(reference, reference_optim.base_optimizer, None)
    assert any("momentum_buffer" in k for k in expected)
    assert max(relative_difference(state[k], expected[k]) for k in expected) <= TOL


def test_an_optimizer_held_over_other_parameters_is_refused_by_its_attribute():
    """An inner optimizer over parameters the step's modules do not own is left out, and
    its step() refused naming the attribute it is reached by, nothing changed."""
    net, other = _net(), _net(1)
    optim = _SAM(net.parameters(), torch.optim.SGD, lr=0.1)
    optim.base_optimizer = torch.optim.SGD(other.parameters(), lr=0.1)
    before = [p.detach().clone() for p in (*net.parameters(), *other.parameters())]
    x, y = _batches()[0]
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError) as info:
        sc.compile()(_sam_step)(net, optim, x, y)
    assert "optimizer.base_optimizer (an attribute of an optimizer it is given)" in str(info.value)
    after = [p.detach() for p in (*net.parameters(), *other.parameters())]
    assert all(torch.equal(a, b) and not isinstance(a, DTensor) for a, b in zip(after, before, strict=True))


class _PlainLookahead:
    """A Lookahead written as a plain class over an optimizer it holds (adv/c5_look.py)."""

    def __init__(self, params, base: torch.optim.Optimizer) -> None:  # noqa: ANN001
        self.params = list(params)
        self.base = base

    def step(self) -> None:
        self.base.step()

    def zero_grad(self) -> None:
        self.base.zero_grad()


class _Lookahead(torch.optim.Optimizer):
    """The form the refusal advises: an Optimizer subclass holding the inner optimizer,
    sharing its param groups, its counter and slow weights tensors in its state."""

    def __init__(self, base: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        super().__init__(base.param_groups, {})
        self.base_optimizer = base
        self.param_groups = base.param_groups
        self.k, self.alpha = k, alpha

    @torch.no_grad()
    def step(self, closure=None) -> None:  # noqa: ANN001
        self.base_optimizer.step()
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "slow" not in state:
                    state["slow"] = p.detach().clone()
                    state["n"] = torch.zeros((), dtype=torch.int64)
                state["n"] += 1
                sync = state["n"] % self.k == 0
                slow = state["slow"]
                slow.copy_(torch.where(sync, slow + self.alpha * (p - slow), slow))
                p.copy_(torch.where(sync, slow, p))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.base_optimizer.zero_grad(set_to_none)


def _wrapped_step(model, opt, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def test_an_optimizer_held_by_a_plain_argument_is_refused_by_its_attribute():
    """An SGD held by a plain wrapper object given as the step's ``opt``: refused as "not
    among its optimizers ... pass the optimizer", advice the user had followed; now the
    message names the attribute and the argument, says the wrapper is no Optimizer and
    how to write it; nothing changed."""
    net = _net()
    opt = _PlainLookahead(net.parameters(), torch.optim.SGD(net.parameters(), lr=0.1))
    before = [p.detach().clone() for p in net.parameters()]
    x, y = _batches()[0]
    with sc.simulate(world_size=WORLD), pytest.raises(SPMDCompileError) as info:
        sc.compile()(_wrapped_step)(net, opt, x, y)
    message = str(info.value)
    assert "reached through attribute base of argument opt (a _PlainLookahead: a plain object, not a torch.optim.Optimizer)" in message, message
    assert "make _PlainLookahead a torch.optim.Optimizer subclass" in message
    after = [p.detach() for p in net.parameters()]
    assert all(torch.equal(a, b) and not isinstance(a, DTensor) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize("mode", MODES)
def test_the_advised_lookahead_matches_eager(mode):
    """The refusal's advice works: the Optimizer-subclass Lookahead trains as eager."""
    net, reference = _net(), _net()
    optim = _Lookahead(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    reference_optim = _Lookahead(torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
    step = sc.compile(DataParallel(mode))(_wrapped_step)
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            loss = step(net, optim, x, y)
            assert relative_difference(loss, _wrapped_step(reference, reference_optim, x, y)) <= TOL
        state = full_state(net, optim.base_optimizer, sim)
    expected = full_state(reference, reference_optim.base_optimizer, None)
    assert max(relative_difference(state[k], expected[k]) for k in expected) <= TOL
