"""A tensor read from outside the step's arguments as a Python value (``float(START)``,
``START.item()``, ``x[:, int(START):]``, ``x.narrow(1, START, P)``) is guarded like a
graph constant, so a change between calls (in place, through ``.data``, or the global
rebound) compiles a new program (NOTE: [outside tensors read as Python values]); before,
no guard held it and the first program ran with the old value (2 simulated ranks,
``float``: losses 0.77592, 0.19696, 0.14621 where eager gave 0.77592, 0.05250, 0.01336,
compile_count 1). A step writing such a tensor through ``.data`` or memory it shares is
refused, the tensor left as it was (NOTE: [outside tensors written through shared memory
in the step]); before, ``C.data.add_(1)`` recompiled every call and trained 1.17 off.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models

TOL = 1e-12
P = 4
START = torch.tensor(2)
READ = "float"


def _step(model, optim, x):  # noqa: ANN001
    if READ == "narrow":
        h = x.narrow(1, START, P)
    elif READ == "int":
        h = x[:, int(START):int(START) + P]
    elif READ == "item":
        h = x[:, :P] * START.item()
    else:
        h = x[:, :P] * float(START)
    loss = model(h).pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _change(how: str) -> None:
    global START
    if how == "inplace":
        START.sub_(1)
    elif how == "data":
        START.data.sub_(1)
    else:
        START = START - 1


@pytest.mark.parametrize("read", ["float", "item", "int", "narrow"])
@pytest.mark.parametrize("how", ["inplace", "data", "rebind"])
def test_a_value_read_in_python_is_guarded(read, how):
    global START, READ
    saved = START, READ
    READ = read
    torch.manual_seed(0)
    model = nn.Linear(P, 2).double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = [torch.rand(8, 6, dtype=torch.float64) for _ in range(3)]
    try:
        expected = []
        START = torch.tensor(2)
        for x in batches:
            expected.append(_step(reference, ref_optim, x))
            _change(how)
        START = torch.tensor(2)
        compiled = sc.compile(make_mode("ddp"))(_step)
        with sc.simulate(world_size=2) as sim:
            for x, want in zip(batches, expected):
                loss = compiled(model, optim, x)
                assert torch.allclose(loss, want, rtol=TOL, atol=0), (float(loss), float(want))
                _change(how)
            differences = compare_models(model, reference, sim)
    finally:
        START, READ = saved
    assert max(differences.values()) < TOL, differences
    assert compiled.compile_count == 3


ARR = np.zeros(1)
C = torch.zeros(1)


def _writing_step(form):  # noqa: ANN001
    def step(model, optim, x, y):  # noqa: ANN001
        loss = F.mse_loss(model(x) * (1.0 + C), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if form == "data_add":
            C.data.add_(1)
        elif form == "data_iadd":
            C.data += 1
        elif form == "data_view":
            C.data.view(-1)[0] += 1
        else:
            ARR[0] += 1
        return loss.detach()
    return step


@pytest.mark.parametrize("form", ["data_add", "data_iadd", "data_view", "numpy"])
def test_a_write_through_data_in_the_step_is_refused(form):
    global C
    saved = C
    ARR[:] = 0
    C = torch.from_numpy(ARR) if form == "numpy" else torch.zeros(1)
    version = C._version
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(_writing_step(form))
    try:
        with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="writes in place") as raised:
            compiled(model, optim, torch.randn(8, 8), torch.randn(8, 2))
        assert C.tolist() == [0.0] and C._version == version  # left as found
        assert "a tensor that is neither an argument" in str(raised.value)
    finally:
        C = saved
