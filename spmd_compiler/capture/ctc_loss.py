"""``F.ctc_loss`` as plain ops at capture.

NOTE: [CTC loss at capture]
torch's ``ctc_loss`` reads its lengths as Python integers (``aten._ctc_loss`` has a
value-dependent output shape), has no DTensor rule and no decomposition, so a step with a
CTC loss (transformers' ``Wav2Vec2ForCTC``, any speech model trained with
``nn.CTCLoss``) was refused at capture. While the step is traced, ``F.ctc_loss`` is
answered by the forward (alpha) recursion in log space, in plain ops with static shapes:
- the targets, padded ``(N, S)`` or concatenated 1-D (row ``n`` at ``cumsum`` of the
  target lengths before it), become ``(N, S)`` rows; the extended label sequence puts
  the blank before, between and after them (``2S + 1`` states);
- ``alpha_0`` holds the first frame's blank and first label; every later frame ``t``
  takes ``logsumexp`` of the state itself, the one before and (between two different
  labels) the one two before, plus the frame's log probability of the state's label,
  and keeps ``alpha`` unchanged from a sample's ``input_length`` on;
- the loss is ``-logsumexp`` of the last label's state and the blank after it at the
  sample's last frame, divided by the target length and averaged for ``mean``
  (torch's reduction), summed for ``sum``; an impossible alignment (input shorter than
  its labels need) is ``inf``, or 0 with ``zero_infinity``.
Unreachable states hold a large finite negative number, not ``-inf``, so every gradient
is finite and theirs is exactly zero. Autograd derives the backward through the
recursion. Eager's kernel returns, as the gradient for ``log_probs``, the gradient for
the logits before a ``log_softmax``: ``exp(log_probs)`` minus the label posteriors, over
each sample's first ``input_length`` frames (0 after them). Autograd through the
recursion gives the posteriors alone (the gradient for ``log_probs`` itself), so each
sample's negative log likelihood passes through ``_KernelGradient``, whose backward adds
``exp(log_probs)`` over the sample's frames (a ``m - m.detach()`` term would do it in
value 0, but not where ``exp`` overflows: ``inf - inf``). So the gradient is eager's
whether or not the log probabilities come from ``log_softmax``. Before (2026-12-02) the
term was missing: the two agreed only after a ``log_softmax``, and a model feeding the
loss unnormalized scores trained silently differently (a bias 1.0 off after two steps,
found by a sweep of torch's module database). Float64 tests agree with eager within
1e-12. One difference is kept: for an impossible alignment without ``zero_infinity``
(the loss is ``inf``) eager's gradient is NaN (``-inf + inf`` in its kernel), ours 0.
Concatenated 1-D targets are one tensor along the batch
dim like any input: on real data-parallel ranks each rank's share must have the same
length (padded 2-D targets have no such condition). Eager's argument checks (lengths within the tensors'
sizes) are value checks verified every call. The graph grows with the number of frames
``T`` (one recursion step per frame).
"""

from __future__ import annotations

from typing import Any

import torch

from .value_checks import eager_check

_BATCH_DIM = 1


def _lengths(lengths: Any, device: torch.device) -> torch.Tensor:
    if isinstance(lengths, torch.Tensor):
        return lengths.to(device=device, dtype=torch.long)
    return torch.as_tensor(lengths, dtype=torch.long, device=device)


def _padded_targets(targets: torch.Tensor, target_lengths: torch.Tensor, batch: int) -> torch.Tensor:
    """(N, S) label rows: padded targets as they are; concatenated 1-D ones gathered
    from each row's offset (positions past a row's length are masked later)."""
    if targets.dim() == 2:
        return targets.to(torch.long)
    total = targets.numel()
    if total == 0:
        return targets.new_zeros((batch, 0), dtype=torch.long)
    offsets = torch.cumsum(target_lengths, 0) - target_lengths
    positions = (offsets[:, None] + torch.arange(total, device=targets.device)[None, :]).clamp(max=total - 1)
    return targets.to(torch.long)[positions]


def _check(condition: torch.Tensor, message: str) -> None:
    """Eager's argument check, verified every call (a value check at capture)."""
    eager_check(condition, f"ctc_loss: {message}")


