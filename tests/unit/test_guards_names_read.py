"""Guards on the attributes the code names, of the user's objects (no tracing).

NOTE: [guards on the names the code reads] in ``capture/guards.py``. Before it, every
entry of a module or object the step holds was a guard down to two levels: a counter
the training loop bumps on its trainer or model (``trainer.global_step += 1``), which
the step never reads, compiled a new program on every call. Now an attribute of a
user's object is guarded where some code the step runs names it; the cases below check
both sides: what no code reads changes freely, and what code reads in the ways Python
hides (``super().forward``, a decorated forward, ``__call__``, a property, a hook,
``vars``, a class the step constructs) is still seen.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from spmd_compiler.capture.bindings import find_bindings
from spmd_compiler.capture.guards import build_guards

OFFSET = 0.0


class Trainer:
    def __init__(self) -> None:
        self.global_step = 0
        self.history: list[float] = []
        self.clip = 1.0

    def train_step(self, model, optim, x):  # noqa: ANN001
        loss = model(x).sum() * self.clip
        loss.backward()
        optim.step()
        return loss


class Scorer:
    def __init__(self) -> None:
        self.alpha = 2.0

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.alpha  # ``alpha`` is named here only


class Base(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.base_gain = 1.0  # read by Base.forward, reached through super()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.base_gain


def scaled(forward):  # noqa: ANN001, ANN201 - a decorator of the user's
    @functools.wraps(forward)
    def wrapper(self, x):  # noqa: ANN001, ANN202
        return forward(self, x)

    return wrapper


class Net(Base):
    def __init__(self) -> None:
        super().__init__()
        self.scorer = Scorer()
        self._shift = 0.5
        self.floor_value = 0.0
        self.seen = 0  # bumped by the loop, read by nothing the step runs
        self.log: dict[str, float] = {}

    @property
    def shift(self) -> float:
        return self._shift + OFFSET

    @scaled
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scorer(super().forward(x)) + self.shift + self._floor()

    @torch.no_grad()  # torch's decorator: its wrapper's code is torch's
    def _floor(self) -> float:
        return self.floor_value


def step(model, optim, x):  # noqa: ANN001
    loss = model(x).sum()
    loss.backward()
    optim.step()
    return loss


def _guards(model: nn.Module, func=step, *extra):  # noqa: ANN001
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    args = (model, optim, torch.ones(2, 4), *extra)
    bindings = find_bindings(func, args, {})
    guards = build_guards(func, bindings, frozenset())
    assert guards.first_change(bindings) is None
    return guards, bindings


def test_what_no_code_reads_changes_freely():
    model = Net()
    trainer = Trainer()
    guards, bindings = _guards(model, trainer.train_step)
    for _ in range(3):
        trainer.global_step += 1
        trainer.history.append(1.0)
        model.seen += 4
        model.log["loss"] = float(trainer.global_step)
    assert guards.first_change(bindings) is None
    trainer.clip = 0.5  # the step reads this one
    assert guards.first_change(bindings) == "Trainer.clip was 1.0, now 0.5"


def test_an_attribute_added_later_is_seen():
    """It may shadow a class attribute or answer a ``getattr`` with a default."""
    model = Net()
    guards, bindings = _guards(model)
    model.late = 1.0
    assert guards.first_change(bindings).startswith("the number of attributes of module <root>")


def test_reads_python_hides_are_guarded():
    cases = {
        "super().forward": (lambda m: setattr(m, "base_gain", 3.0), "module <root>.base_gain"),
        "__call__ of an object the forward calls": (lambda m: setattr(m.scorer, "alpha", 3.0),
                                                    "module <root>.scorer.alpha"),
        "a property's getter": (lambda m: setattr(m, "_shift", 1.5), "module <root>._shift"),
        "a method torch's decorator wraps": (lambda m: setattr(m, "floor_value", 1.0), "module <root>.floor_value"),
        "a global a property reads": (lambda m: globals().__setitem__("OFFSET", 1.0), "global OFFSET"),
    }
    for label, (mutate, where) in cases.items():
        model = Net()
        guards, bindings = _guards(model)
        try:
            mutate(model)
            change = guards.first_change(bindings)
        finally:
            globals()["OFFSET"] = 0.0
        assert change is not None and change.startswith(where), (label, change)


def test_a_hook_reads_what_it_names():
    model = Net()
    model.hook_gain = 2.0
    model.register_forward_hook(lambda module, args, out: out * module.hook_gain)
    guards, bindings = _guards(model)
    model.hook_gain = 3.0
    assert guards.first_change(bindings) == "module <root>.hook_gain was 2.0, now 3.0"


def test_a_private_hook_setting_is_not_torchs_bookkeeping():
    """``_hook_scale`` is a float, not one of torch's hook dicts: guarded (it was taken
    for torch's bookkeeping by its name); torch's own hook dicts stay out."""
    model = Net()
    model._hook_scale = 2.0
    model.register_forward_hook(lambda module, args, out: out * module._hook_scale)
    guards, bindings = _guards(model)
    assert not any("_forward_hooks" in name or "_is_full_backward_hook" in name for name in guards.names)
    model._hook_scale = 3.0
    assert guards.first_change(bindings) == "module <root>._hook_scale was 2.0, now 3.0"


class ReadsEverything(Net):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = sum(v for v in vars(self.scorer).values() if isinstance(v, float))
        return super().forward(x) * total


def test_code_that_reads_every_attribute_guards_every_entry():
    """``vars(obj)``, ``obj.__dict__``, ``dataclasses.asdict``: names cannot tell."""
    model = ReadsEverything()
    guards, bindings = _guards(model)
    model.seen = 5
    assert guards.first_change(bindings) == "module <root>.seen was 0, now 5"


class Dropout(nn.Dropout):
    """A subclass of torch's module: torch's forward reads ``self.p``."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.tag = 1


