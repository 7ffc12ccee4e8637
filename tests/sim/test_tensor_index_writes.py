"""Writes at a 0-d integer tensor the step computed (NOTE: [0-d tensor indices at
capture], the write).

``mem.x[mem.ptr] = x[0]`` (a ring buffer's write pointer held in a buffer) and
``mem.x[pos] = torch.where(keep, x[i], mem.x[pos])`` (reservoir sampling) were refused
before 2026-12-08 as a value read, with a hint to use ``torch.where`` that the second
already followed; only the read ``mem.x[mem.ptr]`` compiled. Now the write is taken by
``index_select`` / ``index_copy_`` in the program: the buffer's contents, the pointer and
the loss as eager's over 4 calls, and a written activation's gradient as eager's.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel

SLOTS, FEATURES = 6, 3
MODES = {"ddp": lambda: DataParallel("replicate"), "fsdp": lambda: DataParallel("fully_shard")}


class Memory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(FEATURES, 1)
        self.register_buffer("x", torch.zeros(SLOTS, FEATURES))
        self.register_buffer("age", torch.zeros(SLOTS, dtype=torch.long))
        self.register_buffer("ptr", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))


def _replay(model, optim, x):  # noqa: ANN001, ANN202
    """A step on the batch and the buffer's rows."""
    loss = model.net(x).pow(2).mean() + model.net(model.x).pow(2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss


def ring_step(model, optim, x):  # noqa: ANN001, ANN201
    """Replay from the buffer, then write the batch's first rows at the pointer."""
    loss = _replay(model, optim, x)
    with torch.no_grad():
        model.x[model.ptr] = x[0]
        model.age += 1
        model.age[model.ptr] = 0  # a Python number into an integer buffer
        model.x[model.ptr - SLOTS + 1, 1:3] = x[1, :2] * 2  # a negative index, a slice after
        model.ptr.add_(2).remainder_(SLOTS)
        model.x[:, model.age.argmax()] += 0.5  # a column, read, added to, written back
    return loss


def reservoir_step(model, optim, x):  # noqa: ANN001, ANN201
    """Reservoir sampling: row ``i`` replaces a random slot with probability SLOTS/seen."""
    loss = _replay(model, optim, x)
    with torch.no_grad():
        for i in range(x.shape[0]):
            drawn = torch.randint(0, 10**9, ()) % (model.seen + 1)
            position = torch.where(model.seen < SLOTS, model.seen, drawn)
            keep = position < SLOTS
            position = position.clamp(max=SLOTS - 1)
            model.x[position] = torch.where(keep, x[i], model.x[position])
            model.seen += 1
    return loss


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("step", [ring_step, reservoir_step], ids=["ring", "reservoir"])
def test_a_buffer_written_at_a_tensor_index_as_eager(mode, step) -> None:  # noqa: ANN001
    torch.manual_seed(0)
    model = Memory().double()
    eager = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optim = torch.optim.SGD(eager.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=MODES[mode]())(step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=2) as sim:
        for call in range(4):
            x = torch.randn(4, FEATURES, generator=gen, dtype=torch.float64)
            torch.manual_seed(10 + call)
            want = step(eager, eager_optim, x)
            torch.manual_seed(10 + call)
            got = compiled(model, optim, x)
            assert abs(float(sim.full_tensor(got)) - float(want)) < 1e-12, call
        state = {name: sim.full_tensor(value) for name, value in model.state_dict().items()}
    for name, want in eager.state_dict().items():
        assert state[name].dtype == want.dtype, name
        assert torch.allclose(state[name], want, rtol=1e-12, atol=1e-12), (name, state[name], want)
    assert float(eager.x.abs().sum()) > 0  # the writes happened


class WrittenActivation(nn.Module):
    """An activation written at a data-chosen column and row before the loss: the gradient
    flows through what the writes left, none through what they replaced."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 4)
        self.fill = nn.Parameter(torch.tensor(0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x) * 1.5  # saved by no backward, so written in place as in eager
        column = h.detach().mean(0).argmax()
        h[:, column] = self.fill * 2  # a value that requires grad, broadcast down the batch
        h[column % 2, 1:3] = 0.0  # a row of the sharded batch, two features
        h[column, column] = 1.0 if h.shape[0] > 8 else 0.0  # two 0-d tensors, no batch row
        return self.out(torch.tanh(h))


@pytest.mark.parametrize("mode", list(MODES))
def test_a_written_activation_has_eagers_gradient(run_parity, classification_batches, mode) -> None:  # noqa: ANN001
    result = run_parity(
        lambda: WrittenActivation().double(),
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        2,
        classification_batches(3, dtype=torch.float64),
        mode=MODES[mode](),
    )
    result.assert_close(1e-12)
    assert float(result.reference.fill.detach()) != 0.25  # the written value got a gradient


def test_an_index_out_of_range_fails_at_run_time() -> None:
    """As eager's ``IndexError``: the program's kernel fails, nothing is written silently."""
    model = Memory().double()
    model.ptr.fill_(SLOTS)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, optim, x):  # noqa: ANN001, ANN202
        loss = model.net(x).pow(2).mean()
        loss.backward()
        optim.step()
        with torch.no_grad():
            model.x[model.ptr] = x[0]
        return loss

    with pytest.raises(IndexError):
        step(copy.deepcopy(model), torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(4, FEATURES).double())
    with sc.simulate(world_size=2), pytest.raises(Exception, match="out of bounds|out of range"):
        sc.compile(parallel_mode=DataParallel("replicate"))(step)(model, optim, torch.randn(4, FEATURES).double())
    assert float(model.x.abs().sum()) == 0
