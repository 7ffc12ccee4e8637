"""DataParallel replicate / fully_shard on simulated ranks: parity, bytes, memory, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import spmd_compiler as sc
from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.tools.parity import compare_models, compare_optimizers, max_difference

TOL = 1e-5


_step = classification_train_step


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8))


def _run(mode, world_size, *, steps=3, batch=16, make_opt=None, model=None, disable_passes=()):
    model = model if model is not None else _mlp()
    reference = copy.deepcopy(model)
    make_opt = make_opt or (lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-5))
    optim, ref_optim = make_opt(model.parameters()), make_opt(reference.parameters())
    step = sc.compile(mode, disable_passes=disable_passes)(_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size) as sim:
        for _ in range(steps):
            x = torch.randn(batch, 8, generator=gen)
            y = torch.randint(0, 8, (batch,), generator=gen)
            loss = step(model, optim, x, y)
            ref_loss = _step(reference, ref_optim, x, y)
            assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
        diff = max_difference(
            compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim)
        )
    return model, optim, step, diff


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize(
    "mode",
    [
        DataParallel("replicate"),
        DataParallel("fully_shard"),
        DataParallel("fully_shard", reshard_after_forward=False),
    ],
    ids=["replicate", "fully_shard", "fully_shard_no_reshard"],
)
def test_parity_with_single_device(mode, world_size):
    model, optim, _, diff = _run(mode, world_size)
    assert diff < TOL
    want = (Shard(0),) if mode.style == "fully_shard" else (Replicate(),)
    for p in model.parameters():
        assert isinstance(p, DTensor) and tuple(p.placements) == want
    for state in optim.state.values():
        assert all(isinstance(v, DTensor) for v in state.values())


def test_parity_sgd_momentum_fully_shard():
    _, _, _, diff = _run(
        DataParallel("fully_shard"), 4,
        make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-2),
    )
    assert diff < TOL


class _SequenceFirst(nn.Module):
    """Takes (seq, batch, feature) and works batch-first inside."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.body(x.transpose(0, 1)).transpose(0, 1)


def test_input_batch_dim_1_sequence_first():
    torch.manual_seed(0)
    model = _SequenceFirst()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(model, optim, x, y):  # x: (seq, batch, feature)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    compiled = sc.compile(DataParallel("replicate", input_batch_dim=1))(step)
    with sc.simulate(4) as sim:
        for _ in range(3):
            x, y = torch.randn(5, 8, 8), torch.randn(5, 8, 8)
            assert torch.allclose(compiled(model, optim, x, y), step(reference, ref_optim, x, y), rtol=TOL)
        assert compiled.last_program.local_inputs[-1].shape == (5, 2, 8)
        assert max_difference(compare_models(model, reference, sim)) < TOL


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


UNBUCKETED = ("bucket_collectives",)  # the expansion's own collectives, one per value


def test_replicate_moves_one_all_reduce_of_gradients():
    model, _, step, _ = _run(DataParallel("replicate"), 4, disable_passes=UNBUCKETED)
    stats = collective_stats(step.last_program.graph_module)
    assert set(stats.counts) == {"all_reduce"}
    # every gradient once, plus two scalars: the loss and the loss's total weight
    assert stats.bytes["all_reduce"] == _param_bytes(model) + 2 * 4
    assert stats.counts["all_reduce"] == len(list(model.parameters())) + 2


def test_fully_shard_bytes_without_reshard():
    model, _, step, _ = _run(
        DataParallel("fully_shard", reshard_after_forward=False), 4, disable_passes=UNBUCKETED
    )
    stats = collective_stats(step.last_program.graph_module)
    assert stats.bytes["all_gather"] == _param_bytes(model)  # each parameter once
    assert stats.bytes["reduce_scatter"] == _param_bytes(model)  # each gradient once
    assert stats.counts["all_gather"] == stats.counts["reduce_scatter"] == len(list(model.parameters()))
    assert stats.bytes.get("all_reduce", 0) == 2 * 4  # loss and total weight only


def test_bucketing_keeps_the_bytes_and_cuts_the_launches():
    model, _, step, _ = _run(DataParallel("replicate"), 4)
    stats = collective_stats(step.last_program.graph_module)
    assert stats.bytes["all_reduce"] == _param_bytes(model) + 2 * 4
    assert stats.counts["all_reduce"] < len(list(model.parameters()))


