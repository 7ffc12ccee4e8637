"""Objects with ``__slots__``: ``slot_names`` and the ``Attributes`` mapping the guards
and kept tensors read (and write back) in place of ``vars`` (``capture/plain_objects.py``),
and the guards built on them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from spmd_compiler.capture.bindings import find_bindings
from spmd_compiler.capture.guards import build_guards
from spmd_compiler.capture.plain_objects import Attributes, attributes, plain_object, slot_names


class Base:
    __slots__ = ("a", "__hidden")


class Child(Base):
    __slots__ = "b"


class Open(Base):  # no __slots__ of its own: a __dict__ beside the base's slots
    pass


def test_slot_names_cover_the_bases_and_mangled_names():
    assert slot_names(Child) == ("b", "a", "_Base__hidden")
    assert slot_names(Open) == ("a", "_Base__hidden")
    assert slot_names(type("Plain", (), {})) == ()


def test_attributes_read_set_slots_and_the_dict():
    obj = Open()
    obj.a, obj.extra = 1.0, "x"
    view = attributes(obj)
    assert isinstance(view, Attributes)
    assert dict(view) == {"a": 1.0, "extra": "x"}  # the unset private slot is left out
    assert len(view) == 2 and "a" in view and "_Base__hidden" not in view
    assert view.get("_Base__hidden", "unset") == "unset"
    view["_Base__hidden"] = 3
    assert obj._Base__hidden == 3 and len(view) == 3
    del view["a"]
    assert not hasattr(obj, "a")
    with pytest.raises(KeyError):
        view["a"]
    with pytest.raises(KeyError):
        del view["a"]
    plain = type("Plain", (), {})()
    assert attributes(plain) is vars(plain)


@dataclasses.dataclass(slots=True)
class Options:
    scale: float
    tag: str = "main"


def test_a_slotted_object_is_a_plain_object_and_guarded_by_what_it_holds():
    assert plain_object(Options(1.0))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.options = Options(2.0)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x) * self.options.scale

    def step(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model(x).sum()

    model = Model()
    bindings = find_bindings(step, (model, torch.ones(1, 2)), {})
    guards = build_guards(step, bindings, frozenset())
    assert any(name.endswith("options.scale") for name in guards.names)
    assert guards.first_change(bindings) is None
    model.options.scale = 3.0
    assert "options.scale was 2.0, now 3.0" in guards.first_change(bindings)
