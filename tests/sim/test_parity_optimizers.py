"""Single-device equivalence on simulated ranks, across optimizers and model features.

Each test compiles the standard train step (DTensorExpandMode, the default), runs it on
1, 2 or 4 simulated ranks with the global batch, runs the same undecorated step eagerly on
a deepcopy of the model, and compares the returned loss of every step and every
parameter, buffer and optimizer-state tensor at the end (``conftest.run_parity``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.optim import ZeroRedundancyOptimizer

import spmd_compiler as sc
from spmd_compiler.capture.optimizers import _cpu_alpha_rounds_to_dtype
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

FLOAT32_TOLERANCE = 1e-5
FLOAT64_TOLERANCE = 1e-12
STEPS = 3
WORLD_SIZES = (1, 2, 4)


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


OPTIMIZERS = {
    "sgd": lambda m: torch.optim.SGD(m.parameters(), lr=0.1),
    "sgd_momentum": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
    "sgd_nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    "sgd_weight_decay": lambda m: torch.optim.SGD(m.parameters(), lr=0.1, weight_decay=0.05),
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
    "adamw_foreach": lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-2, weight_decay=0.1, foreach=True
    ),
    "adamw_single_tensor": lambda m: torch.optim.AdamW(
        m.parameters(), lr=1e-2, weight_decay=0.1, foreach=False
    ),
}

# Plain SGD keeps no state, and Adam's state is made before the first program (NOTE:
# [optimizer state made before the first program]): one program. SGD's momentum buffer
# is its first gradient: a first program, then the steady one.
EXPECTED_COMPILES = {"sgd_momentum": 2, "sgd_nesterov": 2}


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_optimizer_parity(run_parity, classification_batches, optimizer, world_size):
    result = run_parity(mlp, OPTIMIZERS[optimizer], world_size, classification_batches(STEPS))
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts[-1] == EXPECTED_COMPILES.get(optimizer, 1)
    # The state really moved: a step that silently did nothing would still "match" at 0.
    moved = relative_difference(result.reference[0].weight, mlp_initial_weight())
    assert moved > 1e-3


# The rest of torch.optim (item 7 of issue 11). Adagrad, RMSprop, Adadelta and Rprop read
# the learning-rate tensor through a Scalar argument (NOTE: [tensor hyper-parameters in
# Scalar arguments]); Adagrad creates its state in __init__, so it compiles once, and
# so do those that make their state of zeros (NOTE: [optimizer state made before the
# first program]). ASGD's ``eta`` is the learning rate and Rprop's step sizes a tensor
# of it: they compile a first program, then the steady one.
TWO_PROGRAMS = {"asgd", "rprop"}
MORE_OPTIMIZERS = {
    "adam_amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2, weight_decay=0.01),
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2),
    "nadam_decoupled": lambda m: torch.optim.NAdam(
        m.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True
    ),
    "radam": lambda m: torch.optim.RAdam(m.parameters(), lr=1e-2),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=1e-1, lr_decay=0.01),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2),
    "rmsprop_centered_momentum": lambda m: torch.optim.RMSprop(
        m.parameters(), lr=1e-2, momentum=0.9, centered=True, weight_decay=0.01
    ),
    "adadelta": lambda m: torch.optim.Adadelta(m.parameters(), lr=1.0, weight_decay=0.01),
    "asgd": lambda m: torch.optim.ASGD(m.parameters(), lr=1e-2, t0=1),
    "rprop": lambda m: torch.optim.Rprop(m.parameters(), lr=1e-2),
}


@pytest.mark.parametrize("optimizer", list(MORE_OPTIMIZERS))
def test_more_optimizers_parity(run_parity, classification_batches, optimizer):
    result = run_parity(mlp, MORE_OPTIMIZERS[optimizer], 4, classification_batches(STEPS))
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts[-1] == (2 if optimizer in TWO_PROGRAMS else 1)
    moved = relative_difference(result.reference[0].weight, mlp_initial_weight())
    assert moved > 1e-3


@pytest.mark.parametrize("optimizer", ["adagrad", "rmsprop_centered_momentum", "adadelta"])
def test_scalar_lr_optimizers_follow_a_scheduler(run_parity, classification_batches, optimizer):
    """The learning rate still is a graph input: a scheduler changes it without a
    recompile, and the compiled step follows it."""
    result = run_parity(
        mlp,
        MORE_OPTIMIZERS[optimizer],
        2,
        classification_batches(4),
        make_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5),
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.compile_counts[-1] == 1


@pytest.mark.parametrize(
    ("make_optimizer", "name", "advice"),
    [
        (lambda m: torch.optim.LBFGS(m.parameters()), "LBFGS", "another optimizer"),
        (lambda m: torch.optim.SparseAdam(list(m.parameters())), "SparseAdam", "Adam"),
        (lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam), "ZeroRedundancyOptimizer",
         "DataParallel('fully_shard')"),
    ],
)
def test_unsupported_optimizers_are_refused_by_name(
    classification_batches, train_step, make_optimizer, name, advice
):
    model = mlp()
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, make_optimizer(model), *classification_batches(1)[0])
    assert f"optim.{name}" in str(info.value)  # torch.optim or torch.distributed.optim
    assert advice in str(info.value)


def mlp_initial_weight() -> torch.Tensor:
    torch.manual_seed(0)
    return mlp()[0].weight.detach()


@pytest.mark.parametrize("optimizer", ["sgd_nesterov", "adam", "adamw_foreach"])
def test_optimizer_parity_float64(run_parity, classification_batches, optimizer):
    """In float64, rounding cannot hide a real difference: parity to ~1e-12 at world 4."""
    result = run_parity(
        lambda: mlp().double(),
        OPTIMIZERS[optimizer],
        4,
        classification_batches(STEPS, dtype=torch.float64),
    )
    result.assert_close(FLOAT64_TOLERANCE)


def test_adam_state_keys_and_steps_match(run_parity, classification_batches):
    """Optimizer state has the same keys as eager and the step counter counts calls."""
    steps = 4
    result = run_parity(mlp, OPTIMIZERS["adam"], 2, classification_batches(steps))
    result.assert_close(FLOAT32_TOLERANCE)
    keys = {k for s in result.optimizer.state.values() for k in s}
    assert keys == {"step", "exp_avg", "exp_avg_sq"}
    assert len(result.optimizer.state) == len(list(result.model.parameters()))
    assert {key for key, v in result.state_differences.items() if key.endswith(".step")}
    for state in result.reference_optimizer.state.values():
        assert float(state["step"]) == steps


# ---------------------------------------------------------------- param groups


def three_groups_adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": m[0].parameters()},
            {"params": [m[2].weight], "lr": 3e-2, "weight_decay": 0.2},
            {"params": [m[2].bias], "lr": 5e-3, "weight_decay": 0.0},
        ],
        lr=1e-2,
        weight_decay=0.05,
    )


def three_groups_sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(
        [
            {"params": m[0].parameters(), "momentum": 0.5},
            {"params": [m[2].weight], "lr": 0.3, "weight_decay": 0.1},
            {"params": [m[2].bias], "lr": 0.01, "nesterov": True},
        ],
        lr=0.1,
        momentum=0.9,
    )


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("make_optimizer", [three_groups_adamw, three_groups_sgd])
def test_param_groups_parity(run_parity, classification_batches, make_optimizer, world_size):
    result = run_parity(mlp, make_optimizer, world_size, classification_batches(STEPS))
    result.assert_close(FLOAT32_TOLERANCE)
    groups = result.optimizer.param_groups
    assert [len(g["params"]) for g in groups] == [2, 1, 1]
    assert [g["lr"] for g in groups] == [g["lr"] for g in result.reference_optimizer.param_groups]


def test_swapping_parameters_between_groups_recompiles(classification_batches):
    """Two param groups with the same options but other learning rates: two biases of
    the same shape swapped between them between calls take their new group's rate. The
    program's key names each group's parameters; before, shapes alone left the key
    unchanged and the call failed with a KeyError on the moved state."""
    import copy

    from spmd_compiler.tools.demo.steps import classification_train_step
    from spmd_compiler.tools.parity import compare_states, full_state

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    reference = copy.deepcopy(model)

    def two_groups(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([
            {"params": [m[0].weight, m[0].bias, m[4].weight, m[4].bias], "lr": 1e-2},
            {"params": [m[2].weight, m[2].bias], "lr": 1e-1},
        ])

    def swap_biases(opt: torch.optim.Optimizer) -> None:
        first, second = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
        first[1], second[1] = second[1], first[1]

    opt, ref_opt = two_groups(model), two_groups(reference)
    step = sc.compile()(classification_train_step)
    with sc.simulate(world_size=2) as sim:
        for k, (x, y) in enumerate(classification_batches(4)):
            if k == 2:
                swap_biases(opt)
                swap_biases(ref_opt)
            loss = step(model, opt, x, y)
            expected = classification_train_step(reference, ref_opt, x, y)
            assert relative_difference(loss, expected) < FLOAT32_TOLERANCE
        diffs = compare_states(full_state(model, opt, sim), full_state(reference, ref_opt, None))
    assert max(diffs.values()) < FLOAT32_TOLERANCE, diffs
    assert step.compile_count == 2  # the state made first, then the swapped biases


# ---------------------------------------------------------------- model features


class TokenClassifier(nn.Module):
    """Embedding, LayerNorm, GELU, Dropout(p=0) and a per-token cross entropy."""

    def __init__(self, vocab: int = 11, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, 2 * width)
        self.act = nn.GELU()
        self.drop = nn.Dropout(p=0.0)
        self.head = nn.Linear(2 * width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.act(self.fc(self.norm(self.embed(tokens))))))


def token_step(model, optim, tokens, targets):
    logits = model(tokens)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def token_batches(steps: int, batch: int = 8, seq: int = 5, vocab: int = 11):
    gen = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, vocab, (batch, seq), generator=gen),
            torch.randint(0, vocab, (batch, seq), generator=gen),
        )
        for _ in range(steps)
    ]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_embedding_layernorm_gelu_dropout_parity(run_parity, world_size):
    result = run_parity(
        TokenClassifier,
        lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2),
        world_size,
        token_batches(STEPS),
        step=token_step,
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert "param.embed.weight" in result.state_differences


class ScaledByBuffer(nn.Module):
    """A constant buffer used in forward, and a buffer the forward updates in place."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        self.out = nn.Linear(16, 4)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.out(torch.tanh(self.fc(x * self.scale)))


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_model_with_buffers_parity(run_parity, classification_batches, world_size):
    def check(sim, result):
        assert float(sim.full_tensor(result.model.calls)) == STEPS
        assert torch.equal(sim.full_tensor(result.model.scale), torch.linspace(0.5, 1.5, 8))

    result = run_parity(
        ScaledByBuffer,
        lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
        world_size,
        classification_batches(STEPS),
        check_simulation=check,
    )
    result.assert_close(FLOAT32_TOLERANCE)
    assert {"param.scale", "param.calls"} <= set(result.state_differences)


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.fc(x)))


def sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_batchnorm_running_stats_parity(run_parity, classification_batches, world_size):
    """Batch statistics span the global batch; running stats are updated state."""
    result = run_parity(BatchNormNet, sgd, world_size, classification_batches(STEPS))
    result.assert_close(FLOAT32_TOLERANCE)
    assert result.state_differences["param.bn.running_mean"] < FLOAT32_TOLERANCE
    assert float(result.reference.bn.num_batches_tracked) == STEPS


class NormCheckingSGD(torch.optim.Optimizer):
    """A custom optimizer with an ``if`` on an ``.item()`` inside step(): an ``if`` on the
    tensor's value, compiled (NOTE: [value checks], [returned .item() values])."""

    def __init__(self, params, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad.norm().item() > 0:
                    p.add_(p.grad * -group["lr"])


class NormScaledSGD(NormCheckingSGD):
    """A custom optimizer that computes in Python with a tensor's value inside step()."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad * (-group["lr"] / (1.0 + p.grad.norm().item())))


def test_optimizer_with_an_if_on_an_item_matches_one_device(run_parity, classification_batches):
    result = run_parity(
        lambda: mlp().double(), lambda m: NormCheckingSGD(m.parameters()), 2,
        classification_batches(STEPS, dtype=torch.float64), mode=DataParallel("fully_shard"),
    )
    result.assert_close(1e-12)


def test_optimizer_reading_tensor_values_is_named(classification_batches, train_step):
    model = mlp()
    compiled = sc.compile()(train_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, NormScaledSGD(model.parameters()), *classification_batches(1)[0])
    message = str(info.value)
    assert "optimizer[0]" in message and "NormScaledSGD" in message and "step()" in message


def _muon_on_weights(m: nn.Module) -> torch.optim.Optimizer:
    """torch.optim.Muon orthogonalizes 2-D updates only: the weights (biases stay)."""
    return torch.optim.Muon([p for p in m.parameters() if p.ndim == 2], lr=1e-2)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_muon_parity_float64(run_parity, classification_batches, world_size):
    """Muon orthogonalizes its update in bf16 and adds it to the weight with
    ``alpha=-lr * ratio``, the learning rate a tensor here. The product was formed in bf16
    (3.9e-4 relative off the weights on 2 ranks, 7.5e-5 on one); it is formed at the
    weight's precision now, as eager's ``add_`` does."""
    result = run_parity(
        lambda: mlp().double(), _muon_on_weights, world_size,
        classification_batches(STEPS, dtype=torch.float64),
    )
    result.assert_close(FLOAT64_TOLERANCE)
    assert relative_difference(result.reference[0].weight, mlp_initial_weight().double()) > 1e-3


# Optimizers whose learning rate reaches a Scalar argument (NOTE: [tensor hyper-parameters
# in Scalar arguments]) compute what eager computes bit for bit on one rank, 16-bit
# weights included, and so do Adam and AdamW (eager's single-tensor formula, NOTE:
# [Adam's update as eager's], with beta1 kept a Python number: NOTE: [hyper-parameters
# kept Python numbers]; before, bf16 and float32 Adam differed from eager after one
# step). NAdam and Adamax take their capturable path, which rounds differently in bf16
# (see the README's Limitations). Every tensor of the model has a multiple of 64
# elements: CPU kernels round a 16-bit product in their scalar tail loop but not in
# their vector body, so eager itself treats the last elements of a shorter tensor
# differently from the rest, and where the tail falls depends on the machine's vector
# width.
BIT_EXACT_ON_ONE_RANK = {
    "sgd_momentum": OPTIMIZERS["sgd_momentum"],
    "adagrad": MORE_OPTIMIZERS["adagrad"],
    "rmsprop": MORE_OPTIMIZERS["rmsprop"],
    "adadelta": MORE_OPTIMIZERS["adadelta"],
    "muon": _muon_on_weights,
    "adam": OPTIMIZERS["adam"],
    "adamw_single_tensor": OPTIMIZERS["adamw_single_tensor"],
    "adam_amsgrad": MORE_OPTIMIZERS["adam_amsgrad"],
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("optimizer", list(BIT_EXACT_ON_ONE_RANK))
def test_one_rank_is_bit_exact(run_parity, classification_batches, optimizer, dtype):
    result = run_parity(
        lambda: nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64)).to(dtype),
        BIT_EXACT_ON_ONE_RANK[optimizer], 1,
        classification_batches(STEPS, batch_size=64, features=64, classes=64, dtype=dtype),
    )
    assert result.state_differences and max(result.loss_differences) == 0.0
    differing = {k: v for k, v in result.state_differences.items() if v != 0.0}
    assert not differing, differing


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("optimizer", ["adagrad", "rmsprop", "adadelta"])
def test_16_bit_tensor_scalars_add_no_value_check(classification_batches, train_step, optimizer, dtype):
    """The probe of how torch's CPU ``add`` rounds a 16-bit ``alpha`` (NOTE: [tensor
    hyper-parameters in Scalar arguments]) runs on real tensors even when it is first
    asked inside a trace: before, its comparison became an ``if`` on a traced value,
    kept in the program as a check (and the state was not made before the first
    program: two programs)."""
    _cpu_alpha_rounds_to_dtype.cache_clear()  # first asked inside this test's trace
    model = mlp().to(dtype)
    compiled = sc.compile()(train_step)
    optimizer_ = MORE_OPTIMIZERS[optimizer](model)
    x, y = classification_batches(1, dtype=dtype)[0]
    with sc.simulate(world_size=2):
        compiled(model, optimizer_, x, y)
    assert compiled.compile_count == 1
    assert not compiled.last_program.captured.checks


@pytest.mark.parametrize(("optimizer", "state", "steps"), [("nadam", "mu_product", 3), ("asgd", "eta", 5)])
@pytest.mark.parametrize("default", [torch.float32, torch.float64])
def test_scalar_state_in_float32_by_default(train_step, optimizer, state, steps, default):
    """NAdam's ``mu_product`` and ASGD's ``eta`` are float32 in eager under the default
    dtype, float64 in compiled programs (README, Numerics notes): a float64 model differs
    by the float32 rounding of that state only, and not at all when eager keeps it in
    float64 too."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 4).double()
        reference = copy.deepcopy(model)
        optim = MORE_OPTIMIZERS[optimizer](model)
        reference_optim = MORE_OPTIMIZERS[optimizer](reference)
        x, y = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))
        compiled = sc.compile(parallel_mode=DataParallel("replicate"))(train_step)
        with sc.simulate(world_size=2) as sim:
            for _ in range(steps):
                compiled(model, optim, x, y)
                train_step(reference, reference_optim, x, y)
            params = compare_models(model, reference, sim)
            states = compare_optimizers(optim, reference_optim, sim)
    finally:
        torch.set_default_dtype(before)
    worst_param = max(params.values())
    worst_state = max(v for k, v in states.items() if k.endswith(state))
    assert reference_optim.state[reference.weight][state].dtype == default
    if default == torch.float64:
        assert worst_param < 1e-15 and worst_state == 0.0
    else:  # the float32 rounding of eager's state, and only that
        assert 1e-10 < worst_param < 1e-8
        assert 1e-9 < worst_state < 1e-7

