"""A train step that sets its parameters' ``requires_grad`` itself (NOTE: [requires_grad
set in the step] in ``capture/trace.py``).

``model[0].requires_grad_(False)`` on some call (freezing a layer mid-training;
pix2pix's ``set_requires_grad(netD, False)`` left so) runs at capture only: before, the
user's parameters kept their flags, the next call ran the program of the old flags and
trained the frozen layer on, silently (SGD, float64, 4 calls: 0.weight 6.2e-2 relative
off eager). Compiled under ddp and fsdp on 2 simulated ranks against the undecorated
step on one device on the global batch (float64): the losses, every parameter and each
parameter's flag after every call match eager's. A toggle and back inside the step
changes no flag; a refused call sets none; a buffer made to require grad, and a
parameter unfrozen under a ``param_dtype`` policy, are refused.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel, MixedPrecisionPolicy, make_mode
from spmd_compiler.tools.parity import compare_models

TOL = 1e-12


def _model(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).double()
    model[0].requires_grad_(not frozen)
    return model


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 16, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(n)]


def _update(model, optim, loss):  # noqa: ANN001
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def freeze_step(model, optim, x, y, switch):  # noqa: ANN001
    if switch:
        model[0].requires_grad_(False)
    return _update(model, optim, F.cross_entropy(model(x), y))


def unfreeze_step(model, optim, x, y, switch):  # noqa: ANN001
    if switch:
        model[0].requires_grad_(True)
    return _update(model, optim, F.cross_entropy(model(x), y))


def toggle_step(model, optim, x, y, switch):  # noqa: ANN001
    """The first layer frozen for its own forward, then unfrozen: no flag changes, and
    the first layer takes no gradient on the calls that toggle."""
    if switch:
        for p in model[0].parameters():
            p.requires_grad_(False)
    hidden = F.relu(model[0](x))
    if switch:
        for p in model[0].parameters():
            p.requires_grad_(True)
    return _update(model, optim, F.cross_entropy(model[2](hidden), y))


def _flags(model: nn.Module) -> list[bool]:
    return [p.requires_grad for p in model.parameters()]


def _run(step, model, mode, switches):  # noqa: ANN001
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(mode)(step)
    with sc.simulate(world_size=2) as sim:
        for (x, y), switch in zip(_batches(len(switches)), switches, strict=True):
            got = compiled(model, optim, x, y, switch)
            want = step(reference, ref_optim, x, y, switch)
            assert abs(float(got) - float(want)) <= TOL * abs(float(want))
            assert _flags(model) == _flags(reference)
        assert max(compare_models(model, reference, sim).values()) < TOL
    return compiled, reference


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize(("step", "frozen"), [(freeze_step, False), (unfreeze_step, True)],
                         ids=["freeze", "unfreeze"])
def test_flags_set_in_the_step_stay_set_as_eagerly(mode, step, frozen):
    """Set on call 2 of 4: calls 3 and 4 run the program for the new flags (before, the
    first layer trained on, or stayed frozen, and ended 6e-2 off eager)."""
    _, reference = _run(step, _model(frozen), make_mode(mode), [False, True, False, False])
    assert _flags(reference)[:2] == [frozen, frozen]  # the switch took hold eagerly


@pytest.mark.parametrize(("step", "frozen"), [(freeze_step, False), (unfreeze_step, True)],
                         ids=["freeze", "unfreeze"])
def test_flags_set_on_the_first_call_reach_the_placed_parameters(step, frozen):
    """The first call replaces the parameters by DTensor ones: the flags are set on those."""
    _run(step, _model(frozen), make_mode("fsdp"), [True, False, False])


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_toggle_and_back_in_the_step_changes_no_flag(mode):
    compiled, reference = _run(toggle_step, _model(), make_mode(mode), [False, True, False, True])
    assert all(_flags(reference)) and compiled.compile_count == 2  # one program per switch value


def _freeze_then_reseed(model, optim, x, y, switch):  # noqa: ANN001
    model[0].requires_grad_(False)
    torch.manual_seed(1)  # refused at capture
    return _update(model, optim, F.cross_entropy(model(x), y))


def test_a_refused_call_sets_no_flag():
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = _batches(1)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="manual_seed"):
        sc.compile(make_mode("ddp"))(_freeze_then_reseed)(model, optim, x, y, True)
    assert all(_flags(model))


class _WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 4).double()
        self.register_buffer("shift", torch.zeros(4, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + self.shift


def buffer_step(model, optim, x, y, switch):  # noqa: ANN001
    model.shift.requires_grad_(switch)
    return _update(model, optim, F.cross_entropy(model(x), y))


def test_a_buffer_made_to_require_grad_is_refused():
    model = _WithBuffer()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = _batches(1)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="buffer shift"):
        sc.compile(make_mode("ddp"))(buffer_step)(model, optim, x, y, True)
    assert not model.shift.requires_grad


def test_unfreezing_under_a_param_dtype_is_refused_and_freezing_is_not():
    """The casts forward reads are made before the step runs: one made of a frozen
    parameter has no gradient to give it (a freeze drops the gradient as eagerly)."""
    policy = MixedPrecisionPolicy(param_dtype=torch.float32)
    model = _model(frozen=True)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    (x, y), = _batches(1)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="param_dtype"):
        sc.compile(DataParallel("replicate", mp_policy=policy))(unfreeze_step)(model, optim, x, y, True)
    assert _flags(model)[:2] == [False, False]
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    first = model[0].weight.detach().clone()
    step = sc.compile(DataParallel("replicate", mp_policy=policy))(freeze_step)
    with sc.simulate(world_size=2):
        for (x, y), switch in zip(_batches(3), [True, False, False], strict=True):
            step(model, optim, x, y, switch)
        state = sc.checkpoint.full_state_dict(model)["model"]
    assert _flags(model)[:2] == [False, False]
    assert torch.equal(state["0.weight"], first)  # never trained


HELD: dict[str, list[torch.Tensor]] = {}


def held_freeze_step(model, optim, x, y, switch):  # noqa: ANN001
    if switch:
        for p in HELD["first"]:
            p.requires_grad_(False)
    return _update(model, optim, F.cross_entropy(model(x), y))


def test_a_parameter_set_through_a_list_held_outside_is_refused():
    """The user's parameter itself, set while traced: the stand-in the program was traced
    on kept its flag (before, call 2's program trained the layer: 3.4e-2 off eager)."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(make_mode("ddp"))(held_freeze_step)
    (x, y), (x2, y2) = _batches(2)
    with sc.simulate(world_size=2):
        HELD["first"] = list(model[0].parameters())
        step(model, optim, x, y, False)
        HELD["first"] = list(model[0].parameters())  # the placed parameters
        with pytest.raises(SPMDCompileError, match="outside its modules"):
            step(model, optim, x2, y2, True)
    HELD.clear()
    assert all(_flags(model))
