"""``launch`` serialises ``fn`` and ``args`` once and each rank loads its own copy (NOTE:
[each rank its own copy of the arguments] in ``spmd_compiler/runtime/launch.py``): two
loads share no memory with each other nor with the parent's objects, and keep the links
inside the arguments (views of one tensor, an optimizer's parameters). No processes here;
tests/dist/test_launch_args_gloo.py runs it on real ranks."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn

from spmd_compiler.runtime import launch as launch_module


def _fn(rank: int, world_size: int, *args: object) -> None:
    """A module-level function to send."""


def test_each_load_is_its_own_copy(tmp_path) -> None:
    base = torch.zeros(4, dtype=torch.float64)
    model = nn.Linear(2, 2).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    carried = torch.zeros(2)
    launch_module._write_work(str(tmp_path), functools.partial(_fn, carried=carried), (base, base[1:3], model, optim))
    (fn_a, (a, a_view, model_a, optim_a)), (fn_b, (b, _, model_b, _)) = (
        launch_module._read_work(str(tmp_path)) for _ in range(2)
    )
    a.add_(1.0)
    fn_a.keywords["carried"].add_(1.0)
    model_a.weight.data.add_(1.0)
    assert b.tolist() == [0.0] * 4 and base.tolist() == [0.0] * 4
    assert fn_b.keywords["carried"].tolist() == [0.0, 0.0] and carried.tolist() == [0.0, 0.0]
    assert torch.equal(model_b.weight, model.weight)
    assert a_view.tolist() == [1.0, 1.0], "a view of an argument is no longer a view of it"
    assert optim_a.param_groups[0]["params"][0] is model_a.weight


def test_args_that_cannot_be_sent_fail_in_the_parent(tmp_path) -> None:
    with pytest.raises(TypeError, match="args cannot be sent"):
        launch_module._write_work(str(tmp_path), _fn, (lambda: 0,))


def test_a_forced_weights_only_load_still_reads_the_work(tmp_path, monkeypatch) -> None:
    """TORCH_FORCE_WEIGHTS_ONLY_LOAD=1 overrides ``weights_only=False``: every rank failed
    to load its function (a review); the variable is set again after the load."""
    launch_module._write_work(str(tmp_path), _fn, (torch.ones(2), {"k": 1}))
    monkeypatch.setenv("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "1")
    fn, (t, d) = launch_module._read_work(str(tmp_path))
    assert fn is _fn and t.tolist() == [1.0, 1.0] and d == {"k": 1}
    import os

    assert os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] == "1"
