"""merge_regathers: a re-gather whose gap holds the peak stays; one that saves nothing goes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from collective_pass_harness import TOL, DataParallelWithPasses, TinyGraph, mlp_setup, ops, train

from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.passes import PassOptions, run_pipeline
from spmd_compiler.passes.live_bytes import live_bytes

aten = torch.ops.aten
PASS = ("merge_regathers",)


def _forward_then_backward(g: TinyGraph, peak_in_gap: bool):
    """forward gathers ``shard``, a large activation lives either across the gap (dying
    before backward's re-gather) or beside backward's copy; backward gathers again."""
    shard, batch = g.input("shard", 2, 3), g.input("batch", 64, 3)
    forward = g.all_gather("forward", shard)
    forward_use = g.op("forward_use", aten.mul.Tensor, forward, 2.0)
    outputs = [forward_use]
    if peak_in_gap:
        activation = g.op("activation", aten.mul.Tensor, batch, 2.0)
        outputs.append(g.op("reduced", aten.sum.default, activation))
    backward = g.all_gather("backward", shard)
    if not peak_in_gap:
        activation = g.op("activation", aten.mul.Tensor, batch, 2.0)
    backward_use = g.op("backward_use", aten.mul.Tensor, backward, 3.0)
    if not peak_in_gap:
        outputs.append(g.op("reduced", aten.sum.default, activation))
    return forward, backward_use, g.program(*outputs, backward_use)


def test_a_regather_whose_gap_holds_the_peak_stays():
    g = TinyGraph()
    forward, backward_use, program = _forward_then_backward(g, peak_in_gap=True)
    code = program.graph_module.code

    run_pipeline(program, PassOptions(), pipeline=PASS)

    assert [n.name for n in ops(program.graph, "all_gather")] == ["forward", "backward"]
    assert program.graph_module.code == code


def test_a_regather_that_lowers_no_peak_goes():
    g = TinyGraph()
    forward, backward_use, program = _forward_then_backward(g, peak_in_gap=False)
    peak = live_bytes(program.graph).peak

    run_pipeline(program, PassOptions(), pipeline=PASS)

    assert [n.name for n in ops(program.graph, "all_gather")] == ["forward"]
    assert backward_use.args[0] is forward
    assert "backward_group" not in program.names()  # its group node went with it
    assert live_bytes(program.graph).peak <= peak


def test_a_shard_written_in_between_is_gathered_again():
    g = TinyGraph()
    shard = g.input("shard", 2, 3)
    forward = g.all_gather("forward", shard)
    forward_use = g.op("forward_use", aten.mul.Tensor, forward, 2.0)
    g.op("update", aten.add_.Tensor, shard, 1.0)  # the shard changes: the copy is stale
    backward = g.all_gather("backward", shard)
    backward_use = g.op("backward_use", aten.mul.Tensor, backward, 3.0)
    program = g.program(forward_use, backward_use)

    run_pipeline(program, PassOptions(), pipeline=PASS)

    assert len(ops(program.graph, "all_gather")) == 2


def test_an_earlier_gather_unpacked_after_the_readers_is_not_read_early():
    """The earlier gather is issued first but its result is defined after the later
    gather's reader (an earlier bucket unpacked where first read): pointing that reader at
    it would read a value before it exists, so the later gather stays (the pass failed
    its graph check under fsdp_tp 2x2 with SGD's momentum)."""
    g = TinyGraph()
    shard = g.input("shard", 2, 3)
    first = g.all_gather("first", shard)
    second = g.all_gather("second", shard)
    second_use = g.op("second_use", aten.mul.Tensor, second, 3.0)
    second_use.append(first)  # the earlier result, unpacked after the later reader
    first_use = g.op("first_use", aten.mul.Tensor, first, 2.0)
    program = g.program(second_use, first_use)

    run_pipeline(program, PassOptions(), pipeline=PASS)

    program.graph.lint()
    assert [n.name for n in ops(program.graph, "all_gather")] == ["first", "second"]
    assert second_use.args[0] is second


def _plain_mlp_setup():
    """Linear, GELU, Linear: only the second weight is read again in backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 8, generator=gen), torch.randint(0, 8, (16,), generator=gen))
        for _ in range(2)
    ]
    return model, optim, batches


@pytest.mark.parametrize("bucketed", [False, True], ids=["lone", "bucketed"])
def test_the_last_layers_regather_goes_and_training_is_exact(bucketed: bool):
    # The second Linear's weight is read last in forward and first in backward: keeping
    # forward's copy costs nothing at the peak, so backward gathers nothing again.
    passes = ("bucket_collectives",) * bucketed + PASS
    without = train(DataParallelWithPasses("fully_shard", passes[:-1]), _plain_mlp_setup)
    run = train(DataParallelWithPasses("fully_shard", passes), _plain_mlp_setup)
    gathered = collective_stats(run.step.last_program.graph_module)
    before = collective_stats(without.step.last_program.graph_module)
    n_params = len(list(run.model.parameters()))
    assert before.counts["all_gather"] == (2 if bucketed else n_params + 1)
    assert gathered.counts["all_gather"] == (1 if bucketed else n_params)
    assert gathered.bytes["all_gather"] == sum(p.numel() * 4 for p in run.model.parameters())
    assert live_bytes(run.graph).peak <= live_bytes(without.graph).peak
    assert run.max_loss_difference < TOL and run.max_state_difference < TOL
    assert run.losses == without.losses  # the same values, read from forward's copies


def _weight_normed_setup():
    """Linear, Tanh, and a weight-normed Linear(16, 4): backward re-gathers its ``v`` (one
    row a rank) and ``g`` (one element) in one bucket."""
    _, _, batches = _plain_mlp_setup()
    torch.manual_seed(0)
    last = torch.nn.utils.parametrizations.weight_norm(nn.Linear(16, 4))
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), last)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    return model, optim, [(x, y % 4) for x, y in batches]


def test_a_bucket_whose_members_are_copied_to_contiguous_merges():
    """bucket_collectives copies a one-row member's columns before reshaping them (NOTE:
    [bucket results stay contiguous]); the re-gather bucket goes with its copies."""
    passes = ("bucket_collectives",) + PASS
    without = train(DataParallelWithPasses("fully_shard", passes[:-1]), _weight_normed_setup)
    run = train(DataParallelWithPasses("fully_shard", passes), _weight_normed_setup)
    # forward: g, v, bias; backward: g, v
    assert len(ops(without.graph, "clone")) == 5
    assert collective_stats(without.step.last_program.graph_module).counts["all_gather"] == 2
    assert len(ops(run.graph, "clone")) == 3
    assert collective_stats(run.step.last_program.graph_module).counts["all_gather"] == 1
    assert run.max_loss_difference < TOL and run.max_state_difference < TOL
    assert run.losses == without.losses


def test_a_norm_whose_gap_holds_the_peak_is_gathered_again():
    # mlp_setup's LayerNorm sits early: its weight and bias would be alive at the loss,
    # where this program peaks; the last Linear's weight goes
    run = train(DataParallelWithPasses("fully_shard", PASS), mlp_setup)
    n_params = len(list(run.model.parameters()))
    assert collective_stats(run.step.last_program.graph_module).counts["all_gather"] == n_params + 2
    assert run.max_loss_difference < TOL and run.max_state_difference < TOL


def _deep_setup():
    """Six wide layers on a batch whose activations dwarf the parameters: early layers'
    copies would be alive at the peak (the end of forward)."""
    torch.manual_seed(0)
    layers = [m for _ in range(6) for m in (nn.Linear(16, 16), nn.Tanh())]
    model = nn.Sequential(*layers, nn.Linear(16, 8))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(256, 16, generator=gen), torch.randint(0, 8, (256,), generator=gen))]
    return model, optim, batches


def test_early_layers_are_gathered_again_where_the_peak_needs_it():
    run = train(DataParallelWithPasses("fully_shard", PASS), _deep_setup)
    without = train(DataParallelWithPasses("fully_shard", ()), _deep_setup)
    kept = collective_stats(run.step.last_program.graph_module).counts["all_gather"]
    all_regathers = collective_stats(without.step.last_program.graph_module).counts["all_gather"]
    n_params = len(list(run.model.parameters()))
    # some re-gathers went (the last layer's), not all: the first layers' stay
    assert n_params < kept < all_regathers
    assert live_bytes(run.graph).peak <= live_bytes(without.graph).peak
    assert run.max_loss_difference < TOL and run.max_state_difference < TOL


def test_low_precision_casts_of_a_shard_are_one_source():
    # bf16 parameters: each gather reads a cast of the shard; forward's and backward's
    # casts are separate nodes of the same values, so the re-gather still goes
    from spmd_compiler.parallel_modes import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(torch.bfloat16)
    passes = ("bucket_collectives", *PASS)
    run = train(DataParallelWithPasses("fully_shard", passes, mp_policy=policy), _plain_mlp_setup)
    without = train(
        DataParallelWithPasses("fully_shard", passes[:-1], mp_policy=policy), _plain_mlp_setup
    )
    assert collective_stats(run.step.last_program.graph_module).counts["all_gather"] == 1
    assert collective_stats(without.step.last_program.graph_module).counts["all_gather"] == 2
    assert run.losses == without.losses
