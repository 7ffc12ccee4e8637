"""NOTE: [state the step gives a new shape] (``runtime/runner.py``).

A buffer made empty and filled on the first call (torch.ao's ``PerChannelMinMaxObserver``:
``torch.tensor([])``, then ``resize_`` and ``copy_``, or ``self.buf = new``) leaves the
step with another shape than it came in with. Write-back kept the buffer DTensor's
global shape (0,), so the program key never changed and every later call ran the first
call's branch (``numel() == 0``): the running max was overwritten by each batch's, with
losses and weights unchanged. Now such state is written back as a DTensor of its new
shape, the next call compiles again and sees the filled buffer. Each case runs 4 steps
in float64 against the undecorated step on one device (global batch):

- a running max kept by ``resize_`` / by assignment, ddp and fsdp, 1, 2 and 4 ranks;
- torch.ao's per-channel observers (min/max and moving average), ddp and fsdp;
- an optimizer whose state starts empty and takes its parameter's shape on the second
  step (sharded under fsdp): the state is placed for its new shape;
- a buffer reassigned between calls, outside the step, with another shape;
- a parameter given a new shape (refused), a buffer that grows every call (named);
- a rotary cache grown in forward beside a Python counter of its rebuilds: exact from
  the first call (NOTE: [the probe starts from the buffers left] in ``api.py``), and a
  counter bumped on every call beside it still refused.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.ao.quantization.observer import (
    MovingAveragePerChannelMinMaxObserver,
    PerChannelMinMaxObserver,
)

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_states, full_state

TOL = 1e-12


@pytest.fixture(autouse=True)
def _float64_by_default():
    """The empty buffers and the optimizer's state are made in the default dtype."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(default)


class RunningMax(nn.Module):
    """The lazy-init pattern of torch.ao's per-channel observers."""

    def __init__(self, assign: bool) -> None:
        super().__init__()
        self.assign = assign
        self.register_buffer("max_val", torch.tensor([]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cur = x.detach().amax(0)
        new = cur if self.max_val.numel() == 0 else torch.max(cur, self.max_val)
        if self.assign:
            self.max_val = new
        else:
            self.max_val.resize_(new.shape)
            self.max_val.copy_(new)
        return x


class Net(nn.Module):
    def __init__(self, observer: nn.Module) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(16, 6)
        self.obs = observer
        self.l2 = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.obs(torch.relu(self.l1(x))))


def _step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    # the first batch's maxima are the largest: a program that forgets them shows
    return [
        (torch.randn(8, 16, generator=g) * (3.0 if i == 0 else 0.3), torch.randint(0, 4, (8,), generator=g))
        for i in range(n)
    ]


def _run(model: nn.Module, make_opt, mode: str, world_size: int, between=None):  # noqa: ANN001
    """Losses, compile count and the states' largest relative difference after 4 steps."""
    ref = copy.deepcopy(model)
    opt, ref_opt = make_opt(model), make_opt(ref)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(_step)
    with sc.simulate(world_size=world_size) as sim:
        for i, (x, y) in enumerate(_batches(4)):
            if between is not None and i == 2:
                between(model)
                between(ref)
            got, want = compiled(model, opt, x, y), _step(ref, ref_opt, x, y)
            assert abs(got.item() - want.item()) <= TOL * abs(want.item()), i
        actual = full_state(model, opt, sim)
    expected = full_state(ref, ref_opt, None)
    for key, value in expected.items():  # the shapes themselves, not after a reshape
        assert tuple(actual[key].shape) == tuple(value.shape), key
    return max(compare_states(actual, expected).values()), compiled.compile_count


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("assign", [False, True], ids=["resize", "assign"])
def test_buffer_filled_on_the_first_call_accumulates(mode, world_size, assign):
    # before: running max [0.40, 0.15, 0.00, ...] where eager's is [3.03, 2.03, 2.56, ...]
    diff, compiles = _run(Net(RunningMax(assign)), _sgd, mode, world_size)
    assert diff <= TOL
    assert compiles == 2  # the empty buffer's program, then the filled one's


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize(
    "observer",
    [
        lambda: PerChannelMinMaxObserver(ch_axis=1, dtype=torch.quint8),
        lambda: MovingAveragePerChannelMinMaxObserver(ch_axis=1, averaging_constant=0.5, dtype=torch.quint8),
    ],
    ids=["minmax", "moving_average"],
)
def test_torch_ao_per_channel_observers(mode, observer):
    # before: PerChannelMinMaxObserver's max_val 0.27 relative off eager after 3 steps
    diff, compiles = _run(Net(observer()), _sgd, mode, 2)
    assert diff <= TOL
    assert compiles == 2


class LazyMomentum(torch.optim.Optimizer):
    """Momentum whose buffer is made empty on the first step and set to the gradient on
    the second: state of shape (0,), then its parameter's."""

    def __init__(self, params, lr: float = 0.1) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "m" not in state:
                    state["m"] = torch.zeros(0)
                elif state["m"].numel() == 0:
                    state["m"] = p.grad.clone()
                else:
                    state["m"].mul_(0.9).add_(p.grad)
                p.add_(state["m"] if state["m"].numel() else p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_optimizer_state_that_takes_a_new_shape(mode):
    # before: the second step's program (``m = grad``) ran on every later call; on
    # fsdp the state's stale (0,) DTensor made simulated ranks disagree
    def make_opt(m: nn.Module) -> torch.optim.Optimizer:
        return LazyMomentum(m.parameters())

    model = nn.Sequential(nn.Linear(16, 6), nn.ReLU(), nn.Linear(6, 4))
    diff, compiles = _run(model, make_opt, mode, 2)
    assert diff <= TOL
    assert compiles == 3  # no state, empty state, then the parameter-shaped state


def test_buffer_reassigned_between_calls_with_another_shape():
    """Set outside the step: the module holds a new plain tensor, the key reads its shape."""

    def reset(model: nn.Module) -> None:
        model.obs.max_val = torch.full((6,), 0.5)

    diff, compiles = _run(Net(RunningMax(assign=False)), _sgd, "fully_shard", 2, between=reset)
    assert diff <= TOL
    assert compiles == 2  # the filled buffer's program serves the reset one too

    def empty(model: nn.Module) -> None:
        model.obs.max_val = torch.tensor([])

    diff, compiles = _run(Net(RunningMax(assign=True)), _sgd, "replicate", 2, between=empty)
    assert diff <= TOL
    assert compiles == 2  # back to the empty buffer's program, then the filled one's


def test_parameter_given_a_new_shape_is_refused():
    """A frozen parameter made empty and filled in the step: refused, the model untouched."""

    class LazyStat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 4)
            self.stat = nn.Parameter(torch.tensor([]), requires_grad=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with torch.no_grad():
                self.stat.resize_(x.shape[1:])
                self.stat.copy_(x.amax(0))
            return self.lin(x)

    model = LazyStat()
    opt = _sgd(model)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_step)
    x, y = _batches(1)[0]
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError, match="changes parameter 'stat'"):
        compiled(model, opt, x, y)
    assert type(model.stat) is nn.Parameter and model.stat.shape == (0,)


