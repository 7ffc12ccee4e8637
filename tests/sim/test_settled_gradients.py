"""Gradients are reduced once, where backward leaves them (NOTE: [gradients settle after
backward]): a step that clips between ``backward()`` and ``optimizer.step()`` moves the
gradient bytes torch's DDP / FSDP2 move, and still matches one device.

Before the change, with ``clip_grad_norm_``: ddp all-reduced the gradients twice (the
norm, then the update) and fsdp all-reduced them whole on top of its reduce-scatter.

A gradient whose rows the ranks do not divide is zero-padded where the optimizer reads it
and settles there (NOTE: [padded gradients settle at their pad]). Before, that pad stayed
partial and each of its readers reduced it: Adagrad and RMSprop reduce-scattered every
uneven gradient twice (``addcdiv(grad, std, value=-lr)`` scales it before its own
reduce-scatter).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.ir.collectives import collective_kind
from spmd_compiler.parallel_modes import FullyShardTensorParallel, make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers

TOL = 1e-12
FEATURES, HIDDEN, CLASSES, BATCH = 6, 16, 4, 8
GRADIENT_ELEMENTS = FEATURES * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, CLASSES)).double()


def clipped_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optim.step()
    optim.zero_grad()
    return loss


def two_backward_step(model, optim, x, y):  # noqa: ANN001
    """Accumulation inside one step: the first backward's gradient is read by the second
    backward only, so it stays partial and the sum is reduced once."""
    F.cross_entropy(model(x), y).backward()
    F.cross_entropy(model(2 * x), y).backward()
    for p in model.parameters():
        p.grad.mul_(0.5)
    optim.step()
    optim.zero_grad()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64),
             torch.randint(0, CLASSES, (BATCH,), generator=gen)) for _ in range(n)]


def _mode(name: str):  # noqa: ANN202
    if name == "tp":
        return make_mode("tp", plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    if name == "fsdp_tp":
        return FullyShardTensorParallel({"0": ColwiseParallel(), "2": RowwiseParallel()}, mesh_shape=(2, 2))
    return make_mode(name)


def _run(mode: str, step, world: int = 2, model=None, optimizer=torch.optim.AdamW):  # noqa: ANN001, ANN202
    model = model if model is not None else _model()
    reference = copy.deepcopy(model)
    optim = optimizer(model.parameters(), lr=1e-2)
    reference_optim = optimizer(reference.parameters(), lr=1e-2)
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(world_size=world) as sim:
        for x, y in _batches():
            compiled(model, optim, x, y)
            step(reference, reference_optim, x, y)
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, reference_optim, sim)}.values())
    assert worst < TOL, worst
    graph = compiled.last_program.graph_module.graph
    return [(collective_kind(n), n.args[0].meta["val"].numel()) for n in graph.nodes if collective_kind(n)]


def _gradient_reductions(collectives: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The reductions that carry gradients (the buckets, not the loss's scalars)."""
    return [(kind, n) for kind, n in collectives
            if kind in ("all_reduce", "reduce_scatter") and n >= GRADIENT_ELEMENTS // 2]


def test_ddp_with_clipping_all_reduces_the_gradients_once():
    reductions = _gradient_reductions(_run("ddp", clipped_step))
    assert [kind for kind, _ in reductions] == ["all_reduce"], reductions  # (and the loss's count)


def test_fsdp_with_clipping_reduce_scatters_the_gradients_once():
    reductions = _gradient_reductions(_run("fsdp", clipped_step))
    kinds = [kind for kind, _ in reductions]
    assert kinds.count("reduce_scatter") == 1 and "all_reduce" not in kinds, reductions


def test_accumulating_two_backwards_reduces_once():
    reductions = _gradient_reductions(_run("ddp", two_backward_step))
    assert [kind for kind, _ in reductions] == ["all_reduce"], reductions


@pytest.mark.parametrize("mode,world", [("tp", 2), ("fsdp_tp", 4)])
def test_tensor_parallel_with_clipping_matches_one_device(mode, world):
    collectives = _run(mode, clipped_step, world)
    assert all(n < GRADIENT_ELEMENTS for kind, n in collectives if kind == "all_reduce"), collectives


def _uneven_model() -> nn.Module:
    """Rows (5, 5) and biases the 2 ranks do not divide: every parameter is padded."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 5), nn.Tanh(), nn.Linear(5, 5)).double()


def plain_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


# each gradient once, padded to an even number of rows: [6, 6] + [6] + [6, 5] + [6]
UNEVEN_PADDED_ELEMENTS = 36 + 6 + 30 + 6


@pytest.mark.parametrize("step", [plain_step, clipped_step], ids=["plain", "clipped"])
@pytest.mark.parametrize("optimizer", [torch.optim.Adagrad, torch.optim.RMSprop, torch.optim.Adam])
def test_fsdp_reduce_scatters_each_uneven_gradient_once(optimizer, step):
    """Before the fix: Adagrad and RMSprop reduce-scattered 156 elements (each uneven
    gradient twice: once for ``addcmul(grad, grad)``, once as ``-lr * grad``), Adam 78."""
    collectives = _run("fsdp", step, model=_uneven_model(), optimizer=optimizer)
    scattered = sum(n for kind, n in collectives if kind == "reduce_scatter")
    assert scattered == UNEVEN_PADDED_ELEMENTS, collectives
    if step is plain_step:  # (clipping's norm still all-reduces the unpadded gradients)
        assert all(n == 1 for kind, n in collectives if kind == "all_reduce"), collectives  # the loss
