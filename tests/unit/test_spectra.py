"""``torch.stft`` and ``torch.istft`` as the capture answers them (NOTE: [short-time
Fourier transforms at capture] in ``spmd_compiler/capture/spectra.py``) equal torch's own
bit for bit, on real tensors, over their options; calls not answered are torch's (its
errors included)."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from spmd_compiler.capture.spectra import istft, stft


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.complex64])
@pytest.mark.parametrize("signal_dim", [1, 2])
def test_stft_equals_torch_bit_for_bit(dtype, signal_dim):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((3, 50) if signal_dim == 2 else (50,), generator=gen, dtype=dtype)
    compared = 0
    for n_fft, hop, win, hann, center, pad_mode, normalized, onesided in itertools.product(
        [16, 15], [None, 5], [None, 10], [False, True], [True, False], ["reflect", "constant"],
        [False, True], [None, False, True],
    ):
        window = torch.hann_window(win or n_fft, dtype=x.real.dtype) if hann else None
        options = dict(
            hop_length=hop, win_length=win, window=window, center=center, pad_mode=pad_mode,
            normalized=normalized, onesided=onesided, return_complex=True,
        )
        if dtype.is_complex and onesided:
            with pytest.raises(RuntimeError):
                stft(x, n_fft, **options)
            continue
        with warnings.catch_warnings():  # torch's once-per-process "no window" warning
            warnings.simplefilter("ignore")
            expected = torch.stft(x, n_fft, **options)
        actual = stft(x, n_fft, **options)
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert torch.equal(actual, expected), options
        compared += 1
    assert compared >= 128


def test_calls_not_answered_are_torchs():
    x = torch.randn(2, 40)
    with pytest.raises(RuntimeError):  # torch: return_complex is required for real input
        stft(x, 16)
    with pytest.raises(RuntimeError):  # n_fft longer than the signal
        stft(x, 64, center=False, return_complex=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("signal_dim", [1, 2])
def test_istft_equals_torch_bit_for_bit(dtype, signal_dim):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((3, 50) if signal_dim == 2 else (50,), generator=gen, dtype=dtype)
    compared = refused = 0
    for n_fft, hop, win, hann, center, normalized, onesided, length in itertools.product(
        [16, 15], [None, 5], [None, 12], [False, True], [True, False], [False, True],
        [None, True, False], [None, 40, 60],
    ):
        window = torch.hann_window(win or n_fft, dtype=dtype) if hann else None
        spectrum = torch.stft(
            x, n_fft, hop_length=hop, win_length=win, window=window, center=center,
            normalized=normalized, onesided=onesided, return_complex=True,
        )
        options = dict(
            hop_length=hop, win_length=win, window=window, center=center,
            normalized=normalized, onesided=onesided, length=length,
        )
        try:
            expected = torch.istft(spectrum, n_fft, **options)
        except RuntimeError:  # a window whose envelope vanishes at the ends (NOLA)
            with pytest.raises(RuntimeError):
                istft(spectrum, n_fft, **options)
            refused += 1
            continue
        actual = istft(spectrum, n_fft, **options)
        assert actual.shape == expected.shape and actual.dtype == expected.dtype
        assert torch.equal(actual, expected), options
        compared += 1
    assert compared >= 256 and refused > 0
