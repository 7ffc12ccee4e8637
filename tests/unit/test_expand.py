"""Expansion on tiny steps: collectives, memoization, placements in node.meta."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.ir.node_meta import ORIGIN, PLACEMENT
from spmd_compiler.passes.manager import check_program
from spmd_compiler.tools.demo.steps import classification_train_step

_step = classification_train_step


def _compiled_mlp(world_size: int, optimizer=torch.optim.AdamW):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
    optim = optimizer(model.parameters(), lr=1e-2)
    step = sc.compile(disable_passes=("bucket_collectives",))(_step)  # expansion's own output
    with sc.simulate(world_size):
        for _ in range(2):
            step(model, optim, torch.randn(8, 8), torch.randint(0, 4, (8,)))
    return model, step


def test_each_gradient_is_all_reduced_exactly_once():
    model, step = _compiled_mlp(4)
    stats = collective_stats(step.last_program.graph_module)
    grad_bytes = sum(p.numel() * 4 for p in model.parameters())
    # one all-reduce per gradient, plus the returned loss and the loss's total weight
    n_params = len(list(model.parameters()))
    assert stats.counts == {"all_reduce": n_params + 2}
    assert stats.bytes["all_reduce"] == grad_bytes + 4 + 4


def test_world_size_one_has_no_collectives():
    _, step = _compiled_mlp(1)
    assert collective_stats(step.last_program.graph_module).total_count == 0


def test_every_collective_is_waited_before_use():
    _, step = _compiled_mlp(2)
    check_program(step.last_program.graph_module)


def test_nodes_record_placement_and_origin():
    _, step = _compiled_mlp(2)
    gm = step.last_program.graph_module
    placements = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.addmm.default:
            placements[node.name] = node.meta[PLACEMENT]
            assert node.meta[ORIGIN].startswith("addmm")
    # activations of a batch-sharded step stay sharded on the batch dimension
    assert placements and all(p == (Shard(0),) for p in placements.values())
    inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    assert inputs[0].meta[PLACEMENT] == (Replicate(),)
    assert inputs[-1].meta[PLACEMENT] == (Shard(0),)


def test_program_inputs_are_local_shapes():
    _, step = _compiled_mlp(4)
    program = step.last_program
    batch = program.local_inputs[-2]
    assert batch.shape == (2, 8)  # global batch 8 over 4 ranks


# A custom op whose integer argument is a size read off the global shape (like group
# norm's N): its local kernel, run by DTensor with that integer unchanged, returns the
# wrong number of rows (NOTE: [local shape check]).
# FRAGMENT, defined once: safe if this module is imported twice
_LIB = torch.library.Library("spmd_test_expand", "FRAGMENT")


def _rows_like(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.sum(0, keepdim=True).expand(n, -1).clone()


if not hasattr(torch.ops.spmd_test_expand, "rows_like"):
    _LIB.define("rows_like(Tensor x, SymInt n) -> Tensor")
    _LIB.impl("rows_like", _rows_like, "CompositeExplicitAutograd")
    _LIB.impl("rows_like", lambda x, n: x.new_empty((n, x.shape[1])), "Meta")


def _register_rows_like_sharding() -> None:
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.spmd_test_expand.rows_like.default)
    def _(x, n):  # noqa: ANN001, ANN202 - the claim the kernel breaks: rows follow x's
        return [([Shard(0)], [Shard(0), None]), ([Replicate()], [Replicate(), None])]


def test_a_local_result_of_the_wrong_shape_is_refused_with_the_node_named():
    _register_rows_like_sharding()

    def step(model, optim, x, y):  # noqa: ANN001
        weights = torch.ops.spmd_test_expand.rows_like(x, x.shape[0])
        loss = model(x).mean() * weights.mean()  # without the check: no error, a wrong loss
        loss.backward()
        optim.step()
        return loss

    model = nn.Linear(8, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile()(step)
    with sc.simulate(2), pytest.raises(sc.SPMDCompileError) as info:
        compiled(model, optim, torch.randn(8, 8), torch.randint(0, 4, (8,)))
    message = str(info.value)
    assert "local result with shape (8, 8)" in message and "(4, 8)" in message
    assert "rows_like" in message and "test_expand.py" in message


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    return x.sum(1, keepdim=True)


if not hasattr(torch.ops.spmd_test_expand, "row_sums"):
    _LIB.define("row_sums(Tensor x) -> Tensor")
    _LIB.impl("row_sums", _row_sums, "CompositeExplicitAutograd")
    _LIB.impl("row_sums", lambda x: x.new_empty((x.shape[0], 1)), "Meta")


def test_a_wrong_local_result_on_an_unevenly_sharded_output_is_refused():
    """A rule placing the (8, 1) result on its size-1 dimension (uneven over 2 ranks) while
    the kernel keeps the rows local: the rows are still checked (an unevenly sharded output
    was not checked at all before 2026-12-02, so the wrong result was silent)."""
    from torch.distributed.tensor.experimental import register_sharding

    @register_sharding(torch.ops.spmd_test_expand.row_sums.default)
    def _(x):  # noqa: ANN001, ANN202 - the wrong claim: the result's columns follow x's rows
        return [([Shard(1)], [Shard(0)]), ([Replicate()], [Replicate()])]

    def step(model, optim, x, y):  # noqa: ANN001
        loss = model(x).mean() * torch.ops.spmd_test_expand.row_sums(x).mean()
        loss.backward()
        optim.step()
        return loss

    model = nn.Linear(8, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.simulate(2), pytest.raises(sc.SPMDCompileError) as info:
        sc.compile()(step)(model, optim, torch.randn(8, 8), torch.randint(0, 4, (8,)))
    message = str(info.value)
    assert "local result with shape (4, 1)" in message and "(8, '?')" in message
