"""remove_noop_reshapes: same-shape reshapes go, real ones stay; parity on and off."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from collective_pass_harness import TOL, DataParallelWithPasses, TinyGraph, ops, train

from spmd_compiler.passes.remove_noop_reshapes import remove_noop_reshapes
from spmd_compiler.tools.demo.gpt import gpt_train_step
from spmd_compiler.tools.demo.run import DemoConfig, build

aten = torch.ops.aten
PASS = ("remove_noop_reshapes",)


def test_same_shape_reshapes_are_replaced_by_their_input():
    g = TinyGraph()
    x = g.input("x", 4, 6)
    same = g.op("same", aten.reshape.default, x, [4, 6])
    also_same = g.op("also_same", aten.view.default, same, [4, 6])
    flat = g.op("flat", aten.reshape.default, also_same, [24])
    out = g.op("out", aten.mul.Tensor, flat, 2.0)
    program = g.program(out, also_same)
    assert remove_noop_reshapes(program, SimpleNamespace()) is True
    names = [n.name for n in program.graph_module.graph.nodes]
    assert names == ["x", "flat", "out", "output"]
    flat_node = next(n for n in program.graph_module.graph.nodes if n.name == "flat")
    assert flat_node.args[0].name == "x"
    # the graph output that was a no-op view is now the input itself
    assert program.graph_module.graph.output_node().args[0][1].name == "x"
    assert remove_noop_reshapes(program, SimpleNamespace()) is False


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_demo_gpt_parity_and_fewer_nodes(on):
    run = train(
        DataParallelWithPasses("replicate", PASS if on else ()),
        lambda: build(DemoConfig(steps=2, n_head=4)),
        step_fn=gpt_train_step,
    )
    assert run.max_loss_difference < TOL and run.max_state_difference < TOL
    same = [
        n for n in ops(run.graph, "reshape")
        if tuple(n.args[0].meta["val"].shape) == tuple(n.meta["val"].shape)
    ]
    assert (not same) if on else len(same) > 100
