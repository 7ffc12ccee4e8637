"""``torch.optim.Adafactor`` in a compiled step (NOTE: [Adafactor in tensor ops] in
``spmd_compiler/capture/adafactor.py``): its step reads the step count and two norms with
``.item()``; traced with those values as tensors, float64, 2 simulated ranks, against the
undecorated step on one device on the global batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.capture import adafactor
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import FullyShardTensorParallel, TensorParallel, make_mode
from spmd_compiler.parallel_modes.base import placements_for_state
from spmd_compiler.tools.demo.steps import classification_train_step as plain_step

pytestmark = pytest.mark.skipif(
    not hasattr(torch.optim, "Adafactor"), reason="this torch has no torch.optim.Adafactor"
)

TOL = 1e-13
BATCH, CLASSES = 8, 4


def _mlp() -> nn.Module:
    """Rows that do not divide 2 ranks, a 2-D weight (factored state) and biases
    (a second moment shaped like the bias)."""
    return nn.Sequential(nn.Linear(8, 15), nn.GELU(), nn.Linear(15, CLASSES)).double()


class _Conv(nn.Module):
    """4-D weights: Adafactor factors their last two dimensions, so the factors keep the
    weight's first dimension, the one fsdp shards."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.mix = nn.Conv2d(4, CLASSES, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(F.relu(self.conv(x))).mean((2, 3))


def _batches(shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(shape, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(4)
    ]


SETTINGS = {
    "defaults": {},
    "weight_decay_maximize": {"weight_decay": 0.1, "maximize": True},
    # lr above 1 / sqrt(step) for the first steps: the step size is the smaller one
    "large_lr_small_eps": {"lr": 0.5, "eps": (1e-30, 1e-3), "d": 2.0, "beta2_decay": -0.5},
}


def test_this_torch_has_the_update_mirrored():
    """A torch whose Adafactor update takes other arguments keeps its own (and the step
    is refused as before): this says when that happens."""
    assert adafactor.mirrors(private.adafactor_single_tensor_step())


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_adafactor_under_ddp_matches_one_device(setting, run_parity):
    result = run_parity(
        _mlp, lambda m: torch.optim.Adafactor(m.parameters(), **SETTINGS[setting]), 2,
        _batches((BATCH, 8)), step=plain_step, mode=make_mode("ddp"),
    )
    result.assert_close(TOL)
    assert result.compile_counts[-1] == 1
    assert "optim.g0.p0.row_var" in result.state_differences  # the factored state compared


def test_adafactor_under_fsdp_shards_convolution_factors(run_parity):
    result = run_parity(
        lambda: _Conv().double(), lambda m: torch.optim.Adafactor(m.parameters()), 2,
        _batches((BATCH, 3, 6, 6)), step=plain_step, mode=make_mode("fsdp"),
    )
    result.assert_close(TOL)


def _even_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, CLASSES)).double()


