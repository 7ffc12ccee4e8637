"""A meta-device module read by name as a functional_call template (NOTE: [meta
templates read by name]): torch's model-ensembling recipe trains as on one device, and a
read of the template's own (valueless) tensors is refused naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call, stack_module_state, vmap

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

TOL = 1e-12
MEMBERS = 4


def member() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3)).double()


class Ensemble(nn.Module):
    """The members' parameters stacked (``stack_module_state``), held as parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        stacked, _ = stack_module_state([member() for _ in range(MEMBERS)])
        self.p = nn.ParameterDict({k.replace(".", "_"): nn.Parameter(v.detach().clone()) for k, v in stacked.items()})


def make_step(base: nn.Module):  # noqa: ANN201
    def step(ens, opt, x, y):  # noqa: ANN001, ANN202
        params = {k.replace("_", "."): v for k, v in ens.p.items()}
        logits = vmap(lambda pp, xx: functional_call(base, pp, (xx,)), in_dims=(0, None))(params, x)
        loss = sum(F.cross_entropy(logits[i], y) for i in range(MEMBERS))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    return step


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (8,), generator=g))
            for _ in range(3)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_meta_template_ensemble_matches_one_device(mode):
    """Before: refused, "parameter 1.0.weight is on the meta device ... to_empty"."""
    step = make_step(member().to("meta"))
    reference = Ensemble()
    reference_opt = torch.optim.Adam(reference.parameters(), lr=1e-2)
    want = [step(reference, reference_opt, x, y) for x, y in _batches()]

    model = Ensemble()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        got = [sim.full_tensor(compiled(model, opt, x, y)) for x, y in _batches()]
        state = sc.checkpoint.full_state_dict(model)["model"]
    assert max(float((g - w).abs()) for g, w in zip(got, want)) <= TOL
    for name, p in reference.state_dict().items():
        assert float((state[name] - p).abs().max()) <= TOL, name
    assert compiled.compile_count == 1


def test_a_read_of_the_templates_own_tensors_is_refused_naming_it():
    base = member().to("meta")

    def step(ens, opt, x, y):  # noqa: ANN001, ANN202
        params = {k.replace("_", "."): v for k, v in ens.p.items()}
        del params["2.bias"]  # left to the template: it has no values
        logits = vmap(lambda pp, xx: functional_call(base, pp, (xx,)), in_dims=(0, None))(params, x)
        loss = logits.sum()
        loss.backward()
        opt.step()
        return loss.detach()

    model = Ensemble()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(step)(model, opt, *_batches()[0])
    text = str(info.value)
    assert "parameter 2.bias of the meta-device module closure variable 'base'" in text
    assert "supply every parameter and buffer" in text
    assert all(type(p) is nn.Parameter for p in model.parameters())  # nothing placed


def test_a_meta_model_alone_is_still_refused():
    """NOTE: [state on the meta device]: a step over a meta module and nothing else is a
    model left unmaterialized, not a template."""
    model = member().to("meta")

    def step(x, y):  # noqa: ANN001, ANN202
        return F.cross_entropy(model(x), y)

    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="on the meta device"):
        sc.compile(make_mode("ddp"))(step)(*_batches()[0])
