"""remove_duplicate_collectives: duplicates go, different or re-gathered ones stay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.fx
from collective_pass_harness import TOL, DataParallelWithPasses, TinyGraph, ops, train

from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.passes import PassOptions, register_pass, run_pipeline
from spmd_compiler.passes.collective_graph import wait_of
from spmd_compiler.passes.manager import is_collective
from spmd_compiler.passes.remove_duplicate_collectives import remove_duplicate_collectives

aten = torch.ops.aten
PASS = ("remove_duplicate_collectives",)


@register_pass(
    "test_duplicate_collectives",
    "test only: each collective's last user reads a fresh copy of it",
    changes_collectives=True,
)
def _duplicate_collectives(program, context) -> bool:
    graph = program.graph_module.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.nodes if is_collective(n)]:
        wait = wait_of(node)
        last = max(wait.users, key=position.__getitem__)
        with graph.inserting_before(last):
            copy_wait = _copy_with_fresh_group(graph, node, wait)
        last.replace_input_with(wait, copy_wait)
    return True


def _copy_with_fresh_group(graph: torch.fx.Graph, node: torch.fx.Node, wait: torch.fx.Node):
    group = node.args[-1]
    mesh = graph.node_copy(group.args[0])  # a fresh group, as expansion makes them
    copy_group = graph.node_copy(group, lambda a: mesh)
    copy = graph.node_copy(node, lambda a: copy_group if a is group else a)
    return graph.node_copy(wait, lambda a: copy)


def test_duplicate_in_an_equal_group_is_removed():
    g = TinyGraph()
    x = g.input("x", 8)
    first = g.all_reduce("first", x)
    use_1 = g.op("use_1", aten.mul.Tensor, first, 2.0)
    second = g.all_reduce("second", x)  # its own get_attr + mesh_get_process_group
    use_2 = g.op("use_2", aten.add.Tensor, second, 1.0)
    program = g.program(use_1, use_2)

    run_pipeline(program, PassOptions(), pipeline=PASS)

    # the duplicate and its group nodes are gone; its user reads the first result
    assert program.names() == ["first_mesh", "first_group", "first", "first_wait", "use_1", "use_2"]
    assert use_2.args[0] is first


def test_other_reduce_op_or_input_is_no_duplicate_and_the_pass_is_a_no_op():
    g = TinyGraph()
    x, y = g.input("x", 8), g.input("y", 8)
    outs = [g.all_reduce("sum_x", x), g.all_reduce("avg_x", x, "avg"), g.all_reduce("sum_y", y)]
    program = g.program(*outs)
    code = program.graph_module.code

    assert remove_duplicate_collectives(program, SimpleNamespace()) is False
    assert program.graph_module.code == code
    assert len(ops(program.graph, "all_reduce")) == 3


def test_gather_again_after_last_use_is_kept_but_a_live_duplicate_goes():
    g = TinyGraph()
    shard = g.input("shard", 2, 3)
    forward = g.all_gather("forward", shard)
    forward_use = g.op("forward_use", aten.mul.Tensor, forward, 2.0)
    backward = g.all_gather("backward", shard)  # forward's copy is dead: a re-gather
    backward_use = g.op("backward_use", aten.mul.Tensor, backward, 3.0)
    live = g.all_gather("live", shard)  # backward's copy is still used below: a duplicate
    both = g.op("both", aten.add.Tensor, backward, live)
    program = g.program(forward_use, backward_use, both)

    run_pipeline(program, PassOptions(), pipeline=PASS)

    assert [n.name for n in ops(program.graph, "all_gather")] == ["forward", "backward"]
    assert both.args == (backward, backward)


@pytest.mark.parametrize("remove", [False, True], ids=["off", "on"])
def test_parity_with_duplicated_collectives(remove):
    passes = ("test_duplicate_collectives",) + (PASS if remove else ())
    run = train(DataParallelWithPasses("replicate", passes))
    n_params = len(list(run.model.parameters()))
    # one all-reduce per gradient plus the loss and its total weight, twice without the pass
    want = n_params + 2
    assert collective_stats(run.step.last_program.graph_module).counts == {
        "all_reduce": want if remove else 2 * want
    }
    assert run.max_loss_difference < TOL and run.max_state_difference < TOL


def test_fully_shard_regathers_are_kept():
    run = train(DataParallelWithPasses("fully_shard", ()))
    program = run.step.last_program
    code = program.graph_module.code
    gathers = collective_stats(program.graph_module).counts["all_gather"]
    # every parameter gathered in forward; backward gathers again the LayerNorm weight and
    # bias and the last Linear's weight (reshard_after_forward)
    assert gathers == len(list(run.model.parameters())) + 3
    assert remove_duplicate_collectives(program, SimpleNamespace()) is False
    assert program.graph_module.code == code
