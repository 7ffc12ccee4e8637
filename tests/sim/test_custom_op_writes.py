"""A user's ``torch.library.custom_op`` that writes its arguments (``mutates_args``) is
refused at capture naming the op and the line, the model left as it was: torch's
functionalization raised its own RuntimeError about "alias annotations" before."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.tools.demo.steps import classification_train_step


@torch.library.custom_op("spmd_test_writes::track_absmax", mutates_args=("buf",))
def track_absmax(x: torch.Tensor, buf: torch.Tensor) -> None:
    buf.copy_(torch.maximum(buf, x.detach().abs().amax(dim=0)))


@track_absmax.register_fake
def _(x: torch.Tensor, buf: torch.Tensor) -> None:
    return None


class _Tracked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)
        self.register_buffer("amax", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        track_absmax(h, self.amax)
        return self.b(torch.tanh(h))


def test_a_custom_op_writing_its_argument_is_refused_by_name():
    model = _Tracked()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile()(classification_train_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as raised:
        step(model, optim, torch.randn(4, 8), torch.randint(0, 4, (4,)))
    text = str(raised.value)
    assert "spmd_test_writes::track_absmax writes its argument(s) buf in place" in text
    assert "mutates_args=()" in text and "steps.py:17" in text  # the train step's line
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
