"""``row_spreads``: var / std of rows kept in place against eager's on the selected rows
(NOTE: [spreads of selected rows]), the argument forms read, and the run-time error of
this package's own check (NOTE: [checks of this package decided on the spot])."""

from __future__ import annotations

import pytest
import torch

from spmd_compiler.capture.mask_selections import MaskWithFalseElements
from spmd_compiler.capture.row_spreads import REDUCTION_FORMS, spread, spread_arguments
from spmd_compiler.capture.value_checks import OWN_CHECK, stop_text
from spmd_compiler.ir.signature import ValueCheck
from spmd_compiler.runtime.runner import check_failed

X = torch.empty(0)


@pytest.mark.parametrize("args,kwargs,expected", [
    ((X,), {}, (None, 1.0, False)),
    ((X, False), {}, (None, 0.0, False)),
    ((X,), {"unbiased": False}, (None, 0.0, False)),
    ((X, 0), {}, (0, 1.0, False)),
    ((X, (0, 1), False, True), {}, ((0, 1), 0.0, True)),
    ((X, [0]), {"keepdim": True}, ([0], 1.0, True)),
    ((X,), {"dim": 1, "correction": 0.5}, (1, 0.5, False)),
    ((X,), {"dim": None, "correction": 0}, (None, 0.0, False)),
    ((X, True, True), {}, None),                    # var(unbiased) takes nothing more
    ((X, 0), {"dim": 0}, None),                     # dim twice: eager's error
    ((X,), {"unbiased": True, "correction": 1}, None),
    ((X,), {"out": X}, None),
    ((X,), {"correction": True}, None),
])
def test_spread_arguments_read_eager_overloads(args, kwargs, expected):
    assert spread_arguments(args, kwargs) == expected


def _case(dims, keepdim, correction, name, dtype=torch.float64, kept=(1, 3, 4)):
    gen = torch.Generator().manual_seed(len(kept) * 7 + len(dims))
    x = torch.randn(6, 3, 2, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()
    valid = torch.zeros(6, dtype=torch.bool)
    valid[list(kept)] = True
    got = spread(name, torch.where(valid[:, None, None], x, 1.0), valid[:, None, None], dims, correction, keepdim)
    want = getattr(torch, name)(x[valid], dim=dims, correction=correction, keepdim=keepdim)
    return x, got, want


@pytest.mark.parametrize("name", ["var", "std", "var_mean", "std_mean"])
@pytest.mark.parametrize("dims,keepdim", [((0, 1, 2), False), ((0,), False), ((0,), True), ((0, 2), True)])
@pytest.mark.parametrize("correction", [0.0, 1.0, 1.5])
def test_spread_matches_eager_on_the_selected_rows_with_its_gradient(name, dims, keepdim, correction):
    x, got, want = _case(dims, keepdim, correction, name)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        torch.testing.assert_close(g, w, rtol=1e-13, atol=1e-15)
    weights = [torch.linspace(-1, 2, w.numel(), dtype=w.dtype).reshape(w.shape) for w in want]
    grad_got = torch.autograd.grad(sum((g * k).sum() for g, k in zip(got, weights, strict=True)), x)[0]
    grad_want = torch.autograd.grad(sum((w * k).sum() for w, k in zip(want, weights, strict=True)), x)[0]
    torch.testing.assert_close(grad_got, grad_want, rtol=1e-12, atol=1e-14)
    assert not grad_got[[0, 2, 5]].any()  # the dropped rows get exactly zero


def test_std_of_one_value_has_eager_zero_gradient():
    """std 0 (one row, correction 0): eager's std_backward masks the gradient there;
    sqrt's own derivative would be inf."""
    x, got, want = _case((0,), False, 0.0, "std", kept=(2,))
    assert not got.any() and not want.any()
    grad = torch.autograd.grad(got.sum(), x)[0]
    assert torch.isfinite(grad).all() and not grad.any()
    torch.testing.assert_close(grad, torch.autograd.grad(want.sum(), x)[0])


@pytest.mark.filterwarnings("ignore:.*degrees of freedom")
@pytest.mark.parametrize("kept,correction", [((), 0.0), ((3,), 1.0), ((3,), 40.0), ((1, 2), 4.0)])
def test_no_degrees_of_freedom_give_eager_nan_and_inf(kept, correction):
    for name in ("var", "std"):
        _, got, want = _case((0, 1, 2), False, correction, name, kept=kept)
        torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_rows_accumulate_as_eager(dtype):
    _, got, want = _case((0,), False, 1.0, "std", dtype=dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, want)


def test_the_error_of_an_own_check_says_the_step_raises_nothing_there():
    """Before the sixty-sixth session: "A check on a tensor's value at ... came out False
    on this call: the step raises there (MaskWithFalseElements: ...)", of a step that
    raises nothing (eager runs ``pitch[mask].median()``)."""
    raised = OWN_CHECK + stop_text(MaskWithFalseElements(use="torch.Tensor.median", advice=REDUCTION_FORMS["median"]))
    message = str(check_failed(ValueCheck(0, True, "step.py:7: \"m = p[mask].median()\"", raised)))
    assert message.startswith("The train step at step.py:7: \"m = p[mask].median()\" was compiled only "
                              "for calls where a condition on a tensor's value holds"), message
    assert "the step raises there" not in message and OWN_CHECK not in message, message
    assert "the step itself raises nothing there (eager goes on)" in message
    assert ("torch.Tensor.median of a mask selection is compiled only for masks with no false "
            "element; for any mask write `torch.where(mask, x, float('nan')).nanmedian()`") in message
    assert "Select with fixed shapes" not in message and "Nothing was updated" in message
