"""``find_bindings`` walks the module tree once and ``static_key`` keeps the state dicts it
reads (NOTE: [one walk over the state per call] in ``runtime/runner.py``): the names it
gives, the key's sensitivity and the dicts feeding reads must be what the separate walks
gave."""

from __future__ import annotations

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


def test_memo_keeps_a_state_part_only_while_its_tensors_stay() -> None:
    from spmd_compiler.capture.bindings import StateKeyMemo

    model = _Tied()
    opt = torch.optim.AdamW(model.parameters())
    model.head(model.shared(model.embed(torch.tensor([1, 2])))).sum().backward()
    opt.step()
    memo = StateKeyMemo()
    first = _bindings(model, opt).static_key(memo)
    assert first == _bindings(model, opt).static_key()  # the memo changes no key
    state = opt.state[model.shared.weight]
    memo.start()
    assert memo.get(state) is not None  # kept: the same tensors
    memo.start()  # a walk that did not meet it: dropped from the memo
    memo.start()
    assert memo.get(state) is None
    _bindings(model, opt).static_key(memo)
    # a state tensor replaced by one of another shape under the same key: read afresh
    state["exp_avg"] = torch.zeros(3)
    changed = _bindings(model, opt).static_key(memo)
    assert changed != first and changed == _bindings(model, opt).static_key()
    # a key added (a new kind of state): read afresh
    state["extra"] = torch.zeros(())
    assert _bindings(model, opt).static_key(memo) == _bindings(model, opt).static_key() != changed
