"""NOTE: [buckets reduced in place by Inductor]: a program in which a part of an
all-reduced bucket is also read by another node is found (and lowered by compute
regions); the usual bucket, whose parts only its ``cat`` reads, is not."""

from __future__ import annotations

import torch
import torch.fx

from spmd_compiler.reduction_aliasing import bucket_part_read_elsewhere

aten = torch.ops.aten
all_reduce = torch.ops._c10d_functional.all_reduce.default
wait = torch.ops._c10d_functional.wait_tensor.default


def _program(read_part_again: bool, seed_from_part: bool = False) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    weight_grad = graph.placeholder("weight_grad")
    activations = graph.placeholder("activations")
    scale = graph.placeholder("scale")
    bias_grad = graph.call_function(aten.sum.dim_IntList, (activations, [0]))
    bias_part = graph.call_function(aten.view.default, (bias_grad, [-1]))
    weight_part = graph.call_function(aten.view.default, (weight_grad, [-1]))
    bucket = graph.call_function(aten.cat.default, ([weight_part, bias_part],))
    reduced = graph.call_function(wait, (graph.call_function(all_reduce, (bucket, "sum", "0")),))
    outputs = [reduced]
    if read_part_again:  # the local bias gradient, scaled after the bucket's reduction
        outputs.append(graph.call_function(aten.mul.Tensor, (bias_grad, scale)))
    if seed_from_part:  # as backward's seed ones_like(loss) reads the loss: its shape only
        outputs.append(graph.call_function(aten.ones_like.default, (bias_grad,)))
    graph.output(tuple(outputs))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_a_bucket_part_read_after_the_reduction_is_found():
    found = bucket_part_read_elsewhere(_program(read_part_again=True))
    assert found is not None and found.target is all_reduce


def test_the_usual_bucket_is_not():
    assert bucket_part_read_elsewhere(_program(read_part_again=False)) is None


def test_a_part_whose_other_reader_reads_only_its_shape_is_not():
    assert bucket_part_read_elsewhere(_program(read_part_again=False, seed_from_part=True)) is None
    found = bucket_part_read_elsewhere(_program(read_part_again=True, seed_from_part=True))
    assert found is not None
