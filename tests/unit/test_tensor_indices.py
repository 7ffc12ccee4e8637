"""``selected_by_tensors`` (NOTE: [0-d tensor indices at capture]) against torch's own
indexing, which reads a 0-d integer index on the host: the same values and shapes for
every kind of index around it, and the same gradient."""

from __future__ import annotations

import pytest
import torch

from spmd_compiler.capture.tensor_indices import selected_by_tensors

T = torch.tensor
X = torch.arange(2 * 3 * 4 * 5, dtype=torch.float64).reshape(2, 3, 4, 5)
INDICES = {
    "alone": lambda: T(1),
    "negative": lambda: T(-2),
    "second_dim": lambda: (slice(None), T(2)),
    "two": lambda: (T(1), slice(1, 3), T(-1)),
    "ellipsis_before": lambda: (Ellipsis, T(3)),
    "ellipsis_between": lambda: (T(0), Ellipsis, T(4)),
    "with_none": lambda: (None, T(1), None, slice(None), T(2)),
    "with_int_and_step": lambda: (1, T(2), slice(None, None, 2)),
    "advanced_after": lambda: (T(1), slice(None), T([0, 3, 1])),
    "advanced_before": lambda: (T([1, 0]), T(2), T([3, 3])),
    "advanced_apart": lambda: (T([1, 0]), slice(None), T(1), T([4, 0])),
    "mask_after": lambda: (T(1), X[0, :, :, 0] > 20),
    "int32_index": lambda: (slice(None), T(2, dtype=torch.int32)),
}


@pytest.mark.parametrize("name", list(INDICES))
def test_the_same_values_as_torch(name):
    index = INDICES[name]()
    expected = X[index]
    got = selected_by_tensors(X, index)
    assert got is not None
    assert got.shape == expected.shape and torch.equal(got, expected)


@pytest.mark.parametrize("name", ["second_dim", "two", "advanced_before", "with_none"])
def test_the_same_gradient_as_torch(name):
    index = INDICES[name]()
    weights = torch.randn(X[index].shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    a, b = X.clone().requires_grad_(), X.clone().requires_grad_()
    (a[index] * weights).sum().backward()
    (selected_by_tensors(b, index) * weights).sum().backward()
    assert torch.equal(a.grad, b.grad)


def test_nothing_to_do_without_a_0d_integer_tensor():
    for index in [1, (slice(None), 2), T([0, 1]), (T(True),), (Ellipsis, T(1.0).long().reshape(1))]:
        assert selected_by_tensors(X, index) is None
