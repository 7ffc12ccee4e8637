"""A kernel that raises inside the compiled program names its op, graph node, module and
train-step line, and leaves the state as it was (NOTE: [where a program failed] in
``spmd_compiler/runtime/kernel_failures.py``). Before, simulation raised torch's bare
``IndexError: index out of range in self``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_train_step


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_an_index_out_of_range_names_the_lookup_and_keeps_the_state(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(16, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(DataParallel(mode))(classification_train_step)
    x, y = torch.randint(0, 10, (4, 2)), torch.randint(0, 4, (4,))
    with sc.simulate(2):
        step(model, optim, x, y)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        x[3, 1] = 50
        with pytest.raises(sc.SPMDRuntimeError) as info:
            step(model, optim, x, y)
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), before[name]), name
    text = str(info.value)
    assert text.startswith(
        "The compiled step failed at aten.embedding.default (graph node embedding) in "
        "module '0', train step line "
    ), text
    assert "steps.py" in text and "model(x)" in text
    assert "IndexError: index out of range in self" in text
    assert "hold the state of the last completed step" in text
    assert isinstance(info.value.__cause__, IndexError)
