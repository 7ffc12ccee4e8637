"""The ParallelMode contract, called directly: ``placement_of``, ``placement_at_use``
(typed ``UseStep``s) and ``local_batch`` of every mode on a small MLP.

Placements are compared in their short form (``format_placements``): ``S(0)``, ``R``,
``SS(0,2)`` (a _StridedShard: FSDP's dp split of a TP shard).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.capture.bindings import find_bindings
from spmd_compiler.expand.retrace import format_placements
from spmd_compiler.ir.graph_utils import placeholders
from spmd_compiler.ir.node_meta import OPTIMIZER_PHASE, PHASE
from spmd_compiler.ir.signature import Kind, StateRef, TensorMeta
from spmd_compiler.ir.use_step import UseGroup, UseStep
from spmd_compiler.parallel_modes import (
    DataParallel,
    DTensorExpandMode,
    FullyShardTensorParallel,
    MixedPrecisionPolicy,
    TensorParallel,
)
from spmd_compiler.tools.demo.steps import classification_train_step

WORLD, BATCH, FEATURES, CLASSES = 4, 8, 8, 4
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}
PARAMS = ("0.weight", "0.bias", "2.weight", "2.bias")

MODES = {
    "dtensor_expand": DTensorExpandMode,
    "ddp": lambda: DataParallel("replicate"),
    "fsdp": lambda: DataParallel("fully_shard"),
    "tp": lambda: TensorParallel(PLAN),
    "fsdp_tp": lambda: FullyShardTensorParallel(PLAN, mesh_shape=(2, 2)),
}

# mode -> {batch input x, target y, each parameter (its gradient and optimizer state alike)}
EXPECTED = {
    "dtensor_expand": {"x": "[S(0)]", "y": "[S(0)]", **dict.fromkeys(PARAMS, "[R]")},
    "ddp": {"x": "[S(0)]", "y": "[S(0)]", **dict.fromkeys(PARAMS, "[R]")},
    "fsdp": {"x": "[S(0)]", "y": "[S(0)]", **dict.fromkeys(PARAMS, "[S(0)]")},
    "tp": {
        "x": "[R]", "y": "[R]",
        "0.weight": "[S(0)]", "0.bias": "[S(0)]", "2.weight": "[S(1)]", "2.bias": "[R]",
    },
    "fsdp_tp": {
        "x": "[S(0), R]", "y": "[S(0), R]",
        "0.weight": "[SS(0,2), S(0)]", "0.bias": "[SS(0,2), S(0)]",
        "2.weight": "[S(0), S(1)]", "2.bias": "[S(0), R]",
    },
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return torch.randn(BATCH, FEATURES, generator=gen), torch.randint(0, CLASSES, (BATCH,), generator=gen)


@pytest.mark.parametrize("name", list(MODES))
def test_placement_of_every_kind(name: str) -> None:
    mode, model = MODES[name](), _model()
    optim = torch.optim.AdamW(model.parameters())
    x, y = _batch()
    expected = EXPECTED[name]
    with sc.simulate(WORLD):
        mesh = mode.mesh("cpu")
        mode.prepare(find_bindings(classification_train_step, (model, optim, x, y), {}))
        got = {
            key: format_placements(mode.placement_of(StateRef(Kind.INPUT, index=i), TensorMeta.of(t), mesh))
            for i, (key, t) in enumerate([("x", x), ("y", y)])
        }
        for pname, p in model.named_parameters():
            meta = TensorMeta.of(p)
            refs = [
                StateRef(Kind.PARAM, pname),
                StateRef(Kind.GRAD, pname),
                StateRef(Kind.OPTIM_STATE, pname, key="exp_avg", optimizer=0),
            ]
            placements = {format_placements(mode.placement_of(ref, meta, mesh)) for ref in refs}
            assert len(placements) == 1, f"{name}: {pname}'s param, grad and exp_avg differ: {placements}"
            got[pname] = placements.pop()
            # 0-d state (Adam's step count) and hyper-parameters are whole on every rank
            scalar = TensorMeta((), torch.float32, torch.device("cpu"))
            step_ref = StateRef(Kind.OPTIM_STATE, pname, key="step", optimizer=0)
            assert set(mode.placement_of(step_ref, scalar, mesh)) == {Replicate()}
        lr = StateRef(Kind.HYPERPARAM, key="lr", optimizer=0, group=0)
        assert set(mode.placement_of(lr, TensorMeta((), torch.float64, torch.device("cpu")), mesh)) == {Replicate()}
    assert got == expected


def _compiled(mode):
    """The captured step and mesh of one compiled call of ``mode`` on the MLP."""
    model = _model()
    optim = torch.optim.AdamW(model.parameters())
    step = sc.compile(parallel_mode=mode)(classification_train_step)
    with sc.simulate(WORLD):
        step(model, optim, *_batch())
    program = step.last_program
    return program.captured, program.mesh


def _uses(captured, hook):
    """(consumer, arg, steps) for every use of every node of the captured graph."""
    out = []
    for node in captured.graph_module.graph.nodes:
        for arg in node.all_input_nodes:
            out.append((node, arg, hook(node, arg)))
    return out


def _params(captured) -> dict:
    refs = captured.input_refs()
    return {
        node: ref.name
        for node, ref in zip(placeholders(captured.graph_module), refs, strict=True)
        if ref.kind is Kind.PARAM
    }


@pytest.mark.parametrize("name", ["dtensor_expand", "ddp"])
def test_no_use_steps_without_sharded_state(name: str) -> None:
    captured, mesh = _compiled(MODES[name]())
    assert MODES[name]().placement_at_use(captured, mesh) is None


@pytest.mark.parametrize("reshard", [True, False], ids=["reshard_after_forward", "keep"])
def test_fully_shard_gathers_parameters_at_use(reshard: bool) -> None:
    mode = DataParallel("fully_shard", reshard_after_forward=reshard)
    captured, mesh = _compiled(mode)
    params = _params(captured)
    groups: dict[str, set[UseGroup]] = {}
    for consumer, arg, steps in _uses(captured, mode.placement_at_use(captured, mesh)):
        if arg not in params or consumer.meta.get(PHASE) == OPTIMIZER_PHASE:
            assert steps is None, f"{consumer} reading {arg}: {steps}"
            continue
        [step] = steps
        assert step.placements == (Replicate(),) and step.redistribute is None
        groups.setdefault(params[arg], set()).add(step.group)
    if reshard:
        # 2.weight is read again in backward (the gradient of the hidden activation)
        assert groups == {
            "0.weight": {UseGroup.FORWARD}, "0.bias": {UseGroup.FORWARD},
            "2.weight": {UseGroup.FORWARD, UseGroup.BACKWARD}, "2.bias": {UseGroup.FORWARD},
        }
    else:
        assert groups == dict.fromkeys(PARAMS, {UseGroup.COMPUTE})


@pytest.mark.parametrize("style, reduced", [("replicate", "[R]"), ("fully_shard", "[S(0)]")])
def test_low_precision_gradients_are_reduced_before_the_cast(style: str, reduced: str) -> None:
    mode = DataParallel(style, mp_policy=MixedPrecisionPolicy(torch.bfloat16))
    captured, mesh = _compiled(mode)
    reduce_steps = [
        (consumer, steps[0])
        for consumer, arg, steps in _uses(captured, mode.placement_at_use(captured, mesh))
        if steps and steps[0].group is UseGroup.REDUCE
    ]
    assert len(reduce_steps) == len(PARAMS)  # one per gradient
    for consumer, step in reduce_steps:
        assert consumer.target is torch.ops.aten._to_copy.default
        assert format_placements(step.placements) == reduced


def _short(placements) -> str:
    """``format_placements`` that shows a None (keep this mesh dimension) as None."""
    return "[" + ", ".join("None" if p is None else format_placements([p])[1:-1] for p in placements) + "]"


def _layout_steps(captured, hook) -> set[tuple[UseGroup, str, str]]:
    return {
        (step.group, step.module, _short(step.placements))
        for _, _, steps in _uses(captured, hook)
        for step in steps or ()
        if step.placements is not None
    }


def test_tensor_parallel_lays_out_module_boundaries() -> None:
    mode = TensorParallel(PLAN)
    captured, mesh = _compiled(mode)
    assert _layout_steps(captured, mode.placement_at_use(captured, mesh)) == {
        (UseGroup.MODULE_INPUT, "0", "[R]"),  # colwise: whole input
        (UseGroup.MODULE_OUTPUT, "0", "[S(1)]"),  # colwise: features sharded
        (UseGroup.MODULE_INPUT, "2", "[S(1)]"),  # rowwise: features sharded
        (UseGroup.MODULE_OUTPUT, "2", "[R]"),  # rowwise: all-reduced
    }


def test_fsdp_tp_gathers_over_dp_and_lays_out_on_tp() -> None:
    mode = FullyShardTensorParallel(PLAN, mesh_shape=(2, 2))
    captured, mesh = _compiled(mode)
    hook = mode.placement_at_use(captured, mesh)
    params = _params(captured)
    by_mode: dict[UseGroup, int] = {}
    for consumer, arg, steps in _uses(captured, hook):
        if arg in params and consumer.meta.get(PHASE) != OPTIMIZER_PHASE:
            [step] = steps
            assert step.redistribute is not None and step.group in (UseGroup.FORWARD, UseGroup.BACKWARD)
        for step in steps or ():
            if step.redistribute is not None:
                by_mode[step.group] = by_mode.get(step.group, 0) + 1
    assert by_mode[UseGroup.REDUCE] >= len(PARAMS)  # gradients reduce-scattered over dp
    assert _layout_steps(captured, hook) == {
        (UseGroup.MODULE_INPUT, "0", "[None, R]"),  # dp keeps the batch sharding
        (UseGroup.MODULE_OUTPUT, "0", "[None, S(1)]"),
        (UseGroup.MODULE_INPUT, "2", "[None, S(1)]"),
        (UseGroup.MODULE_OUTPUT, "2", "[None, R]"),
    }


def test_use_step_is_checked() -> None:
    with pytest.raises(ValueError, match="either placements or redistribute"):
        UseStep(UseGroup.COMPUTE)
    with pytest.raises(ValueError, match="either placements or redistribute"):
        UseStep(UseGroup.COMPUTE, (Replicate(),), redistribute=lambda v: v)
    with pytest.raises(ValueError, match="needs module"):
        UseStep(UseGroup.MODULE_INPUT, (Replicate(),))
    with pytest.raises(ValueError, match="takes no module"):
        UseStep(UseGroup.FORWARD, (Replicate(),), module="0")
    step = UseStep(UseGroup.MODULE_OUTPUT, [Shard(1)], module="layers.0.mlp")
    assert step.placements == (Shard(1),) and str(step) == "out of layers.0.mlp"
    assert step.key != UseStep(UseGroup.MODULE_INPUT, (Shard(1),), module="layers.0.mlp").key


# mode -> rank -> the rows of the global batch that rank passes
LOCAL_ROWS = {
    "dtensor_expand": [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)],
    "ddp": [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)],
    "fsdp": [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)],
    "tp": [slice(0, 8)] * 4,
    "fsdp_tp": [slice(0, 4), slice(0, 4), slice(4, 8), slice(4, 8)],  # (dp, tp) = (2, 2)
}


@pytest.mark.parametrize("name", list(MODES))
def test_local_batch_is_the_simulated_share(name: str) -> None:
    mode, (x, y) = MODES[name](), _batch()
    with sc.simulate(WORLD) as sim:
        mesh = mode.mesh("cpu")
        for index, t in enumerate((x, y)):
            placements = mode.placement_of(StateRef(Kind.INPUT, index=index), TensorMeta.of(t), mesh)
            simulated = sim.per_rank(sim.shard(t, mesh, placements))
            for rank in range(WORLD):
                local = mode.local_batch(t, rank, index=index, mesh=mesh)
                assert torch.equal(local, t[LOCAL_ROWS[name][rank]])
                assert torch.equal(local, simulated[rank])


def test_local_batch_follows_the_mode_options() -> None:
    x = torch.arange(32.0).reshape(4, 8)
    with sc.simulate(WORLD):
        by_column = DataParallel(input_batch_dim=1)
        assert torch.equal(by_column.local_batch(x, 3), x[:, 6:8])
        assert by_column.local_batch(x, 3).is_contiguous()
        whole_target = DTensorExpandMode(input_placements={1: [Replicate()]})
        assert torch.equal(whole_target.local_batch(x, 2, index=1), x)
        assert torch.equal(whole_target.local_batch(x, 2, index=0), x[2:3])
        assert DataParallel().local_batch(torch.tensor(3.0), 1).shape == ()  # 0-d: whole
        with pytest.raises(ValueError, match="does not split evenly over the 4 ranks"):
            DataParallel().local_batch(torch.zeros(6, 2), 0)
        with pytest.raises(ValueError, match="rank 4 is not in"):
            DataParallel().local_batch(x, 4)
