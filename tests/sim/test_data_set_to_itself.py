"""``tensor.data = value`` inside the step where ``value`` is the tensor's own ``.data``
(NOTE: [data replaced inside the step]): the assignment changes nothing and compiles;
the in-place op before it is recorded as ``p.data.mul_(k)`` is. ``p.grad.data *= k``
(center-loss recipes), ``p.data -= lr * p.grad`` (hand-written SGD), ``buf.data += v``
and ``w.data = w.data.to(device)`` (pytorch-metric-learning's margin losses) match the
undecorated step on one device, on the global batch (float64, within 1e-12): losses,
parameters, buffers and gradients, 3 calls, ddp and fsdp on 2 simulated ranks. A real
swap (``w.data = w.data.clamp(...)``, a new tensor) stays refused with the line, the
model left as found.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, full_value, relative_difference

TOL = 1e-12
FEATURES, CLASSES = 8, 4


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(FEATURES, 6)
        self.W = nn.Parameter(torch.randn(6, CLASSES))
        self.register_buffer("seen", torch.zeros(CLASSES))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        cos = F.normalize(self.body(x)) @ F.normalize(self.W, dim=0)
        return F.cross_entropy(16 * (cos - 0.3 * F.one_hot(y, CLASSES)), y)


def _grad_scale(model, optim, x, y):  # noqa: ANN001
    optim.zero_grad()
    loss = model(x, y)
    loss.backward()
    model.W.grad.data *= 10.0  # center-loss recipe
    optim.step()  # the gradients stay for the comparison
    return loss.detach()


def _hand_sgd(model, optim, x, y):  # noqa: ANN001
    loss = model(x, y)
    loss.backward()
    for p in model.parameters():
        p.data -= 0.1 * p.grad  # hand-written SGD
        p.grad = None
    return loss.detach()


def _buffer_and_to_device(model, optim, x, y):  # noqa: ANN001
    model.W.data = model.W.data.to(x.device)  # pytorch-metric-learning: a no-op
    model.seen.data += F.one_hot(y, CLASSES).sum(0).to(model.seen.dtype)
    model.seen.data = model.seen.data
    loss = model(x, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, FEATURES, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (8,), generator=gen))
        for _ in range(3)
    ]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("step", [_grad_scale, _hand_sgd, _buffer_and_to_device])
def test_data_set_to_its_own_data_matches_eager(step, mode):
    torch.manual_seed(0)
    model = _Head().double()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(make_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(_batches()):
            loss, expected = compiled(model, optim, x, y), step(reference, ref_optim, x, y)
            assert torch.allclose(loss, expected, rtol=TOL, atol=0), f"step {i}"
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                if q.grad is not None:
                    assert relative_difference(full_value(p.grad, sim), q.grad) < TOL, (i, name)
        differences = compare_models(model, reference, sim)
    assert max(differences.values()) < TOL, differences
    if step is _buffer_and_to_device:
        assert reference.seen.sum() == 24  # the buffer did move


def _clamping_swap(model, optim, x, y):  # noqa: ANN001
    loss = _grad_scale(model, optim, x, y)
    model.W.data = model.W.data.clamp(-0.1, 0.1)  # a new storage: never recorded
    return loss


def _same_storage_other_view(model, optim, x, y):  # noqa: ANN001
    loss = _grad_scale(model, optim, x, y)
    model.seen.data = model.seen.data[:2]  # the same storage, another shape
    return loss


@pytest.mark.parametrize("step", [_clamping_swap, _same_storage_other_view])
def test_a_real_swap_is_still_refused(step):
    torch.manual_seed(0)
    model = _Head().double()
    before = copy.deepcopy(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=r"sets a tensor's \.data") as raised:
        compiled(model, optim, *_batches()[0])
    assert "test_data_set_to_itself.py" in str(raised.value)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name
