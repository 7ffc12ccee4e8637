"""What ``build_guards`` finds and how ``Guards.first_change`` compares (no tracing)."""

from __future__ import annotations

import types

import torch
import torch.nn as nn

from spmd_compiler.capture.bindings import find_bindings
from spmd_compiler.capture.guards import build_guards

THRESHOLD = 0.5
UNREAD_GLOBAL = 3


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.LeakyReLU(0.1)
        self.temperature = 2.0
        self.config = types.SimpleNamespace(scale=1.0, inner=types.SimpleNamespace(flag=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._helper(self.act(self.fc(x))) / self.temperature
        return h * self.config.scale if self.config.inner.flag else h

    def _helper(self, h: torch.Tensor) -> torch.Tensor:
        return clip(h)


def clip(h: torch.Tensor) -> torch.Tensor:
    return h.clamp(max=THRESHOLD)


def step(model, optim, x, mode):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    return loss


def _bindings(model: nn.Module, mode: object = "train"):
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    return find_bindings(step, (model, optim, torch.ones(2, 4), mode), {})


def test_guards_name_what_forward_and_its_helpers_read():
    model = Net()
    guards = build_guards(step, _bindings(model), frozenset())
    names = set(guards.names)
    assert "module <root>.temperature" in names
    assert "module <root>.config.scale" in names
    assert "module <root>.config.inner.flag" in names
    assert "module act.negative_slope" in names
    assert any(n.startswith("global THRESHOLD (read by clip") for n in names)
    assert not any("UNREAD_GLOBAL" in n for n in names)
    assert "argument mode of the step" in names


def test_first_change_is_none_until_a_value_changes():
    model = Net()
    bindings = _bindings(model)
    guards = build_guards(step, bindings, frozenset())
    assert guards.first_change(bindings) is None
    model.config.inner.flag = False
    assert guards.first_change(bindings) == "module <root>.config.inner.flag was True, now False"
    model.config.inner.flag = True
    model.temperature = 2  # same value, another type: a trace may differ (int vs float)
    assert guards.first_change(bindings) == "module <root>.temperature was 2.0, now 2"
    model.temperature = 2.0
    count = len(model.__dict__)
    model.new_setting = 1  # an attribute added later (forward may read it by getattr)
    assert guards.first_change(bindings) == (
        f"the number of attributes of module <root> was {count}, now {count + 1}"
    )


def test_graph_arguments_are_not_guarded():
    model = Net()
    bindings = _bindings(model, mode=0.25)
    assert "argument mode of the step" in build_guards(step, bindings, frozenset()).names
    assert "argument mode of the step" not in build_guards(step, bindings, frozenset({3})).names


def test_guards_follow_the_objects_of_the_call():
    """NOTE: [guards follow the call's objects]: another model is checked as itself."""
    from spmd_compiler.api import step_guards

    first, other = Net(), Net()
    guards = step_guards(step, _bindings(first), frozenset())
    other.temperature = 3.0
    bindings = _bindings(other)
    assert not guards.same_objects(bindings)
    held, change = guards.for_call(bindings)
    assert held is guards and change == "module <root>.temperature was 2.0, now 3.0"
    other.temperature = 2.0
    held, change = guards.for_call(bindings)
    assert change is None and held is not guards and held.same_objects(bindings)
    other.config.scale = 5.0  # the derived guards read the new model's config
    assert held.first_change(bindings) == "module <root>.config.scale was 1.0, now 5.0"
    assert guards.first_change(_bindings(first)) is None  # the first model's own: unchanged


def test_numpy_values_are_guarded_by_value():
    """A NumPy scalar or array a forward reads is baked into the program like a Python
    number; before, neither was guarded (a new `np.float32` scale, or an array changed
    in place, kept the capture's value)."""
    import numpy as np

    class ReadsNumPy(Net):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * self.np_scale * float(self.np_weights.sum())

    model = ReadsNumPy()
    model.np_scale = np.float32(2.0)
    model.np_weights = np.array([1.0, 2.0])
    bindings = _bindings(model)
    guards = build_guards(step, bindings, frozenset())
    assert guards.first_change(bindings) is None
    model.np_weights[1] = 5.0  # in place: the same object
    assert guards.first_change(bindings).startswith("module <root>.np_weights was ('numpy array'")
    model.np_weights[1] = 2.0
    model.np_scale = np.float64(2.0)  # the same value, another dtype
    assert guards.first_change(bindings) == (
        "module <root>.np_scale was ('numpy', 'float32', 2.0), now ('numpy', 'float64', 2.0)"
    )