def test_fully_shard_reshard_gathers_again_only_what_backward_reads():
    # what the mode asks for, before merge_regathers drops re-gathers that save no memory
    disabled = (*UNBUCKETED, "merge_regathers")
    model, _, step, _ = _run(DataParallel("fully_shard"), 4, disable_passes=disabled)
    stats = collective_stats(step.last_program.graph_module)
    params = _param_bytes(model)
    # forward gathers every parameter once; backward re-gathers the ones it reads:
    # the LayerNorm weight and bias and the last Linear's weight (not biases, and not
    # the first Linear's weight, whose input needs no gradient)
    backward = model[1].weight.numel() * 4 + model[1].bias.numel() * 4 + model[3].weight.numel() * 4
    assert stats.bytes["all_gather"] == params + backward
    assert stats.bytes["reduce_scatter"] == params


def test_fully_shard_memory_is_a_quarter_at_world_4():
    model, optim, step, _ = _run(DataParallel("fully_shard"), 4, batch=16)
    full = _param_bytes(model) * 3  # params + exp_avg + exp_avg_sq
    sim_bytes = 0
    with sc.simulate(4) as sim:
        for t in list(model.parameters()) + [
            v for s in optim.state.values() for v in s.values() if v.dim() > 0
        ]:
            sim_bytes = max(sim_bytes, 0) + sim.per_rank(t)[0].numel() * t.element_size()
    assert sim_bytes * 4 == full
    grads_per_rank = sum(
        n.meta["val"].numel() * n.meta["val"].element_size()
        for n in step.last_program.graph_module.graph.nodes
        if n.op == "call_function" and "wait_tensor" in str(n.target)
        and "reduce_scatter" in str(n.args[0].target)
    )
    assert grads_per_rank * 4 == _param_bytes(model)


def test_mesh_size_mismatch_is_refused():
    with sc.simulate(2):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
    with sc.simulate(4):
        model = _mlp()
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        step = sc.compile(DataParallel("replicate", mesh=mesh))(_step)
        with pytest.raises(sc.SPMDCompileError, match="mesh of 2 ranks"):
            step(model, optim, torch.randn(8, 8), torch.randint(0, 8, (8,)))
        assert not isinstance(model[0].weight, DTensor)


def test_missing_batch_dimension_is_refused():
    model = _mlp()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(DataParallel("replicate", input_batch_dim=2))(_step)
    with sc.simulate(2), pytest.raises(sc.SPMDCompileError, match="no batch dimension 2"):
        step(model, optim, torch.randn(8, 8), torch.randint(0, 8, (8,)))
    assert not isinstance(model[0].weight, DTensor)


def test_unknown_style_is_refused():
    with pytest.raises(ValueError, match="replicate"):
        DataParallel("zero2")


