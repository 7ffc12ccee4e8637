"""``torch.autocast`` inside the compiled step (bf16 on CPU).

The trace runs under the step's autocast region, so the captured program holds the casts
autocast made (bf16 matmuls, float32 LayerNorm and loss) and replays them without autocast.
On one rank the compiled step is the eager step to float32 rounding. On two ranks a bf16
matmul's weight gradient is each rank's partial product rounded to bf16, summed in
float32 and the sum rounded to bf16 again, as one device rounds its full-batch product
(NOTE: [low-precision partials rounded where reduced] in ``expand/retrace.py``): it
still differs from one device's by up to one bf16 ulp (the partials' own rounding), so
the 2-rank check is against that per-rank reference (each shard's eager autocast
gradient, averaged, what torch DDP computes, then rounded to bf16), and against the
float32 step, to show autocast took effect.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, relative_difference

BATCH, FEATURES, CLASSES = 8, 8, 4


def _model(classes: int = CLASSES) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 64), nn.LayerNorm(64), nn.GELU(), nn.Linear(64, classes))


def _batch(seed: int = 1, classes: int = CLASSES) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, FEATURES, generator=gen), torch.randint(0, classes, (BATCH,), generator=gen)


def _autocast_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model[0](x)
        with torch.autocast("cpu", enabled=False):  # a float32 island inside the region
            hidden = model[1](hidden.float())
        logits = model[3](model[2](hidden))
    return F.cross_entropy(logits.float(), y)


def autocast_step(model, optim, x, y):  # noqa: ANN001
    loss = _autocast_loss(model, x, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def autocast_gradients(model, x, y):  # noqa: ANN001
    _autocast_loss(model, x, y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return grads


def _eager_gradients(model: nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: bool) -> list[torch.Tensor]:
    model = copy.deepcopy(model)
    if autocast:
        return autocast_gradients(model, x, y)
    F.cross_entropy(model(x), y).backward()
    return [p.grad for p in model.parameters()]


def test_one_rank_matches_the_eager_autocast_step() -> None:
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = sc.compile(make_mode("ddp"))(autocast_step)
    with sc.simulate(world_size=1) as sim:
        for seed in range(3):
            loss = step(model, optim, *_batch(seed))
            expected = autocast_step(reference, reference_optim, *_batch(seed))
            assert relative_difference(loss, expected) < 1e-6
        worst = max(compare_models(model, reference, sim).values())
    assert worst < 1e-6, worst


@pytest.mark.parametrize(
    ("mode", "classes"), [("ddp", CLASSES), ("fsdp", CLASSES), ("fsdp", 5)],
    ids=["ddp", "fsdp", "fsdp_uneven_rows"],
)
def test_two_ranks_reduce_the_per_rank_bf16_gradients(mode: str, classes: int) -> None:
    """fsdp_uneven_rows: 5 output rows over 2 ranks are padded shards (NOTE: [uneven
    shards]), and autocast's cast of the padded shard failed the local shape check."""
    model = _model(classes)
    x, y = _batch(classes=classes)
    half = BATCH // 2
    shards = [_eager_gradients(model, x[s], y[s], True) for s in (slice(0, half), slice(half, None))]
    per_rank = [(a + b) / 2 for a, b in zip(*shards, strict=True)]
    # the Linears' gradients (bf16 products) rounded as one device's; the LayerNorm's
    # (a float32 island) as they are
    per_rank = [g if i in (2, 3) else g.bfloat16().float() for i, g in enumerate(per_rank)]
    full_float32 = _eager_gradients(model, x, y, False)
    step = sc.compile(make_mode(mode))(autocast_gradients)
    with sc.simulate(world_size=2):
        grads = step(copy.deepcopy(model), x, y)
    for got, want in zip(grads, per_rank, strict=True):
        assert relative_difference(got, want) < 1e-6
    # autocast took effect: the float32 step's gradients are far from these
    assert max(relative_difference(g, f) for g, f in zip(grads, full_float32, strict=True)) > 1e-3


def plain_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_a_step_called_inside_autocast_is_captured_inside_it() -> None:
    """NOTE: [autocast around the step] in ``api.py``: calls inside and outside a
    caller's autocast region alternate, each against the eager step in the same region
    (one rank: the compiled step is the eager one to float32 rounding). Before, the key
    ignored the region: the second call ran the first call's float32 program with its
    matmuls cast at run time (3e-3 off the eager step)."""
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = sc.compile(make_mode("ddp"))(plain_step)
    with sc.simulate(world_size=1) as sim:
        for seed, inside in enumerate([False, True, True, False, True]):
            region = torch.autocast("cpu", dtype=torch.bfloat16, enabled=inside)
            with region:
                loss = step(model, optim, *_batch(seed))
            with region:
                expected = plain_step(reference, reference_optim, *_batch(seed))
            assert relative_difference(loss, expected) < 1e-6, (seed, inside)
        worst = max(compare_models(model, reference, sim).values())
    assert worst < 1e-6, worst
    # the steady program (AdamW's state made before it) outside and inside the region
    assert step.compile_count == 2
