"""Python state a train step writes, across the traces of one capture and a refusal.

A first call's capture traces the step more than once: the ways of an ``if`` on a tensor
value, and, where the step changed a Python value, once more on the changed values to
tell a set-up from a counter (NOTE: [a step that changes what it reads] in
``capture/guards.py``). Found by the sixty-second session's probers:
- a cache grown in ``forward`` and guarded by a Python number set beside it (an older
  transformers rotary embedding, ``if seq_len > self.max_seq_len_cached:`` rebuild
  ``cos_cached``; nanoGPT-style lazy masks) failed its first call, which eager runs: the
  trace on the changed values read the old cache ("Attempting to broadcast a dimension
  of length 4", "'NoneType' object is not subscriptable"; NOTE: [a probe on half the
  changed state] in ``api.py``), and a buffer registered as ``None`` and filled in the
  step failed with "KeyError: 'cos_cached'" (NOTE: [buffers the step makes] in
  ``capture/kept_tensors.py``);
- an attribute the step made on a torch module (``model.calls = getattr(model, "calls",
  0) + 1``) stayed after the refused first call (``model.calls`` 2), and a one-time
  set-up made that way ran the first call 10x off eager beside an ``if`` on a tensor
  value, silently (NOTE: [attributes a step makes on a counted object] in
  ``capture/guards.py``).
Each runs float64 on 2 simulated ranks under ddp and fsdp, against eager on the global
batch.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import relative_difference

TOLERANCE = 1e-12
STYLES = ["replicate", "fully_shard"]


class RotaryCache(nn.Module):
    """A cache of ``cos`` rows grown when a longer sequence comes, guarded by a Python int
    set beside it (``held``: "buffer", registered small in ``__init__`` and registered
    again larger, as older transformers did; "none_buffer", a buffer registered as
    ``None``; "attribute", a plain attribute ``None``)."""

    def __init__(self, held: str) -> None:
        super().__init__()
        self.held = held
        self.lin = nn.Linear(8, 8, dtype=torch.float64)
        if held == "buffer":
            self.register_buffer("cos_cached", torch.arange(4.0, dtype=torch.float64)[:, None].cos(), persistent=False)
        elif held == "none_buffer":
            self.register_buffer("cos_cached", None, persistent=False)
        else:
            self.cos_cached = None
        self.max_cached = 4 if held == "buffer" else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.max_cached:
            cos = torch.arange(t, dtype=x.dtype)[:, None].cos()
            if self.held == "buffer":
                self.register_buffer("cos_cached", cos, persistent=False)
            else:
                self.cos_cached = cos
            self.max_cached = t
        return self.lin(x * self.cos_cached[:t])


def rotary_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def _batches(lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        (torch.randn(4, t, 8, generator=gen, dtype=torch.float64),
         torch.randn(4, t, 8, generator=gen, dtype=torch.float64))
        for t in lengths
    ]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("held", ["buffer", "none_buffer", "attribute"])
def test_a_cache_grown_beside_a_python_number_matches_eager(held, style):
    """The three ways of holding the cache, 3 calls of sequences of 16 (the cache held 4
    rows, or none): losses, parameters and the cache as eager's; the cache grows once,
    on the first call (its program stores it), and the second call is captured on what
    it stored. Before: the first call was refused (see the module docstring)."""
    torch.manual_seed(0)
    model = RotaryCache(held)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=DataParallel(style))(rotary_step)
    with sc.simulate(world_size=2):
        for i, (x, y) in enumerate(_batches([16, 16, 16])):
            loss = compiled(model, opt, x, y)
            expected = rotary_step(reference, reference_opt, x, y)
            assert relative_difference(loss, expected) < TOLERANCE, (i, loss, expected)
        for name, p in reference.named_parameters():
            assert relative_difference(_full(model.get_parameter(name)), p) < TOLERANCE, name
        assert model.max_cached == 16
        cache = _full(model.cos_cached)
        assert not isinstance(cache, torch._subclasses.FakeTensor)
        assert torch.equal(cache, reference.cos_cached)
        assert ("cos_cached" in dict(model.named_buffers())) == (held != "attribute")
    assert compiled.compile_count == 2  # the first call's program, then the grown cache's


def test_a_cache_grown_twice_matches_eager():
    """Sequences of 8, 16, then 12 (no growth: a slice of the cache of 16)."""
    torch.manual_seed(0)
    model = RotaryCache("none_buffer")
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=DataParallel("fully_shard"))(rotary_step)
    with sc.simulate(world_size=2):
        for x, y in _batches([8, 16, 12]):
            assert relative_difference(compiled(model, opt, x, y), rotary_step(reference, reference_opt, x, y)) < TOLERANCE
        for name, p in reference.named_parameters():
            assert relative_difference(_full(model.get_parameter(name)), p) < TOLERANCE, name
        assert model.max_cached == 16 and tuple(model.cos_cached.shape) == (16, 1)


class DroppedCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("cache", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x * self.cache)
        self.cache = None  # rebuilt by some later call, say
        return out


def test_a_buffer_the_step_sets_to_none_is_refused_untouched():
    """The program holds the buffer as its state and would write a tensor back where
    eager leaves ``None``: refused, naming the buffer and the step's line."""
    model = DroppedCache()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model.lin.weight.detach().clone()
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(rotary_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="sets buffer cache of the model to None"):
        compiled(model, opt, torch.randn(4, 8), torch.randn(4, 8))
    assert torch.equal(model.cache, torch.ones(8)) and not isinstance(model.cache, torch._subclasses.FakeTensor)
    assert torch.equal(model.lin.weight, weight)


