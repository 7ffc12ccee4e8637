"""Where tensor-parallel programs reduce the partial sums backward makes.

A Llama-style block in miniature: RMSNorm written out (pow, mean, rsqrt, as transformers'
Llama / Qwen / Mistral norms are: linear in the incoming gradient, so a partial gradient
passes through them unreduced), a gated feed-forward (gate and up colwise, down rowwise) on
a residual stream, a final RMSNorm and a colwise head whose logits are replicated
(transformers' own plans). NOTE: [a partial operand of a matmul reduced first] in
``expand/local_rules.py`` and NOTE: [a gradient computed whole on tp] in
``parallel_modes/fsdp_tp.py``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from twin_models import adamw_twins

import spmd_compiler as sc
from spmd_compiler.parallel_modes import FullyShardTensorParallel, TensorParallel
from spmd_compiler.tools.demo.steps import classification_train_step as _step
from spmd_compiler.tools.explain import explain
from spmd_compiler.tools.parity import compare_states, full_state, relative_difference

PLAN = {
    "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel(),
    "head": ColwiseParallel(output_layouts=Replicate()),
}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _GatedBlock(nn.Module):
    def __init__(self, width: int = 8, hidden: int = 16, classes: int = 6) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.rand(width) + 0.5)
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)
        self.final_norm = nn.Parameter(torch.rand(width) + 0.5)
        self.head = nn.Linear(width, classes, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _rms_norm(x, self.norm)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(_rms_norm(x, self.final_norm))


def _run(mode, world: int):  # noqa: ANN001, ANN202
    """Three AdamW steps compiled and on one device, compared; the compiled step."""
    model, reference, optim, ref_optim = adamw_twins(_GatedBlock)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 6, (8,), generator=gen))
        for _ in range(3)
    ]
    step = sc.compile(mode)(_step)
    with sc.simulate(world) as sim:
        for x, y in batches:
            loss, expected = step(model, optim, x, y), _step(reference, ref_optim, x, y)
            assert relative_difference(loss, expected) < 1e-12
        diffs = compare_states(full_state(model, optim, sim), full_state(reference, ref_optim, None))
    assert max(diffs.values()) < 1e-10
    return step


def _collectives(step) -> list[tuple[str, int | None]]:  # noqa: ANN001
    return [(row.kind, row.mesh_dim) for row in explain(step).collectives]


def test_a_partial_gradient_is_reduced_before_a_matmul_with_a_sharded_operand():
    """The head's input gradient is a partial sum over tp; it reaches the down
    projection's backward through the final norm unreduced. DTensor kept it partial by
    gathering down's input and weight (and reduce-scattering down's weight gradient); it is
    all-reduced once instead. Before: all_gather x2 and reduce_scatter x2 besides the
    all-reduces; now the forward's all-reduce, the logits' all-gather and the backward's
    all-reduces (bucketed)."""
    collectives = _collectives(_run(TensorParallel(PLAN), 2))
    kinds = [kind for kind, _ in collectives]
    assert "reduce_scatter" not in kinds, collectives
    assert kinds.count("all_gather") == 1, collectives  # the head's replicated logits


def test_fsdp_tp_update_reads_no_gathered_state():
    """Under fsdp_tp the head's weight gradient, computed whole on tp from the replicated
    logits' gradient, is cut to the weight's tp rows before its dp reduce-scatter; the
    update then reads every gradient in its parameter's layout. Before, AdamW gathered
    the head's weight and state over dp and tp after the reduce-scatter. Over tp only the
    logits are gathered; over dp only the parameters (before the forward)."""
    collectives = _collectives(_run(FullyShardTensorParallel(PLAN, mesh_shape=(2, 2)), 4))
    gathers = [i for i, (kind, _) in enumerate(collectives) if kind == "all_gather"]
    assert [collectives[i][1] for i in gathers].count(1) == 1, collectives  # the logits
    # over dp the parameters alone, before the backward (in one bucket or two: since
    # Adam's update is traced as eager's, the bucketing pass splits them in two)
    first_scatter = min(i for i, (kind, _) in enumerate(collectives) if kind == "reduce_scatter")
    assert all(i < first_scatter for i in gathers), collectives
    assert "reduce_scatter" not in [kind for kind, dim in collectives if dim == 1], collectives
    last_scatter = max(i for i, (kind, _) in enumerate(collectives) if kind == "reduce_scatter")
    assert all(kind != "all_gather" for kind, _ in collectives[last_scatter:]), collectives


@pytest.mark.parametrize("mode, world", [
    (TensorParallel(PLAN), 2), (FullyShardTensorParallel(PLAN, mesh_shape=(2, 2)), 4),
], ids=["tp", "fsdp_tp"])
def test_a_replicated_output_layers_weight_gradient_is_computed_on_its_rows(mode, world):  # noqa: ANN001
    """NOTE: [weight gradients computed on the rows kept] in expand/retrace.py: the head's
    logits are replicated, so its output gradient is whole on every tp rank; the weight
    gradient ``mm(t(grad_out), x)`` was computed whole (6 x 8 here) and sliced at the
    update (under fsdp_tp: before the dp reduce-scatter). Now its rows are sliced first:
    no matmul of the program makes a whole (6, 8), and the steps still match one device."""
    step = _run(mode, world)
    matmuls = [
        tuple(n.meta["val"].shape) for n in step.records[0].program.graph_module.graph.nodes
        if n.target is torch.ops.aten.mm.default and "val" in n.meta
    ]
    assert (3, 8) in matmuls and (6, 8) not in matmuls, matmuls
