"""The tensor a learning rate is fed as (NOTE: [hyper-parameters without a device sync]
in ``runtime/runner.py``): kept while the value stays, made anew when it changes."""

from __future__ import annotations

import torch

from spmd_compiler.ir.signature import Kind, StateRef
from spmd_compiler.runtime.runner import _hyperparam_tensor


def test_kept_while_the_value_stays_and_renewed_when_it_changes() -> None:
    cache: dict = {}
    lr = StateRef(Kind.HYPERPARAM, key="lr", optimizer=0, group=0)
    first = _hyperparam_tensor(cache, lr, 0.1, torch.device("cpu"))
    assert first.dtype == torch.float64 and first.shape == () and first.item() == 0.1
    assert _hyperparam_tensor(cache, lr, 0.1, torch.device("cpu")) is first
    changed = _hyperparam_tensor(cache, lr, 0.05, torch.device("cpu"))
    assert changed is not first and changed.item() == 0.05 and first.item() == 0.1
    other = StateRef(Kind.HYPERPARAM, key="lr", optimizer=0, group=1)
    assert _hyperparam_tensor(cache, other, 0.05, torch.device("cpu")) is not changed


def test_without_a_cache_every_call_makes_a_tensor() -> None:
    lr = StateRef(Kind.HYPERPARAM, key="lr", optimizer=0, group=0)
    a = _hyperparam_tensor(None, lr, 1e-3, torch.device("cpu"))
    assert _hyperparam_tensor(None, lr, 1e-3, torch.device("cpu")) is not a
