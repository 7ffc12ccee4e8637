"""Code run inside ``optimizer.step()`` besides the optimizer's element-wise update, on
parameters whose sharded dimension does not divide 2 simulated ranks (fsdp: a Linear of 3
output rows; tp: a hidden width of 15), float64 against one device on the global batch
(NOTE: [what the optimizer computes on padded rows]).

Every op traced inside ``optimizer.step()`` is tagged optimizer phase, hooks and a
hand-written step's reductions included, and used to read the padded shard: a step
post-hook centering a weight over its rows came out 2.18e-01 off eager under fsdp
(1.09e-02 under tp), a logged mean 0.75x eager's, and an EMA of the weights updated in a
post-hook (``AveragedModel``) was refused with a hint about Muon. The padding rows stay
zero after such hooks, and torch's optimizers with an update whose padding rows do not
stay zero by themselves (Adamax's ``max(|g| + eps, ...)``) have them zeroed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel, TensorParallel
from spmd_compiler.tools.parity import compare_models, compare_optimizers, max_difference

TOL = 1e-12
WORLD = 2
MODES = ["fsdp", "tp"]


def _model(mode: str) -> nn.Module:
    """fsdp: the last Linear's 3 rows do not divide 2 ranks; tp: the hidden width 15 (the
    first Linear's rows, the second's columns) does not."""
    torch.manual_seed(0)
    hidden = 15 if mode == "tp" else 16
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3)).double()


def _mode(mode: str):  # noqa: ANN202
    if mode == "tp":
        return TensorParallel({"0": ColwiseParallel(), "2": RowwiseParallel()})
    return DataParallel("fully_shard")


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(steps)
    ]


def _step(model, optim, x, y):  # noqa: ANN001, ANN202
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _center_rows(opt: torch.optim.Optimizer, *_: object) -> None:
    with torch.no_grad():
        for p in opt.param_groups[0]["params"]:
            if p.dim() == 2:
                p.sub_(p.mean(0, keepdim=True))


def _scale_by_std(opt: torch.optim.Optimizer, *_: object) -> None:
    with torch.no_grad():
        for p in opt.param_groups[0]["params"]:
            p.div_(p.std() + 1)


def _check_padding_rows_zero(model: nn.Module, optim: torch.optim.Optimizer, sim) -> int:  # noqa: ANN001
    """The rows padding each rank's shard of the parameters and optimizer state (the
    padded buffer the runtime keeps and feeds again, NOTE: [uneven shards]) are zero;
    returns how many padded shards were seen."""
    seen = 0
    tensors = [*model.named_parameters()] + [
        (f"state {key}", value)
        for state in optim.state.values() for key, value in state.items()
        if isinstance(value, torch.Tensor) and value.dim()
    ]
    for name, p in tensors:
        for rank, local in sim.per_rank(p).items():
            base = local._base
            if base is None or base.shape == local.shape or base.dim() != local.dim():
                continue
            dim = next(d for d in range(local.dim()) if base.shape[d] != local.shape[d])
            padding = base.narrow(dim, local.shape[dim], base.shape[dim] - local.shape[dim])
            assert torch.count_nonzero(padding) == 0, f"{name} rank {rank}: {padding}"
            seen += 1
    return seen


def _run(
    mode: str,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    step: Callable = _step,
) -> tuple[float, int]:
    model = _model(mode)
    reference = copy.deepcopy(model)
    optim, ref_optim = make_optimizer(model), make_optimizer(reference)
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            got, want = compiled(model, optim, x, y), step(reference, ref_optim, x, y)
            assert float(got) == pytest.approx(float(want), rel=TOL, abs=TOL)
        diff = max_difference(
            compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim)
        )
        seen = _check_padding_rows_zero(model, optim, sim)
    return diff, seen


@pytest.mark.parametrize("mode", MODES)
def test_post_hook_centering_rows(mode):
    """``p.sub_(p.mean(0))`` in a step post-hook: the mean over the true rows, and the
    padding rows stay zero (fsdp 2.18e-01 off eager before, tp 1.09e-02)."""

    def make(model: nn.Module) -> torch.optim.Optimizer:
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        optim.register_step_post_hook(_center_rows)
        return optim

    diff, seen = _run(mode, make)
    assert diff < TOL
    assert seen > 0


@pytest.mark.parametrize("mode", MODES)
def test_pre_hook_std(mode):
    """``p.div_(p.std() + 1)`` in a step pre-hook: the standard deviation of the true
    elements (a variance over the padded shard counted the zero rows)."""

    def make(model: nn.Module) -> torch.optim.Optimizer:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        optim.register_step_pre_hook(_scale_by_std)
        return optim

    diff, _ = _run(mode, make)
    assert diff < TOL


@pytest.mark.parametrize("mode", MODES)
def test_logged_mean_and_norm_returned(mode):
    """Statistics of a weight recorded by a post-hook and returned by the step: the mean
    came out 0.75x eager's under fsdp (the padding row counted); the norm was exact and
    stays so (zero rows add nothing to it)."""
    stats: dict[str, torch.Tensor] = {}

    def make(model: nn.Module) -> torch.optim.Optimizer:
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)

        def log(*_: object) -> None:
            weight = model[2].weight.detach()
            stats["mean"], stats["norm"] = weight.mean(), weight.norm()

        optim.register_step_post_hook(log)
        return optim

    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        loss = _step(model, optim, x, y)
        return torch.stack([loss, stats["mean"], stats["norm"]])

    model = _model(mode)
    reference = copy.deepcopy(model)
    optim, ref_optim = make(model), make(reference)
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(world_size=WORLD):
        for x, y in _batches():
            got, want = compiled(model, optim, x, y), step(reference, ref_optim, x, y)
            assert torch.allclose(torch.as_tensor(got), want, rtol=TOL, atol=0), (got, want)


class _CenteredSGD(torch.optim.Optimizer):
    """SGD with momentum whose step centers each matrix over its rows after the update."""

    def __init__(self, params, lr: float = 0.1) -> None:  # noqa: ANN001
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201, ARG002
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "buf" not in state:
                    state["buf"] = torch.zeros_like(p)
                state["buf"].mul_(0.9).add_(p.grad)
                p.add_(state["buf"], alpha=-group["lr"])
                if p.dim() == 2:
                    p.sub_(p.mean(0, keepdim=True))


@pytest.mark.parametrize("mode", MODES)
def test_custom_optimizer_row_mean(mode):
    """A hand-written optimizer's own step reduces over the rows: not a hook, so the rule
    is keyed on the op, not on where it was traced."""
    diff, seen = _run(mode, lambda model: _CenteredSGD(model.parameters()))
    assert diff < TOL
    assert seen > 0


@pytest.mark.parametrize("mode", MODES)
def test_averaged_model_ema_in_post_hook(mode):
    """``AveragedModel.update_parameters`` in a step post-hook (a ``_foreach_lerp`` of
    the EMA copy, which holds the true rows, with the padded weights): refused before,
    naming Muon."""
    emas: dict[int, AveragedModel] = {}

    def make(model: nn.Module) -> torch.optim.Optimizer:
        ema = emas[id(model)] = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.9))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        optim.register_step_post_hook(lambda *_: ema.update_parameters(model))
        return optim

    def step(model, ema, optim, x, y):  # noqa: ANN001, ANN202
        return _step(model, optim, x, y)

    model = _model(mode)
    reference = copy.deepcopy(model)
    optim, ref_optim = make(model), make(reference)
    ema, ref_ema = emas[id(model)], emas[id(reference)]
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(world_size=WORLD) as sim:
        for x, y in _batches():
            got, want = compiled(model, ema, optim, x, y), step(reference, ref_ema, ref_optim, x, y)
            assert float(got) == pytest.approx(float(want), rel=TOL)
        diff = max_difference(compare_models(ema, ref_ema, sim), compare_models(model, reference, sim))
    assert diff < TOL


@pytest.mark.parametrize("mode", MODES)
def test_adamax_padding_rows_zeroed(mode):
    """Adamax's ``exp_inf = max(beta2 * exp_inf, |g| + eps)`` puts ``eps`` in the padding
    rows; they are zeroed where the state is written back, on each rank's shard."""
    diff, seen = _run(mode, lambda model: torch.optim.Adamax(model.parameters(), lr=1e-2))
    assert diff < TOL
    assert seen > 0
