"""Metrics a step appends to lists in nested dicts (NOTE: [metrics kept in nested dicts]).

TRL's ``self._stored_metrics[train_eval][key].append(value.item())`` on
``defaultdict(lambda: defaultdict(list))`` was refused until the sixty-sixth session as
keeping "a traced tensor" (the ``.item()`` float) in "a new defaultdict"; a dict of dicts
of lists built before the first call as "deeper than the compiled step looks". Now the
stored structure after 3 calls equals eager's (keys, order, container types, float64
values within 1e-12), on 2 simulated ranks, ddp and fsdp; a step that reads such a list
is refused, and a container the runtime cannot make again is refused naming what is
stored and where, the object left as the call found it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-12


class _Trainer:
    """A trainer whose ``step`` stores metrics as ``store`` says."""

    def __init__(self, store: str) -> None:
        torch.manual_seed(0)
        self.model = nn.Linear(8, 1).double()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.store = store
        if store == "one_level":
            self.metrics: Any = defaultdict(list)
        elif store == "prebuilt":
            self.metrics = {"train": {"loss": [], "w": []}}
        else:
            self.metrics = defaultdict(lambda: defaultdict(list))

    def update(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = F.mse_loss(self.model(x).squeeze(-1), y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return loss.detach()

    def store_metrics(self, metrics: dict[str, float], train_eval: str) -> None:  # TRL's
        for key, value in metrics.items():
            self.metrics[train_eval][key].append(value)


# One class per way of storing: the bytecode check of the reads (NOTE: [metrics kept in
# nested dicts]) takes ``self.metrics`` subscripted to another depth in the same class
# for a read.
class _Trl(_Trainer):
    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        loss = self.update(x, y)
        train_eval = "train" if train else "eval"
        self.store_metrics({"loss": loss.item(), "w": self.model.weight.sum().item()}, train_eval)
        return loss


class _ConstantKeys(_Trainer):
    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        loss = self.update(x, y)
        self.metrics["train"]["loss"].append(loss.mean().item())
        self.metrics["train"]["w"].append(self.model.weight.sum().item())
        return loss


class _Tensors(_Trainer):
    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        loss = self.update(x, y)
        self.metrics["train"]["loss"].append(loss)
        return loss


class _OneLevel(_Trainer):
    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        loss = self.update(x, y)
        self.metrics["loss"].append(loss.item())
        return loss


_STORES = {"trl": _Trl, "constant_keys": _ConstantKeys, "tensors": _Tensors, "one_level": _OneLevel,
           "prebuilt": _ConstantKeys}


def _batches() -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randn(8, generator=gen, dtype=torch.float64), train)
        for train in (True, False, True)
    ]


def _same(a: Any, b: Any) -> bool:
    """The stored structures are equal: keys in order, container types and factories'
    products, float values within ``TOL``, tensors plain and close."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        made = (type(a.default_factory()), getattr(a.default_factory(), "default_factory", None)) \
            if isinstance(a, defaultdict) else None
        if made != ((type(b.default_factory()), getattr(b.default_factory(), "default_factory", None))
                    if isinstance(b, defaultdict) else None):
            return False
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor):
        return type(a) is torch.Tensor and torch.allclose(a, b, rtol=TOL, atol=TOL)
    return abs(a - b) <= TOL


def _run(store: str, mode: str) -> tuple[_Trainer, _Trainer, Any]:
    eager, trainer = _STORES[store](store), _STORES[store](store)
    step = sc.compile(make_mode(mode))(trainer.step)
    with sc.simulate(world_size=2) as sim:
        for x, y, train in _batches():
            assert torch.allclose(step(x, y, train), eager.step(x, y, train), rtol=TOL, atol=TOL)
        diff = max((sim.full_tensor(p) - q).abs().max().item()
                   for p, q in zip(trainer.model.parameters(), eager.model.parameters()))
    return trainer, eager, diff


