"""torch functions answered with plain ops while the step is traced.

NOTE: [functions as plain ops at capture]
A few torch functions have no DTensor rule and no decomposition for their kernels (or
read values a graph cannot hold): ``F.embedding_bag`` (NOTE: [embedding bags at
capture]), ``F.multi_margin_loss`` and ``F.multilabel_margin_loss`` (NOTE: [margin losses
at capture]) and ``F.ctc_loss`` (NOTE: [CTC loss at capture]); ``F.embedding`` passes
through, refusing ``sparse=True`` with the user's line. Packed sequences stay padded
(NOTE: [packed sequences at capture]): ``pack_padded_sequence``'s and
``pad_packed_sequence``'s kernels are answered here, and the recurrent layers given one
run their masked recurrence. Rows selected by a mask stay in place with the mask beside
them (NOTE: [selected rows kept in place]): every function first meets that rule.
Overlapping windows made by ``as_strided`` are gathered by index (NOTE: [windows by
as_strided]). ``torch.cov`` and ``torch.corrcoef`` take their degrees of freedom from
the shape (NOTE: [covariance at capture]); ``fill_diagonal_`` is a masked fill (NOTE:
[diagonals at capture]); ``torch.stft`` / ``torch.istft`` frame and overlap by index
(NOTE: [short-time Fourier transforms at capture]); ``repeat_interleave`` by a tensor
of counts with an ``output_size`` gathers by their cumulative sums (NOTE: [repeats of a
fixed total at capture]); ``bincount`` with a ``minlength`` counts into that many bins
(NOTE: [counts of a fixed length]). One
``TorchFunctionMode``,
entered around the trace, answers each with its formula in plain ops, from which
autograd derives the backward; every other function runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .. import _torch_private as private
from . import selected_rows
from .counts_of_rows import bincount
from .covariance import corrcoef, cov
from .ctc_loss import ctc_loss
from .diagonals import fill_diagonal_
from .embedding_bag import embedding, embedding_bag
from .margin_losses import multi_margin_loss, multilabel_margin_loss
from .packed_sequences import pack_padded, packed_sequences, pad_packed, refuse_other_uses
from .repeated_rows import repeat_interleave
from .spectra import istft, stft
from .strided_windows import as_strided, refuse_writes_through_windows, strided_windows

_AS_OPS: dict[Callable[..., Any], Callable[..., Any]] = {
    F.embedding: embedding,
    F.embedding_bag: embedding_bag,
    F.multi_margin_loss: multi_margin_loss,
    F.multilabel_margin_loss: multilabel_margin_loss,
    F.ctc_loss: ctc_loss,
    private.pack_padded_sequence_op(): pack_padded,
    private.pad_packed_sequence_op(): pad_packed,
    torch.Tensor.as_strided: as_strided,
    torch.as_strided: as_strided,
    torch.cov: cov,
    torch.Tensor.cov: cov,
    torch.corrcoef: corrcoef,
    torch.Tensor.corrcoef: corrcoef,
    torch.Tensor.fill_diagonal_: fill_diagonal_,
    torch.stft: stft,
    torch.Tensor.stft: stft,
    torch.istft: istft,
    torch.Tensor.istft: istft,
    torch.bincount: bincount,
    torch.Tensor.bincount: bincount,
    torch.repeat_interleave: functools.partial(repeat_interleave, torch.repeat_interleave),
    torch.Tensor.repeat_interleave: functools.partial(repeat_interleave, torch.Tensor.repeat_interleave),
}


def _compute(func: Any, args: tuple, kwargs: dict) -> Any:
    answer = _AS_OPS.get(func)
    if answer is None:
        refuse_other_uses(func, args, kwargs)  # NOTE: [packed sequences at capture]
        refuse_writes_through_windows(func, args, kwargs)  # NOTE: [windows by as_strided]
        answer = func
    return answer(*args, **kwargs)


class _FunctionsAsOps(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # NOTE: [selected rows kept in place]
        return selected_rows.answer(func, args, kwargs, _compute)


@contextlib.contextmanager
def functions_as_ops() -> Iterator[None]:
    """Inside: the functions of the NOTE compute with plain ops."""
    with packed_sequences(), strided_windows(), selected_rows.custom_functions_settle(), _FunctionsAsOps():
        yield


__all__ = ["functions_as_ops"]