def counting_step(model, opt, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    model.calls = getattr(model, "calls", 0) + 1
    if model.calls % 2 == 0:
        opt.step()
        opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("style", STYLES)
def test_a_refused_counter_made_on_a_torch_module_is_removed(style):
    """``model.calls`` on an ``nn.Linear`` (its ``__dict__`` guarded whole, so the name
    is not guarded as absent): refused, and the refusal says what to do; the model is
    left without ``calls`` (before: ``calls`` 2 after the refused call)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    weight = model.weight.detach().clone()
    compiled = sc.compile(parallel_mode=DataParallel(style))(counting_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, opt, torch.randn(8, 8), torch.randint(0, 4, (8,)))
    message = str(info.value)
    assert "changes a Python value every time it runs: module <root>.calls was 1, now 2" in message
    assert "register_buffer('calls'" in message and "bool argument" in message, message
    assert not hasattr(model, "calls")
    assert torch.equal(model.weight, weight) and model.weight.grad is None


def warm_up_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    if not hasattr(model, "warm"):  # a one-time set-up made as a new attribute
        loss = loss * 0.1
        model.warm = True
    if loss > 100:  # an `if` on a tensor value: the capture traces both ways
        loss = loss * 0.5
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("style", STYLES)
def test_each_trace_starts_without_the_attribute_an_earlier_one_made(run_parity, style):
    """The second trace of the first call's capture found the ``model.warm`` the first
    made and traced the path without the set-up: the first loss 10x eager's (0.891
    against 0.0891), silently."""
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(4, 8, generator=gen, dtype=torch.float64),
                torch.randn(4, 8, generator=gen, dtype=torch.float64)) for _ in range(3)]
    result = run_parity(
        lambda: nn.Linear(8, 8, dtype=torch.float64), lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
        2, batches, step=warm_up_step, mode=DataParallel(style),
    )
    result.assert_close(TOLERANCE)
    assert result.model.warm is True


def cache_and_counting_step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    model.calls = getattr(model, "calls", 0) + 1
    opt.step()
    opt.zero_grad()
    return loss.detach()


def test_a_counter_beside_a_grown_cache_is_refused_on_the_second_call():
    """The trace on the changed values fails on the old cache, so it cannot tell the
    counter from a set-up (NOTE: [a probe on half the changed state]): the first call
    runs as eager, and the second, captured on what the first stored, is refused and
    leaves the model as the first call left it."""
    torch.manual_seed(0)
    model = RotaryCache("none_buffer")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=DataParallel("fully_shard"))(cache_and_counting_step)
    (x, y), (x2, y2) = _batches([16, 16])
    with sc.simulate(world_size=2):
        compiled(model, opt, x, y)
        assert model.calls == 1 and model.max_cached == 16
        with pytest.raises(SPMDCompileError, match=r"changes a Python value every time it runs: module <root>\.calls was 2, now 3"):
            compiled(model, opt, x2, y2)
    assert model.calls == 1 and tuple(model.cos_cached.shape) == (16, 1)
    assert not isinstance(model.cos_cached, torch._subclasses.FakeTensor)
