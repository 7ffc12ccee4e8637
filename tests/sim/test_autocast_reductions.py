"""Low-precision gradients reduced as one device rounds them (NOTE: [low-precision
partials rounded where reduced] in ``expand/retrace.py``).

Under ``torch.autocast`` a Linear's weight gradient is a float16 (bfloat16) product cast
up to float32. One device computes it over the whole batch and rounds it once, to inf
where it passes float16's range; the ranks' partial products are reduced in float32 and
then rounded the same way. With ``GradScaler`` the overflow decides whether the step is
skipped: the skip decisions, the scale sequence and the parameters must be eager's on one
device, in ddp and fsdp. A float32 step gets no extra op.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

# measured after the fix: parameters 1.2e-7, AdamW's state 1.3e-3 relative (its second
# moments hold float16 gradients differing in their last bit: partial products rounded)
PARAMS_TOL, STATE_TOL = 1e-6, 5e-3
# two ulps of the largest gradient element, relative to it (relative_difference's
# measure): the ranks' partial products are rounded before their sum is (measured here:
# 7.6e-3 bf16, 6.7e-4 fp16, one ulp being 7.8e-3 and 9.8e-4)
ULPS = {torch.bfloat16: 2 * 2.0**-7, torch.float16: 2 * 2.0**-10}


def overflow_step(model, optim, scaler, x):  # noqa: ANN001
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    loss = out.float().sum()  # d loss / d out = 1: the scale itself, per row
    scaler.scale(loss).backward()
    scaler.step(optim)
    scaler.update()
    optim.zero_grad()
    return loss.detach(), scaler.get_scale()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_gradient_one_device_overflows_skips_the_step(mode: str) -> None:
    """``ones(8, 4)`` at scale 8192: one device's float16 weight gradient sums 8 rows of
    8192, 65536 (inf in float16): the step is skipped and the scale halved; at 4096 it is
    32768 and the step runs, the scale grows back (every good step). Each rank of 2 sums
    4 rows, 32768, finite: before, reduced in float32 to a finite 65536, every step ran
    and the scale grew from 8192 to 131072 in 4 calls where eager's went 4096, 8192,
    4096, 8192, and the weights moved on the skipped calls."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=1e-3)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=1e-3)
    scaler, reference_scaler = (torch.amp.GradScaler("cpu", init_scale=8192.0, growth_interval=1) for _ in range(2))
    x = torch.ones(8, 4)
    step = sc.compile(make_mode(mode))(overflow_step)
    got, want = [], []
    with sc.simulate(world_size=2) as sim:
        for _ in range(4):
            got.append(step(model, optim, scaler, x)[1])
            want.append(overflow_step(reference, reference_optim, reference_scaler, x)[1])
        worst = max(compare_models(model, reference, sim).values())
    assert want == [4096.0, 8192.0, 4096.0, 8192.0]
    assert got == want
    assert scaler.state_dict() == reference_scaler.state_dict()
    assert worst == 0.0, worst


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))


def clipped_step(model, optim, scaler, x, y, dtype=torch.float16):  # noqa: ANN001
    with torch.autocast("cpu", dtype=dtype):
        logits = model(x)
    loss = F.cross_entropy(logits.float(), y)
    scaler.scale(loss).backward()
    scaler.unscale_(optim)
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optim)
    scaler.update()
    optim.zero_grad()
    return loss.detach(), scaler.get_scale()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_scale_sequence_of_overflowing_data_matches_one_device(mode: str) -> None:
    """An MLP with AdamW and clipping from scale 2 ** 24 (growth every 2 good steps): the
    float16 backward overflows naturally in the first calls. Before, call 7 overflowed on
    one device (skipped, scale 262144 -> 131072) and not on 2 ranks (stepped, scale grown
    to 524288), the parameters 6.4e-2 off eager's after 8 calls."""
    torch.manual_seed(0)
    model = _mlp()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler, reference_scaler = (torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2) for _ in range(2))
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)) for _ in range(8)]
    step = sc.compile(make_mode(mode))(clipped_step)
    got, want = [], []
    with sc.simulate(world_size=2) as sim:
        for x, y in batches:
            got.append(step(model, optim, scaler, x, y)[1])
            want.append(clipped_step(reference, reference_optim, reference_scaler, x, y)[1])
        params = max(compare_models(model, reference, sim).values())
        state = max(compare_optimizers(optim, reference_optim, sim).values())
    assert want[7] < want[6], "the data no longer overflows at call 8"
    assert got == want
    assert scaler.state_dict() == reference_scaler.state_dict()
    assert params < PARAMS_TOL and state < STATE_TOL, (params, state)


