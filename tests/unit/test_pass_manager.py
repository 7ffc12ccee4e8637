"""The pass manager: ordering, disabling, checks that name the failing pass."""

from __future__ import annotations

import pytest
import torch
import torch.fx

from spmd_compiler.errors import CREATED_BY
from spmd_compiler.passes import PassFailure, PassOptions, register_pass, run_pipeline
from spmd_compiler.passes.manager import check_program


class _Program:
    """The slice of DistributedProgram the manager touches."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        self.graph_module = gm
        self.passes_applied: list[str] = []
        self.pass_seconds: dict[str, float] = {}


def _tiny_program() -> _Program:
    def f(x):
        y = torch.ops.aten.mul.Tensor(x, 2.0)
        unused = torch.ops.aten.add.Tensor(x, 1.0)  # noqa: F841
        return (y,)

    gm = torch.fx.symbolic_trace(f)
    return _Program(gm)


def test_remove_dead_nodes_changes_then_is_a_no_op():
    program = _tiny_program()
    before = len(program.graph_module.graph.nodes)
    run_pipeline(program, PassOptions(), pipeline=("remove_dead_nodes",))
    assert len(program.graph_module.graph.nodes) == before - 1
    assert program.passes_applied == ["remove_dead_nodes"]
    nodes = len(program.graph_module.graph.nodes)
    run_pipeline(program, PassOptions(), pipeline=("remove_dead_nodes",))
    assert len(program.graph_module.graph.nodes) == nodes


def test_disabled_pass_does_not_run(monkeypatch):
    program = _tiny_program()
    before = len(program.graph_module.graph.nodes)
    run_pipeline(program, PassOptions(disabled=frozenset({"remove_dead_nodes"})),
                 pipeline=("remove_dead_nodes",))
    assert len(program.graph_module.graph.nodes) == before
    monkeypatch.setenv("SPMD_DISABLE_PASSES", "remove_dead_nodes")
    run_pipeline(program, PassOptions(), pipeline=("remove_dead_nodes",))
    assert len(program.graph_module.graph.nodes) == before
    assert program.passes_applied == []


def test_broken_pass_is_named_with_passes_before_it():
    @register_pass("test_break_graph", "uses a collective's result without its wait")
    def _break(program, context):
        graph = program.graph_module.graph
        x = next(n for n in graph.nodes if n.op == "placeholder")
        out = graph.output_node()
        with graph.inserting_before(out):
            ar = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
            use = graph.call_function(torch.ops.aten.add.Tensor, (ar, 1.0))
        out.args = ((use,),)
        return True

    program = _tiny_program()
    with pytest.raises(PassFailure, match=r"test_break_graph.*remove_dead_nodes"):
        run_pipeline(program, PassOptions(), pipeline=("remove_dead_nodes", "test_break_graph"))


def test_nodes_created_by_a_pass_carry_its_name():
    @register_pass("test_add_node", "appends a multiply")
    def _add(program, context):
        graph = program.graph_module.graph
        out = graph.output_node()
        (value,) = out.args[0]
        with graph.inserting_before(out):
            new = graph.call_function(torch.ops.aten.mul.Tensor, (value, 3.0))
        out.args = ((new,),)
        return True

    program = _tiny_program()
    run_pipeline(program, PassOptions(), pipeline=("test_add_node",))
    created = [n for n in program.graph_module.graph.nodes if n.meta.get(CREATED_BY) == "test_add_node"]
    assert len(created) == 1
    assert program.graph_module(torch.ones(2))[0].tolist() == [6.0, 6.0]


def test_check_program_accepts_waited_collectives():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    ar = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", "0"))
    wait = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (ar,))
    graph.output((wait,))
    check_program(torch.fx.GraphModule(torch.nn.Module(), graph))