def test_a_subclass_of_a_torch_module_is_guarded_whole():
    model = nn.Sequential(nn.Linear(4, 4), Dropout())
    guards, bindings = _guards(model)
    model[1].tag = 2
    assert guards.first_change(bindings) == "module 1.tag was 1, now 2"


class Lookup:
    """Computes attributes: what it reads cannot be told by name."""

    def __init__(self) -> None:
        self.table = {"scale": 2.0}
        self.unnamed = 1

    def __getattr__(self, name: str) -> float:
        try:
            return self.__dict__["table"][name]
        except KeyError:
            raise AttributeError(name) from None


class UsesLookup(Net):
    def __init__(self) -> None:
        super().__init__()
        self.lookup = Lookup()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.lookup.scale


def test_an_object_that_computes_attributes_is_guarded_whole():
    model = UsesLookup()
    guards, bindings = _guards(model)
    model.lookup.unnamed = 2
    assert guards.first_change(bindings) == "module <root>.lookup.unnamed was 1, now 2"


DEFAULT_WEIGHT = 1.0


class Options:
    def __init__(self) -> None:
        self.weight = DEFAULT_WEIGHT


def constructing_step(model, optim, x):  # noqa: ANN001
    loss = model(x).sum() * Options().weight
    loss.backward()
    optim.step()
    return loss


def test_what_the_constructor_of_a_class_the_step_names_reads():
    model = Net()
    guards, bindings = _guards(model, constructing_step)
    globals()["DEFAULT_WEIGHT"] = 2.0
    try:
        change = guards.first_change(bindings)
    finally:
        globals()["DEFAULT_WEIGHT"] = 1.0
    assert change is not None and change.startswith("global DEFAULT_WEIGHT (read by Options.__init__"), change


def test_the_model_runs():
    """The forwards these guards describe are real ones."""
    for model in (Net(), ReadsEverything(), UsesLookup()):
        assert model(torch.ones(2, 4)).shape == (2, 4)


class CountingTrainer(Trainer):
    def __init__(self) -> None:
        super().__init__()
        self.step = 0  # a counter sharing its name with ``optim.step()``


def test_a_name_only_called_as_a_method_guards_no_counter():
    """``optim.step()`` names ``step`` as a method called at once: a scalar ``step``
    would raise if called, so the trainer's counter of that name is no guard."""
    trainer = CountingTrainer()
    guards, bindings = _guards(Net(), trainer.train_step)
    trainer.step += 1
    assert guards.first_change(bindings) is None


class ByHeldName(Net):
    def __init__(self) -> None:
        super().__init__()
        self.source = "gain_value"  # the attribute forward reads, by this string
        self.gain_value = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * getattr(self, self.source)


def test_an_attribute_read_by_a_name_the_object_holds():
    model = ByHeldName()
    guards, bindings = _guards(model)
    model.gain_value = 2.0
    assert guards.first_change(bindings) == "module <root>.gain_value was 1.0, now 2.0"
    assert model(torch.ones(2, 4)).shape == (2, 4)


