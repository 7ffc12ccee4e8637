"""Guards below ``OBJECT_DEPTH`` and through what the code reaches by name (no tracing).

NOTE: [guards below the walked depth] in ``capture/guards.py``. Each case builds the
guards of a step, changes one Python value the step reads, and checks that
``first_change`` names it. Before the walk by name, every one of these values was
unguarded: the compiled step silently ran the program traced with the old value
(``tests/sim/test_guards_by_name.py`` runs some of them end to end).
"""

from __future__ import annotations

import collections
import functools
import logging
from typing import NamedTuple

import pytest
import torch
import torch.nn as nn

from spmd_compiler.capture import guards as guards_module
from spmd_compiler.capture.bindings import find_bindings
from spmd_compiler.capture.guards import build_guards


class Stage:
    def __init__(self, k: float) -> None:
        self.k = k


class Holder:
    def __init__(self, inner: object) -> None:
        self.inner = inner


class Gain:
    def __init__(self, gain: float) -> None:
        self.gain = gain


class Note:
    def __init__(self, label: str) -> None:
        self.label = label  # no code the step runs names it


class Settings:
    base = 2.0  # a class attribute the code reads through an instance

    def __init__(self) -> None:
        self.inner = Holder(Stage(1.5))

    def factor(self) -> float:
        return self.base * MULTIPLIER


class Pair(NamedTuple):
    low: float
    high: float


MULTIPLIER = 3.0
SETTINGS = Settings()
STAGES = (Stage(2.0), Stage(4.0))
TABLE = {"gain": Stage(0.5)}


def read_inner(settings: Settings) -> float:
    """A helper handed a global object: reads what the caller's code never names."""
    return settings.inner.inner.k


class Net(nn.Module):
    scale = 1.0  # a class attribute of the module's class

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.stages = [Stage(1.0), Stage(2.0)]
        self.deep = Holder(Holder(Holder(Stage(3.0))))
        self.named = Holder(Holder(Gain(1.0)))  # ``gain`` is only a string in forward
        self.spec = (1, [2, 3])
        self.table = collections.OrderedDict(a=1.0)
        self.pair = Pair(0.0, 1.0)
        self.shallow = Holder(Note("x"))  # a user's class: by name at every depth
        self.unread = Holder(Holder(Note("x")))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x) * self.scale * self.stages[1].k * self.deep.inner.inner.inner.k
        h = h * getattr(self.named.inner.inner, "gain") * self.spec[1][0] * self.table["a"]  # noqa: B009
        h = h.clamp(self.pair.low, self.pair.high)
        h = h * read_inner(SETTINGS) * SETTINGS.factor() * STAGES[1].k * TABLE["gain"].k
        return h


def step(model, optim, x):  # noqa: ANN001
    loss = model(x).sum()
    loss.backward()
    optim.step()
    return loss


@pytest.fixture
def restore():
    """Put back the globals and class attributes a case changes."""
    yield
    Net.scale, Settings.base = 1.0, 2.0
    SETTINGS.__dict__.pop("base", None)
    SETTINGS.inner.inner.k, STAGES[1].k, TABLE["gain"].k = 1.5, 4.0, 0.5
    globals()["MULTIPLIER"] = 3.0


def _guards(model: nn.Module):
    bindings = find_bindings(step, (model, torch.optim.SGD(model.parameters(), lr=0.1), torch.ones(2, 4)), {})
    guards = build_guards(step, bindings, frozenset())
    assert guards.first_change(bindings) is None
    return guards, bindings


