"""Functions an object holds, and functions in globals, are guarded by identity (no tracing).

NOTE: [functions an object holds] in ``capture/guards.py``. Each case puts another
function where the step's code finds one; on the code before the note, all three ran the
program traced with the old function, silently (``first_change`` / ``for_call`` found no
change).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from spmd_compiler.capture.bindings import find_bindings
from spmd_compiler.capture.guards import build_guards


def double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def triple(x: torch.Tensor) -> torch.Tensor:
    return x * 3


ACT = F.gelu


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = F.gelu  # torch's: no code of it is walked
        self.ops = {"scale": double}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ACT(self.ops["scale"](self.act(self.fc(x))))


class Wrapped(nn.Module):
    """A library-like module (``nn.Sequential`` holds it): walked whole."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Sequential(nn.Linear(4, 4))
        self.inner.fn = double


def step(model, optim, x):  # noqa: ANN001
    loss = model(x).sum()
    loss.backward()
    optim.step()
    return loss


def _guards(model: nn.Module):
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    bindings = find_bindings(step, (model, optim, torch.ones(2, 4)), {})
    guards = build_guards(step, bindings, frozenset())
    guards.rebuild = lambda b: build_guards(step, b, frozenset())  # as the compiled step sets it
    assert guards.for_call(bindings)[1] is None
    return guards, bindings


def test_a_torch_function_replaced_on_a_module():
    model = Net()
    guards, bindings = _guards(model)
    model.act = F.relu
    change = guards.for_call(bindings)[1]
    assert change in ("the function at 'act' was replaced",  # found by the link to it
                      f"module <root>.act was {F.gelu!r}, now {F.relu!r}"), change


def test_a_function_in_a_dict_on_a_module():
    model = Net()
    guards, bindings = _guards(model)
    model.ops["scale"] = triple
    change = guards.for_call(bindings)[1]
    assert change is not None and change.startswith("module <root>.ops['scale'] was <function double"), change


def test_a_function_on_a_torch_module():
    model = Wrapped()
    guards, bindings = _guards(model)
    model.inner.fn = triple
    change = guards.for_call(bindings)[1]
    assert change is not None and change.startswith("module inner.fn was <function double"), change


def test_a_global_torch_function_rebound():
    model = Net()
    guards, bindings = _guards(model)
    global ACT
    ACT = F.relu
    try:
        change = guards.for_call(bindings)[1]
    finally:
        ACT = F.gelu
    assert change == "the function at 'ACT' was replaced", change


def test_the_same_functions_on_a_second_model_reuse_the_guards():
    guards, _ = _guards(Net())
    other = Net()
    bindings = find_bindings(step, (other, torch.optim.SGD(other.parameters(), lr=0.1), torch.ones(2, 4)), {})
    assert guards.for_call(bindings)[1] is None


def test_the_model_runs():
    assert Net()(torch.ones(2, 4)).shape == (2, 4)
