"""``@spmd_compiler.compile(...)`` written on a method in a class body (NOTE: [a compiled
step written on a method] in ``api.py``): ``trainer.step(x, y)`` is the step of
``trainer``, compiled for it alone, as ``self.step = sc.compile(...)(self.step)`` in
``__init__`` is. Each trainer runs 3 AdamW steps on 2 simulated ranks (ddp) against the
undecorated method run eagerly on one device (float64). Before, the compiled step was no
descriptor: ``trainer.step(x, y)`` called the function without ``self`` and was refused
("The train step trains no nn.Module")."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.explain import explain
from spmd_compiler.tools.parity import full_state, relative_difference

WORLD, STEPS, TOL = 2, 3, 1e-12


def _net(seed: int, width: int = 8) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 3)).double()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, dtype=torch.float64, generator=gen), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(STEPS)
    ]


class Trainer:
    def __init__(self, net: nn.Module, loss_weight: float = 1.0) -> None:
        self.model = net
        self.loss_weight = loss_weight
        self.opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)

    @sc.compile(parallel_mode=DataParallel("replicate"))
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y) * self.loss_weight
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss


eager_step = Trainer.step.__wrapped__  # the undecorated method


def _worst(trained: Trainer, reference: Trainer, sim: object) -> float:
    state, expected = full_state(trained.model, trained.opt, sim), full_state(reference.model, reference.opt, None)
    assert state.keys() == expected.keys()
    return max(relative_difference(state[k], expected[k]) for k in expected)


def test_two_trainers_each_compile_their_own_step():
    """Two trainers over models of other widths and another loss weight, called in turn:
    each matches its eager twin, compiles once, and keeps its records to itself."""
    trainers = [Trainer(_net(0)), Trainer(_net(5, width=12), loss_weight=3.0)]
    twins = [Trainer(_net(0)), Trainer(_net(5, width=12), loss_weight=3.0)]
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            for trained, twin in zip(trainers, twins):
                got, want = trained.step(x, y), eager_step(twin, x, y)
                assert abs(got.item() - want.item()) <= TOL * abs(want.item()), (got, want)
        for trained, twin in zip(trainers, twins):
            assert _worst(trained, twin, sim) <= TOL
            assert all(isinstance(p, DTensor) for p in trained.model.parameters())
    first, second = trainers
    assert first.step is first.step and first.step is not second.step
    assert first.step.func.__self__ is first and second.step.func.__self__ is second
    assert (first.step.compile_count, second.step.compile_count) == (1, 1)
    assert len(first.step.records) == 1 and first.step.last_program is not second.step.last_program
    assert [len(explain(t.step).params) for t in trainers] == [4, 4]
    # the decorator's own object, on the class: compiles nothing itself
    assert isinstance(Trainer.step, sc.CompiledTrainStep) and Trainer.step.compile_count == 0


def test_the_class_attribute_called_with_the_object_is_the_objects_step():
    """``Trainer.step(trainer, x, y)``, as for any method: the same step as
    ``trainer.step(x, y)``, its program reused."""
    trained, twin = Trainer(_net(0)), Trainer(_net(0))
    with sc.simulate(world_size=WORLD) as sim:
        for i, (x, y) in enumerate(_batches()):
            got = trained.step(x, y) if i % 2 else Trainer.step(trained, x, y)
            want = eager_step(twin, x, y)
            assert abs(got.item() - want.item()) <= TOL * abs(want.item())
        assert _worst(trained, twin, sim) <= TOL
    assert trained.step.compile_count == 1 and Trainer.step.compile_count == 0


class SelfTraining(nn.Module):
    """A model's own train step, decorated in its class body."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _net(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    @sc.compile(parallel_mode=DataParallel("replicate"))
    def train_step(self, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss


def test_a_models_own_decorated_method():
    """The compiled step kept on the module is no state of it, and no guarded value:
    one compile over 3 steps; a deep copy (and a pickle) of the model holds none of the
    original's steps, a shallow copy makes its own."""
    model, reference = SelfTraining(), SelfTraining()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    ref_optim = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.1)
    compiled = model.train_step
    twin = copy.deepcopy(model)
    assert twin.train_step is not compiled and twin.train_step.func.__self__ is twin
    assert pickle.loads(pickle.dumps(model)).train_step.func.__self__ is not model
    shallow = copy.copy(model)
    assert shallow.train_step.func.__self__ is shallow and model.train_step is compiled
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            got = model.train_step(optim, x, y)
            want = SelfTraining.train_step.__wrapped__(reference, ref_optim, x, y)
            assert abs(got.item() - want.item()) <= TOL * abs(want.item())
        state, expected = full_state(model, optim, sim), full_state(reference, ref_optim, None)
    assert max(relative_difference(state[k], expected[k]) for k in expected) <= TOL
    assert compiled.compile_count == 1 and "_spmd_compiled_steps" not in model.state_dict()


