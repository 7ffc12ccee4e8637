"""An optimizer holding a parameter no module passed to the step owns (NOTE: [stray
optimizer parameters]): refused before anything is placed, the message naming the cause
it can read (a meta parameter: the optimizer was built before ``to_empty``; a module
owning another parameter of that shape: a module not passed or a replaced layer, both
named) and saying to build the optimizer after the change."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode


def _step(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _data():  # noqa: ANN202
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_an_optimizer_built_on_the_meta_model_is_refused_naming_to_empty(mode):
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)  # before to_empty: meta parameters
    model.to_empty(device="cpu")
    for sub in model.modules():
        if hasattr(sub, "reset_parameters"):
            sub.reset_parameters()
    before = [p.detach().clone() for p in model.parameters()]
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode(mode))(_step)(model, optim, *_data())
    message = str(info.value)
    assert "on the meta device" in message and "to_empty" in message
    assert "build the optimizer after" in message
    assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing placed
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


def test_a_layer_replaced_after_the_optimizer_is_refused_naming_the_new_one():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model[2] = nn.Linear(16, 4)  # the old optimizer holds the old head
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(_step)(model, optim, *_data())
    message = str(info.value)
    assert "replaced that parameter: they own another of that shape and dtype (2.weight, " \
        "which no optimizer holds)" in message, message
    assert "point it at the new ones" in message


def test_a_module_not_passed_beside_a_layer_of_its_shape_is_not_called_replaced():
    """An optimizer over a Linear(3, 3) that simply was not passed, the model owning its
    own 3x3 layer: the message said the optimizer "may have been built before it
    replaced" that layer (review of f11b842); shapes cannot tell the two apart, so it
    names both causes, the module not passed first."""
    torch.manual_seed(0)
    head = nn.Linear(4, 4)  # updated by the optimizer, not passed to the step
    model = nn.Sequential(nn.Linear(8, 4), nn.Tanh(), nn.Linear(4, 4))
    optim = torch.optim.SGD(list(model[0].parameters()) + list(head.parameters()), lr=0.1)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(_step)(model, optim, *_data())
    message = str(info.value)
    assert "Either a module the optimizer updates was not passed to the step, or the " \
        "optimizer was built before" in message, message
    assert "own another parameter of that shape and dtype (2.weight): the optimizer may " \
        "have been built" not in message, message
    assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing placed


def _temperature_step(model, log_alpha, optim, optim_alpha, x):  # noqa: ANN001, ANN202
    logp = -model(x).pow(2).sum(-1)
    loss = model(x).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()
    if isinstance(log_alpha, nn.Module):
        log_alpha = log_alpha.log_alpha
    loss_alpha = -(log_alpha * (logp.detach() + 1.0)).mean()
    optim_alpha.zero_grad()
    loss_alpha.backward()
    optim_alpha.step()
    return loss.detach(), log_alpha.detach().clone()


@pytest.mark.parametrize("kind", ["parameter", "requires_grad"])
def test_a_learnable_tensor_passed_on_its_own_is_refused_saying_to_hold_it_in_a_module(kind):
    """SAC's log_alpha passed beside the model with its own optimizer (NOTE: [a learnable
    tensor passed on its own]): the hint said only "pass every module whose parameters
    the optimizer updates"; it names the argument and the holder module that works."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    log_alpha = nn.Parameter(torch.zeros(())) if kind == "parameter" else torch.zeros((), requires_grad=True)
    optim, optim_alpha = torch.optim.Adam(model.parameters()), torch.optim.Adam([log_alpha], lr=0.1)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(_temperature_step)(model, log_alpha, optim, optim_alpha, torch.randn(8, 4))
    message = str(info.value)
    assert "optimizer[1].param_groups[0] holds a parameter of shape ()" in message, message
    assert "it is the step's tensor argument `log_alpha`" in message, message
    assert "holder.log_alpha = nn.Parameter(...)" in message, message
    assert float(log_alpha.detach()) == 0.0


def test_a_learnable_tensor_held_in_a_module_matches_eager():
    """The fix the refusal names works: the holder module compiles and matches eager."""
    def build():  # noqa: ANN202
        torch.manual_seed(0)
        model = nn.Linear(4, 2).double()
        holder = nn.Module()
        holder.log_alpha = nn.Parameter(torch.zeros((), dtype=torch.float64))
        return model, holder, torch.optim.Adam(model.parameters()), torch.optim.Adam(holder.parameters(), lr=0.1)

    gen = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 4, generator=gen, dtype=torch.float64) for _ in range(3)]
    eager = build()
    expected = [_temperature_step(*eager, x)[1] for x in batches]
    compiled = build()
    with sc.simulate(world_size=2):
        step = sc.compile(make_mode("ddp"))(_temperature_step)
        got = [step(*compiled, x)[1] for x in batches]
    for e, g in zip(expected, got, strict=True):
        assert abs(float(e) - float(g)) < 1e-12, (expected, got)
    assert abs(float(expected[-1])) > 0.01  # the temperature moved
