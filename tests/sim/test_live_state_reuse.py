"""Training state put back into the live objects a compiled step trains, then trained on,
against one device (float64, 2 simulated ranks). Each case failed before its fix:

- a checkpoint loaded back into the same model and optimizer (rolling back a step): the
  replicated state ``Simulation.shard`` made was one plain tensor all simulated ranks
  updated in place, once per rank (Rprop's step sizes 44% off);
- an eager ``optimizer.step()`` after a compiled backward-only step, the same way
  (5.5e-2 under ddp);
- a fused Adam's state put back with ``load_state_dict`` (its ``step`` float32 again):
  the program read the float32 counter (2.4e-6 off);
- ``sc.checkpoint.load`` after a compiled evaluation step placed the parameters: the
  optimizer still held the old ones, and torch's state-dict API met them (raised).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel

TOL = 1e-10
OPTIMIZERS = {
    "Rprop": lambda p: torch.optim.Rprop(p, lr=0.01),
    "ASGD": lambda p: torch.optim.ASGD(p, lr=0.05, t0=1),
    "AdamW_fused": lambda p: torch.optim.AdamW(p, lr=0.05, fused=True),
}


@pytest.fixture(autouse=True)
def _float64_scalars():
    """Eager ASGD keeps ``eta`` and ``mu`` in the default dtype, the programs in float64
    (NOTE: [float64 step counters]): float64 throughout, so that the two are one."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(before)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(n)]


def _close(state: dict, reference: nn.Module, reference_optim: torch.optim.Optimizer | None = None) -> None:
    for name, value in reference.state_dict().items():
        assert torch.allclose(state["model"][name], value, rtol=TOL, atol=1e-14), name
    if reference_optim is None:
        return
    names = {id(p): n for n, p in reference.named_parameters()}
    for p, entries in reference_optim.state.items():
        for key, value in entries.items():
            got = torch.as_tensor(state["optimizer"]["state"][names[id(p)]][key]).double()
            assert torch.allclose(got, torch.as_tensor(value).double(), rtol=TOL, atol=1e-14), (names[id(p)], key)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_a_checkpoint_loaded_back_into_the_live_objects(tmp_path, train_step, mode, optimizer):
    model = _model()
    reference = copy.deepcopy(model)
    optim, reference_optim = OPTIMIZERS[optimizer](model.parameters()), OPTIMIZERS[optimizer](reference.parameters())
    batches = _batches(4)
    for batch in batches:
        train_step(reference, reference_optim, *batch)
    step = sc.compile(parallel_mode=DataParallel(mode))(train_step)
    with sc.simulate(world_size=2):
        step(model, optim, *batches[0])
        step(model, optim, *batches[1])
        sc.checkpoint.save(tmp_path / "two", model, optim)
        step(model, optim, *batches[2])  # rolled back
        sc.checkpoint.load(tmp_path / "two", model, optim)
        step(model, optim, *batches[2])
        step(model, optim, *batches[3])
        state = sc.checkpoint.full_state_dict(model, optim)
    _close(state, reference, reference_optim)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_fused_adams_state_put_back_with_load_state_dict(train_step, mode):
    model = _model()
    reference = copy.deepcopy(model)
    optim, reference_optim = (OPTIMIZERS["AdamW_fused"](m.parameters()) for m in (model, reference))
    step = sc.compile(parallel_mode=DataParallel(mode))(train_step)
    with sc.simulate(world_size=2):
        for i, batch in enumerate(_batches(4)):
            step(model, optim, *batch)
            train_step(reference, reference_optim, *batch)
            if i == 1:  # the step counter comes back float32
                optim.load_state_dict(copy.deepcopy(optim.state_dict()))
        state = sc.checkpoint.full_state_dict(model, optim)
    _close(state, reference, reference_optim)


def _backward_only(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_an_eager_update_after_a_compiled_backward(mode):
    model = _model()
    reference = copy.deepcopy(model)
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    x, y = _batches(1)[0]
    with sc.simulate(world_size=2):
        sc.compile(parallel_mode=DataParallel(mode))(_backward_only)(model, optim, x, y)
        optim.step()
        state = sc.checkpoint.full_state_dict(model)
    _backward_only(reference, reference_optim, x, y)
    reference_optim.step()
    _close(state, reference)


def _evaluate(model, x, y):
    with torch.no_grad():
        return F.cross_entropy(model(x), y)


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_checkpoint_loaded_after_an_evaluation_step(tmp_path, train_step, mode):
    """The evaluation placed the parameters; the optimizer it was not given follows them
    when the checkpoint functions read it, as on its next compiled call."""
    trained = _model()
    trained_optim = torch.optim.AdamW(trained.parameters(), lr=0.05)
    batches = _batches(3)
    with sc.simulate(world_size=2):
        sc.compile(parallel_mode=DataParallel(mode))(train_step)(trained, trained_optim, *batches[0])
        sc.checkpoint.save(tmp_path / "one", trained, trained_optim)
        expected = sc.checkpoint.full_state_dict(trained, trained_optim)
    model = _model()
    optim = torch.optim.AdamW(model.parameters(), lr=0.05)
    with sc.simulate(world_size=2):
        sc.compile(parallel_mode=DataParallel(mode))(_evaluate)(model, *batches[1])
        sc.checkpoint.load(tmp_path / "one", model, optim)
        state = sc.checkpoint.full_state_dict(model, optim)
        sc.compile(parallel_mode=DataParallel(mode))(train_step)(model, optim, *batches[2])
    for name, value in expected["model"].items():
        assert torch.equal(state["model"][name], value), name
    assert float(state["optimizer"]["state"]["0.weight"]["step"]) == 1
