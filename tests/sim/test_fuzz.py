"""Fuzzing: random small models, modes and world sizes against single-device eager.

Every case either matches eager (float64, 3 steps, with or without the opt-in
``cross_iteration_overlap`` pass) or raises SPMDCompileError before touching the model;
never a silent wrong result. ``FUZZ_STATS`` counts the outcomes
(printed with ``pytest -s``).
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel, DTensorExpandMode, TensorParallel
from spmd_compiler.parity import compare_models, compare_optimizers, max_difference

FUZZ_STATS: Counter = Counter()
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "none": nn.Identity}


@st.composite
def cases(draw):
    widths = draw(st.lists(st.integers(1, 9), min_size=2, max_size=4))
    return {
        "widths": widths,
        "activation": draw(st.sampled_from(sorted(ACTIVATIONS))),
        "bias": draw(st.booleans()),
        "mode": draw(st.sampled_from(["dtensor_expand", "replicate", "fully_shard", "tp"])),
        "world_size": draw(st.sampled_from([1, 2, 4])),
        "batch": draw(st.integers(1, 9)),
        "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
        "cross_iteration": draw(st.booleans()),
        "seed": draw(st.integers(0, 1000)),
    }


def _model(case) -> nn.Module:
    torch.manual_seed(case["seed"])
    layers: list[nn.Module] = []
    widths = case["widths"]
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b, bias=case["bias"]))
        if i < len(widths) - 2:
            layers.append(ACTIVATIONS[case["activation"]]())
    return nn.Sequential(*layers).double()


def _mode(case, model):
    if case["mode"] == "dtensor_expand":
        return DTensorExpandMode()
    if case["mode"] in ("replicate", "fully_shard"):
        return DataParallel(case["mode"])
    linears = [str(i) for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    plan = {name: (ColwiseParallel() if k % 2 == 0 else RowwiseParallel()) for k, name in enumerate(linears)}
    return TensorParallel(plan)


def _step(model, optim, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _optimizer(case, params):
    if case["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases())
def test_random_models_match_eager_or_refuse_clearly(case):
    model = _model(case)
    reference = copy.deepcopy(model)
    optim, ref_optim = _optimizer(case, model.parameters()), _optimizer(case, reference.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    extra = ("cross_iteration_overlap",) if case["cross_iteration"] else ()
    step = sc.compile(_mode(case, model), extra_passes=extra)(_step)
    gen = torch.Generator().manual_seed(case["seed"])
    widths = case["widths"]
    batches = [
        (torch.randn(case["batch"], widths[0], generator=gen, dtype=torch.float64),
         torch.randn(case["batch"], widths[-1], generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]
    with sc.simulate(case["world_size"]) as sim:
        try:
            losses = [step(model, optim, x, y) for x, y in batches]
        except sc.SPMDCompileError:
            FUZZ_STATS["raised"] += 1
            # refused before anything ran: the model is untouched
            assert not any(isinstance(p, DTensor) for p in model.parameters())
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            return
        step.flush()  # a deferred last update (cross_iteration_overlap) lands here
        ref_losses = [_step(reference, ref_optim, x, y) for x, y in batches]
        for got, want in zip(losses, ref_losses):
            assert abs(got.item() - want.item()) <= 1e-9 * max(1.0, abs(want.item()))
        diff = max_difference(
            compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim)
        )
    assert diff < 1e-9, (case, diff)
    FUZZ_STATS["matched"] += 1


def teardown_module(module):
    print(f"\nfuzz: {dict(FUZZ_STATS)}")
