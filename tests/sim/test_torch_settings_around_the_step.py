"""torch's settings around a compiled call that change what its capture traces (NOTE:
[torch settings in the program key] in api.py): the default device, flush-denormal mode,
the attention backends (``sdpa_kernel``) and saved-tensor hooks are part of the program
key, so a call with another value compiles its own program and computes what eager
computes (float64 against the eager step on one device with the global batch). Before,
the first call's program served every later call, silently: a doubling unpack hook baked
into the program or ignored by it (0.23 / 0.25 off), flushed scalars kept (1.8e-11 off),
and a default device or attention backend that fails eagerly ran the old program.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, max_difference

TOL = 1e-12


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4)).double()


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.o = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.q(x).view(x.shape[0], 2, 1, 8)  # (batch, heads, length, dim)
        return self.o(F.scaled_dot_product_attention(h, h, h).reshape(x.shape[0], 16))


def _attention() -> nn.Module:
    torch.manual_seed(0)
    return _Attention().double()


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(8, 16, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen)


def plain_step(model, opt, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def made_tensor_step(model, opt, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x) + torch.zeros(4), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def tiny_scale_step(model, opt, x, y):  # noqa: ANN001
    out = model(x)
    loss = F.cross_entropy(out + out * 1e-310 * 1e300, y)  # a denormal on the way
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@contextlib.contextmanager
def _flush_denormal() -> Iterator[None]:
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def _default_device(device: str) -> Iterator[None]:
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None)


def _doubling_hooks() -> contextlib.AbstractContextManager:
    # a lambda pair written where it is used: new functions on every call
    return torch.autograd.graph.saved_tensors_hooks(
        lambda t: t, lambda t: t * 2 if t.is_floating_point() else t
    )


SETTINGS: dict[str, tuple[Callable, Callable, Callable[[], contextlib.AbstractContextManager], str]] = {
    "flush_denormal": (_mlp, tiny_scale_step, _flush_denormal, "flush-denormal mode"),
    "saved_tensors_hooks": (_mlp, plain_step, _doubling_hooks, "saved-tensor hooks"),
    "sdpa_math": (_attention, plain_step, lambda: sdpa_kernel(SDPBackend.MATH), "attention backends"),
}


@pytest.mark.skipif(not torch.set_flush_denormal(False), reason="no flush-denormal mode on this CPU")
@pytest.mark.parametrize("first", [True, False], ids=["set_first", "set_later"])
@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_a_setting_changed_between_calls_matches_eager(
    setting: str, first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    model_of, fn, around, named = SETTINGS[setting]
    model = model_of()
    reference = copy.deepcopy(model)
    optim, reference_optim = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (model, reference))
    step = sc.compile(make_mode("ddp"))(fn)
    with sc.simulate(world_size=2) as sim, caplog.at_level(logging.INFO, logger="spmd_compiler"):
        for i, on in enumerate((first, not first, first, not first)):
            with around() if on else contextlib.nullcontext():
                loss = step(model, optim, *_batch(i))
                expected = fn(reference, reference_optim, *_batch(i))
            assert float(loss) == pytest.approx(float(expected), rel=TOL, abs=TOL), i
            assert max_difference(
                compare_models(model, reference, sim), compare_optimizers(optim, reference_optim, sim)
            ) < TOL, i
        assert len(step.records) == 2  # one program for each value, both kept
    assert any("recompiling" in r.getMessage() and named in r.getMessage() for r in caplog.records)


def test_save_on_cpu_entered_on_every_call_compiles_once() -> None:
    model = _mlp()
    reference = copy.deepcopy(model)
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = sc.compile(make_mode("ddp"))(plain_step)
    with sc.simulate(world_size=2) as sim:
        for i in range(3):
            with torch.autograd.graph.save_on_cpu():
                step(model, optim, *_batch(i))
                plain_step(reference, reference_optim, *_batch(i))
        assert max_difference(compare_models(model, reference, sim)) < TOL
    assert len(step.records) == 1


def _pack(t: torch.Tensor) -> torch.Tensor:
    return t


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _counting_hooks() -> contextlib.AbstractContextManager:
    seen = [0]  # a new list every call: the hook is keyed by itself

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[0] += 1
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, _unpack)


def test_a_partial_hook_made_every_call_compiles_once() -> None:
    """NOTE: [saved-tensor hooks made every call]: a ``functools.partial`` is keyed by its
    function and arguments; keyed by itself, it compiled a program every call (5 in 5)."""
    model = _mlp()
    reference = copy.deepcopy(model)
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = sc.compile(make_mode("ddp"))(plain_step)
    with sc.simulate(world_size=2) as sim:
        for i in range(3):
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack), functools.partial(_unpack)):
                step(model, optim, *_batch(i))
                plain_step(reference, reference_optim, *_batch(i))
        assert max_difference(compare_models(model, reference, sim)) < TOL
    assert len(step.records) == 1


def test_a_hook_made_every_call_over_a_new_object_is_warned_of(caplog: pytest.LogCaptureFixture) -> None:
    """A hook closing over a new list every call compiles a program every call (what it
    holds may change what it computes); the recompile line shows which object differs
    (before, it read "was mk.<locals>.p, unpack, now mk.<locals>.p, unpack") and the third
    change is warned of, saying to make the hooks once."""
    model = _mlp()
    reference = copy.deepcopy(model)
    optim, reference_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    step = sc.compile(make_mode("ddp"))(plain_step)
    with sc.simulate(world_size=2) as sim, caplog.at_level(logging.INFO, logger="spmd_compiler"):
        for i in range(4):
            with _counting_hooks():
                step(model, optim, *_batch(i))
            plain_step(reference, reference_optim, *_batch(i))
        assert max_difference(compare_models(model, reference, sim)) < TOL
    lines = [r.getMessage() for r in caplog.records if "saved-tensor hooks" in r.getMessage()]
    changes = [line for line in lines if line.startswith("recompiling")]
    assert len(changes) == 3 and all("_counting_hooks.<locals>.pack (the object at 0x" in c for c in changes)
    assert all(c.split(" was ")[1].split(", now ")[0] != c.split(", now ")[1] for c in changes)
    warned = [line for line in lines if "changed on 3 calls" in line]
    assert len(warned) == 1 and "make the hooks once, outside the loop" in warned[0]


@pytest.mark.parametrize(
    "model_of,fn,around,eager_error",
    [
        (_mlp, made_tensor_step, lambda: _default_device("meta"), "meta"),
        (_attention, plain_step, lambda: sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION), "No viable backend"),
    ],
    ids=["default_device_meta", "sdpa_efficient_on_cpu"],
)
def test_a_setting_eager_fails_under_fails_after_a_first_program(
    model_of: Callable, fn: Callable, around: Callable, eager_error: str
) -> None:
    """After a call without it, a call under a setting the eager step fails under is
    captured again and fails as eager does, the model and optimizer left as they were;
    before, the first program ran on."""
    model = model_of()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(make_mode("ddp"))(fn)
    eager, batch = copy.deepcopy(model), _batch(1)
    with around(), pytest.raises(RuntimeError, match=eager_error):
        fn(eager, torch.optim.SGD(eager.parameters(), lr=0.1), *batch)
    with sc.simulate(world_size=2) as sim:
        step(model, optim, *_batch(0))
        before_model, before_optim = copy.deepcopy(model), copy.deepcopy(optim)
        with around(), pytest.raises(SPMDCompileError, match=eager_error):
            step(model, optim, *batch)
        assert max_difference(
            compare_models(model, before_model, sim), compare_optimizers(optim, before_optim, sim)
        ) == 0.0
        step(model, optim, *batch)  # without it again: the first program
        assert len(step.records) == 1
