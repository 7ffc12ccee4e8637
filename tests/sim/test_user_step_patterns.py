"""Train-step patterns from ordinary training scripts, each compiled under ddp and fsdp
on 2 simulated ranks against the undecorated step on one device on the global batch
(float64, every parameter, buffer and optimizer-state tensor within 1e-10):

- the Hugging Face token-mean loss: ``ignore_index=-100`` labels, ``reduction="sum"``
  divided by the global count of counted tokens (a rank must not divide by its own);
- ``ignore_index`` with label smoothing;
- a mean over the batch added to the loss (an activation penalty); a gradient penalty
  (the input gradient's norm, taken with ``create_graph``: a double backward);
- gradient clipping by the global norm; two micro-batches accumulated in one step;
- ``zero_grad()`` first (gradients kept between steps); a ``no_grad`` update of the
  parameters after the optimizer; a frozen parameter; two parameter groups;
- activation checkpointing (``torch.utils.checkpoint``, non-reentrant);
- a padding mask built from the batch, fed to ``nn.TransformerEncoderLayer``;
- Conv2d + BatchNorm2d: the batch statistics (and running buffers) of the global batch;
  Conv2d + GroupNorm (per-sample statistics; its op takes the batch size as an integer);
- a weight-normalized layer (``nn.utils.parametrizations.weight_norm``);
- recurrent layers (a bidirectional 2-layer ``nn.LSTM`` into an ``nn.GRU``);
- one submodule registered under two paths (its tensors have two names);
- the weights read again after ``optimizer.step()`` (a validation loss in eval mode
  under ``no_grad``), an EMA copy of the weights updated after the step, and the
  optimizer state, gradient and weight read for logging after the step, all on layers
  whose rows do not divide the ranks (fsdp holds them padded).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.parallel import DistributedDataParallel

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models

TOL = 1e-10
BATCH, FEATURES, CLASSES = 8, 8, 4


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.GELU(), nn.Linear(16, CLASSES)).double()


class _Checkpointed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(FEATURES, 16), nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = torch.utils.checkpoint.checkpoint(
            lambda t: F.gelu(self.a(t)), x, use_reentrant=False
        )
        return self.b(hidden)


class _SharedSubmodule(nn.Module):
    """One module registered under several paths (timm's CoaT hands one relative
    position encoder to every block of a stage): its tensors have a name per path."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(16, 16)
        self.stem = nn.Linear(FEATURES, 16)
        self.blocks = nn.ModuleList(
            [nn.Sequential(self.shared, nn.GELU()), nn.Sequential(nn.Linear(16, 16), self.shared)]
        )
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class _Recurrent(nn.Module):
    """A 2-layer bidirectional LSTM into a GRU: their forward rebuilds ``_flat_weights``
    from the parameters swapped in for the trace (not a tensor the step keeps)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(FEATURES, 6, num_layers=2, batch_first=True, bidirectional=True)
        self.gru = nn.GRU(12, 8, batch_first=True)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        out, last = self.gru(out)
        return self.head(last[-1] + out.mean(1))


class _Frozen(_Checkpointed):
    def __init__(self) -> None:
        super().__init__()
        self.a.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.a(x)))


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(FEATURES, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(FEATURES, CLASSES)


class _ConvBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Linear(4, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.norm(self.conv(x))).mean((2, 3)))


class _ConvGroupNorm(_ConvBatchNorm):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(2, 4)


def _odd_mlp() -> nn.Module:
    """Rows that do not divide 2 ranks: fsdp pads them (NOTE: [uneven shards])."""
    return nn.Sequential(nn.Linear(FEATURES, 15), nn.GELU(), nn.Linear(15, CLASSES)).double()


class _WithEMA(nn.Module):
    """A model and an exponential moving average of its weights (not optimized)."""

    def __init__(self) -> None:
        super().__init__()
        self.net, self.ema = _odd_mlp(), _odd_mlp()
        self.ema.load_state_dict(self.net.state_dict())
        self.ema.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _weight_normed() -> nn.Module:
    model = _odd_mlp()
    torch.nn.utils.parametrizations.weight_norm(model[0])
    return model


def _finish(model, optim, loss):  # noqa: ANN001
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def token_mean_step(model, optim, x, y):  # noqa: ANN001
    labels = torch.where(y == 0, torch.full_like(y, -100), y)
    counted = (labels != -100).sum()
    loss = F.cross_entropy(model(x), labels, ignore_index=-100, reduction="sum") / counted
    return _finish(model, optim, loss)


def label_smoothing_step(model, optim, x, y):  # noqa: ANN001
    labels = torch.where(y == 0, torch.full_like(y, -100), y)
    return _finish(model, optim, F.cross_entropy(model(x), labels, label_smoothing=0.1))


def clipped_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    optim.step()
    optim.zero_grad()
    return loss


def regularized_step(model, optim, x, y):  # noqa: ANN001
    """A mean over the batch added to the loss (torch 2.11 added its Partial("avg") to the
    loss's Partial("sum") by a redistribution it refuses)."""
    out = model(x)
    loss = F.cross_entropy(out, y) + 0.01 * out.pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def gradient_penalty_step(model, optim, x, y):  # noqa: ANN001
    """WGAN-GP style: the norm of the input gradient, taken with create_graph, is part of
    the loss (a double backward)."""
    x = x.clone().requires_grad_(True)
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    loss = F.cross_entropy(out, y) + ((grad.norm(2, dim=1) - 1) ** 2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def hessian_penalty_step(model, optim, x, y):  # noqa: ANN001
    """The squared Hessian of the logits' sum in the first example's input
    (``torch.func.hessian``: forward over reverse; autograd's zero gradients in a second
    derivative were ZeroTensors no expansion could make, and torch.func's basis, written
    in place inside ``vmap``, was taken for a write to a tensor outside the step)."""
    penalty = torch.func.hessian(lambda xi: model(xi).sum())(x[0]).pow(2).sum()
    loss = F.cross_entropy(model(x), y) + 1e-3 * penalty
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def accumulating_step(model, optim, x, y):  # noqa: ANN001
    total = torch.zeros((), dtype=x.dtype)
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        loss = F.cross_entropy(model(xs), ys) / 2
        loss.backward()
        total = total + loss.detach()
    optim.step()
    optim.zero_grad(set_to_none=False)
    return total


def zero_grad_first_step(model, optim, x, y):  # noqa: ANN001
    optim.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss


def no_grad_update_step(model, optim, x, y):  # noqa: ANN001
    loss = _finish(model, optim, F.cross_entropy(model(x), y))
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.99)
    return loss


def eval_after_update_step(model, optim, x, y):  # noqa: ANN001
    _finish(model, optim, F.cross_entropy(model(x), y))
    model.eval()
    with torch.no_grad():  # the updated weights, read again in the same step
        validation = F.cross_entropy(model(x), y)
    model.train()
    return validation


def ema_step(model, optim, x, y):  # noqa: ANN001
    loss = _finish(model, optim, F.cross_entropy(model(x), y))
    with torch.no_grad():
        for average, weight in zip(model.ema.parameters(), model.net.parameters()):
            average.lerp_(weight, 0.1)
    return loss


def reads_state_after_update_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    weight = model[0].weight  # 15 rows: padded under fsdp
    exp_avg = optim.state[weight]["exp_avg"]
    logged = exp_avg.norm() + exp_avg.sum(0).max() + weight.grad.abs().max() + weight[:, 0].sum()
    optim.zero_grad()
    return loss.detach() + grad_norm + logged


def padding_mask_step(model, optim, x, y):  # noqa: ANN001
    keep = (x.abs().sum(-1) > 2.0).to(x.dtype)  # (batch, seq): padding from the data
    hidden = model.layer(x, src_key_padding_mask=keep == 0)
    pooled = (hidden * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp(min=1)
    return _finish(model, optim, F.cross_entropy(model.head(pooled), y))


def plain_step(model, optim, x, y):  # noqa: ANN001
    return _finish(model, optim, F.cross_entropy(model(x), y))


def _two_groups(model: nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    return torch.optim.SGD(
        [{"params": params[:2], "lr": 0.1},
         {"params": params[2:], "lr": 0.01, "weight_decay": 0.1}],
        lr=0.05, momentum=0.9,
    )


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _batches(shape: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(shape, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(3)
    ]


VECTOR = (BATCH, FEATURES)
CASES = {  # name: (model, optimizer, step, input shape)
    "token_mean_loss": (_mlp, _adamw, token_mean_step, VECTOR),
    "ignore_index_label_smoothing": (_mlp, _adamw, label_smoothing_step, VECTOR),
    "clip_grad_norm": (_mlp, _adamw, clipped_step, VECTOR),
    "mean_regularizer": (_mlp, _adamw, regularized_step, VECTOR),
    "gradient_penalty": (_mlp, _adamw, gradient_penalty_step, VECTOR),
    "gradient_accumulation": (_mlp, _adamw, accumulating_step, VECTOR),
    "hessian_penalty": (_mlp, _adamw, hessian_penalty_step, VECTOR),
    "zero_grad_first": (_mlp, _adamw, zero_grad_first_step, VECTOR),
    "no_grad_update": (_mlp, _adamw, no_grad_update_step, VECTOR),
    "frozen_parameter": (lambda: _Frozen().double(), _sgd, plain_step, VECTOR),
    "two_param_groups": (_mlp, _two_groups, plain_step, VECTOR),
    "activation_checkpoint": (lambda: _Checkpointed().double(), _adamw, plain_step, VECTOR),
    # SGD for these two: the key third of in_proj_bias and the conv bias before a
    # BatchNorm have a zero gradient in exact arithmetic, which Adam would turn into
    # noise-sized updates (relative differences of noise over noise)
    "padding_mask_encoder": (lambda: _Encoder().double(), _sgd, padding_mask_step, (BATCH, 5, FEATURES)),
    "conv_batchnorm": (lambda: _ConvBatchNorm().double(), _sgd, plain_step, (BATCH, 3, 5, 5)),
    "conv_groupnorm": (lambda: _ConvGroupNorm().double(), _adamw, plain_step, (BATCH, 3, 5, 5)),
    "eval_after_update": (_odd_mlp, _adamw, eval_after_update_step, VECTOR),
    "ema_of_weights": (_WithEMA, _adamw, ema_step, VECTOR),
    "weight_norm": (_weight_normed, _adamw, plain_step, VECTOR),
    "reads_state_after_update": (_odd_mlp, _adamw, reads_state_after_update_step, VECTOR),
    "lstm_gru": (lambda: _Recurrent().double(), _adamw, plain_step, (BATCH, 5, FEATURES)),
    "shared_submodule": (lambda: _SharedSubmodule().double(), _adamw, plain_step, VECTOR),
}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_step_pattern_matches_one_device(name, mode, run_parity):
    make_model, make_optimizer, step, shape = CASES[name]
    if name == "hessian_penalty" and tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 13):
        # torch 2.11 has no DTensor rule for the diagonal_scatter that functionalizing
        # torch.func's basis (``diagonal(...).fill_(1)``) makes: refused by name
        with pytest.raises(SPMDCompileError, match="diagonal_scatter"):
            run_parity(make_model, make_optimizer, 2, _batches(shape), step=step, mode=make_mode(mode))
        return
    result = run_parity(
        make_model, make_optimizer, 2, _batches(shape), step=step, mode=make_mode(mode)
    )
    if name == "conv_batchnorm":  # the conv bias: zero gradient, compared in absolute terms
        bias = result.state_differences.pop("param.conv.bias")
        result.state_differences.pop("optim.g0.p1.momentum_buffer")
        assert bias < 1e-6
    result.assert_close(TOL)


class _TwoTowers(nn.Module):
    """CLIP-style: two encoders, normalized embeddings, a learned temperature."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Linear(6, BATCH)  # an embedding width equal to the batch size
        self.text = nn.Linear(5, BATCH)
        self.logit_scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        i = F.normalize(self.image(images), dim=-1)
        t = F.normalize(self.text(texts), dim=-1)
        return self.logit_scale.exp() * i @ t.t()  # every image against every text


def contrastive_step(model, optim, images, texts):
    logits = model(images, texts)
    labels = torch.arange(logits.shape[0])
    loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_contrastive_loss_over_the_global_batch(mode, run_parity):
    """In-batch negatives couple every sample with every other: the compiled step scores
    each rank's images against the whole batch's texts, as one device does. The local
    batch check once refused it when the embedding width equals the batch size (the
    normalizing ``expand`` looked batch-sized, and the loss's scalar gradient computed from
    it met the gathered logits)."""
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(BATCH, 6, generator=gen, dtype=torch.float64),
         torch.randn(BATCH, 5, generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]
    result = run_parity(lambda: _TwoTowers().double(), _adamw, 2, batches, step=contrastive_step, mode=make_mode(mode))
    result.assert_close(TOL)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_model_wrapped_in_torch_ddp_traces_as_its_module(mode):
    """Code moving from torch DDP passes the DDP-wrapped model: the trace swaps the
    parameters out from under DDP's reducer, so the step computes what its module does
    (NOTE in ``capture/bindings.py``: ``check_plain_modules``)."""
    with sc.simulate(world_size=2) as sim:
        torch.manual_seed(0)
        inner = _mlp()
        reference = copy.deepcopy(inner)
        wrapped = DistributedDataParallel(inner)
        optim, reference_optim = _adamw(wrapped), _adamw(reference)
        compiled = sc.compile(make_mode(mode))(plain_step)
        for x, y in _batches(VECTOR):
            loss = compiled(wrapped, optim, x, y)
            expected = plain_step(reference, reference_optim, x, y)
            assert abs(float(loss) - float(expected)) <= TOL * abs(float(expected))
        assert max(compare_models(inner, reference, sim).values()) < TOL


def criterion_step(model, criterion, optim, x, y):  # noqa: ANN001
    return _finish(model, optim, criterion(model(x), y))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_weighted_loss_module_passed_as_an_argument(mode):
    """nn.CrossEntropyLoss(weight=w) holds its class weights as a buffer: passed to the
    step it is one more module (its buffer replicated), as it is read by name beside a
    given model (NOTE: [modules read by name beside the given ones])."""
    weight = torch.tensor([0.1, 1.0, 2.0, 3.0], dtype=torch.float64)
    torch.manual_seed(0)
    model = _mlp()
    reference = copy.deepcopy(model)
    criterion = nn.CrossEntropyLoss(weight=weight, label_smoothing=0.1)
    ref_criterion = copy.deepcopy(criterion)
    optim, ref_optim = _adamw(model), _adamw(reference)
    step = sc.compile(make_mode(mode))(criterion_step)
    with sc.simulate(world_size=2) as sim:
        for x, y in _batches(VECTOR):
            loss = step(model, criterion, optim, x, y)
            expected = criterion_step(reference, ref_criterion, ref_optim, x, y)
            assert abs(float(loss) - float(expected)) <= TOL * abs(float(expected))
        differences = compare_models(model, reference, sim)
    assert max(differences.values()) < TOL, differences


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_installed_parameters_are_still_parameters(mode):
    """A placed parameter is a DTensor ``nn.Parameter`` (torch's ``_is_param`` mark):
    ``isinstance(p, nn.Parameter)`` was False after the first call, and tying a layer
    to it between calls raised torch's TypeError."""
    model = _mlp()
    optim = _adamw(model)
    step = sc.compile(make_mode(mode))(plain_step)
    with sc.simulate(world_size=2):
        step(model, optim, *_batches(VECTOR)[0])
        assert all(isinstance(p, nn.Parameter) for p in model.parameters())
        other = nn.Linear(16, CLASSES)
        other.weight = model[2].weight  # a module takes only an nn.Parameter
        assert other.weight is model[2].weight