def test_batch_dim_folded_into_another_dim():
    """nn.Linear folds (seq, batch/N) into one dimension: a strided shard on the rank's
    run-time coordinate (see _torch_private.compile_on_one_rank)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step(model, optim, x, y):
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    compiled = sc.compile(DataParallel("replicate", input_batch_dim=1))(step)
    gen = torch.Generator().manual_seed(2)
    with sc.simulate(4) as sim:
        for _ in range(3):
            x, y = torch.randn(5, 8, 8, generator=gen), torch.randn(5, 8, 8, generator=gen)
            got, want = compiled(model, optim, x, y), step(reference, ref_optim, x, y)
            assert abs(got.item() - want.item()) <= TOL * want.item()
        assert max_difference(compare_models(model, reference, sim)) < TOL


def _uneven_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.LayerNorm(7), nn.GELU(), nn.Linear(7, 8))


@pytest.mark.parametrize("world_size", [4, 8])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd_momentum"])
def test_fully_shard_uneven_and_smaller_than_world(world_size, optimizer):
    """7 rows over 4 or 8 ranks, 8 over 8: ranks hold 2, 1 or 0 real rows."""
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5),
        "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    }[optimizer]
    model = _uneven_mlp()
    reference = copy.deepcopy(model)
    optim, ref_optim = make(model.parameters()), make(reference.parameters())
    step = sc.compile(DataParallel("fully_shard"))(_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size) as sim:
        for _ in range(3):
            x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 8, (8,), generator=gen)
            loss, ref_loss = step(model, optim, x, y), _step(reference, ref_optim, x, y)
            assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
        diff = max_difference(compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim))
        rows = {r: t.shape[0] for r, t in sim.per_rank(model[0].weight).items()}
        assert model[0].weight.shape == (7, 5)
    assert diff < TOL
    chunk = -(-7 // world_size)
    assert rows == {r: max(0, min(chunk, 7 - r * chunk)) for r in range(world_size)}
    assert step.last_program.padded["0.weight"] == (7, chunk * world_size)
    _check_feed_plan(step.last_program, optimizer)


def _check_feed_plan(program, optimizer: str) -> None:
    """The runtime's FeedPlan (NOTE: [one walk over the state per call]) feeds every input
    once, each parameter's optimizer state together, and pads exactly what the program
    pads."""
    from spmd_compiler.runtime.runner import FeedPlan

    plan = FeedPlan.of(program)
    positions = [
        *(pos for pos, _ in plan.params), *(pos for pos, _ in plan.buffers),
        *(pos for _, _, slots in plan.optim for pos, _ in slots), *plan.other,
    ]
    assert sorted(positions) == list(range(len(program.captured.inputs)))
    keys = {"adamw": {"step", "exp_avg", "exp_avg_sq"}, "sgd_momentum": {"momentum_buffer"}}[optimizer]
    assert all({key for _, key in slots} == keys for _, _, slots in plan.optim)
    assert {pos for pos, _ in plan.padded} == {
        pos for pos, (ref, _) in enumerate(program.captured.inputs)
        if ref.kind.name in ("PARAM", "GRAD", "OPTIM_STATE") and program.pads(ref)
    } != set()


def _zero_grad_first_step(model, optim, x, y):
    optim.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss


def _accumulating_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("step_fn", [_zero_grad_first_step, _accumulating_step])
def test_fully_shard_uneven_keeps_gradients_between_steps(world_size, step_fn):
    """Gradients outliving the step (zero_grad at its start, or never) of parameters
    whose rows do not divide the ranks: kept padded like the parameter, equal to eager
    (this failed with a raw GuardOnDataDependentSymNode)."""
    model = _uneven_mlp()
    reference = copy.deepcopy(model)
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-5)  # noqa: E731
    optim, ref_optim = make(model.parameters()), make(reference.parameters())
    step = sc.compile(DataParallel("fully_shard"))(step_fn)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size) as sim:
        for _ in range(3):
            x, y = torch.randn(8, 5, generator=gen), torch.randint(0, 8, (8,), generator=gen)
            loss, ref_loss = step(model, optim, x, y), step_fn(reference, ref_optim, x, y)
            assert abs(loss.item() - ref_loss.item()) <= TOL * abs(ref_loss.item())
        diff = max_difference(compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim))
        grads = {
            name: max_difference({name: _relative(sim.full_tensor(p.grad), q.grad)})
            for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True)
        }
        assert model[0].weight.grad.shape == (7, 5)
    assert diff < TOL
    assert max(grads.values()) < TOL, grads
    assert step.last_program.padded["0.weight"][0] == 7
    assert step.compile_count == 2


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize("reduce_dtype", [None, torch.float32], ids=["reduce_bf16", "reduce_fp32"])
def test_mixed_precision_bf16(style, reduce_dtype):
    """bf16 compute: world 4 equals world 1 within bf16 tolerance; master state fp32;
    parameters are gathered in bf16; gradients reduced in reduce_dtype."""
    from spmd_compiler.parallel_modes import MixedPrecisionPolicy
    from spmd_compiler.tools.parity import compare_states, full_state

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    results = {}
    for world_size in (1, 4):
        model = _mlp()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
        step = sc.compile(DataParallel(style, mp_policy=policy))(_step)
        gen = torch.Generator().manual_seed(1)
        with sc.simulate(world_size) as sim:
            losses = []
            for _ in range(3):
                x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 8, (16,), generator=gen)
                losses.append(step(model, optim, x, y))
            results[world_size] = (losses, full_state(model, optim, sim), step)
    (losses1, state1, _), (losses4, state4, step4) = results[1], results[4]
    assert all(loss.dtype == torch.bfloat16 for loss in losses4)
    assert torch.allclose(torch.stack(losses4).float(), torch.stack(losses1).float(), rtol=2e-2)
    assert all(v.dtype == torch.float32 for k, v in state4.items() if not k.endswith(".step"))
    diffs = compare_states(state4, state1)
    assert max(v for k, v in diffs.items() if k.startswith("param.")) < 2e-2
    stats = collective_stats(step4.last_program.graph_module)
    param_count = sum(p.numel() for p in _mlp().parameters())
    if style == "fully_shard":
        graph = step4.last_program.graph_module.graph
        gathers = [n for n in graph.nodes if "all_gather" in str(n.target)]
        assert gathers and all(n.meta["val"].dtype == torch.bfloat16 for n in gathers)
        scatters = [n for n in graph.nodes if "reduce_scatter" in str(n.target)]
        want = reduce_dtype or torch.bfloat16
        assert scatters and all(n.meta["val"].dtype == want for n in scatters)
    else:
        grad_bytes = param_count * (4 if reduce_dtype == torch.float32 else 2)
        # the gradients once, in reduce_dtype, plus the bf16 loss and its total weight
        assert stats.bytes["all_reduce"] - grad_bytes in (2 + 2, 2 + 4)


def _gradient_reductions(graph) -> list[torch.fx.Node]:
    """The all-reduces and reduce-scatters of gradients (not of the 0-d loss terms)."""
    return [
        n for n in graph.nodes
        if any(k in str(n.target) for k in ("all_reduce", "reduce_scatter")) and n.args[0].meta["val"].dim() > 0
    ]


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize(
    "param_dtype,reduce_dtype",
    [(None, torch.bfloat16), (torch.bfloat16, torch.float16)],
    ids=["fp32_compute_bf16_reduce", "bf16_compute_fp16_reduce"],
)
def test_mixed_precision_reduces_in_reduce_dtype(style, param_dtype, reduce_dtype):
    """NOTE: [gradients reduced in reduce_dtype]: a reduce_dtype other than param_dtype
    was ignored, the gradients reduced in float32 (twice the bytes). Now they are cast
    to reduce_dtype before the reduction and back to float32 after it, as FSDP2 does:
    world 2 equals world 1 within the reduce dtype's precision, master state stays
    float32, and the gradient reductions move half the bytes of float32 ones."""
    from spmd_compiler.parallel_modes import MixedPrecisionPolicy
    from spmd_compiler.tools.parity import compare_states, full_state

    def run(world_size, policy):
        model = _mlp()
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
        step = sc.compile(DataParallel(style, mp_policy=policy))(_step)
        gen = torch.Generator().manual_seed(1)
        with sc.simulate(world_size) as sim:
            for _ in range(3):
                step(model, optim, torch.randn(16, 8, generator=gen), torch.randint(0, 8, (16,), generator=gen))
            return full_state(model, optim, sim), step

    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    state2, step2 = run(2, policy)
    state1, _ = run(1, policy)
    _, step_fp32 = run(2, MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    reductions = _gradient_reductions(step2.last_program.graph_module.graph)
    assert reductions and all(n.args[0].meta["val"].dtype == reduce_dtype for n in reductions)
    assert all(v.dtype == torch.float32 for k, v in state2.items() if not k.endswith(".step"))
    assert all(p.grad is None for p in _mlp().parameters())
    diffs = compare_states(state2, state1)
    assert max(v for k, v in diffs.items() if k.startswith("param.")) < 2e-2, diffs

    def grad_bytes(step):
        nodes = _gradient_reductions(step.last_program.graph_module.graph)
        return sum(n.args[0].meta["val"].numel() * n.args[0].meta["val"].element_size() for n in nodes)

    # 312 gradient elements (the loss terms may share the float32 bucket: + up to 8)
    count = sum(p.numel() for p in _mlp().parameters())
    assert 2 * count <= grad_bytes(step2) <= 2 * count + 8
    assert 4 * count <= grad_bytes(step_fp32) <= 4 * count + 8


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize("reduce_dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_reduce_dtype_matches_an_eager_reference_that_casts_the_same_way(style, reduce_dtype):
    """fp32 compute, gradients reduced in reduce_dtype (torch's FSDP2 policy, converted),
    one SGD step at 2 ranks == eager: each rank's gradient of its half (local sum over the
    global batch size) cast to reduce_dtype, the two summed in it, cast back, applied.
    Measured 2026-12-06: 0 difference; the float32-reduced update is 8e-5..6e-4 (bf16) and
    1e-5..1e-4 (fp16) away, which the check also asserts it is not."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from spmd_compiler.tools.parity import full_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    step = sc.compile(DataParallel(style, mp_policy=TorchPolicy(reduce_dtype=reduce_dtype)))(_step)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 16, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    with sc.simulate(2) as sim:
        step(model, optim, x, y)
        state = full_state(model, optim, sim)
    grads = []
    for rank in range(2):
        local = copy.deepcopy(reference)
        rows = slice(4 * rank, 4 * rank + 4)
        (F.cross_entropy(local(x[rows]), y[rows], reduction="sum") / 8).backward()
        grads.append([p.grad for p in local.parameters()])
    with torch.no_grad():
        for (name, p), g0, g1 in zip(reference.named_parameters(), *grads, strict=True):
            cast = p - 0.5 * (g0.to(reduce_dtype) + g1.to(reduce_dtype)).float()
            fp32 = p - 0.5 * (g0 + g1)
            got = state[f"param.{name}"]
            assert (got - cast).abs().max() < 1e-6, name
            assert (got - fp32).abs().max() > 5e-6, name


