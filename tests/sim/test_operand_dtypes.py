"""Operands of different dtypes into a matrix product or a convolution (NOTE: [operands of
one dtype] in ``spmd_compiler/capture/dtype_agreement.py``): a float32 batch into a float64
model is refused at capture, as eager refuses it, naming the op, the module and the line,
with the model and optimizer untouched; the right dtype then trains as eager does."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_states, full_state


def step(model, optim, x, y):
    loss = F.cross_entropy(model(x).flatten(1), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_batch_of_another_dtype_is_refused_at_capture(style: str, layer: str) -> None:
    torch.manual_seed(0)
    model = (nn.Sequential(nn.Linear(6, 3)) if layer == "linear" else nn.Sequential(nn.Conv1d(6, 3, 1))).double()
    eager = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(4, 6) if layer == "linear" else torch.randn(4, 6, 1)
    y = torch.randint(0, 3, (4,))
    with pytest.raises(RuntimeError):
        eager(x)  # eager refuses it too
    compiled = sc.compile(parallel_mode=DataParallel(style))(step)
    before = full_state(model, optim, None)
    with sc.simulate(world_size=2):
        with pytest.raises(SPMDCompileError) as caught:
            compiled(model, optim, x, y)
        message = str(caught.value)
        # a convolution's fake kernel checks dtypes itself: the capture names its failure
        assert ("takes operands of different dtypes (torch.float" if layer == "linear"
                else "Capturing the train step failed") in message, message
        assert "module:      0" in message and "test_operand_dtypes.py" in message, message
        assert all(type(p) is nn.Parameter for p in model.parameters()) and not optim.state
        assert compare_states(full_state(model, optim, None), before) == dict.fromkeys(before, 0.0)
        compiled(model, optim, x.double(), y)
        got = full_state(model, optim, None)
    eager_optim = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    step(eager, eager_optim, x.double(), y)
    errors = compare_states(got, full_state(eager, eager_optim, None))
    assert max(errors.values()) < 1e-12, errors
