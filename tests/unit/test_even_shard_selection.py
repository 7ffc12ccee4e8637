"""NOTE: [even shard selections]: the fake slice read from value ranges is torch's own,
and anything the ranges cannot prove is left to torch's kernel."""

from __future__ import annotations

import torch

from spmd_compiler import _torch_private as private


def coordinate_slice(upper: int, fast: bool) -> torch.Tensor | None:
    """Rows ``[4 u, 4 u + 4)`` of an 8-row fake tensor, ``u`` an unbacked symbol in
    ``[0, upper]`` (a run-time mesh coordinate)."""
    mode = private.fake_tensor_mode(with_shape_env=True)
    with mode:
        u = mode.shape_env.create_unbacked_symint()
        torch._check(u >= 0)
        torch._check(u <= upper)
        x = torch.empty(8, 3)
        start, end = 4 * u, 4 * u + 4
        if fast:
            return private._provable_slice(mode, x, 0, start, end, 1)
        return torch.ops.aten.slice.Tensor(x, 0, start, end)


def test_provable_slice_is_torchs_slice() -> None:
    fast, torchs = coordinate_slice(1, fast=True), coordinate_slice(1, fast=False)
    assert fast is not None and torchs is not None
    assert tuple(fast.shape) == tuple(torchs.shape) == (4, 3)
    assert fast.stride() == torchs.stride()
    assert str(fast.storage_offset()) == str(torchs.storage_offset())


def test_provable_slice_declines_what_ranges_cannot_prove() -> None:
    # with u up to 3 the rows may run past the 8 the tensor has: torch's kernel decides
    assert coordinate_slice(3, fast=True) is None
