"""Masks made by ``*_like`` factories of the model's tensors (NOTE: [masks shaped like the
model's tensors]) and the advice for rows of a model mask counted (NOTE: [advice for rows
of a model mask counted]).

AdaCos' target-class mask ``torch.zeros_like(logits).scatter_(1, y[:, None], 1) == 1``
reads only ``logits``' shape: the median of the selected angles compiles as it does for
``F.one_hot(y, C) == 1`` and matches the undecorated step on one device on the global
batch (float64, within 1e-12; ddp and fsdp, 2 simulated ranks, 3 calls). A mask that
reads the model's values stays refused, with a hint naming the fixed-shape form of a
count, one element per row and a statistic; a refusal under pytorch-metric-learning's
reducers names ``reducers.MeanReducer()``.
"""

from __future__ import annotations

import copy
import importlib.util
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import run_against_eager

TOL = 1e-12
FEATURES, CLASSES = 8, 4


def _mask(kind: str, logits: torch.Tensor, theta: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if kind == "zeros_like":
        return torch.zeros_like(logits).scatter_(1, y[:, None], 1) == 1
    if kind == "new_zeros":
        return logits.new_zeros(logits.shape).scatter_(1, y[:, None], 1.0).bool()
    if kind == "one_hot":
        return F.one_hot(y, CLASSES) == 1
    if kind == "model_values":  # reads the model's values: refused
        return theta < 1.2
    if kind == "like_plus_values":  # the factory's result combined with the values: refused
        return (torch.zeros_like(logits) + logits) > 0
    raise ValueError(kind)


def _adacos_step(kind: str):  # noqa: ANN202
    def step(model, optim, x, y):  # noqa: ANN001
        logits = F.normalize(model(x))
        theta = torch.acos(logits.clamp(-1 + 1e-7, 1 - 1e-7))
        mask = _mask(kind, logits, theta, y)
        with torch.no_grad():
            scale = 1.0 / torch.cos(torch.median(theta[mask]).clamp(max=0.78))
        loss = F.cross_entropy(16 * scale * logits, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    return step


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, FEATURES, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (8,), generator=gen))
        for _ in range(3)
    ]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("kind", ["zeros_like", "new_zeros", "one_hot"])
def test_a_mask_shaped_like_the_logits_matches_one_device(kind, mode):
    torch.manual_seed(0)
    pairs, differences, compiled = run_against_eager(
        nn.Linear(FEATURES, CLASSES).double(), _adacos_step(kind), make_mode(mode), _batches(), lr=0.1
    )
    for i, (loss, expected) in enumerate(pairs):
        assert torch.allclose(loss, expected, rtol=TOL, atol=0), f"step {i}"
    assert max(differences.values()) < TOL, differences
    assert compiled.compile_count == 1


@pytest.mark.parametrize("kind", ["model_values", "like_plus_values"])
def test_a_mask_of_the_models_values_is_refused_with_what_to_do(kind):
    torch.manual_seed(0)
    model = nn.Linear(FEATURES, CLASSES).double()
    before = copy.deepcopy(model.state_dict())
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(_adacos_step(kind))
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, optim, *_batches()[0])
    message = str(info.value)
    assert "a mask computed from the model" in message
    for advice in ("mask.sum()", "gather", "torch.nanmedian(torch.where(mask, x, float('nan')))"):
        assert advice in message, advice
    assert "MeanReducer" not in message  # no pytorch-metric-learning frame here
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


REDUCER = '''
import torch

def element_reduction_helper(losses):
    losses = losses[losses > 0]
    num_past_filter = len(losses)  # pytorch-metric-learning's ThresholdReducer
    return torch.mean(losses) if num_past_filter >= 1 else losses.sum() * 0
'''


def test_a_refusal_under_pytorch_metric_learnings_reducer_names_the_mean_reducer(tmp_path, monkeypatch):
    path = tmp_path / "pytorch_metric_learning" / "reducers" / "threshold_reducer.py"
    path.parent.mkdir(parents=True)
    path.write_text(REDUCER)
    spec = importlib.util.spec_from_file_location("_pml_threshold_reducer", path)
    assert spec is not None and spec.loader is not None
    reducer = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "_pml_threshold_reducer", reducer)
    spec.loader.exec_module(reducer)

    def step(model, optim, x, y):  # noqa: ANN001
        losses = F.cross_entropy(model(x), y, reduction="none") - 1.0
        loss = reducer.element_reduction_helper(losses)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach()

    model = nn.Linear(FEATURES, CLASSES).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, optim, *_batches()[0])
    message = str(info.value)
    assert "len(losses)" in message and "reducer=reducers.MeanReducer()" in message
