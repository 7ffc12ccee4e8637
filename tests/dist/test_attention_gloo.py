"""torch's attention modules with their heads split over tp (MultiheadAttentionParallel)
under FSDP x TP 2x2 on 4 real gloo ranks, each passing its dp share of the global batch,
and under TP on 2 (the whole batch each, attention core on the rank's heads), against
the undecorated step on one device on the global batch (float64).

Measured: every rank within 1.5e-10 of eager (the key bias's rounding noise reaching
Adam, see tests/sim/test_attention.py), the losses within 2e-16.
"""

from __future__ import annotations

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.tools.parity import full_state, launch_timeout, relative_difference
from tests.sim.test_attention import (
    _HEADS_TP_PLAN,
    _adamw,
    _batches,
    _classification_step,
    _mode,
    _TorchAttention,
)

pytestmark = [pytest.mark.dist, pytest.mark.slow]

DP_SHARE = 4  # global batch 8 over dp 2


# the layers' self_attn / multihead_attn head-split, their feed-forward Megatron-style
PLAN = {k: v for k, v in _HEADS_TP_PLAN.items() if k != "block"}


def _worker(rank: int, world: int, kind: str, mode: str) -> dict:
    torch.manual_seed(0)
    model = _TorchAttention(kind).double()
    optim = _adamw(model)
    step = sc.compile(_mode(mode, PLAN))(_classification_step)
    rows = (  # tp ranks see the whole batch; the ranks of one dp coordinate share a slice
        slice(None) if mode == "tp" else slice((rank // 2) * DP_SHARE, (rank // 2 + 1) * DP_SHARE)
    )
    losses = [
        step(model, optim, x[rows], y[rows]).detach().clone()
        for x, y in _batches(dtype=torch.float64)
    ]
    return {"losses": losses, "state": full_state(model, optim, None)}


@pytest.mark.parametrize(
    "kind,mode", [("encoder", "fsdp_tp"), ("decoder", "fsdp_tp"), ("encoder", "tp")]
)
def test_heads_tensor_parallel_on_gloo(kind: str, mode: str) -> None:
    world = 2 if mode == "tp" else 4
    results = sc.launch(_worker, world, args=(kind, mode), timeout_s=launch_timeout(900))
    torch.manual_seed(0)
    reference = _TorchAttention(kind).double()
    optim = _adamw(reference)
    losses = [
        _classification_step(reference, optim, x, y).detach()
        for x, y in _batches(dtype=torch.float64)
    ]
    state = full_state(reference, optim, None)
    for rank, got in enumerate(results):
        loss = max(relative_difference(a, b) for a, b in zip(got["losses"], losses, strict=True))
        worst = max(relative_difference(got["state"][k], v) for k, v in state.items())
        assert loss < 1e-9 and worst < 1e-9, (rank, loss, worst)
