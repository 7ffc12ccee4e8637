"""A copy of placed parameters made between calls (an EWC / L2-SP anchor) read by the
next step: refused with the place it was read from and what to do (NOTE: [DTensors read
from outside the arguments]); before the sixty-fourth session DTensor's raw "aten.sub.
Tensor got mixed torch.Tensor and DTensor". The hint's two ways (buffers of a module
passed to the step; a plain full copy, ``sc.checkpoint.full_state_dict`` on simulated
ranks) match eager, float64."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step


class _Anchor:
    def __init__(self, old: dict[str, torch.Tensor]) -> None:
        self.old = old

    def penalty(self, model: nn.Module) -> torch.Tensor:
        return sum(((p - self.old[n]) ** 2).sum() for n, p in model.named_parameters())  # type: ignore[return-value]


def _anchored_step(model, anchor, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    (loss + 5 * anchor.penalty(model)).backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


class _Buffers(nn.Module):
    """The hint's first way: the copy as buffers of a module passed to the step."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.names = [n for n, _ in model.named_parameters()]
        for i, (_, p) in enumerate(model.named_parameters()):
            self.register_buffer(f"old{i}", p.detach().clone())

    def penalty(self, model: nn.Module) -> torch.Tensor:
        return _Anchor({n: getattr(self, f"old{i}") for i, n in enumerate(self.names)}).penalty(model)


def _run(mode: str | None, snapshot, anchor_of=_Anchor) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrap = (lambda f: f) if mode is None else sc.compile(make_mode(mode))
    first, second = wrap(classification_train_step), wrap(_anchored_step)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
               for _ in range(4)]
    first(model, opt, *batches[0])
    first(model, opt, *batches[1])
    anchor = anchor_of(snapshot(model))  # between calls
    return [float(second(model, anchor, opt, x, y)) for x, y in batches[2:]]


def _clones(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_copy_of_placed_parameters_read_by_the_step_is_refused_with_a_hint(mode) -> None:
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        _run(mode, _clones)
    text = str(info.value)
    assert "(_Anchor).old['0.weight'], a DTensor from outside its arguments" in text, text
    assert "full_state_dict" in text and "register_buffer" in text, text
    assert "got mixed" not in text, text


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_the_hints_full_copy_matches_eager(mode) -> None:
    want = _run(None, _clones)
    with sc.simulate(world_size=2):
        got = _run(mode, lambda m: dict(sc.checkpoint.full_state_dict(m)["model"]))
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_the_hints_buffers_match_eager(mode) -> None:
    want = _run(None, _Buffers, anchor_of=lambda a: a)
    with sc.simulate(world_size=2):
        got = _run(mode, _Buffers, anchor_of=lambda a: a)
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12)