def test_torchs_own_mixed_precision_policy_is_converted():
    """A script ported from FSDP2 passes ``torch.distributed.fsdp.MixedPrecisionPolicy``:
    accepted, then the first call failed inside the mode (no ``effective_reduce_dtype``).
    It is converted; what this mode does not do is refused when the mode is made."""
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy

    from spmd_compiler.parallel_modes import MixedPrecisionPolicy

    mode = DataParallel("fully_shard", mp_policy=TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    assert mode.mp_policy == MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = _mlp()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
    with sc.simulate(2):
        loss = sc.compile(mode)(_step)(model, optim, torch.randn(16, 8), torch.randint(0, 8, (16,)))
    assert loss.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="output_dtype"):
        DataParallel("fully_shard", mp_policy=TorchPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    with pytest.raises(ValueError, match="cast_forward_inputs"):
        DataParallel("fully_shard", mp_policy=TorchPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False))


def test_mixed_precision_with_uneven_rows():
    """A bf16 cast of a padded shard (7 and 5 rows over 2 ranks, NOTE: [uneven shards])
    failed the local shape check at expansion; world 2 now equals world 1 within bf16."""
    from spmd_compiler.parallel_modes import MixedPrecisionPolicy
    from spmd_compiler.tools.parity import compare_states, full_state

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    results = {}
    for world_size in (1, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 7), nn.GELU(), nn.Linear(7, 5))
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-5)
        step = sc.compile(DataParallel("fully_shard", mp_policy=policy))(_step)
        gen = torch.Generator().manual_seed(1)
        with sc.simulate(world_size) as sim:
            for _ in range(3):
                step(model, optim, torch.randn(16, 8, generator=gen), torch.randint(0, 5, (16,), generator=gen))
            results[world_size] = full_state(model, optim, sim)
    diffs = compare_states(results[2], results[1])
    assert max(v for k, v in diffs.items() if k.startswith("param.")) < 2e-2, diffs



