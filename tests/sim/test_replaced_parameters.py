"""Parameters held from before the first compiled call (NOTE: [replaced parameters held
outside the step] in ``spmd_compiler/capture/bindings.py``).

The first compiled call replaces the model's parameters by DTensor parameters. A list of
the old ones handed to ``clip_grad_norm_`` between a compiled backward and a compiled
update clipped nothing, and an optimizer no compiled call was given, stepped eagerly,
updated nothing: both silently. Now the clip acts on the gradients the program left and
the eager update is refused naming the parameter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_states, full_state


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)).double()
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _backward(model, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    return loss


def _update(model, optim):  # noqa: ANN001, ANN202
    optim.step()
    optim.zero_grad()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
            for _ in range(3)]


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_a_clip_on_parameters_listed_before_the_first_call_clips(mode: str) -> None:
    model, optim = _build()
    reference, ref_optim = copy.deepcopy(model), None
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())  # before the first compiled call
    backward = sc.compile(DataParallel(mode))(_backward)
    update = sc.compile(DataParallel(mode))(_update)
    with sc.simulate(2) as sim:
        for x, y in _batches():
            backward(model, x, y)
            norm = torch.nn.utils.clip_grad_norm_(params, 1e-3)
            update(model, optim)
            _backward(reference, x, y)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e-3)
            _update(reference, ref_optim)
            assert torch.allclose(torch.as_tensor(norm.full_tensor() if hasattr(norm, "full_tensor") else norm),
                                  ref_norm, rtol=1e-10)
        diffs = compare_states(full_state(model, optim, sim), full_state(reference, ref_optim, None))
    assert max(diffs.values()) < 1e-10, max(diffs.items(), key=lambda kv: kv[1])


def test_an_optimizer_stepped_eagerly_on_replaced_parameters_is_refused() -> None:
    model, optim = _build()
    backward = sc.compile(DataParallel("replicate"))(_backward)
    (x, y), *_ = _batches()
    with sc.simulate(2):
        backward(model, x, y)
        with pytest.raises(sc.SPMDRuntimeError, match="parameter '0.weight' was replaced"):
            optim.step()
        optim.zero_grad()  # reaches the gradients the program left
        assert all(p.grad is None for p in model.parameters())
        # metadata still answers (counting parameters); a setter does not
        stale = optim.param_groups[0]["params"]
        assert sum(p.numel() for p in stale) == 212 and stale[0].shape == (16, 8)
        with pytest.raises(sc.SPMDRuntimeError, match="was replaced"):
            stale[0].requires_grad_(False)


def test_an_optimizer_held_through_an_evaluation_first_still_trains() -> None:
    """A compiled evaluation before the first train step replaces the parameters; the
    optimizer, cleared eagerly and then given to the train step, follows them."""
    model, optim = _build()
    reference = copy.deepcopy(model)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    def evaluate(model, x):  # noqa: ANN001, ANN202
        with torch.no_grad():
            return model(x).sum()

    def train(model, optim, x, y):  # noqa: ANN001, ANN202
        loss = _backward(model, x, y)
        _update(model, optim)
        return loss

    compiled_eval = sc.compile(DataParallel("replicate"))(evaluate)
    compiled_train = sc.compile(DataParallel("replicate"))(train)
    with sc.simulate(2) as sim:
        for x, y in _batches():
            compiled_eval(model, x)
            optim.zero_grad()
            compiled_train(model, optim, x, y)
            train(reference, ref_optim, x, y)
        diffs = compare_states(full_state(model, optim, sim), full_state(reference, ref_optim, None))
    assert max(diffs.values()) < 1e-10
