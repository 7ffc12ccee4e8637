"""``F.embedding_bag`` (``nn.EmbeddingBag``) as plain ATen ops at capture.

NOTE: [embedding bags at capture]
``aten._embedding_bag`` and its backward have no DTensor rule in any supported torch, so
a step with ``nn.EmbeddingBag`` was refused at expansion. During capture a
``TorchFunctionMode`` answers ``F.embedding_bag`` for a 2-D input (a batch of bags of
equal length, the form a data-parallel batch splits by rows) with an embedding lookup
and a reduction over each bag: ``sum`` (times ``per_sample_weights`` where given),
``mean`` (over the bag's entries that are not ``padding_idx``) or ``max`` (over those
entries; an empty bag gives zeros, as torch's kernel does). ``padding_idx`` entries are
left out of every bag and get no gradient; ``max_norm`` renormalizes the rows used
before the lookup, as eager does (``_embedding_renorm_over_global_batch``). Autograd
derives the backward from these ops. Numerics: sums in the order of the bag, as the kernel does in
float64 tests (within 1e-15); a ``max`` tie between two different rows of equal values
splits the gradient between them where the kernel gives it to one.

Refused, naming the user's line: a 1-D input with ``offsets`` (its offsets index the
global token list, which does not split into the ranks' batches), ``sparse=True``
(sparse gradients) and ``scale_grad_by_freq=True`` (torch's CPU kernel does not divide
by each row's count as documented: in a probe a row seen once in the batch had its
gradient divided by 13, another row's count; the program could not match it).

``F.embedding`` (``nn.Embedding``) with ``sparse=True`` is refused the same way, naming
the line: its gradient is a sparse tensor, which no DTensor placement or collective here
holds (unchecked, the trace failed inside the optimizer with a dispatcher error about the
SparseCPU backend). With ``sparse=False``, SGD without momentum and Adagrad (both without
weight decay) compute the same update with a dense gradient; Adam / AdamW in place of
SparseAdam update every row every step, a different update, which the hint says.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import SPMDCompileError, innermost_model_frame_of_stack


def embedding_bag(
    input: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor | None = None,
    max_norm: float | None = None,
    norm_type: float = 2,
    scale_grad_by_freq: bool = False,
    mode: str = "mean",
    sparse: bool = False,
    per_sample_weights: torch.Tensor | None = None,
    include_last_offset: bool = False,
    padding_idx: int | None = None,
) -> torch.Tensor:
    """``F.embedding_bag`` on a 2-D input in plain ops (same arguments; see the NOTE)."""
    if input.dim() != 2 or offsets is not None:
        _refuse(
            "F.embedding_bag / nn.EmbeddingBag with a 1-D input and offsets cannot be "
            "compiled: the offsets index the whole token list, which does not split into "
            "the ranks' batches.",
            "pass a 2-D input (one row per bag, padded to one length with padding_idx).",
        )
    if scale_grad_by_freq:
        _refuse(
            "F.embedding_bag / nn.EmbeddingBag with scale_grad_by_freq=True cannot be "
            "compiled: torch's CPU kernel does not divide each row's gradient by its "
            "count in the batch (measured: rows seen once were divided by another row's "
            "count), so the program could not match eager.",
            "drop scale_grad_by_freq, or use nn.Embedding(scale_grad_by_freq=True) and "
            "reduce the bag yourself.",
        )
    if sparse:
        _refuse(
            "F.embedding_bag / nn.EmbeddingBag with sparse=True cannot be compiled: "
            "compiled steps make dense gradients.",
            "use sparse=False.",
        )
    if mode not in ("sum", "mean", "max"):
        raise ValueError("mode has to be one of sum, mean or max")
    if per_sample_weights is not None and mode != "sum":
        raise NotImplementedError(
            "embedding_bag: per_sample_weights was not None. per_sample_weights is only "
            f"supported for mode='sum' (got mode='{mode}'). Please open a feature request "
            "on GitHub."
        )
    # (bags, length, dim); max_norm renormalizes the rows used first, in place, as eager
    rows = F.embedding(input, weight, max_norm=max_norm, norm_type=norm_type)
    if padding_idx is not None:
        padding_idx = padding_idx % weight.size(0)
        kept = input != padding_idx
    else:
        kept = torch.ones_like(input, dtype=torch.bool)
    if mode == "max":
        masked = torch.where(kept.unsqueeze(-1), rows, torch.full((), float("-inf"), dtype=rows.dtype))
        top = masked.amax(1)
        return torch.where(kept.any(1, keepdim=True), top, torch.zeros((), dtype=rows.dtype))
    if per_sample_weights is not None:
        rows = rows * per_sample_weights.unsqueeze(-1)
    summed = torch.where(kept.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype)).sum(1)
    if mode == "sum":
        return summed
    count = kept.sum(1, keepdim=True).clamp(min=1).to(rows.dtype)
    return summed / count


def embedding(input: torch.Tensor, weight: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """``F.embedding``, refusing ``sparse=True`` (see the NOTE); otherwise unchanged."""
    # F.embedding(input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    sparse = kwargs.get("sparse", args[4] if len(args) > 4 else False)
    if sparse:
        _refuse(
            "F.embedding / nn.Embedding with sparse=True cannot be compiled: its gradient "
            "is a sparse tensor, and compiled steps make dense gradients.",
            "use sparse=False: SGD without momentum and Adagrad, both without weight decay, "
            "then make the same update with a dense gradient. SparseAdam cannot run on dense gradients; "
            "Adam or AdamW take its place but update every row each step (their moments "
            "decay for rows not in the batch), where SparseAdam updates only the batch's rows.",
        )
    return F.embedding(input, weight, *args, **kwargs)  # type: ignore[arg-type]


def _refuse(message: str, hint: str) -> None:
    raise SPMDCompileError(message, user_line=innermost_model_frame_of_stack(), hint=hint)


__all__ = ["embedding", "embedding_bag"]