def _clip_norm_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
    optim.step()
    optim.zero_grad()
    return loss, norm


def _clip_value_step(model, optim, x, y):
    """``clip_grad_value_``, then the gradients read directly (their norm, scaled in place)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    norm = torch.stack([p.grad.norm() for p in model.parameters()]).norm()
    for p in model.parameters():
        p.grad.mul_(0.5)
    optim.step()
    optim.zero_grad()
    return loss, norm


class _OnCasts:
    """Eager as FSDP2 computes: forward (and so backward) on ``dtype`` casts of the
    float32 parameters, whose gradients land on the parameters themselves, which
    ``parameters()`` gives the step's clipping and gradient reads."""

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        self.model, self.dtype = model, dtype

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        casts = {name: p.to(self.dtype) for name, p in self.model.named_parameters()}
        return torch.func.functional_call(self.model, casts, (x.to(self.dtype),))

    def parameters(self):
        return self.model.parameters()


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
@pytest.mark.parametrize(
    "step,dtype",
    [(_clip_norm_step, torch.bfloat16), (_clip_norm_step, torch.float16), (_clip_value_step, torch.bfloat16)],
    ids=["clip_norm_bf16", "clip_norm_fp16", "clip_value_and_grad_reads_bf16"],
)
def test_mixed_precision_clips_the_parameters_gradients(style, step, dtype):
    """NOTE: [low-precision parameters inside forward only]: with ``param_dtype`` the
    casts were the module's parameters for the whole step, so ``clip_grad_norm_`` after
    ``backward()`` found no ``.grad``, returned 0.0 and clipped nothing (measured
    2026-12-06: the parameters 0.285 off the clipped reference after 3 SGD steps), and
    ``p.grad.norm()`` failed on None at capture. Now the step reads the float32
    parameters and their gradients: the norms and parameters match an eager reference
    that computes on the same casts, within the low precision."""
    from spmd_compiler.parallel_modes import MixedPrecisionPolicy
    from spmd_compiler.tools.parity import full_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4))
    reference, unclipped = copy.deepcopy(model), copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=1.0)
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 6, generator=gen), torch.randint(0, 4, (8,), generator=gen)
    policy = MixedPrecisionPolicy(param_dtype=dtype)
    compiled = sc.compile(DataParallel(style, mp_policy=policy))(step)
    with sc.simulate(2) as sim:
        for _ in range(3):
            loss, norm = compiled(model, optim, x, y)
            ref_loss, ref_norm = (t.detach() for t in step(_OnCasts(reference, dtype), ref_optim, x, y))
            assert float(norm) > 0.01
            assert abs(float(norm) - float(ref_norm)) <= 2e-2 * float(ref_norm)
            assert abs(float(loss) - float(ref_loss)) <= 2e-2 * float(ref_loss)
        state = full_state(model, optim, sim)
    sgd = torch.optim.SGD(unclipped.parameters(), lr=1.0)
    for _ in range(3):
        F.cross_entropy(unclipped(x), y).backward()
        sgd.step()
        sgd.zero_grad()
    off_clipped, off_unclipped = 0.0, 0.0
    for (name, p), q in zip(reference.named_parameters(), unclipped.parameters(), strict=True):
        got = state[f"param.{name}"]
        assert got.dtype == torch.float32
        off_clipped = max(off_clipped, float((got - p.detach()).abs().max()))
        off_unclipped = max(off_unclipped, float((got - q.detach()).abs().max()))
    assert off_clipped < 5e-3 and off_unclipped > 0.05, (off_clipped, off_unclipped)


