"""``selected_by_tensors`` (NOTE: [0-d tensor indices at capture]) against torch's own
indexing, which reads a 0-d integer index on the host: the same values and shapes for
every kind of index around it, and the same gradient."""

from __future__ import annotations

import pytest
import torch

from spmd_compiler.capture.tensor_indices import selected_by_tensors, written_by_tensors

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


# NOTE: [0-d tensor indices at capture], the write: ``x[index] = value`` as torch writes it
# (values, dtype, broadcasting of the value), index and value kinds around the 0-d tensor
WRITES = {
    "row_from_tensor": lambda: (T(1), torch.full((3, 4, 5), 7.0, dtype=torch.float64)),
    "row_from_number": lambda: (T(1), 2.5),
    "row_from_int_number": lambda: (T(0), 3),
    "negative": lambda: (T(-1), torch.randn(4, 5, dtype=torch.float64)),
    "broadcast": lambda: (T(1), torch.arange(5.0, dtype=torch.float64)),
    "leading_ones_stripped": lambda: (T(0), torch.randn(1, 1, 3, 4, 5, dtype=torch.float64)),
    "float32_into_float64": lambda: (T(1), torch.randn(3, 4, 5)),
    "second_dim": lambda: ((slice(None), T(2)), torch.randn(2, 4, 5, dtype=torch.float64)),
    "with_slice_after": lambda: ((T(1), slice(1, 3)), -1.0),
    "two_tensors": lambda: ((T(1), slice(None), T(-2)), 0.0),
    "two_adjacent": lambda: ((T(0), T(2)), torch.randn(4, 5, dtype=torch.float64)),
    "ellipsis_before": lambda: ((Ellipsis, T(3)), torch.randn(3, 4, dtype=torch.float64)),
    "ellipsis_between": lambda: ((T(0), Ellipsis, T(4)), torch.randn(3, 4, dtype=torch.float64)),
    "with_none": lambda: ((None, T(1), None, slice(None), T(2)), torch.randn(1, 1, 3, 5, dtype=torch.float64)),
    "with_int": lambda: ((1, T(2), slice(None, None, 2)), 9.0),
    "advanced_after": lambda: ((T(1), slice(None), T([0, 3, 1])), torch.randn(3, 3, 5, dtype=torch.float64)),
    "advanced_before": lambda: ((T([1, 0]), T(2), T([3, 3])), 4.0),
    "mask_after": lambda: ((T(1), X[0, :, :, 0] > 20), -3.0),
    "int32_index": lambda: ((slice(None), T(2, dtype=torch.int32)), 5.0),
}


@pytest.mark.parametrize("name", list(WRITES))
def test_writes_as_torch(name):
    index, value = WRITES[name]()
    expected, got = X.clone(), X.clone()
    expected[index] = value
    assert written_by_tensors(got, index, value)
    assert got.dtype == expected.dtype and torch.equal(got, expected)


def test_writes_into_an_integer_buffer():
    buffer, expected = torch.zeros(4, 2, dtype=torch.long), torch.zeros(4, 2, dtype=torch.long)
    expected[T(-1)] = T([3, 4])
    assert written_by_tensors(buffer, T(-1), T([3, 4]))
    assert torch.equal(buffer, expected)


@pytest.mark.parametrize("name", ["row_from_tensor", "broadcast", "with_slice_after", "two_tensors",
                                  "advanced_after", "with_none"])
def test_writes_with_the_gradient_of_torch(name):
    index, value = WRITES[name]()
    weights = torch.randn(X.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    grads = []
    for write in (lambda h, v: h.__setitem__(index, v), lambda h, v: written_by_tensors(h, index, v)):
        x = X.clone().requires_grad_()
        v = value.clone().requires_grad_() if isinstance(value, torch.Tensor) else value
        h = x * 2  # a non-leaf activation, written in place
        write(h, v)
        (h * weights).sum().backward()
        grads.append((x.grad, v.grad if isinstance(v, torch.Tensor) else None))
    (x_eager, v_eager), (x_got, v_got) = grads
    assert torch.equal(x_eager, x_got)
    assert (v_eager is None and v_got is None) or torch.equal(v_eager, v_got)


def test_a_write_out_of_range_fails():
    for position in (T(4), T(-5)):
        with pytest.raises(IndexError):
            written_by_tensors(torch.zeros(4, 2), position, 1.0)


def test_a_write_into_a_leaf_that_requires_grad_is_refused_as_in_eager():
    leaf = torch.zeros(4, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf[1] = 1.0
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        written_by_tensors(leaf, T(1), 1.0)


def test_no_write_without_a_0d_integer_tensor():
    x = X.clone()
    for index in [1, (slice(None), 2), T([0, 1]), (T(True),)]:
        assert not written_by_tensors(x, index, 0.0)
    assert torch.equal(x, X)