CHANGES = {
    "a list item's attribute": (lambda m: setattr(m.stages[1], "k", 5.0), "module <root>.stages[1].k"),
    "an attribute four objects down": (lambda m: setattr(m.deep.inner.inner.inner, "k", 5.0), ".inner.inner.inner.k"),
    "an attribute read by getattr": (lambda m: setattr(m.named.inner.inner, "gain", 2.0), ".named.inner.inner.gain"),
    "a list inside a tuple": (lambda m: m.spec[1].__setitem__(0, 7), "module <root>.spec"),
    "an OrderedDict entry": (lambda m: m.table.__setitem__("a", 2.0), "module <root>.table"),
    "a named tuple replaced": (lambda m: setattr(m, "pair", Pair(0.0, 2.0)), "module <root>.pair"),
    "a module class attribute": (lambda m: setattr(Net, "scale", 2.0), "class Net.scale"),
    "what a helper reads of a global it is passed": (
        lambda m: setattr(SETTINGS.inner.inner, "k", 2.5), "global SETTINGS.inner.inner.k"),
    "a class attribute a method reads": (lambda m: setattr(Settings, "base", 5.0), "class Settings.base"),
    "an instance attribute shadowing it": (lambda m: setattr(SETTINGS, "base", 5.0), "global SETTINGS.base"),
    "a global a method reads": (lambda m: globals().__setitem__("MULTIPLIER", 4.0), "global MULTIPLIER"),
    "an object in a global tuple": (lambda m: setattr(STAGES[1], "k", 5.0), "global STAGES[1].k"),
    "an object in a global dict": (lambda m: setattr(TABLE["gain"], "k", 5.0), "global TABLE['gain'].k"),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_change_below_the_walked_depth_is_seen(case, restore):
    model = Net()
    guards, bindings = _guards(model)
    mutate, where = CHANGES[case]
    mutate(model)
    change = guards.first_change(bindings)
    assert change is not None and where in change, change


def test_attributes_no_code_names_are_not_guarded():
    """Of a user's objects, at any depth, only the attributes some walked code names
    (NOTE: [guards on the names the code reads])."""
    guards, _ = _guards(Net())
    assert not any(".shallow" in name or ".unread" in name for name in guards.names)
    assert any(".deep.inner.inner.inner.k" in name for name in guards.names)


def test_a_walk_by_name_that_reaches_too_much_stops_and_warns(monkeypatch, caplog):
    monkeypatch.setattr(guards_module, "NAMED_OBJECTS", 3)
    monkeypatch.setattr(guards_module, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"):
        guards, _ = _guards(Net())
    assert guards.cut_short is not None
    assert "are not guarded" in caplog.text and guards.cut_short in caplog.text


class Options:
    def __init__(self, weight: float) -> None:
        self.weight = weight


class OtherOptions(Options):
    pass


def _key(arg: object) -> tuple:
    model = nn.Linear(2, 2)
    return find_bindings(step, (model, torch.optim.SGD(model.parameters(), lr=0.1), arg), {}).static_key()


def test_an_object_argument_is_keyed_by_its_class():
    """Its contents are guards; two objects with the same class share a key (the guards
    tell them apart), other classes do not, and what guards cannot see into stays keyed
    by identity (a partial)."""
    assert _key(Options(1.0)) == _key(Options(2.0))
    assert _key(Options(1.0)) != _key(OtherOptions(1.0))
    twice = functools.partial(max, 2)
    assert _key(twice) == _key(twice)
    assert _key(twice) != _key(functools.partial(max, 2))


def test_the_model_runs():
    """The forward these guards describe is a real one (its reads are the ones named)."""
    model = Net()
    assert model(torch.ones(2, 4)).shape == (2, 4)


class KeyedByNone(Net):
    def __init__(self) -> None:
        super().__init__()
        self.by_none = {None: Holder(Stage(1.0)), "x": 1}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.by_none[None].inner.k


def test_a_dict_entry_keyed_by_none_is_walked():
    """``_entries`` marks a container's size by its kind, not by a None key."""
    model = KeyedByNone()
    guards, bindings = _guards(model)
    model.by_none[None].inner.k = 4.0
    change = guards.first_change(bindings)
    assert change is not None and "module <root>.by_none[None].inner.k" in change, change


class _Slotted:
    __slots__ = ("scale", "unused")

    def __init__(self, scale: float) -> None:
        self.scale = scale


# code that names 3,000 attributes (a library's): the names the walk intersects with
exec(  # noqa: S102
    "def _reads_many(obj):\n    if obj is None:\n        return 0\n"
    + "".join(f"    _ = obj.name_{i}\n" for i in range(3000)) + "    return 1\n"
)


class _ManySlotted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.knobs = [_Slotted(1.0 + i) for i in range(40)]

    def forward(self, x):  # noqa: ANN001, ANN201
        if x.dim() == 0:  # never: only named
            _reads_many(self)  # noqa: F821
        return self.fc(x) * self.knobs[3].scale


def _many_slotted_step(model, optim, x):  # noqa: ANN001
    model(x).sum().backward()
    optim.step()
    return x


def test_slotted_objects_are_walked_by_their_keys(monkeypatch):
    """The walk by name intersects each object's attributes with the names the walked code
    reads: an object with ``__slots__`` was tested once per name read, through a Python
    mapping (a peft model's capture: 128 million calls, 18 of its 20 minutes); now its few
    keys are, and its guard still sees a change."""
    from spmd_compiler.capture import plain_objects

    reads = []
    real = plain_objects.Attributes.get
    monkeypatch.setattr(plain_objects.Attributes, "get", lambda self, *a: reads.append(1) or real(self, *a))
    model = _ManySlotted()
    args = (model, torch.optim.SGD(model.parameters(), lr=0.1), torch.ones(2, 4))
    bindings = find_bindings(_many_slotted_step, args, {})
    guards = build_guards(_many_slotted_step, bindings, frozenset())
    assert len(reads) < 40 * 20, len(reads)  # a few reads per object and round
    model.knobs[3].scale = 7.0
    change = guards.first_change(bindings)
    assert change is not None and "knobs[3].scale" in change.what


LOADED = 1.0


def _loads_globals(obj, xs):  # noqa: ANN001, ANN202 - every way code loads a global
    scaled = [LOADED * x for x in xs]  # in a comprehension
    pick = lambda: SHOWN  # noqa: E731, F821 - in a lambda (defined or not)

    class Local:
        attr = CLASS_READ  # noqa: F821 - a class body's LOAD_NAME

    return obj.out(scaled), obj.helper.attr, pick, Local


def test_globals_are_the_names_the_code_loads_as_globals():
    """NOTE: [globals by the bytecode]: ``co_names`` names attributes too; only loads
    of globals count (``out``, ``helper``, ``attr`` are attributes here)."""
    from spmd_compiler.capture.code_names import global_names_in

    names = set(global_names_in(_loads_globals.__code__))
    assert {"LOADED", "SHOWN", "CLASS_READ"} <= names
    assert not names & {"out", "helper", "attr"}