class Slotted:
    __slots__ = ("model", "opt")

    def __init__(self, net: nn.Module) -> None:
        self.model = net
        self.opt = torch.optim.SGD(net.parameters(), lr=0.1)

    @sc.compile(parallel_mode=DataParallel("replicate"))
    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return loss


def test_an_object_without_a_dict_is_refused_with_what_to_do():
    with pytest.raises(SPMDCompileError, match="__slots__") as info:
        Slotted(_net(0)).step  # noqa: B018 - the access makes the object's step
    assert "self.step = spmd_compiler.compile(...)(self.step)" in str(info.value)


def test_a_compiled_bound_method_and_function_bind_nothing():
    """The compiled bound method (``sc.compile(...)(trainer.step)``) and a compiled
    function held as a class attribute of another object keep their calls as before."""

    class Plain:
        def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = F.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
            self.opt.zero_grad()
            return loss

    plain, twin = Plain(), Plain()
    plain.model, plain.opt = _net(0), None
    plain.opt = torch.optim.AdamW(plain.model.parameters(), lr=0.05, weight_decay=0.1)
    twin.model = _net(0)
    twin.opt = torch.optim.AdamW(twin.model.parameters(), lr=0.05, weight_decay=0.1)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(plain.step)

    class Holder:
        bound = compiled

    assert Holder().bound is compiled and Holder.bound is compiled
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            got, want = Holder().bound(x, y), twin.step(x, y)
            assert abs(got.item() - want.item()) <= TOL * abs(want.item())
        state = full_state(plain.model, plain.opt, sim)
    expected = full_state(twin.model, twin.opt, None)
    assert max(relative_difference(state[k], expected[k]) for k in expected) <= TOL
    assert compiled.compile_count == 1


class Undecorated:
    """Trainer's step, undecorated, on a class of its own."""

    __init__ = Trainer.__init__
    step = eager_step


def test_the_compiled_function_called_with_its_object_is_the_objects_step():
    """``sc.compile(...)(Undecorated.step)`` called as ``cstep(trainer, x, y)``, the model
    and optimizer on the object. Before the sixty-seventh session it was refused ("The
    train step trains no nn.Module"); it is ``trainer.step`` compiled now, one program
    per object."""
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(Undecorated.step)
    trained, other, twin = Undecorated(_net(0)), Undecorated(_net(5)), Undecorated(_net(0))
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            got, want = compiled(trained, x, y), eager_step(twin, x, y)
            assert abs(got.item() - want.item()) <= TOL * abs(want.item()), (got, want)
            compiled(other, x, y)
        state = full_state(trained.model, trained.opt, sim)
    expected = full_state(twin.model, twin.opt, None)
    assert max(relative_difference(state[k], expected[k]) for k in expected) <= TOL
    steps = [vars(t)["_spmd_compiled_steps"][compiled] for t in (trained, other)]
    assert [s.compile_count for s in steps] == [1, 1] and compiled.compile_count == 0
