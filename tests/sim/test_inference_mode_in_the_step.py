"""``torch.inference_mode()`` inside a compiled step (NOTE: [inference mode in the step]).

Under inference mode autograd's dispatch keys are off, so an op autograd decomposes with
its own C++ kernel (``nll_loss``, ``var.dim``, ``upsample_bilinear2d.vec``, ...) reached
the capture's decomposition table as itself, and torch's table holds Python references
for some of them whose signatures are not the op's. Before, ``F.cross_entropy(lg, y,
reduction="sum")`` returned the mean (1.4585 for eager's 5.8339) and ``reduction="none"``
the sum as a 0-d tensor, with ``ignore_index=0`` the sum was half of eager's (1.334 for
2.668) and ``ignore_index=-100`` failed at run time (IndexError in aten.index.Tensor);
any world size, ddp and fsdp, simulated and real ranks. ``torch.var(x, 0)`` and
``torch.fft.rfft`` were refused, ``F.hinge_embedding_loss`` failed at capture. Every
result is compared in float64 with the eager step on one device with the global batch.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.capture.ops_named_in_place import named_in_place_decompositions
from spmd_compiler.capture.trace import capture_decompositions
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, max_difference

TOL = 1e-12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 5)).double()


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 8, generator=gen, dtype=torch.float64)
    # rank 0 of 2 (and of 4) holds more ignored (-100) targets and more 0s than the others
    y = torch.tensor([-100, 1, -100, 0, 2, 3, 0, 4])
    return x, y


def _valid(y: torch.Tensor) -> torch.Tensor:
    return y.clamp(min=0)


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "ce_sum": lambda lg, y: F.cross_entropy(lg, _valid(y), reduction="sum"),
    "ce_none": lambda lg, y: F.cross_entropy(lg, _valid(y), reduction="none"),
    "ce_mean": lambda lg, y: F.cross_entropy(lg, _valid(y)),
    "ce_ignore_mean": lambda lg, y: F.cross_entropy(lg, y, ignore_index=-100),
    "ce_ignore_sum": lambda lg, y: F.cross_entropy(lg, y, ignore_index=-100, reduction="sum"),
    "ce_ignore_none": lambda lg, y: F.cross_entropy(lg, y, ignore_index=-100, reduction="none"),
    "ce_ignore0_sum": lambda lg, y: F.cross_entropy(lg, _valid(y), ignore_index=0, reduction="sum"),
    "ce_ignore0_mean": lambda lg, y: F.cross_entropy(lg, _valid(y), ignore_index=0),
    "ce_smoothing_sum": lambda lg, y: F.cross_entropy(lg, y, reduction="sum", label_smoothing=0.1),
    "ce_smoothing_mean": lambda lg, y: F.cross_entropy(lg, y, label_smoothing=0.1),
    "nll_sum": lambda lg, y: F.nll_loss(F.log_softmax(lg, -1), _valid(y), reduction="sum"),
    "nll_none": lambda lg, y: F.nll_loss(F.log_softmax(lg, -1), y, reduction="none"),
    "module_sum": lambda lg, y: nn.CrossEntropyLoss(reduction="sum")(lg, _valid(y)),
    "weighted_sum": lambda lg, y: F.cross_entropy(
        lg, y, weight=torch.arange(1.0, 6.0, dtype=lg.dtype), reduction="sum"
    ),
}


# other ops autograd decomposes itself, found in torch's table under inference mode
OTHER_OPS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "var_dim": lambda lg, y: torch.var(lg, 0, unbiased=False, keepdim=True),
    "std_mean": lambda lg, y: torch.stack(torch.std_mean(lg, 1)),
    "interpolate_bilinear": lambda lg, y: F.interpolate(
        lg[:, :4].reshape(-1, 1, 2, 2), scale_factor=2, mode="bilinear", align_corners=False
    ),
    "rfft": lambda lg, y: torch.view_as_real(torch.fft.rfft(lg, norm="ortho")),
    "prelu": lambda lg, y: F.prelu(lg, torch.tensor([0.25], dtype=lg.dtype)),
    "hinge_sum": lambda lg, y: F.hinge_embedding_loss(lg, torch.sign(lg.detach() - 0.1), reduction="sum"),
    "margin_ranking_sum": lambda lg, y: F.margin_ranking_loss(
        lg[:, 0], lg[:, 1], torch.sign(lg[:, 2] - lg[:, 3]), margin=0.1, reduction="sum"
    ),
}


def _evaluation(*losses: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Callable[..., tuple]:
    def evaluate(model, x, y):  # noqa: ANN001, ANN202
        with torch.inference_mode():
            logits = model(x)
            return tuple(loss(logits, y) for loss in losses)

    return evaluate


def _compiled_evaluation(losses: dict[str, Callable], mode: str, world: int) -> None:
    """All ``losses`` in one step (one compilation), each checked against eager's."""
    model, (x, y) = _model(), _batch()
    names = sorted(losses)
    step = _evaluation(*(losses[n] for n in names))
    expected = step(copy.deepcopy(model), x, y)
    with sc.simulate(world_size=world):
        got = sc.compile(make_mode(mode))(step)(model, x, y)
    for name, g, e in zip(names, got, expected, strict=True):
        assert g.shape == e.shape, (name, g.shape, e.shape)
        assert torch.allclose(g, e, rtol=TOL, atol=TOL), (name, g, e)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_class_index_losses_under_inference_mode_match_eager(mode: str, world: int) -> None:
    _compiled_evaluation(LOSSES, mode, world)