@pytest.mark.parametrize(("store", "mode"), [
    ("trl", "ddp"), ("trl", "fsdp"), ("constant_keys", "fsdp"), ("tensors", "ddp"),
    ("one_level", "ddp"), ("prebuilt", "ddp"), ("prebuilt", "fsdp"),
])
def test_metrics_appended_in_nested_dicts_equal_eagers(store, mode):  # noqa: ANN001
    """Before: refused on the first call (the defaultdicts: "a new defaultdict holding a
    traced tensor"; the prebuilt dict: "deeper than the compiled step looks")."""
    trainer, eager, diff = _run(store, mode)
    assert diff <= TOL
    assert _same(trainer.metrics, eager.metrics), (trainer.metrics, eager.metrics)
    expected = {"trl": {"train": 2, "eval": 1}, "one_level": {"loss": 3}}.get(store, {"train": 3})
    assert {k: len(next(iter(v.values())) if isinstance(v, dict) else v) for k, v in trainer.metrics.items()} == expected


class _Reading(_Trl):
    def __init__(self, how: str) -> None:
        super().__init__("trl")
        self.how = how

    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        train_eval = "train" if train else "eval"
        if self.how == "constant":
            seen = len(self.metrics["train"]["constant"])
        else:  # keys in variables, as TRL's own code has them
            key = self.how
            seen = len(self.metrics[train_eval][key])
        loss = self.update(x, y) * (seen + 1)
        self.store_metrics({self.how: loss.item()}, train_eval)
        return loss


@pytest.mark.parametrize(("how", "label"), [("constant", "list"), ("variable", "dict of lists")])
def test_a_step_reading_its_stored_metrics_is_refused_left_as_found(how, label):  # noqa: ANN001
    """With the fix but without the read check, the variable-key read ran on the
    capture's length: the fourth call stored 2.64 where eager stored 5.27."""
    trainer = _Reading(how)
    step = sc.compile(make_mode("ddp"))(trainer.step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as refused:
        step(*_batches()[0])
    message = str(refused.value)
    assert f"reads the {label} it appends to" in message and "_Reading (the step's object).metrics" in message
    assert "lists the step appends to and reads" in message
    assert dict(trainer.metrics) == {}


class _SetDefault(_Trl):
    def __init__(self, store: str) -> None:
        super().__init__(store)
        self.metrics = {}

    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        loss = self.update(x, y)
        self.metrics.setdefault("train", {}).setdefault("loss", []).append(loss.item())
        return loss


class _SetWhole(_Trl):
    def step(self, x: torch.Tensor, y: torch.Tensor, train: bool = True) -> torch.Tensor:
        loss = self.update(x, y)
        self.metrics["train"] = defaultdict(list)  # a new container every call: eager replaces
        self.metrics["train"]["loss"].append(loss)
        return loss


@pytest.mark.parametrize(("how", "what", "calls"), [
    ("setdefault", "a Python number from .item()", 1), ("set_whole", "a tensor", 2),
])
def test_a_container_the_runtime_cannot_remake_is_refused_naming_what_and_where(how, what, calls):  # noqa: ANN001
    """Before: "keeps a traced tensor in ...['train'] (a new dict holding a traced
    tensor)" for the ``.item()`` float, with no hint of the way out. A container set
    whole each call is taken as the factory's on the first call (eager's result), and
    refused on the second, which finds it there."""
    trainer = (_SetDefault if how == "setdefault" else _SetWhole)(how)
    step = sc.compile(make_mode("ddp"))(trainer.step)
    batches = _batches()
    with sc.simulate(world_size=2):
        for x, y, train in batches[: calls - 1]:
            step(x, y, train)
        found = {k: {kk: list(vv) for kk, vv in v.items()} for k, v in trainer.metrics.items()}
        with pytest.raises(SPMDCompileError) as refused:
            step(*batches[calls - 1])
    message = str(refused.value)
    assert f"keeps {what} in {type(trainer).__name__} (the step's object).metrics['train'] (a new " in message
    assert "holding it at ['loss'][0])" in message
    assert "traced tensor" not in message and "metrics kept in nested dicts" in message
    assert "for k, v in metrics.items(): self._stored_metrics['train'][k].append(v)" in message
    assert {k: {kk: list(vv) for kk, vv in v.items()} for k, v in trainer.metrics.items()} == found
    assert all(type(v) is float or type(v) is torch.Tensor for d in found.values() for vv in d.values() for v in vv)