def gradients_step(model, x, y, dtype=torch.bfloat16):  # noqa: ANN001
    with torch.autocast("cpu", dtype=dtype):
        logits = model(x)
    F.cross_entropy(logits.float(), y).backward()
    grads = [p.grad.detach().clone() for p in model.parameters()]
    model.zero_grad()
    return grads


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_low_precision_gradients_are_rounded_as_one_device_rounds_them(mode: str, dtype: torch.dtype) -> None:
    """Every gradient of the Linears (float16 / bfloat16 products) is a value of the low
    dtype, as one device's is, and within two of its ulps of one device's; before, the
    sum of the ranks' rounded partials was left unrounded, off the low dtype's values."""
    torch.manual_seed(0)
    model = _mlp()
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 4, (16,), generator=gen)
    want = gradients_step(copy.deepcopy(model), x, y, dtype)
    with sc.simulate(world_size=4):
        got = sc.compile(make_mode(mode))(gradients_step)(model, x, y, dtype)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, g.to(dtype).float())
        assert relative_difference(g, w) <= ULPS[dtype], relative_difference(g, w)


def plain_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _casts(gm: torch.fx.GraphModule) -> int:
    return sum(n.target is torch.ops.aten._to_copy.default for n in gm.graph.nodes)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_float32_steps_get_no_rounding(mode: str) -> None:
    """The float32 step's per-rank program casts where its captured graph does, and no
    more; the float16 step's rounds each of its 4 gradients once (2 casts each)."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 8, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    torch.manual_seed(0)
    model = _mlp()
    plain = sc.compile(make_mode(mode))(plain_step)
    scaled = sc.compile(make_mode(mode))(clipped_step)
    with sc.simulate(world_size=2):
        high = copy.deepcopy(model)
        plain(high, torch.optim.AdamW(high.parameters(), lr=1e-2), x, y)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        low = copy.deepcopy(model)
        scaled(low, torch.optim.AdamW(low.parameters(), lr=1e-2), scaler, x, y)
    program = plain.last_program
    assert _casts(program.graph_module) == _casts(program.captured.graph_module)
    program = scaled.last_program
    assert _casts(program.graph_module) == _casts(program.captured.graph_module) + 2 * 4


def test_fsdp_tp_gradients_are_rounded_where_its_own_reduce_scatter_reduces_them() -> None:
    """fsdp_tp reduces its gradients over dp by hand (``reduce_scatter_over_dp``), not
    through DTensor's redistribution, where the rounding is made: before the fix a review
    found the scale sequence [16384, 32768, 16384, 32768] against one device's [16384,
    8192, 16384, 8192] (the step taken where one device's float16 sum overflows),
    parameters 3.2e-5 off."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from spmd_compiler.parallel_modes import FullyShardTensorParallel

    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Identity(), nn.Linear(4, 2, bias=False))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.125)
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=1e-6)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=1e-6)
    scaler, reference_scaler = (torch.amp.GradScaler("cpu", init_scale=32768.0, growth_interval=1) for _ in range(2))

    def scaled_step(model, optim, scaler, x):  # noqa: ANN001, ANN202
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        scaler.scale(out.float().sum()).backward()
        scaler.step(optim)
        scaler.update()
        optim.zero_grad()
        return scaler.get_scale()

    mode = FullyShardTensorParallel({"0": ColwiseParallel(), "2": RowwiseParallel()}, mesh_shape=(2, 2))
    step = sc.compile(mode)(scaled_step)
    x = torch.ones(8, 4)
    with sc.simulate(world_size=4) as sim:
        got = [step(model, optim, scaler, x) for _ in range(4)]
        want = [scaled_step(reference, reference_optim, reference_scaler, x) for _ in range(4)]
        assert got == want == [16384.0, 8192.0, 16384.0, 8192.0], (got, want)
        assert max(compare_models(model, reference, sim).values()) == 0.0