def test_other_composite_ops_under_inference_mode_match_eager() -> None:
    _compiled_evaluation(OTHER_OPS, "ddp", 2)


def test_the_capture_table_holds_no_torch_decomposition_of_a_composite_op() -> None:
    """Only our own entries may be keyed on an op autograd decomposes (they are reached
    under inference mode only, and hold the op's schema)."""
    ours = {torch.ops.aten.where.Scalar, torch.ops.aten.where.ScalarSelf, torch.ops.aten.where.ScalarOther}
    # the bit operators named like in-place ops (NOTE: [ops named like in-place ones]):
    # composite, so reached under inference mode only, and traced as their bitwise twins
    ours |= set(named_in_place_decompositions())
    composite = {op for op in capture_decompositions() if private.is_op_overload(op) and private.is_composite_implicit(op)}
    assert composite <= ours, sorted(map(str, composite - ours))


def distill(model, teacher, opt, x, y):  # noqa: ANN001
    with torch.inference_mode():
        teacher_logits = teacher(x)
        teacher_loss = F.cross_entropy(teacher_logits, y, reduction="sum")
    logits = model(x)
    # clone: a normal tensor autograd may save (eager refuses the inference tensor itself)
    loss = F.cross_entropy(logits, y) + (logits - teacher_logits.clone()).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach(), teacher_loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_train_step_with_an_inference_mode_teacher_matches_eager(mode: str) -> None:
    model, teacher = _model(), _model()
    with torch.no_grad():
        for p in teacher.parameters():
            p.mul_(0.5)
    x, y = _batch()
    y = _valid(y)
    reference, reference_teacher = copy.deepcopy(model), copy.deepcopy(teacher)
    optim, reference_optim = (torch.optim.Adam(m.parameters(), lr=0.05) for m in (model, reference))
    step = sc.compile(make_mode(mode))(distill)
    with sc.simulate(world_size=2) as sim:
        for _ in range(2):
            got = step(model, teacher, optim, x, y)
            expected = distill(reference, reference_teacher, reference_optim, x, y)
            for g, e in zip(got, expected, strict=True):
                assert float(g) == pytest.approx(float(e), rel=TOL, abs=TOL)
        assert max_difference(
            compare_models(model, reference, sim), compare_optimizers(optim, reference_optim, sim)
        ) < TOL


def saves_an_inference_tensor(model, teacher, opt, x, y):  # noqa: ANN001
    with torch.inference_mode():
        teacher_logits = teacher(x)
    loss = (model(x) * teacher_logits).mean()  # mul saves its operand for backward
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


def writes_an_inference_tensor(model, teacher, opt, x, y):  # noqa: ANN001
    with torch.inference_mode():
        teacher_logits = teacher(x)
    teacher_logits.add_(1.0)
    loss = (model(x) + teacher_logits).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.detach()


@pytest.mark.parametrize(
    ("step_fn", "match"),
    [
        (saves_an_inference_tensor, "Inference tensors cannot be saved for backward"),
        (writes_an_inference_tensor, "Inplace update to inference tensor outside InferenceMode"),
    ],
    ids=["saved_for_backward", "written_in_place"],
)
def test_an_inference_tensor_in_autograd_fails_as_eager_does(step_fn: Callable, match: str) -> None:
    model, teacher = _model(), _model()
    x, _ = _batch()
    with pytest.raises(RuntimeError, match=match):
        step_fn(copy.deepcopy(model), teacher, torch.optim.SGD(model.parameters(), lr=0.1), x, None)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = copy.deepcopy(model)
    with sc.simulate(world_size=2) as sim:
        with pytest.raises(SPMDCompileError, match=match):
            sc.compile(make_mode("fsdp"))(step_fn)(model, teacher, optim, x, None)
        assert max_difference(compare_models(model, before, sim)) == 0.0
