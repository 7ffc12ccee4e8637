"""``find_bindings`` walks the module tree once and ``static_key`` keeps the state dicts it
reads (NOTE: [one walk over the state per call] in ``runtime/runner.py``): the names it
gives, the key's sensitivity and the dicts feeding reads must be what the separate walks
gave."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from spmd_compiler.capture.bindings import find_bindings


class _Tied(nn.Module):
    """A shared submodule, a tied weight, a buffer and a None parameter slot."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.shared = nn.Linear(4, 4)
        self.blocks = nn.Sequential(self.shared, nn.BatchNorm1d(4), self.shared)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.register_parameter("unused", None)


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    pass


def _bindings(model: nn.Module, opt: torch.optim.Optimizer):
    return find_bindings(_step, (model, opt, torch.zeros(2, 4)), {})


def test_names_match_named_parameters_and_buffers() -> None:
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    b = _bindings(model, opt)
    by_id: dict[int, str] = {}
    expect_params = {}
    for fqn, p in model.named_parameters(remove_duplicate=False):
        expect_params.setdefault(by_id.setdefault(id(p), fqn), p)
    assert list(b.params) == list(expect_params)
    assert all(b.params[n] is p for n, p in expect_params.items())
    assert b.module_params[0] == {
        fqn: by_id[id(p)] for fqn, p in model.named_parameters(remove_duplicate=False)
    }
    assert list(b.buffers) == [fqn for fqn, _ in model.named_buffers()]
    assert set(b.module_buffers[0]) == {fqn for fqn, _ in model.named_buffers(remove_duplicate=False)}


def test_key_sees_a_training_flag_of_a_shared_submodule() -> None:
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    before = _bindings(model, opt).static_key()
    model.blocks[1].eval()
    assert _bindings(model, opt).static_key() != before
    model.blocks[1].train()
    assert _bindings(model, opt).static_key() == before


def test_state_dicts_read_by_the_key_and_looked_up_afresh_when_forgotten() -> None:
    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    loss = model.head(model.shared(model.embed(torch.tensor([1, 2])))).sum()
    loss.backward()
    opt.step()
    b = _bindings(model, opt)
    empty_key = _bindings(model, torch.optim.AdamW(model.parameters())).static_key()
    key = b.static_key()
    assert key != empty_key  # the state's set and shapes are in the key
    name = "shared.weight"
    held = b.optim_state(0, name)
    assert held is opt.state[b.params[name]]
    assert set(held) == {"step", "exp_avg", "exp_avg_sq"}
    # replaced behind the bindings' back (what install_state does on a first call)
    opt.state[b.params[name]] = fresh = {k: v.clone() for k, v in held.items()}
    assert b.optim_state(0, name) is held
    b.forget_state_dicts()
    assert b.optim_state(0, name) is fresh
    # a state tensor of another shape changes the key
    fresh["exp_avg"] = torch.zeros(3)
    assert b.static_key() != key


def _memo_bindings(model: nn.Module, opt: torch.optim.Optimizer, memo):
    return find_bindings(_step, (model, opt, torch.zeros(2, 4)), {}, memo)


def _trained(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model.head(model.shared(model.embed(torch.tensor([1, 2])))).sum().backward()
    opt.step()


def _agrees(model: nn.Module, opt: torch.optim.Optimizer, memo) -> object:
    """The memo's bindings and key are a fresh walk's; returns the memo's bindings."""
    kept, fresh = _memo_bindings(model, opt, memo), _bindings(model, opt)
    assert kept.static_key() == fresh.static_key()
    assert list(kept.params.items()) == list(fresh.params.items())
    assert list(kept.buffers.items()) == list(fresh.buffers.items())
    assert kept.module_params == fresh.module_params
    assert kept.submodules == fresh.submodules
    for (oi, name), state in fresh._state_dicts.items():
        assert kept.optim_state(oi, name) is state
    return kept


def test_walk_memo_is_taken_only_while_every_object_stays() -> None:
    """NOTE: [one walk over the state per call]: each change below makes the next call
    walk afresh (``unchanged`` False) and agree with a fresh walk; the call after it
    takes the memo again."""
    from spmd_compiler.capture.bindings import WalkMemo

    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    _trained(model, opt)
    memo = WalkMemo()

    def settles() -> None:
        assert not _agrees(model, opt, memo).unchanged  # the change: walked afresh
        assert _agrees(model, opt, memo).unchanged  # then kept

    settles()
    model.head.weight = nn.Parameter(torch.zeros(10, 4))  # untied: a new parameter
    opt.param_groups[0]["params"].append(model.head.weight)
    settles()
    model.act = nn.ReLU()  # a submodule added
    settles()
    model.act = nn.Tanh()  # and replaced
    settles()
    model.register_buffer("extra", torch.zeros(3))  # a buffer added
    settles()
    model.extra2 = model._buffers.pop("extra")  # renamed: the same tensor, another key
    model.register_buffer("renamed", model.__dict__.pop("extra2"))
    settles()
    state = opt.state[model.shared.weight]
    state["exp_avg"] = torch.zeros(3)  # a state tensor of another shape
    settles()
    state["extra"] = torch.zeros(())  # a new kind of state
    settles()
    opt.state[model.shared.weight] = dict(state)  # the same tensors in a new dict
    settles()
    model.scale = nn.Parameter(torch.ones(2))  # a parameter in a group of its own
    settles()
    opt.add_param_group({"params": [model.scale], "lr": 0.5})
    settles()
    other = torch.optim.AdamW(model.parameters())  # another optimizer
    assert not _agrees(model, other, memo).unchanged
    assert _agrees(model, other, memo).unchanged


def test_walk_memo_never_keeps_mutable_state() -> None:
    """A state value that is neither a tensor nor an immutable scalar (a list) can change
    in place: every call reads it."""
    from spmd_compiler.capture.bindings import WalkMemo

    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    _trained(model, opt)
    opt.state[model.shared.weight]["history"] = [1]
    memo = WalkMemo()
    for _ in range(3):
        assert not _agrees(model, opt, memo).unchanged
    opt.state[model.shared.weight]["history"].append(2)
    assert not _agrees(model, opt, memo).unchanged


def test_walk_memo_holds_no_optimizer_state() -> None:
    import gc
    import weakref

    from spmd_compiler.capture.bindings import WalkMemo

    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    _trained(model, opt)
    memo = WalkMemo()
    for _ in range(2):
        _memo_bindings(model, opt, memo).static_key()
    held = weakref.ref(opt.state[model.shared.weight]["exp_avg"])
    del opt
    gc.collect()
    assert held() is None


def test_unhashable_arguments_in_the_key() -> None:
    """A NumPy array argument is keyed by its type (its values are a guard); before, the
    key's hash failed with numpy's TypeError. Another unhashable one is refused."""
    import numpy as np

    from spmd_compiler.errors import SPMDCompileError

    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    key = find_bindings(_step, (model, opt, np.array([1.0, 2.0])), {}).static_key()
    hash(key)
    assert "numpy.ndarray" in key
    with pytest.raises(SPMDCompileError, match="argument 2 of the step is a set"):
        find_bindings(_step, (model, opt, {1, 2}), {}).static_key()
