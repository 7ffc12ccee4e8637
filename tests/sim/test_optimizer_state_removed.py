"""NOTE: [optimizer state removed in the step] (``capture/removed_state.py``).

A FedAvg client resets its local optimizer inside the step on some calls (reset True,
False, False, True), in three forms: ``opt.state.clear()``, ``opt.state =
defaultdict(dict)`` and ``opt.state.pop(p, None)`` for each parameter. On 2 simulated
ranks (float64), against the undecorated step on one device, after every one of 4 calls:
the loss, the parameters and the optimizer state (its entries, and their values), for
Adam and AdamW under ddp and fsdp, with the optimizer empty at the first call (the
predicted first state: NOTE: [Adam's first state predicted]) and with state present
there (the steady program). Before the fix the first form left the optimizer empty after
call 1 (call 3's loss 1.4523 against 1.4162), the second wrote the old state back.

A reset in a call that does not step takes state out that no program can take out of
the optimizer: refused, naming the line, the optimizer left as found.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.capture.initial_state import RecordedState, RecordedStates
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_models, compare_states, full_state

TOL = 1e-10
RESETS = [True, False, False, True]


def _reset(optim: torch.optim.Optimizer, how: str) -> None:
    if how == "clear":
        optim.state.clear()
    elif how == "reassign":
        optim.state = defaultdict(dict)
    else:
        for group in optim.param_groups:
            for p in group["params"]:
                optim.state.pop(p, None)


def _step_resetting(how: str):  # noqa: ANN202
    def step(model, optim, x, y, reset):  # noqa: ANN001
        if reset:
            _reset(optim, how)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    return step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).double()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(1)
    return [(torch.randn(16, 16, dtype=torch.float64), torch.randint(0, 4, (16,))) for _ in range(n)]


def _entries(optim: torch.optim.Optimizer) -> list[list[str]]:
    return [sorted(map(str, s)) for s in optim.state.values()]


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("how", ["clear", "reassign", "pop"])
def test_a_reset_inside_the_step_gives_eager_state(how, optimizer, mode):
    _check_resets(how, optimizer, mode, state_first=False)


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW])
@pytest.mark.parametrize("how", ["clear", "reassign", "pop"])
def test_a_reset_inside_the_step_with_state_present_gives_eager_state(how, optimizer):
    """The steady program from the first call (``reassign`` wrote the old state back:
    Adam's state 2.4 relative off)."""
    _check_resets(how, optimizer, "replicate", state_first=True)


def _check_resets(how: str, optimizer: type, mode: str, state_first: bool) -> None:
    model = _model()
    ref = copy.deepcopy(model)
    optim, ref_optim = optimizer(model.parameters(), lr=0.05), optimizer(ref.parameters(), lr=0.05)
    batches = _batches(len(RESETS) + 1)
    step = _step_resetting(how)
    if state_first:  # a plain step before: the compiled calls find state
        step(model, optim, *batches[-1], False)
        step(ref, ref_optim, *batches[-1], False)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for i, ((x, y), reset) in enumerate(zip(batches, RESETS, strict=False)):
            want = step(ref, ref_optim, x, y, reset).item()
            got = compiled(model, optim, x, y, reset).item()
            assert abs(got - want) < TOL, (i, got, want)
            assert _entries(optim) == _entries(ref_optim), i
            states = compare_states(full_state(model, optim, sim), full_state(ref, ref_optim, None))
            assert max(states.values()) < TOL, (i, max(states.items(), key=lambda kv: kv[1]))
        assert max(compare_models(model, ref, sim).values()) < TOL
        assert len(optim.state_dict()["state"]) == len(ref_optim.state_dict()["state"]) == 4


def _reset_without_stepping(model, optim, x, y, reset):  # noqa: ANN001
    if reset:
        optim.state.clear()
    loss = F.cross_entropy(model(x), y)
    if not reset:
        loss.backward()
        optim.step()
        optim.zero_grad()
    return loss.detach()


def test_state_taken_out_and_not_made_again_is_refused():
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    (x, y), = _batches(1)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_reset_without_stepping)
    with sc.simulate(world_size=2) as sim:
        compiled(model, optim, x, y, False)
        before = full_state(model, optim, sim)
        with pytest.raises(sc.SPMDCompileError, match=r"takes optimizer\[0\] \(Adam\) state") as info:
            compiled(model, optim, x, y, True)
        assert "optim.state.clear()" in str(info.value.user_line)
        assert "zero its state in place" in str(info.value.hint)
        after = full_state(model, optim, sim)
    assert _entries(optim) == [["exp_avg", "exp_avg_sq", "step"]] * 4
    assert max(compare_states(after, before).values()) == 0.0


def test_removals_are_noted_with_the_line():
    states = RecordedStates()
    states["a"] = RecordedState({"x": 1})
    assert states.removed_at is None
    states.pop("a")
    assert "states.pop" in str(states.removed_at)
    entries = RecordedState({"x": 1})
    entries.clear()
    assert "entries.clear()" in str(entries.removed_at)
