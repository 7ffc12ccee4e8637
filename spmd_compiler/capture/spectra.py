"""Short-time Fourier transforms at capture: frames gathered (``stft``) or overlapped
(``istft``) by index around ATen's FFT ops.

NOTE: [short-time Fourier transforms at capture]
``torch.stft`` cuts its (padded) signal into overlapping frames with an ``as_strided``
inside ATen's kernel, below the Python functions NOTE: [windows by as_strided] answers,
so a step computing a spectrogram (an audio model's front end) was refused at expansion
(DTensor has no ``as_strided``; its backward writes a whole storage). While the step is
traced, ``torch.stft`` / ``Tensor.stft`` runs ATen's algorithm here in ops DTensor has
rules for, step for step:

1. ``center``: the signal padded by ``n_fft // 2`` on each side with ``pad_mode``, as
   ``torch.functional.stft`` pads it;
2. the frames ``(batch, n_frames, n_fft)`` at ``hop_length`` steps: the same window grid
   ATen's ``as_strided`` names, gathered by index as NOTE: [windows by as_strided]
   gathers (the batch stays sharded, autograd derives the backward from the gather),
   without its element-by-element check or size cap: a long signal's grid is large,
   and lies in the signal by construction;
3. the window: ``win_length`` < ``n_fft`` centres it in zeros (a window of ones where
   none is given), and the frames are multiplied by it;
4. ``_fft_r2c`` (real frames; ``onesided`` by default) or ``_fft_c2c`` (complex) over the
   last dimension, normalized by ``1 / sqrt(n_fft)`` when ``normalized``; frequencies
   moved before frames, the batch dimension dropped for a 1-D signal.

``torch.istft`` (a mask applied to the spectrum, then the waveform again: speech
enhancement, source separation) runs ATen's inverse the same way: ``_fft_c2r`` of each
frame, the window, the frames overlapped and added along time by ``index_add`` (frame
after frame at each sample: the tests find ATen's sums bit for bit), divided by the
window's overlapped squares. ATen refuses a window whose envelope vanishes (NOLA) by
reading the envelope's minimum with ``.item()``; here it is an ``if`` on the value, which
the program keeps and checks on every call (NOTE: [value checks]).

Both results equal torch's bit for bit (``tests/unit/test_spectra.py`` compares them over
the options on real tensors). Only ``stft`` with ``return_complex=True`` and a 1-D or 2-D
signal, no ``align_to_window``, ``istft`` of a complex spectrum to a real signal, and
arguments ATen accepts are answered here; any other call is torch's own, which raises
ATen's error or is refused at expansion as before.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

aten = torch.ops.aten

_NORM_NONE, _NORM_BY_ROOT_N, _NORM_BY_N = 0, 1, 2  # ATen's fft_norm_mode


def _frame_positions(frames_n: int, n_fft: int, hop: int, device: torch.device) -> torch.Tensor:
    """``(frames_n, n_fft)``: the sample each frame position reads (``stft``) or adds
    into (``istft``), ``f * hop + k``."""
    return torch.arange(frames_n, device=device).unsqueeze(-1) * hop + torch.arange(n_fft, device=device)


def _centred(taper: torch.Tensor, win: int, n_fft: int) -> torch.Tensor:
    """A window of ``win`` samples centred in ``n_fft`` zeros, as ATen centres it."""
    left = (n_fft - win) // 2
    return F.pad(taper, [left, n_fft - win - left]) if win < n_fft else taper


def _frames(signal: torch.Tensor, n_fft: int, hop: int, frames_n: int) -> torch.Tensor:
    """``signal.as_strided((batch, frames_n, n_fft), (s0, hop * s1, s1))``, the frames
    ATen's kernel views, gathered by index: sample ``f * hop + k`` of the signal for frame
    ``f``, position ``k``. As in ``windows_by_index`` the batch is moved last for the
    gather (no ``None`` before the index, so a batch sharded there stays sharded), but
    the grid needs no element-by-element check: every frame lies in the signal (``n_fft
    <= length``), whatever its size."""
    positions = _frame_positions(frames_n, n_fft, hop, signal.device)
    return signal.movedim(0, -1)[positions].movedim(-1, 0)


def stft(
    input: torch.Tensor,
    n_fft: int,
    hop_length: int | None = None,
    win_length: int | None = None,
    window: torch.Tensor | None = None,
    center: bool = True,
    pad_mode: str = "reflect",
    normalized: bool = False,
    onesided: bool | None = None,
    return_complex: bool | None = None,
    align_to_window: bool | None = None,
) -> Any:
    """``torch.stft`` while the step is traced (see the NOTE)."""
    def torch_own() -> Any:
        extra = {} if align_to_window is None else {"align_to_window": align_to_window}
        return torch.stft(
            input, n_fft, hop_length=hop_length, win_length=win_length, window=window,
            center=center, pad_mode=pad_mode, normalized=normalized, onesided=onesided,
            return_complex=return_complex, **extra,
        )

    hop = n_fft // 4 if hop_length is None else hop_length
    win = n_fft if win_length is None else win_length
    signal_dim = input.dim() if isinstance(input, torch.Tensor) else 0
    if (
        return_complex is not True or align_to_window is not None or signal_dim not in (1, 2)
        or not isinstance(n_fft, int) or not isinstance(hop, int) or not isinstance(win, int)
        or hop <= 0 or not 0 < win <= n_fft
        or (window is not None and (window.dim() != 1 or window.shape[0] != win))
    ):
        return torch_own()
    signal = input
    if center:
        pad = int(n_fft // 2)
        shape = [1] * (3 - signal_dim) + list(signal.size())
        signal = F.pad(signal.view(shape), [pad, pad], pad_mode)
        signal = signal.view(signal.shape[-signal_dim:])
    batched = signal if signal_dim == 2 else signal.unsqueeze(0)
    length = batched.shape[-1]
    if not 0 < n_fft <= length:
        return torch_own()
    frames = _frames(batched, n_fft, hop, 1 + (length - n_fft) // hop)
    taper = window
    if taper is None and win < n_fft:  # ATen: a window of ones, centred
        taper = torch.ones(win, dtype=batched.dtype, device=batched.device)
    if taper is not None:
        frames = frames.mul(_centred(taper, win, n_fft))
    complex_fft = frames.is_complex()
    sided = not complex_fft if onesided is None else onesided
    if complex_fft and sided:
        return torch_own()  # ATen refuses a onesided transform of complex frames
    norm = _NORM_BY_ROOT_N if normalized else _NORM_NONE
    if complex_fft:
        out = aten._fft_c2c(frames, [2], norm, True)
    else:
        out = aten._fft_r2c(frames, [2], norm, sided)
    out = out.transpose(1, 2)
    return out.squeeze(0) if signal_dim == 1 else out


def istft(
    input: torch.Tensor,
    n_fft: int,
    hop_length: int | None = None,
    win_length: int | None = None,
    window: torch.Tensor | None = None,
    center: bool = True,
    normalized: bool = False,
    onesided: bool | None = None,
    length: int | None = None,
    return_complex: bool = False,
) -> Any:
    """``torch.istft`` while the step is traced (see the NOTE): the inverse FFT of each
    frame, windowed, overlapped and added by ``index_add`` along time, divided by the
    window's overlapped envelope; the envelope's check that it nowhere vanishes (NOLA)
    is an ``if`` on a value, which the program keeps and checks every call (NOTE: [value
    checks]) where ATen reads it with ``.item()``."""
    def torch_own() -> Any:
        return torch.istft(
            input, n_fft, hop_length=hop_length, win_length=win_length, window=window,
            center=center, normalized=normalized, onesided=onesided, length=length,
            return_complex=return_complex,
        )

    hop = n_fft // 4 if hop_length is None else hop_length
    win = n_fft if win_length is None else win_length
    if (
        not isinstance(input, torch.Tensor) or not input.is_complex() or input.dim() not in (2, 3)
        or return_complex or not isinstance(n_fft, int) or not isinstance(hop, int)
        or not isinstance(win, int) or not 0 < hop <= win or not 0 < win <= n_fft
        or (window is not None and (window.dim() != 1 or window.shape[0] != win or window.is_complex()))
    ):
        return torch_own()
    spectrum = input if input.dim() == 3 else input.unsqueeze(0)  # (channel, freq, frames)
    frames_n, fft_size = spectrum.shape[-1], spectrum.shape[-2]
    sided = fft_size != n_fft if onesided is None else onesided
    if frames_n < 1 or fft_size != (n_fft // 2 + 1 if sided else n_fft):
        return torch_own()
    total = n_fft + hop * (frames_n - 1)
    start = n_fft // 2 if center else 0
    if length is not None:
        end = start + length
    else:
        end = total - n_fft // 2 if center else total
    if end <= start:
        return torch_own()
    real_dtype = spectrum.real.dtype
    taper = _centred(
        torch.ones(win, dtype=real_dtype, device=spectrum.device) if window is None else window,
        win, n_fft,
    )
    frames = spectrum.resolve_conj().transpose(1, 2)  # (channel, frames, freq)
    norm = _NORM_BY_ROOT_N if normalized else _NORM_BY_N
    if not sided:
        frames = frames.narrow(-1, 0, n_fft // 2 + 1)
    frames = aten._fft_c2r(frames, [2], norm, n_fft)  # (channel, frames, n_fft)
    frames = frames * taper.view(1, 1, n_fft)
    positions = _frame_positions(frames_n, n_fft, hop, frames.device).reshape(-1)
    signal = frames.new_zeros(frames.shape[0], total).index_add(1, positions, frames.reshape(frames.shape[0], -1))
    squares = taper.pow(2).expand(frames_n, n_fft).reshape(-1)
    envelope = squares.new_zeros(total).index_add(0, positions, squares)
    stop = min(end, total)
    signal, envelope = signal[:, start:stop], envelope[start:stop]
    if envelope.abs().min() < 1e-11:
        raise RuntimeError("istft(...): window overlap add min is below 1e-11 (the window does not satisfy NOLA)")
    signal = signal / envelope
    if input.dim() == 2:
        signal = signal.squeeze(0)
    if end > total:
        signal = F.pad(signal, [0, end - total])
    return signal


__all__ = ["istft", "stft"]