def test_a_buffer_that_grows_every_call_is_named(caplog):
    """Exact, a program per shape, and the recompiles name the buffer (warned after 3)."""

    class History(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("seen", torch.tensor([]))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.seen = torch.cat([self.seen, x.detach().amax().reshape(1)])
            return x

    with caplog.at_level(logging.INFO, logger="spmd_compiler"):
        diff, compiles = _run(Net(History()), _sgd, "replicate", 2)
    assert diff <= TOL
    assert compiles == 4
    messages = [r.getMessage() for r in caplog.records]
    assert any("the shape of buffer obs.seen was [1], now [2]" in m for m in messages), messages
    assert any("make the buffer at its final shape" in m for m in messages), messages


class RopeLM(nn.Module):
    """A cos table grown in forward when the sequence is longer (decided on the tensor's
    shape), its rebuilds counted in a Python int; ``every_call``: a counter of calls too."""

    def __init__(self, every_call: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.out = nn.Embedding(20, 16), nn.Linear(16, 20)
        self.register_buffer("cos", torch.zeros(0, 16), persistent=False)
        self.rebuilds, self.calls, self.every_call = 0, 0, every_call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length = x.shape[1]
        if self.cos.shape[0] < length:
            angles = torch.arange(length).view(-1, 1) * torch.linspace(0.1, 1.0, 16).view(1, -1)
            self.cos = torch.cos(angles)
            self.rebuilds += 1
        if self.every_call:
            self.calls += 1
        return self.out(self.emb(x) * self.cos[:length]).reshape(-1, 20)  # a logit row per token


def _token_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randint(0, 20, (8, t), generator=g), torch.randint(0, 20, (8 * t,), generator=g))
        for t in (4, 6, 6)
    ]


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_cache_grown_in_forward_beside_a_counter_of_its_rebuilds(mode):
    # before: refused on the first call, "changes a Python value every time it runs:
    # module <root>.rebuilds was 1, now 2" (the probe read the (0, 16) table again)
    model = RopeLM()
    ref = copy.deepcopy(model)
    opt, ref_opt = _sgd(model), _sgd(ref)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(_step)
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(_token_batches()):
            got, want = compiled(model, opt, x, y), _step(ref, ref_opt, x, y)
            assert abs(got.item() - want.item()) <= TOL * abs(want.item()), i
            assert model.rebuilds == ref.rebuilds == (1, 2, 2)[i], i
        actual = full_state(model, opt, sim)
    assert max(compare_states(actual, full_state(ref, ref_opt, None)).values()) <= TOL
    assert compiled.compile_count == 3  # a program per table length: 0, 4, then 6


def test_a_counter_of_every_call_beside_a_grown_cache_is_still_refused():
    model = RopeLM(every_call=True)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_step)
    x, y = _token_batches()[0]
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        compiled(model, _sgd(model), x, y)
    assert "every time it runs: module <root>.calls went from 0 to 1 on this call, and from 1 to 2" in str(info.value)
    assert (model.calls, model.rebuilds, tuple(model.cos.shape)) == (0, 0, (0, 16))  # as found
