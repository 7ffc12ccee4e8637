"""split_at_collectives (NOTE: [compute regions]): the collectives stay where the passes put
them, between separately compiled stretches of compute."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx

from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.lower import LoweringOptions, split_at_collectives

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


def _program() -> torch.fx.GraphModule:
    """A folded per-rank program: the all-reduce is issued before the compute that does
    not need it, and waited after it (what schedule_overlap does)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    total = graph.call_function(aten.sum.default, (x,))
    issued = graph.call_function(c10d.all_reduce.default, (total, "sum", "0"))
    hidden = graph.call_function(aten.mul.Tensor, (x, 3.0))
    parts = graph.call_function(aten.split.Tensor, (hidden, 2))
    first = graph.call_function(operator.getitem, (parts, 0))
    view = graph.call_function(aten.view.default, (first, [-1]))
    reduced = graph.call_function(c10d.wait_tensor.default, (issued,))
    out = graph.call_function(aten.div.Tensor, (view, reduced))
    graph.output((out,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _called(outer: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in outer.graph.nodes if n.op == "call_module"]


def test_collectives_run_between_regions_in_program_order():
    outer, compiled = split_at_collectives(_program())

    calls = _called(outer)
    kinds = [type(getattr(outer, name)).__name__ for name in calls]
    # sum | all_reduce | mul, split, getitem, view | wait | div
    assert kinds == ["_CompiledRegion", "GraphModule", "_CompiledRegion", "GraphModule", "_CompiledRegion"]
    assert compiled == 3
    collective = getattr(outer, calls[1])
    assert [n.target for n in collective.graph.nodes if n.op == "call_function"] == [
        c10d.all_reduce.default
    ]
    # the split's list stays inside its region: only tensors cross region boundaries
    middle = getattr(outer, calls[2]).region
    assert operator.getitem in [n.target for n in middle.graph.nodes]


def test_a_region_of_views_only_is_not_compiled():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    issued = graph.call_function(c10d.all_reduce.default, (x, "sum", "0"))
    reduced = graph.call_function(c10d.wait_tensor.default, (issued,))
    flat = graph.call_function(aten.view.default, (reduced, [-1]))
    graph.output((flat,))
    outer, compiled = split_at_collectives(torch.fx.GraphModule(torch.nn.Module(), graph))

    assert compiled == 0
    assert all(isinstance(getattr(outer, n), torch.fx.GraphModule) for n in _called(outer))


def test_regions_choice_by_device_and_refused_with_cuda_graphs():
    # the whole graph by default: measured faster on CPU, the only one measured on CUDA
    assert LoweringOptions("inductor").regions("cpu") is False
    assert LoweringOptions("inductor").regions("cuda") is False
    assert LoweringOptions("inductor", inductor_regions=True).regions("cpu") is True
    assert LoweringOptions("inductor", inductor_regions=True).regions("cuda") is True
    assert LoweringOptions("inductor", cuda_graphs=True).regions("cuda") is False
    with pytest.raises(SPMDCompileError, match="compute regions"):
        LoweringOptions("inductor", cuda_graphs=True, inductor_regions=True)
