"""A first call that fails after it placed the state leaves the model as it was (NOTE: [a
failed first call leaves the model as it was] in ``spmd_compiler/runtime/runner.py``).

A value check that comes out the way no program holds is found while the program runs,
after the call replaced the parameters by DTensors. Before, the error said nothing was
updated, yet the model's parameters stayed DTensors: calling the model eagerly raised,
and the user could not go on without the compiler.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel


def _counted_step(model, optim, x, y):
    out = model(x)
    count = torch.nonzero(y).shape[0]  # compiled for an all-true mask, checked every call
    loss = F.cross_entropy(out, y, reduction="sum") / count
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),  # state made first
}


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_first_call_failing_its_value_check_leaves_the_model_plain(mode, optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    optim = OPTIMIZERS[optimizer](model)
    reference = copy.deepcopy(model)
    reference_optim = OPTIMIZERS[optimizer](reference)
    held = list(model.parameters())
    x = torch.randn(8, 8, dtype=torch.float64)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(_counted_step)
    with sc.simulate(world_size=2):
        with pytest.raises(sc.SPMDRuntimeError, match="Nothing was updated"):
            compiled(model, optim, x, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
        # the same parameter objects, plain, with the optimizer's state as before
        assert all(a is b for a, b in zip(held, model.parameters(), strict=True))
        assert all(type(p) is nn.Parameter for p in model.parameters())
        assert all(optim.param_groups[0]["params"][i] is p for i, p in enumerate(held))
        assert not optim.state
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters(), strict=True))
        # the model trains eagerly, then compiled, as the reference does
        y = torch.tensor([1, 2, 3, 1, 2, 3, 1, 2])
        for m, o in ((model, optim), (reference, reference_optim)):
            _counted_step(m, o, x, y)
        loss = compiled(model, optim, x, y)
        expected = _counted_step(reference, reference_optim, x, y)
        assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
    state = sc.checkpoint.full_state_dict(model, optim)
    for name, value in reference.state_dict().items():
        assert torch.allclose(state["model"][name], value, rtol=1e-10, atol=1e-14), name


def test_a_failed_call_sets_back_the_scheduler_it_stepped_first():
    """A scheduler stepped before the update is replayed before the program runs; when
    the program's value check then fails, "nothing was updated" holds for it too (it
    was left one epoch ahead)."""

    def step(model, optim, scheduler, x, y):
        out = model(x)
        loss = F.cross_entropy(out, y, reduction="sum") / torch.nonzero(y).shape[0]
        scheduler.step()
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda e: 1 / (1 + e))
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(step)
    x = torch.randn(8, 8, dtype=torch.float64)
    with sc.simulate(world_size=2):
        with pytest.raises(sc.SPMDRuntimeError, match="Nothing was updated"):
            compiled(model, optim, scheduler, x, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3]))
        assert scheduler.last_epoch == 0 and optim.param_groups[0]["lr"] == 0.1
        compiled(model, optim, scheduler, x, torch.tensor([1, 2, 3, 1, 2, 3, 1, 2]))
        assert scheduler.last_epoch == 1 and optim.param_groups[0]["lr"] == 0.05


def test_an_error_after_the_update_keeps_it_as_eager_does():
    """The scheduler stepped after the update raises (a schedule at its end), as it does
    eagerly; the update the program made stays, as eager's does (the undo of a failed
    first call put the model back before it)."""

    def step(model, optim, scheduler, x, y):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        scheduler.step()
        return loss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    parts = []
    for m in (model, reference):
        optim = torch.optim.SGD(m.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(optim, max_lr=0.5, total_steps=1)
        scheduler.step()  # at its end: the next step() raises
        parts.append((optim, scheduler))
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    with sc.simulate(world_size=2):
        with pytest.raises(ValueError, match="Tried to step"):
            sc.compile(parallel_mode=DataParallel("replicate"))(step)(model, *parts[0], x, y)
        with pytest.raises(ValueError, match="Tried to step"):
            step(reference, *parts[1], x, y)
        state = sc.checkpoint.full_state_dict(model)["model"]
    for name, value in reference.state_dict().items():
        assert torch.allclose(state[name], value, rtol=1e-12, atol=1e-15), name


class _BadBatch(Exception):
    pass


def test_an_error_the_step_raises_at_capture_says_nothing_was_applied():
    """Eager keeps what ran before the step's own ``raise`` (here the gradients of
    ``backward()``); the failed capture applies nothing, and the message says so (a loop
    catching the error and going on would part from eager unawares)."""

    def step(model, optim, x, y, bad):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        if bad:
            raise _BadBatch("a bad batch")
        optim.step()
        optim.zero_grad()
        return loss

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(step)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randint(0, 3, (4,))
    with sc.simulate(world_size=2):
        compiled(model, optim, x, y, 0)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(sc.SPMDCompileError) as info:
            compiled(model, optim, x, y, 1)
        assert all(torch.equal(p.detach(), before[n]) and p.grad is None for n, p in model.named_parameters())
    assert isinstance(info.value.__cause__, _BadBatch)
    assert "_BadBatch: a bad batch (nothing of this call was applied: the model, its gradients" in str(info.value)
