"""Compiled steps without an optimizer (NOTE: [steps without an optimizer]).

An evaluation step (forward under ``no_grad``, metrics returned) and a step that only
accumulates gradients run under the same mode as the train step, on the same DTensor
state: before the first train step (a sanity check), between train steps and after them,
each against the undecorated step on one device on the global batch (float64). A direct
call of the placed model with plain tensors is refused with what to do (the refusal of
an optimizer the step was not given is in tests/unit/test_errors.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

TOL = 1e-10
BATCH, FEATURES, CLASSES = 8, 6, 4
PLAN = {"0": ColwiseParallel(), "3": RowwiseParallel()}


def _model() -> nn.Module:
    """BatchNorm: eval mode reads the running statistics the train steps updated. (No
    bias before it: that bias's gradient is zero in exact arithmetic, so Adam turns
    rounding noise into its update.)"""
    return nn.Sequential(
        nn.Linear(FEATURES, 16, bias=False), nn.BatchNorm1d(16), nn.Tanh(),
        nn.Linear(16, CLASSES),
    ).double()


def _tp_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(FEATURES, 16), nn.Tanh(), nn.Dropout(0.0), nn.Linear(16, CLASSES)
    ).double()


def train_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def eval_step(model, x, y):  # noqa: ANN001
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        accuracy = (logits.argmax(-1) == y).double().mean()
    model.train()
    return {"loss": loss, "accuracy": accuracy, "logits": logits}


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [
        (
            torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64),
            torch.randint(0, CLASSES, (BATCH,), generator=gen),
        )
        for _ in range(n)
    ]


def _mode(name: str):  # noqa: ANN202
    if name == "tp":
        return make_mode("tp", plan=PLAN)
    if name == "fsdp_tp":
        return make_mode("fsdp_tp", plan=PLAN, mesh_shape=(2, 2))
    return make_mode(name)


def _close(actual: dict, expected: dict) -> float:
    return max(relative_difference(actual[k], expected[k]) for k in expected)


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp", "fsdp_tp"])
def test_evaluation_before_between_and_after_training(mode):
    torch.manual_seed(0)
    model = _tp_model() if "tp" in mode else _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train = sc.compile(_mode(mode))(train_step)
    evaluate = sc.compile(_mode(mode))(eval_step)
    held_out = _batches(1)[0]
    differences = []
    with sc.simulate(world_size=4) as sim:
        # a sanity-check evaluation first: it installs the DTensor state the train step
        # and its optimizer then use
        differences.append(_close(evaluate(model, *held_out), eval_step(reference, *held_out)))
        for batch in _batches(3):
            train(model, optim, *batch)
            train_step(reference, reference_optim, *batch)
            differences.append(_close(evaluate(model, *held_out), eval_step(reference, *held_out)))
        state = {**compare_models(model, reference, sim),
                 **compare_optimizers(optim, reference_optim, sim)}
    assert max(differences) < TOL, differences
    assert max(state.values()) < TOL, sorted(state.items(), key=lambda kv: -kv[1])[:3]
    assert evaluate.compile_count == 1
    # the evaluation changed nothing: the running statistics came from the train steps only
    assert model.training


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_gradients_accumulated_by_one_step_and_applied_by_another(mode):
    """``backward()`` in one compiled step, ``optimizer.step()`` in another: the
    gradients live in ``.grad`` (DTensors) between the calls."""

    def accumulate(model, x, y):  # noqa: ANN001
        loss = F.cross_entropy(model(x), y) / 2
        loss.backward()
        return loss

    def apply(model, optim):  # noqa: ANN001
        optim.step()
        optim.zero_grad()

    torch.manual_seed(0)
    model = _tp_model()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled_accumulate = sc.compile(_mode(mode))(accumulate)
    compiled_apply = sc.compile(_mode(mode))(apply)
    batches = _batches(4)
    with sc.simulate(world_size=2) as sim:
        for i in range(0, len(batches), 2):
            for batch in batches[i:i + 2]:
                loss = compiled_accumulate(model, *batch)
                assert relative_difference(loss, accumulate(reference, *batch)) < TOL
            compiled_apply(model, optim)
            apply(reference, reference_optim)
        state = {**compare_models(model, reference, sim),
                 **compare_optimizers(optim, reference_optim, sim)}
    assert max(state.values()) < TOL, sorted(state.items(), key=lambda kv: -kv[1])[:3]


def test_calling_a_placed_model_directly_says_what_to_do():
    """NOTE: [calling a placed model directly]: plain tensors into DTensor state."""
    model = _tp_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    train = sc.compile(make_mode("fsdp"))(train_step)
    x, y = _batches(1)[0]
    with sc.simulate(world_size=2):
        train(model, optim, x, y)
        with pytest.raises(SPMDCompileError) as info:
            model(x)
        assert "a step without an optimizer" in str(info.value)
        train(model, optim, x, y)  # the compiled step itself is not affected
    assert train.compile_count == 1


def test_a_no_grad_decorated_evaluation_is_told_to_compile_it():
    """NOTE: [what called a placed model directly]: `@torch.no_grad()` wraps a function
    in torch's shared wrapper code, which update_bn's `__code__` is too; such an
    evaluation got update_bn's advice before (sixty-seventh session's probe)."""

    @torch.no_grad()
    def evaluate(model, x):
        return model(x).sum()

    model = _tp_model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _batches(1)[0]
    with sc.simulate(world_size=2):
        sc.compile(make_mode("ddp"))(train_step)(model, optim, x, y)
        with pytest.raises(SPMDCompileError) as info:
            evaluate(model, x)
    assert "a step without an optimizer" in str(info.value)
    assert "update_bn" not in str(info.value)