def _updated_twice_step(model, optim, x, y):
    """An optimizer step between two backward passes: the second forward reads the
    parameters the first step updated (a GAN's D then G step, reduced to one model)."""
    first = F.mse_loss(model(x).squeeze(-1), y)
    optim.zero_grad()
    first.backward()
    optim.step()
    second = F.mse_loss(model(x + 1).squeeze(-1), y)
    optim.zero_grad()
    second.backward()
    optim.step()
    return first, second


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard", "no_reshard"])
def test_fully_shard_gathers_parameters_updated_inside_the_step(world_size, reshard):
    """NOTE: [parameters updated inside the step]: the second forward reads the update's
    result gathered, as the first reads the parameter. On 1 rank this failed (a
    Linear(16, 1) head's output sharded on its size-1 dimension, which ``squeeze(-1)``
    could not remove); on 2 the second forward all-gathered the batch instead of the
    parameters. Equal to eager in float64, and the batch is never gathered."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).double()
    reference = copy.deepcopy(model)
    make = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
    optim, ref_optim = make(model.parameters()), make(reference.parameters())
    mode = DataParallel("fully_shard", reshard_after_forward=reshard)
    step = sc.compile(mode, disable_passes=UNBUCKETED)(_updated_twice_step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size) as sim:
        for _ in range(2):
            x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
            y = torch.randn(8, generator=gen, dtype=torch.float64)
            got, want = step(model, optim, x, y), _updated_twice_step(reference, ref_optim, x, y)
            for g, w in zip(got, want, strict=True):
                assert abs(g.item() - w.item()) <= 1e-12 * abs(w.item())
        diff = max_difference(compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim))
    assert diff < 1e-12
    # every all-gather gathers a parameter (the head's rows padded to the ranks), never the
    # batch ((8, 8) inputs, (8, 16) activations)
    rows = -(-1 // world_size) * world_size
    shapes = {(16, 8), (16,), (rows, 16), (rows,)}
    gathers = [n for n in step.last_program.graph_module.graph.nodes if "all_gather" in str(n.target)]
    assert {tuple(n.meta["val"].shape) for n in gathers} <= shapes


class _WithAverage(nn.Module):
    """A model and an average of its weights (sharded like them under fully_shard)."""

    def __init__(self, averaged: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).double()
        if averaged:
            self.ema = AveragedModel(self.net, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        else:
            self.ema = copy.deepcopy(self.net).requires_grad_(False)


def _average_step(model, optim, x, y, *, average=True):
    loss = F.mse_loss(model.net(x), y)
    optim.zero_grad()
    loss.backward()
    optim.step()
    if average and isinstance(model.ema, AveragedModel):
        model.ema.update_parameters(model.net)
    elif average:
        with torch.no_grad():
            for e, p in zip(model.ema.parameters(), model.net.parameters(), strict=True):
                e.mul_(0.9).add_(p, alpha=0.1)
    return loss


def _average_step_grads_cleared(model, optim, x, y):
    """``_average_step`` with ``zero_grad()`` after ``optim.step()``: no gradient left."""
    loss = F.mse_loss(model.net(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    model.ema.update_parameters(model.net)
    return loss


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
@pytest.mark.parametrize(("optimizer", "cleared", "counts"), [
    ("sgd", True, [2, 3, 3, 3, 3]), ("sgd", False, [2, 4, 4, 4, 4]), ("adamw", True, [2, 4, 4, 4, 4]),
])
def test_averaged_model_programs_are_counted(mode, optimizer, cleared, counts):
    """``AveragedModel.update_parameters`` reads its counter in two ``if``s (``n == 0``:
    copy; ``n > 0``: average). NOTE: [value checks] compiles a branch whose ways both go
    on as True first, so each program key the calls reach compiles the (True, True) way,
    which no call takes, then the way its call took ("went the other way"): 2 programs a
    key. The first call has a key of its own where it leaves the step a new one (AdamW's
    state made, gradients left by a ``zero_grad()`` before ``backward()``): 4 programs,
    else 3; none after the second call. The README said "a second program once" (a
    probe measured 3 with SGD, 4 with AdamW). Equal to eager in float64 on every call."""
    model = _WithAverage(True)
    reference = copy.deepcopy(model)
    make = (lambda ps: torch.optim.SGD(ps, lr=0.1)) if optimizer == "sgd" else (  # noqa: E731
        lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    optim, ref_optim = make(model.net.parameters()), make(reference.net.parameters())
    step_fn = _average_step_grads_cleared if cleared else _average_step
    step = sc.compile(DataParallel(mode))(step_fn)
    gen = torch.Generator().manual_seed(1)
    seen = []
    with sc.simulate(2) as sim:
        for _ in counts:
            x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
            y = torch.randn(8, 8, generator=gen, dtype=torch.float64)
            got, want = step(model, optim, x, y), step_fn(reference, ref_optim, x, y)
            assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
            seen.append(step.compile_count)
        diff = max_difference(compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim))
    assert diff < 1e-12
    assert seen == counts


@pytest.mark.parametrize("averaged", [False, True], ids=["by_hand", "AveragedModel"])
def test_fully_shard_updates_an_average_of_the_weights_on_the_shards(averaged):
    """NOTE: [state updated element-wise outside forward]: an EMA of the weights after
    ``optimizer.step()`` (its copy Shard(0) like them) is computed on the shards. The
    gathers NOTE: [parameters updated inside the step] added for a later forward
    all-gathered the updated weights and the EMA copy there and cut the result back to
    Shard(0) (12 all-gathers a step unbucketed, 4 without the EMA). Equal to eager in
    float64, with no more all-gathers than the step without the EMA."""
    gathers = {}
    for average in (False, True):
        model = _WithAverage(averaged)
        reference = copy.deepcopy(model)
        make = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731
        optim, ref_optim = make(model.net.parameters()), make(reference.net.parameters())
        step_fn = lambda m, o, x, y, average=average: _average_step(m, o, x, y, average=average)  # noqa: E731
        step = sc.compile(DataParallel("fully_shard"), disable_passes=UNBUCKETED)(step_fn)
        gen = torch.Generator().manual_seed(1)
        with sc.simulate(2) as sim:
            for _ in range(3):
                x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
                y = torch.randn(8, 8, generator=gen, dtype=torch.float64)
                got, want = step(model, optim, x, y), step_fn(reference, ref_optim, x, y)
                assert abs(got.item() - want.item()) <= 1e-12 * abs(want.item())
            diff = max_difference(compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim))
        assert diff < 1e-12
        gathers[average] = collective_stats(step.last_program.graph_module).counts.get("all_gather", 0)
    assert 0 < gathers[True] <= gathers[False], gathers
