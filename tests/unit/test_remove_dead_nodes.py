"""remove_dead_nodes: dead pure nodes and dead constant ``detach_`` go (NOTE: [traced mesh
constants]); live ``detach_`` stays; bucketing then sees no barrier."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from collective_pass_harness import TinyGraph, ops

from spmd_compiler.passes.bucket_collectives import BucketOptions, bucket_collectives
from spmd_compiler.passes.remove_dead_nodes import remove_dead_nodes

aten = torch.ops.aten


def _dead_mesh_constant(g: TinyGraph, name: str) -> None:
    # the harness root has one attribute, "mesh"; any get_attr stands in for the constant
    const = g.graph.create_node("get_attr", "mesh", name=f"{name}_tensor")
    fresh = g.graph.create_node("call_function", aten.lift_fresh_copy.default, (const,), name=f"{name}_lift")
    g.graph.create_node("call_function", aten.detach_.default, (fresh,), name=f"{name}_detach")


def _program_with_constant_between_gathers() -> tuple:
    g = TinyGraph()
    a, b = g.input("a", 4, 2), g.input("b", 4, 2)
    ga = g.all_gather("ga", a)
    use_a = g.op("use_a", aten.mul.Tensor, ga, 2.0)
    _dead_mesh_constant(g, "mesh0")
    gb = g.all_gather("gb", b)
    use_b = g.op("use_b", aten.mul.Tensor, gb, 3.0)
    program = g.program(use_a, use_b)
    return program


def test_dead_constant_detach_is_erased_and_gathers_then_bucket():
    program = _program_with_constant_between_gathers()
    context = SimpleNamespace(options=BucketOptions())
    # the detach_ is a side effect: the two gathers cannot share a bucket across it
    assert len(ops(program.graph, "all_gather")) == 2
    assert remove_dead_nodes(program, SimpleNamespace()) is True
    assert not ops(program.graph, "detach_") and not ops(program.graph, "lift_fresh")
    assert remove_dead_nodes(program, SimpleNamespace()) is False
    bucket_collectives(program, context)
    assert len(ops(program.graph, "all_gather")) == 1


def test_barrier_keeps_gathers_apart_without_the_removal():
    program = _program_with_constant_between_gathers()
    bucket_collectives(program, SimpleNamespace(options=BucketOptions()))
    assert len(ops(program.graph, "all_gather")) == 2


def test_detach_of_a_used_value_stays():
    g = TinyGraph()
    x = g.input("x", 4)
    y = g.op("y", aten.mul.Tensor, x, 2.0)
    g.graph.create_node("call_function", aten.detach_.default, (y,), name="det")
    program = g.program(y)
    assert remove_dead_nodes(program, SimpleNamespace()) is False
    assert len(ops(program.graph, "detach_")) == 1
