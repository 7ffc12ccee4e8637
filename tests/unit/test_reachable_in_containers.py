"""``reachable_by_name`` searches the dicts, lists and tuples a step reaches by name for
optimizers and schedulers (NOTE: [optimizers held in containers] in
``spmd_compiler/capture/code_names.py``), but not for modules; ``optimizer_not_passed``
names the optimizer whose method the running code is inside (NOTE: [optimizers the step
was not given])."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from spmd_compiler.capture.code_names import (
    _CONTAINER_ENTRIES,
    held_in_containers,
    reachable_by_name,
)
from spmd_compiler.capture.optimizers_not_passed import OptimizerNotPassed, optimizer_not_passed


def _optimizer() -> torch.optim.Optimizer:
    return torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)


OPTIMIZERS: dict[str, Any] = {}


def global_step() -> None:
    OPTIMIZERS["a"].step()


class Trainer:
    def __init__(self) -> None:
        self.model = {"net": nn.Linear(2, 2)}
        self.optimizer = {"g": _optimizer(), "d": [_optimizer(), (_optimizer(),)]}
        self.plain = _optimizer()

    def step(self) -> None:
        self.optimizer["g"].step()


def test_held_in_containers_searches_nested_dicts_lists_and_tuples_in_order():
    a, b, c = _optimizer(), _optimizer(), _optimizer()
    held = {"x": [a, {"y": b}], "z": c, "n": 3, "s": "text"}  # b: 3 containers deep
    assert held_in_containers(held, torch.optim.Optimizer) == [a, b, c]
    assert held_in_containers(a, torch.optim.Optimizer) == [a]
    assert held_in_containers(held, torch.optim.Optimizer, depth=1) == [c]
    assert held_in_containers(held, torch.optim.Optimizer, depth=0) == []
    assert held_in_containers([[[a]]], torch.optim.Optimizer) == [a]
    assert held_in_containers([[[[a]]]], torch.optim.Optimizer) == []  # deeper than 3


def test_the_search_opens_at_most_its_budget_of_entries():
    a, b = _optimizer(), _optimizer()
    assert held_in_containers([a] * _CONTAINER_ENTRIES, torch.optim.Optimizer) == [a] * _CONTAINER_ENTRIES
    assert held_in_containers([a] * (_CONTAINER_ENTRIES + 1), torch.optim.Optimizer) == []
    half = _CONTAINER_ENTRIES // 2
    # the outer list's 2 entries and the first inner list's fit; the second would pass
    assert held_in_containers([[a] * half, [b] * half], torch.optim.Optimizer) == [a] * half
    assert held_in_containers([b, [a] * (_CONTAINER_ENTRIES + 1)], torch.optim.Optimizer) == [b]


def test_the_bound_objects_containers_are_searched_for_optimizers_not_modules():
    trainer = Trainer()
    found = reachable_by_name(trainer.step, [], torch.optim.Optimizer)
    g, (d0, (d1,)) = trainer.optimizer["g"], trainer.optimizer["d"]
    assert found == [g, d0, d1, trainer.plain]
    assert reachable_by_name(trainer.step, [], nn.Module, containers=False) == []
    assert reachable_by_name(trainer.step, [], torch.optim.Optimizer, containers=False) == [trainer.plain]


def test_globals_closures_partials_and_holders_are_searched():
    opt = _optimizer()
    OPTIMIZERS["a"] = opt
    try:
        assert reachable_by_name(global_step, [], torch.optim.Optimizer) == [opt]
    finally:
        OPTIMIZERS.clear()
    inner = _optimizer()
    held = [{"inner": inner}]

    def closure_step() -> None:
        held[0]["inner"].step()

    assert reachable_by_name(closure_step, [], torch.optim.Optimizer) == [inner]

    def bound_step(opts: Any) -> None:
        opts[0].step()

    assert reachable_by_name(functools.partial(bound_step, (inner,)), [], torch.optim.Optimizer) == [inner]

    class Agent:
        def __init__(self) -> None:
            self.optimizers = {"actor": inner}

    def agent_step(agent: Agent) -> None:
        agent.optimizers["actor"].step()

    agent = Agent()
    assert reachable_by_name(agent_step, [agent], torch.optim.Optimizer, holders=[agent]) == [inner]


class _Probing(torch.optim.SGD):
    def probe(self, passed: list[torch.optim.Optimizer]) -> OptimizerNotPassed | None:
        return optimizer_not_passed(passed)


def test_optimizer_not_passed_names_the_innermost_optimizer_and_its_method():
    opt = _Probing(nn.Linear(2, 2).parameters(), lr=0.1)
    found = opt.probe([])
    assert isinstance(found, OptimizerNotPassed)
    assert found.optimizer is opt and found.method == "probe"
    assert opt.probe([opt]) is None
    assert optimizer_not_passed([]) is None  # no optimizer's method is running