_TP_PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
MODES = {
    "fsdp": (lambda: make_mode("fsdp"), 2),
    "tp": (lambda: TensorParallel(_TP_PLAN), 2),
    "fsdp_tp": (lambda: FullyShardTensorParallel(_TP_PLAN, mesh_shape=(2, 2)), 4),
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_factored_2d_weights_under_sharded_modes_match_one_device(mode, run_parity):
    """A 2-D weight's column factor (1, cols) cannot be sharded as the weight's rows
    are: it is replicated there, the row factor keeps the weight's shard (NOTE: [state
    shaped unlike its parameter] in parallel_modes/base.py), and the update is exact."""
    make, world = MODES[mode]
    placements: dict[str, tuple] = {}

    def record(sim, result):
        for p, entries in result.optimizer.state.items():
            name = next(n for n, q in result.model.named_parameters() if q is p)
            for key in ("row_var", "col_var"):
                if key in entries:
                    placements[f"{name}.{key}"] = tuple(entries[key].placements)

    result = run_parity(
        _even_mlp, lambda m: torch.optim.Adafactor(m.parameters()), world,
        _batches((BATCH, 8)), step=plain_step, mode=make(), check_simulation=record,
    )
    result.assert_close(TOL)
    assert result.compile_counts[-1] == 1
    assert "optim.g0.p0.col_var" in result.state_differences
    if mode == "fsdp":  # rows sharded as the weight's, the single-row column factor whole
        assert placements["0.weight.row_var"] == (Shard(0),)
        assert placements["0.weight.col_var"] == (Replicate(),)
    if mode == "tp":  # the rowwise weight is sharded on its columns: so is its column factor
        assert placements["2.weight.row_var"] == (Replicate(),)
        assert placements["2.weight.col_var"] == (Shard(1),)


class _VectorFactors(torch.optim.Optimizer):
    """An SM3 / fairseq-Adafactor-like update keeping a 2-D weight's statistics as 1-D
    vectors: a (rows,) and a (cols,) mean of its squared gradient."""

    def __init__(self, params, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if p.ndim != 2:
                    p.add_(p.grad, alpha=-group["lr"])
                    continue
                if not state:
                    state["row"] = torch.zeros(p.shape[0], dtype=p.dtype)
                    state["col"] = torch.zeros(p.shape[1], dtype=p.dtype)
                square = p.grad.square()
                state["row"].mul_(0.9).add_(square.mean(1), alpha=0.1)
                state["col"].mul_(0.9).add_(square.mean(0), alpha=0.1)
                scale = (state["row"][:, None] * state["col"][None, :]).sqrt() + 1e-8
                p.addcdiv_(p.grad, scale, value=-group["lr"])


@pytest.mark.parametrize("shape", [(2, 2), (2, 1)])
def test_vector_factors_of_a_rowwise_weight_under_fsdp_tp_match_one_device(shape, run_parity):
    """A rowwise weight's (cols,) statistics have no dimension 1 for its tp split
    Shard(1): placing them raised a bare IndexError; they are replicated on tp, as
    TensorParallel alone places them (NOTE: [state with fewer dimensions than its
    parameter] in parallel_modes/fsdp_tp.py), and the update is exact."""
    result = run_parity(
        _even_mlp, lambda m: _VectorFactors(m.parameters()), shape[0] * shape[1], _batches((BATCH, 8)),
        step=plain_step,
        mode=FullyShardTensorParallel(_TP_PLAN, mesh_shape=shape),
    )
    result.assert_close(TOL)
    assert result.compile_counts[-1] == 1
    assert "optim.g0.p2.col" in result.state_differences  # the rowwise weight's (cols,) state


def test_placements_for_state_keep_only_shards_of_the_parameters_size():
    strided = private.strided_shard(0, 2)
    assert placements_for_state((Shard(0),), (16, 1), (16, 8)) == (Shard(0),)
    assert placements_for_state((Shard(0),), (1, 8), (16, 8)) == (Replicate(),)
    assert placements_for_state((Shard(1),), (1, 8), (16, 8)) == (Shard(1),)
    assert placements_for_state((Shard(-1),), (16, 1), (16, 8)) == (Replicate(),)
    assert placements_for_state((strided, Shard(0)), (1, 8), (16, 8)) == (Replicate(), Replicate())
    assert placements_for_state((Shard(0),), (), (16, 8)) == (Replicate(),)
    assert placements_for_state((Shard(0),), (16, 8), (16, 8)) == (Shard(0),)


class _OddConv(_Conv):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)  # 5 output channels: fsdp pads them to 6
        self.mix = nn.Conv2d(5, CLASSES, 1)


def test_factored_state_of_a_padded_weight_is_refused():
    """Zero rows padding an uneven shard would enter the factors (computed across the
    rows), so the step is refused, naming the state (NOTE: [uneven shards])."""
    model = _OddConv().double()
    optimizer = torch.optim.Adafactor(model.parameters())
    compiled = sc.compile(make_mode("fsdp"))(plain_step)
    x, y = _batches((BATCH, 3, 6, 6))[0]
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, optimizer, x, y)
    message = str(info.value)
    assert "state[conv.weight]" in message and "unlike its parameter" in message


def test_muon_on_a_padded_weight_computes_on_the_true_rows(run_parity):
    """Muon's Newton-Schulz transposes a column-parallel weight whose 5 rows the 2 ranks
    do not divide. Refused first as "a bug in spmd_compiler", then naming the padding;
    the matrix products of the optimizer now read the true rows (NOTE: [what the
    optimizer computes on padded rows]) and match one device."""
    if not hasattr(torch.optim, "Muon"):
        pytest.skip("no torch.optim.Muon on this torch")

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(6, 5, bias=False), nn.Tanh(), nn.Linear(5, CLASSES, bias=False)
        ).double()

    result = run_parity(
        model, lambda m: torch.optim.Muon(m.parameters(), lr=0.02), 2, _batches((BATCH, 6)),
        step=plain_step, mode=TensorParallel({"0": ColwiseParallel(), "2": RowwiseParallel()}),
    )
    result.assert_close(TOL)
