"""``repeat_interleave`` by a tensor with ``output_size`` as a gather by cumulative sums
(NOTE: [repeats of a fixed total at capture]), against torch's kernel on one device:
values, dtypes and the gradient into the input, bit for bit."""

from __future__ import annotations

import pytest
import torch

from spmd_compiler.capture.repeated_rows import repeat_interleave

RI = torch.repeat_interleave

CASES = {  # name: (input shape, repeats, dim)
    "rows_with_zeros": ((4, 3), [0, 2, 0, 3], 0),
    "first_and_last_zero": ((5, 2), [0, 1, 4, 2, 0], 0),
    "columns": ((2, 3, 4), [1, 0, 2], 1),
    "last_dim_negative": ((2, 3, 4), [3, 1, 0, 1], -1),
    "flattened": ((2, 3), [1, 0, 2, 1, 1, 3], None),
    "zero_dim_repeats": ((3, 2), 2, 0),
    "one_element_repeats": ((3, 2), [3], 1),
    "all_zero_but_one": ((4,), [0, 0, 5, 0], 0),
}


def _repeats(value: object, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.tensor(value, dtype=dtype)


def _output_size(shape: tuple, repeats: torch.Tensor, dim: int | None) -> int:
    count = torch.Size(shape).numel() if dim is None else shape[dim]
    return int(repeats.expand(count).sum()) if repeats.numel() == 1 else int(repeats.sum())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.int64, torch.bool])
@pytest.mark.parametrize("name", sorted(CASES))
def test_values_are_torchs(name, dtype):
    shape, value, dim = CASES[name]
    x = (torch.randn(shape) * 3).to(dtype)
    repeats = _repeats(value)
    size = _output_size(shape, repeats, dim)
    expected = RI(x, repeats, dim=dim, output_size=size)
    got = repeat_interleave(RI, x, repeats, dim=dim, output_size=size)
    method = repeat_interleave(torch.Tensor.repeat_interleave, x, repeats, dim, output_size=size)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got, expected) and torch.equal(method, expected)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_into_the_input_is_torchs(name):
    shape, value, dim = CASES[name]
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    repeats = _repeats(value)
    size = _output_size(shape, repeats, dim)
    weight = torch.randn(RI(x.detach(), repeats, dim=dim, output_size=size).shape, dtype=torch.float64)
    (expected,) = torch.autograd.grad((RI(x, repeats, dim=dim, output_size=size) * weight).sum(), x)
    (got,) = torch.autograd.grad((repeat_interleave(RI, x, repeats, dim=dim, output_size=size) * weight).sum(), x)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_the_indices_alone_are_torchs(dtype):
    repeats = _repeats([2, 0, 1, 3, 0], dtype)
    got = repeat_interleave(RI, repeats, output_size=6)
    expected = RI(repeats, output_size=6)
    assert got.dtype == expected.dtype == dtype and torch.equal(got, expected)
    got = repeat_interleave(RI, torch.arange(5.0), repeats, 0, output_size=6)
    assert torch.equal(got, RI(torch.arange(5.0), repeats, 0, output_size=6))


@pytest.mark.parametrize("output_size", [3, 5])
def test_another_total_raises_as_torch_raises(output_size):
    x, repeats = torch.randn(3, 2), _repeats([1, 2, 1])  # sums to 4
    with pytest.raises(RuntimeError, match="allocated size does not match"):
        RI(x, repeats, dim=0, output_size=output_size)
    with pytest.raises(RuntimeError, match=f"another total than output_size={output_size}"):
        repeat_interleave(RI, x, repeats, dim=0, output_size=output_size)


def test_a_negative_count_raises_as_torch_raises():
    x, repeats = torch.randn(3, 2), _repeats([2, -1, 3])  # sums to the output_size
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        RI(x, repeats, dim=0, output_size=4)
    with pytest.raises(RuntimeError, match="repeats can not be negative"):
        repeat_interleave(RI, x, repeats, dim=0, output_size=4)


@pytest.mark.parametrize("call", [
    lambda: (torch.randn(3, 2), 2, 0, None),  # an int: a shape, torch's own
    lambda: (torch.randn(3, 2), _repeats([1, 2, 0]), 0, None),  # no output_size
    lambda: (torch.randn(3, 2), _repeats([1, 2]), 0, 3),  # the wrong length
    lambda: (torch.randn(3, 2), torch.tensor([1.0, 2.0, 0.0]), 0, 3),  # float counts
    lambda: (torch.randn(3, 2), _repeats([[1, 2, 0]]), 0, 3),  # 2-d counts
    lambda: (torch.randn(3, 2), _repeats([1, 2, 0]), 2, 3),  # no such dim
    lambda: (torch.randn(0, 2), _repeats(2), 0, 0),  # nothing to repeat
])
def test_other_calls_go_to_torch(call):
    """torch's own result or error; nothing is answered by the gather."""
    x, repeats, dim, size = call()
    seen = []

    def torchs(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        seen.append(args)
        return "torch"

    assert repeat_interleave(torchs, x, repeats, dim=dim, output_size=size) == "torch" and seen
    # the method without repeats is torch's TypeError, not the self-less form
    with pytest.raises(TypeError, match="invalid combination of arguments"):
        repeat_interleave(torch.Tensor.repeat_interleave, _repeats([1, 2]), output_size=3)