class _KernelGradient(torch.autograd.Function):
    """The negative log likelihood, passed through; its backward adds to ``log_probs``'
    gradient ``exp(log_probs)`` times the sample's incoming gradient over the sample's
    frames, which eager's kernel includes (see the NOTE)."""

    @staticmethod
    def forward(ctx: Any, nll: torch.Tensor, log_probs: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(log_probs, frames)
        return nll.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        log_probs, frames = ctx.saved_tensors
        mass = torch.where(frames[..., None], log_probs.exp() * grad[None, :, None], 0.0)
        return grad, mass, None


def ctc_loss(
    log_probs: torch.Tensor, targets: torch.Tensor, input_lengths: Any, target_lengths: Any,
    blank: int = 0, reduction: str = "mean", zero_infinity: bool = False,
) -> torch.Tensor:
    """``F.ctc_loss`` in plain ops (same arguments; see the NOTE)."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{reduction} is not a valid value for reduction")
    unbatched = log_probs.dim() == 2
    if unbatched:
        log_probs, targets = log_probs.unsqueeze(_BATCH_DIM), targets.unsqueeze(0)
    if log_probs.dim() != 3:
        raise RuntimeError(f"ctc_loss: log_probs must be (T, N, C) or (T, C), got {tuple(log_probs.shape)}")
    frames, batch, classes = log_probs.shape
    device, dtype = log_probs.device, log_probs.dtype
    input_len = _lengths(input_lengths, device).reshape(batch)
    target_len = _lengths(target_lengths, device).reshape(batch)
    labels = _padded_targets(targets, target_len, batch)
    width = labels.size(1)
    _check(input_len <= frames, f"input_lengths must be at most the {frames} frames of log_probs")
    _check(input_len >= 0, "input_lengths must be non-negative")
    _check(target_len >= 0, "target_lengths must be non-negative")
    if targets.dim() == 2:
        _check(target_len <= width, f"target_lengths must be at most the {width} columns of targets")
    else:
        _check(target_len.sum() <= targets.numel(), "target_lengths sum past the concatenated targets")
    in_row = torch.arange(width, device=device)[None, :] < target_len[:, None]
    blanks = torch.full_like(labels, blank)
    labels = torch.where(in_row, labels, blanks)
    _check(((labels >= 0) & (labels < classes)) | ~in_row, f"targets must lie in [0, {classes})")

    # extended labels: blank, l1, blank, l2, ..., lS, blank
    extended = torch.cat([torch.stack([blanks, labels], -1).reshape(batch, 2 * width),
                          labels.new_full((batch, 1), blank)], 1)
    states = 2 * width + 1
    before_two = torch.cat([extended.new_full((batch, 2), blank), extended[:, :-2]], 1)
    # == and ~, not !=: torch 2.11 decomposes ne into prims.ne, which DTensor has no rule for
    skips = ~(extended == blank) & ~(extended == before_two)
    frame_log_probs = log_probs.gather(2, extended[None].expand(frames, batch, states))

    low = torch.finfo(dtype).min / 8
    floor = torch.full((batch, states), low, dtype=dtype, device=device)
    first_two = torch.arange(states, device=device)[None, :] < 2
    alpha = torch.where(first_two, frame_log_probs[0], floor)
    pad_one, pad_two = floor[:, :1], floor[:, :2]
    for t in range(1, frames):
        one_before = torch.cat([pad_one, alpha[:, :-1]], 1)
        two_before = torch.where(skips, torch.cat([pad_two, alpha[:, :-2]], 1), floor)
        step = torch.logsumexp(torch.stack([alpha, one_before, two_before]), 0) + frame_log_probs[t]
        alpha = torch.where((t < input_len)[:, None], step, alpha)

    last = (2 * target_len)[:, None]
    before_last = (2 * target_len - 1).clamp(min=0)[:, None]
    ends = torch.cat([alpha.gather(1, last),
                      torch.where(target_len[:, None] > 0, alpha.gather(1, before_last), floor[:, :1])], 1)
    log_likelihood = torch.logsumexp(ends, 1)
    # no frame: the empty alignment has probability 1 for an empty target, 0 otherwise
    empty = torch.where(target_len == 0, torch.zeros((), dtype=dtype, device=device), floor[:, 0])
    log_likelihood = torch.where(input_len > 0, log_likelihood, empty)
    impossible = log_likelihood < low / 2
    inf = torch.full_like(log_likelihood, float("inf"))
    frame_in_sample = torch.arange(frames, device=device)[:, None] < input_len[None, :]
    # eager's gradient for log_probs: the recursion's plus exp(log_probs) (see the NOTE)
    nll = _KernelGradient.apply(-log_likelihood, log_probs, frame_in_sample)
    nll = torch.where(impossible, torch.zeros_like(inf) if zero_infinity else inf, nll)
    if reduction == "mean":
        return (nll / target_len.clamp(min=1).to(dtype)).mean()
    if reduction == "sum":
        return nll.sum()
    return nll.squeeze(0) if unbatched else nll


__all__ = ["ctc_loss"]
