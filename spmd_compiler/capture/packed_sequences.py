"""Packed sequences into recurrent layers, with static shapes at capture.

NOTE: [packed sequences at capture]
``pack_padded_sequence`` keeps, for each time step, only the sequences still running:
its data has ``sum(lengths)`` rows and its ``batch_sizes`` are read in Python by the
recurrent layers (``int(batch_sizes[0])``), sizes the data decides. So a step that packs
a padded batch for ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` was refused as a value read.

While the step is traced (inside ``functions_as_ops``), the packed form is kept padded:
- ``pack_padded_sequence`` (its ``torch._pack_padded_sequence``) answers with the input
  time-major, ``(T, B, *)``, and the true ``batch_sizes`` (how many sequences run at each
  of the ``T`` steps), remembering the lengths for that data tensor;
- ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` given such a packed sequence run their
  recurrence step by step over the ``T`` frames (the graph grows with ``T``, as torch's
  own decomposition of unpacked layers does), every layer and direction, with
  ``proj_size``, biases and dropout between layers. A sequence's state stops changing
  after its last frame (``torch.where`` on the frame < length mask), and the reverse
  direction starts at each sequence's own last frame: the final states are those of
  the packed kernel;
- ``pad_packed_sequence`` (``torch._pad_packed_sequence``) returns the output with
  ``padding_value`` past each length, ``total_length`` frames if given.

Eager's checks are value checks, verified every call (NOTE: [value checks]): lengths
above 0 and at most the ``T`` frames, sorted decreasing under ``enforce_sorted=True``,
and, when ``pad_packed_sequence`` has no ``total_length``, the longest sequence filling
the ``T`` frames (eager's output then has ``max(lengths)`` frames, a size the data
decides: pad batches to their longest sequence, or pass ``total_length``).

The padded data is not eager's packed data (``T * B`` rows, not ``sum(lengths)``), so
any other use of ``PackedSequence.data`` (a loss on ``packed.data``, its shape) is
refused with the line, as are packed sequences given to a subclass that overrides
``forward``. Numerics: the cell formulas of torch's documentation in plain ops; float64
against torch's kernels within 1e-15 (``tests/sim/test_packed_sequences.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from .. import _torch_private as private
from ..errors import SPMDCompileError, innermost_model_frame_of_stack
from .value_checks import eager_check


@dataclasses.dataclass
class _Padded:
    data: torch.Tensor  # (T, B, *), held so that its id stays this tensor's
    lengths: torch.Tensor  # (B,) int64


_REGISTRY: dict[int, _Padded] = {}
_PAD_PACKED_CODE = pad_packed_sequence.__code__
_OWN_FORWARD = [0]  # > 0 while a recurrent layer runs on a padded stand-in
# attributes of the padded data that equal eager's packed data's
_SAME_AS_PACKED = frozenset({"dtype", "device", "is_cuda", "layout", "requires_grad"})


def _remember(data: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    _REGISTRY[id(data)] = _Padded(data, lengths)
    return data


def padded_of(value: Any) -> _Padded | None:
    """The lengths behind a padded stand-in for packed data, if ``value`` is one."""
    if not _REGISTRY or not isinstance(value, torch.Tensor):
        return None
    entry = _REGISTRY.get(id(value))
    return entry if entry is not None and entry.data is value else None


def _running(frames: int, lengths: torch.Tensor) -> torch.Tensor:
    """(T, B): whether sequence b is still running at frame t."""
    return torch.arange(frames, device=lengths.device)[:, None] < lengths[None, :]


def pack_padded(input: torch.Tensor, lengths: torch.Tensor, batch_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch._pack_padded_sequence``: the padded input, time-major, and batch_sizes."""
    data = input.transpose(0, 1) if batch_first else input
    frames = data.shape[0]
    lengths = lengths.to(device=data.device, dtype=torch.int64)
    eager_check(lengths > 0, "Length of all samples has to be greater than 0, but found an "
           "element in 'lengths' that is <= 0")
    eager_check(lengths <= frames, f"pack_padded_sequence: lengths must be at most the {frames} "
           "frames of the input")
    if lengths.shape[0] > 1:
        eager_check(lengths[:-1] >= lengths[1:], "`lengths` array must be sorted in decreasing "
               "order when `enforce_sorted` is True. You can pass `enforce_sorted=False` "
               "to pack_padded_sequence and/or pack_sequence to sidestep this requirement "
               "if you do not need ONNX exportability.")
    batch_sizes = _running(frames, lengths).sum(1)
    return _remember(data, lengths), batch_sizes


def pad_packed(
    data: torch.Tensor, batch_sizes: torch.Tensor, batch_first: bool, padding_value: float,
    total_length: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch._pad_packed_sequence`` of a padded stand-in (see the NOTE)."""
    entry = padded_of(data)
    if entry is None:  # packed elsewhere: torch's kernel (refused as a value read)
        return private.pad_packed_sequence_op()(data, batch_sizes, batch_first, padding_value, total_length)
    frames, lengths = data.shape[0], entry.lengths
    # pad_packed_sequence passes batch_sizes.size(0) (= frames) when it has no total_length
    if _users_total_length() is None:
        eager_check(lengths.max() == frames, "pad_packed_sequence: the longest sequence is "
               f"shorter than the {frames} frames of the padded batch, so eager's output "
               "would have as many frames as the data decides; pass total_length="
               f"{frames} (or pad the batch to its longest sequence)")
    running = _running(frames, lengths)
    shape = (frames, data.shape[1]) + (1,) * (data.dim() - 2)
    out = torch.where(running.reshape(shape), data, torch.full((), padding_value, dtype=data.dtype))
    if total_length > frames:
        fill = out.new_full((total_length - frames, *out.shape[1:]), padding_value)
        out = torch.cat([out, fill])
    return (out.transpose(0, 1) if batch_first else out), lengths


def _users_total_length() -> int | None:
    """The ``total_length`` the user gave ``pad_packed_sequence`` (None when it got none,
    or when the kernel was called another way): read off its frame, because the kernel
    gets ``batch_sizes.size(0)``, our ``T``, either way."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _PAD_PACKED_CODE:
            return frame.f_locals.get("total_length")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _cell(kind: str, x_proj: torch.Tensor, h: torch.Tensor, c: torch.Tensor | None,
          w_hh: torch.Tensor, b_hh: torch.Tensor | None, w_hr: torch.Tensor | None,
          nonlinearity: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One step of the cell (torch's documented formulas)."""
    gh = F.linear(h, w_hh, b_hh)
    if kind == "LSTM":
        assert c is not None  # an LSTM carries its cell state
        i, f, g, o = (x_proj + gh).chunk(4, -1)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h_new = torch.sigmoid(o) * torch.tanh(c_new)
        return (F.linear(h_new, w_hr) if w_hr is not None else h_new), c_new
    if kind == "GRU":
        ir, iz, in_ = x_proj.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None
    pre = x_proj + gh
    return (torch.tanh(pre) if nonlinearity == "tanh" else torch.relu(pre)), None


def _kind(module: nn.Module) -> str:
    for cls in (nn.LSTM, nn.GRU, nn.RNN):
        if isinstance(module, cls):
            return cls.__name__
    raise TypeError(type(module).__name__)


def _packed_forward(module: Any, packed: PackedSequence, entry: _Padded, hx: Any) -> Any:
    """``module`` (an LSTM, GRU or RNN) on a padded stand-in for a packed sequence."""
    kind = _kind(module)
    data, lengths = entry.data, entry.lengths
    frames, batch = data.shape[0], data.shape[1]
    directions = 2 if module.bidirectional else 1
    layers = module.num_layers
    proj = getattr(module, "proj_size", 0)
    out_size = proj if proj > 0 else module.hidden_size
    running = _running(frames, lengths)
    if hx is None:
        h0 = data.new_zeros(layers * directions, batch, out_size)
        c0 = data.new_zeros(layers * directions, batch, module.hidden_size) if kind == "LSTM" else None
    else:
        hx = _permute_batch(hx, packed.sorted_indices)
        h0, c0 = hx if kind == "LSTM" else (hx, None)
    layer_input, h_n, c_n = data, [], []
    for layer in range(layers):
        outputs = []
        for direction in range(directions):
            suffix = f"l{layer}" + ("_reverse" if direction else "")
            w_ih, w_hh = getattr(module, f"weight_ih_{suffix}"), getattr(module, f"weight_hh_{suffix}")
            b_ih = getattr(module, f"bias_ih_{suffix}") if module.bias else None
            b_hh = getattr(module, f"bias_hh_{suffix}") if module.bias else None
            w_hr = getattr(module, f"weight_hr_{suffix}") if proj > 0 else None
            x_proj = F.linear(layer_input, w_ih, b_ih)  # every frame at once
            h = h0[layer * directions + direction]
            c = c0[layer * directions + direction] if c0 is not None else None
            steps: list[torch.Tensor | None] = [None] * frames
            for t in (range(frames) if direction == 0 else range(frames - 1, -1, -1)):
                h_new, c_new = _cell(kind, x_proj[t], h, c, w_hh, b_hh, w_hr,
                                     getattr(module, "nonlinearity", "tanh"))
                keep = running[t][:, None]
                steps[t] = h_new  # past a sequence's end: masked by pad_packed_sequence
                h = torch.where(keep, h_new, h)
                if c is not None and c_new is not None:
                    c = torch.where(keep, c_new, c)
            outputs.append(torch.stack(steps))  # type: ignore[arg-type]
            h_n.append(h)
            if c is not None:
                c_n.append(c)
        layer_input = torch.cat(outputs, -1) if directions == 2 else outputs[0]
        if module.dropout and module.training and layer < layers - 1:
            layer_input = F.dropout(layer_input, module.dropout, True)
    output = PackedSequence(
        _remember(layer_input, lengths), packed.batch_sizes, packed.sorted_indices,
        packed.unsorted_indices,
    )
    hidden: Any = (torch.stack(h_n), torch.stack(c_n)) if kind == "LSTM" else torch.stack(h_n)
    return output, _permute_batch(hidden, packed.unsorted_indices)


def _permute_batch(hidden: Any, permutation: torch.Tensor | None) -> Any:
    """``permute_hidden``: the states' batch dimension (1) put in ``permutation``'s
    order, indexed on a leading dimension (torch 2.11's DTensor has no working rule for
    the backward of ``index_select`` on dimension 1: ``index_put`` with a ``None``)."""
    if permutation is None:
        return hidden
    if isinstance(hidden, tuple):
        return tuple(_permute_batch(h, permutation) for h in hidden)
    return hidden.movedim(1, 0)[permutation].movedim(0, 1)


def _forward_taking_padded(original: Any) -> Any:
    def forward(self: Any, input: Any, hx: Any = None) -> Any:
        entry = padded_of(input.data) if isinstance(input, PackedSequence) else None
        if entry is None:
            return original(self, input, hx)
        _OWN_FORWARD[0] += 1
        try:
            return _packed_forward(self, input, entry, hx)
        finally:
            _OWN_FORWARD[0] -= 1

    return forward


def refuse_other_uses(func: Any, args: tuple, kwargs: dict | None) -> None:
    """Refuse a torch function given a padded stand-in for packed data (see the NOTE)."""
    if _OWN_FORWARD[0] or not _REGISTRY:
        return
    values = list(args) + list((kwargs or {}).values())
    values += [v for a in values if isinstance(a, (list, tuple)) for v in a]
    if not any(padded_of(v) is not None for v in values):
        return
    attribute = getattr(getattr(func, "__self__", None), "__name__", None)
    if attribute in _SAME_AS_PACKED:
        return
    name = attribute or getattr(func, "__name__", repr(func))
    raise SPMDCompileError(
        f"PackedSequence.data is read by {name}: a compiled step keeps packed sequences "
        "padded (NOTE: [packed sequences at capture]), so only nn.LSTM / nn.GRU / nn.RNN "
        "and pad_packed_sequence may read them; the packed data's rows and shape would "
        "not be eager's.",
        user_line=innermost_model_frame_of_stack(),
        hint="unpack with pad_packed_sequence(...) and compute on the padded output "
        "(mask the padding, e.g. with the lengths it returns).",
    )


@contextlib.contextmanager
def packed_sequences() -> Iterator[None]:
    """Inside: the recurrent layers take the padded stand-ins (see the NOTE)."""
    saved = {cls: cls.__dict__["forward"] for cls in (nn.LSTM, nn.GRU, nn.RNN)}
    try:
        for cls, original in saved.items():
            cls.forward = _forward_taking_padded(original)  # type: ignore[method-assign]
        yield
    finally:
        for cls, original in saved.items():
            cls.forward = original  # type: ignore[method-assign]
        _REGISTRY.clear()


__all__ = ["pack_padded", "pad_packed", "packed_sequences", "padded_of", "refuse_other_uses"]