GAINS = {"main": 1.0}


@functools.cache
def cached_gain(key: str) -> float:
    return GAINS[key] * 2


class CachedGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * cached_gain("main")


def test_a_cached_helper_is_walked():
    """``@functools.cache`` makes a C wrapper, not a function: its code was not
    walked, so ``GAINS`` was unguarded (a new value with ``cache_clear()`` ran the old
    program)."""
    guards, bindings = _guards(CachedGain())
    GAINS["main"] = 3.0
    try:
        change = guards.first_change(bindings)
    finally:
        GAINS["main"] = 1.0
    assert change is not None and change.startswith("global GAINS"), change


# NOTE: [kept numbers only written]: the bytecode rule for a dict the step only writes
metrics: dict = {}


def _helper(d):  # noqa: ANN001, ANN202
    return d


def _only_writes(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return loss


def _writes_in_nested_code(self, loss):  # noqa: ANN001, ANN202
    def record() -> None:
        self.stats["loss"] = loss

    record()


def _local_of_that_name(loss):  # noqa: ANN001, ANN202
    metrics = {"lr": 0.1}  # another variable
    metrics.get("lr")
    return loss


def _adds(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    metrics["loss"] += 1


def _gets(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return metrics.get("lr", 0.1)


def _passes(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    _helper(metrics)


def _binds(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    d = metrics
    return d


def _spreads(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return dict(**metrics)


def _formats(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return f"{metrics}"


def _counts(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return len(metrics)


def _deletes(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    del metrics["loss"]


def _tests(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return "loss" in metrics


def _reads_the_key(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return metrics["loss"]


def _other_key(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    metrics["done"] = True


def _computed_key(loss, k):  # noqa: ANN001, ANN202
    metrics[k] = loss


def _reads_globals(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return globals()["metrics"]


def _reads_in_nested_code(loss):  # noqa: ANN001, ANN202
    metrics["loss"] = loss
    return (lambda: metrics.get("loss"))()


def _closures():  # noqa: ANN202
    metrics: dict = {}

    def writes(loss):  # noqa: ANN001, ANN202
        metrics["loss"] = loss

    def gets(loss):  # noqa: ANN001, ANN202
        metrics["loss"] = loss
        return metrics.get("loss")

    def in_nested(loss):  # noqa: ANN001, ANN202
        return (lambda: metrics.__setitem__("loss", loss))()

    def by_locals(loss):  # noqa: ANN001, ANN202
        metrics["loss"] = loss
        return locals()

    return writes, gets, in_nested, by_locals


def test_a_closure_dict_only_written_by_the_walked_code():
    """The same rule for a dict held by a closure variable (``LOAD_DEREF / LOAD_CONST /
    STORE_SUBSCR``); a global of the name is not it, and ``locals()`` reads it whole."""
    from spmd_compiler.capture.guards import _entries_only_written

    writes, gets, in_nested, by_locals = _closures()
    assert _entries_only_written([writes.__code__], "metrics", {"loss"}, cell=True)
    assert not _entries_only_written([_only_writes.__code__], "metrics", {"loss"}, cell=True)
    for fn in (gets, in_nested, by_locals):
        assert not _entries_only_written([fn.__code__], "metrics", {"loss"}, cell=True), fn.__name__


def test_a_dict_only_written_by_the_walked_code():
    """Every instruction naming the dict's global or attribute must load it only to store
    a kept key into it (``LOAD_GLOBAL / LOAD_CONST / STORE_SUBSCR``), in nested code too;
    any other use (``+=``, ``.get``, a call, ``x = d``, ``**``, a format, ``len``, ``del``,
    ``in``, a read of the key, another or a computed key, ``globals()``) is a read."""
    from spmd_compiler.capture.guards import _entries_only_written

    def only(fn, name="metrics"):  # noqa: ANN001, ANN202
        return _entries_only_written([fn.__code__], name, {"loss"})

    assert only(_only_writes)
    assert only(_writes_in_nested_code, "stats")
    assert not only(_local_of_that_name)  # names no global metrics: nothing stored
    assert only(_only_writes) and _entries_only_written(
        [_only_writes.__code__, _local_of_that_name.__code__], "metrics", {"loss"})
    for fn in (_adds, _gets, _passes, _binds, _spreads, _formats, _counts, _deletes, _tests,
               _reads_the_key, _other_key, _computed_key, _reads_globals, _reads_in_nested_code):
        assert not only(fn), fn.__name__
