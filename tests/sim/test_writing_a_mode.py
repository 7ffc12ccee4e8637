"""Two modes written as docs/modes/writing_a_mode.md says, outside ``parallel_modes/``:
each implements only the ParallelMode contract and matches the single-device step.

- ``DataParallelOnRows``: data parallel over the first dimension of a 2-D mesh; the
  second dimension replicates everything (placement_of and mesh only).
- ``GatheredShards``: state Shard(0), gathered at every use outside the optimizer
  (ZeRO-3 without resharding: placement_of and placement_at_use).
"""

from __future__ import annotations

import pytest
import torch
import torch.fx
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.ir.graph_utils import placeholders
from spmd_compiler.ir.node_meta import OPTIMIZER_PHASE, PHASE
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from spmd_compiler.parallel_modes import ParallelMode, UseGroup, UseHook, UseStep

TOL = 1e-5


class DataParallelOnRows(ParallelMode):
    """Batch split over mesh dimension 0 of a (rows, columns) mesh; all else Replicate."""

    name = "dp_on_rows"

    def __init__(self, columns: int = 2) -> None:
        super().__init__()
        self.columns = columns

    def mesh(self, device_type: str) -> DeviceMesh:
        if self._mesh is None:
            world = torch.distributed.get_world_size()
            self._mesh = init_device_mesh(device_type, (world // self.columns, self.columns))
        return self._mesh

    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh):
        if ref.kind is Kind.INPUT and meta.shape:
            return (Shard(0), Replicate())
        return (Replicate(), Replicate())


class GatheredShards(ParallelMode):
    """Parameters, gradients and optimizer state Shard(0); parameters gathered where
    forward and backward read them, once per step."""

    name = "gathered_shards"

    def placement_of(self, ref: StateRef, meta: TensorMeta, mesh: DeviceMesh):
        if ref.kind is Kind.INPUT and meta.shape:
            return (Shard(0),)
        if ref.kind in (Kind.PARAM, Kind.GRAD, Kind.OPTIM_STATE) and meta.shape:
            return (Shard(0),)
        return (Replicate(),)

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        params = {
            node
            for node, ref in zip(placeholders(captured.graph_module), captured.input_refs(), strict=True)
            if ref.kind is Kind.PARAM
        }
        gather = [UseStep(UseGroup.COMPUTE, (Replicate(),))]

        def at_use(consumer: torch.fx.Node, arg: torch.fx.Node) -> list[UseStep] | None:
            if arg in params and consumer.meta.get(PHASE) != OPTIMIZER_PHASE:
                return gather
            return None

        return at_use


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)


@pytest.mark.parametrize("mode", [DataParallelOnRows(), GatheredShards()], ids=lambda m: m.name)
def test_example_mode_matches_one_device(mode, run_parity, classification_batches) -> None:
    result = run_parity(_mlp, _adamw, 4, classification_batches(2), mode=mode)
    result.assert_close(TOL)
    assert result.compile_counts == [1, 1]  # AdamW's state made before the first program
    counts = result.compiled.last_program.collectives_before_passes
    if isinstance(mode, GatheredShards):
        # 4 parameters gathered once each, 4 gradients reduce-scattered
        assert counts.get("all_gather") == 4 and counts.get("reduce_scatter") == 4
    else:
        assert "all_gather" not in counts and counts.get("all_reduce", 0) >= 4


def test_example_mode_local_batch() -> None:
    x = torch.arange(16.0).reshape(8, 2)
    with sc.simulate(4):
        mode = DataParallelOnRows()
        # (2, 2) mesh: ranks 0, 1 hold rows 0..3; ranks 2, 3 rows 4..7
        assert [mode.local_batch(x, r)[0, 0].item() for r in range(4)] == [0.0, 0.0, 8.0, 8.0]
        assert torch.equal(GatheredShards().local_batch(x, 3), x[6:8])


class OldContract(GatheredShards):
    """Returns the pre-UseStep ``(placements, group)`` tuples."""

    def placement_at_use(self, captured: CapturedStep, mesh: DeviceMesh) -> UseHook | None:
        hook = super().placement_at_use(captured, mesh)
        return lambda consumer, arg: [((Replicate(),), "compute")] if hook(consumer, arg) else None


def test_a_hook_that_returns_no_use_steps_is_named() -> None:
    model = _mlp()
    step = sc.compile(parallel_mode=OldContract())(_sum_step)
    with sc.simulate(2), pytest.raises(sc.SPMDCompileError, match="return a list of UseStep") as info:
        step(model, _adamw(model), torch.randn(4, 8))
    assert "placement_at_use returned ((Replicate(),), 'compute')" in str(info.value)


def _sum_step(model, optim, x):
    loss = model(x).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss
