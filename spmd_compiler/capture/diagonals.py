"""Writes to a tensor's diagonal, as selects at capture.

NOTE: [diagonals at capture]
Two ways of writing a diagonal reach ops a compiled step cannot hold:
- ``diagonal_scatter`` (the backward of every ``x.diagonal()``, ``torch.diag(matrix)``
  and ``torch.diagonal(x, offset)`` with a gradient: Barlow Twins' on-diagonal term,
  ``torch.corrcoef``). torch 2.11's DTensor has no rule for it, so capture used torch's
  decomposition (NOTE: [ops without a sharding rule] in ``trace.py``), which writes
  ``src`` in place into a diagonal view of a clone (``prims.copy_to``) and which
  functionalization refuses: the step failed at capture on the GPU machines' torch.
  Answered as ``where(on_diagonal, src placed along the plane, input)``; on a torch whose
  DTensor has a rule (2.13), the op stays as traced.
- ``Tensor.fill_diagonal_`` (a similarity matrix's self-pairs set to ``-inf`` in a
  contrastive loss) views its diagonal with ``as_strided``, which DTensor refuses at
  expansion, on every torch. While the step is traced it is answered as
  ``masked_fill_`` with the diagonal's mask: the positions whose indices are all equal,
  or, with ``wrap=True`` on a matrix taller than wide, every ``(width + 1)``-th element
  in row-major order, as torch's kernel fills a contiguous matrix.
Both are element selections of the same values, so they are exact (tested bit for bit
against torch's ops in ``tests/unit/test_diagonals.py``).
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import torch


def diagonal_scatter_by_mask(
    input: torch.Tensor, src: torch.Tensor, offset: int = 0, dim1: int = 0, dim2: int = 1
) -> torch.Tensor:
    """``torch.diagonal_scatter`` as a select (see the NOTE): the plane's (row, column)
    pairs with ``column - row == offset`` take ``src`` at their place along the diagonal
    (the row for offset >= 0, the column below it)."""
    if src.shape[-1] == 0:  # an offset past the plane: nothing on the diagonal
        return input.clone()
    d1, d2 = dim1 % input.dim(), dim2 % input.dim()
    rows = torch.arange(input.shape[d1], device=input.device).unsqueeze(1)
    cols = torch.arange(input.shape[d2], device=input.device).unsqueeze(0)
    on_diagonal = cols - rows == offset  # (rows, cols)
    along = (rows if offset >= 0 else cols).expand(on_diagonal.shape)
    placed = src[..., along.clamp(max=src.shape[-1] - 1)]  # (batch..., rows, cols)
    mask = on_diagonal.reshape(*[1] * (input.dim() - 2), *on_diagonal.shape)
    return torch.where(
        torch.movedim(mask, (-2, -1), (d1, d2)), torch.movedim(placed, (-2, -1), (d1, d2)), input
    )


def fill_diagonal_(self: torch.Tensor, fill_value: Any, wrap: bool = False) -> torch.Tensor:
    """``Tensor.fill_diagonal_`` as ``masked_fill_`` (see the NOTE)."""
    if self.dim() < 2:
        raise RuntimeError("dimensions must larger than 1")
    height, width = self.shape[0], self.shape[1]
    if self.dim() > 2 and any(size != height for size in self.shape):
        raise RuntimeError("all dimensions of input must be of equal length")
    if wrap and self.dim() == 2 and height > width + 1:
        flat = torch.arange(self.numel(), device=self.device).reshape(self.shape)
        mask = flat % (width + 1) == 0
    else:
        indices = [
            torch.arange(size, device=self.device).reshape([-1 if d == k else 1 for d in range(self.dim())])
            for k, size in enumerate(self.shape)
        ]
        mask = functools.reduce(operator.and_, (indices[0] == i for i in indices[1:]))
    return self.masked_fill_(mask, fill_value)


__all__ = ["diagonal_scatter_by_mask", "fill_diagonal_"]
