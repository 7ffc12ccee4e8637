"""The bytes a program constant read from outside the step held at capture, compared on
every call.

NOTE: [constants changed through shared memory]
A tensor the step reads from outside its arguments is a constant of the program,
guarded where it was found (NOTE: [tensors read from outside the arguments]). The guard
held the object and its version counter, but not every write advances that counter: a
write through memory the tensor shares with another object (the ``bytearray`` of
``torch.frombuffer``, the NumPy array of ``torch.from_numpy`` / ``torch.as_tensor``, a
tensor's ``.data``, DLPack) leaves it as it was. A byte table lower-cased between
calls through its buffer ran the old program on the captured table: 2 simulated ranks,
losses 5.5644 / 5.4677 where eager gave 5.5787 / 5.5267, parameters 7.4e-2 off, no
error (sixty-eighth session, an outside probe). So each constant's guard also holds its
bytes as captured (``CapturedBytes``) and, on every call where object and version are
unchanged, compares them with the tensor's: a change is a change of the value, which
compiles a new program, as an in-place write does. Exact and NaN-blind by design: the
bytes are compared, not the numbers (a NaN equals its own bytes, ``-0.0`` differs
from ``0.0``), with the shape, strides and dtype.
Cost: a constant of at most ``SNAPSHOT_BYTES`` keeps a copy on its own device, compared
with ``memcmp`` on the host, ``torch.equal`` on a device (a 256-byte table: ~10 us a
call; 4 MiB: ~0.4 ms; 64 MiB: ~25 ms, on a loaded 2-core machine). A larger one keeps a
128-bit BLAKE2b digest of its bytes instead of a second copy, recomputed every call (a
pass over its bytes on the host, ~180-280 MB/s here; a CUDA one is copied there first):
256 MiB cost 0.9-1.4 s a call (sixty-ninth session, a review: 2.8 s a call on 2
simulated ranks where the same table as a module buffer took 42 ms). An unequal value
gives an equal digest with probability 2**-128, no realistic silent path. On CUDA either
comparison waits for the GPU once per call. A large or CUDA tensor the step reads every
call is better held as a buffer of a module passed to the step, or passed as an
argument (a program input, read live, never compared): a constant over ``WARN_BYTES``
is warned of once per compiled step (``warn_of_large_constants``), naming it and those
forms; before the sixty-ninth session only a ``log.info`` said so, for a digest only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

SNAPSHOT_BYTES = 64 << 20  # a constant at most this large is compared with a copy
WARN_BYTES = 4 << 20  # a constant larger than this is warned of (see the NOTE)


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor`` as a 1-D uint8 tensor, in place where it is contiguous."""
    t = tensor.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.uint8 else t


def _memcmp() -> Any:
    try:
        function = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):  # no C library to load symbols from (Windows)
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    function.restype = ctypes.c_int
    return function


_MEMCMP = _memcmp()


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the 1-D uint8 tensors ``a`` and ``b`` hold the same bytes: ``memcmp`` on
    the host (0.14 ms for 4 MiB where ``torch.equal`` took 16 ms, on a loaded 2-core
    machine), ``torch.equal`` on a device."""
    if a.numel() != b.numel():
        return False
    if a.device.type == "cpu" and _MEMCMP is not None:
        return a.numel() == 0 or _MEMCMP(a.data_ptr(), b.data_ptr(), a.numel()) == 0
    return torch.equal(a, b)


def _digest(tensor: torch.Tensor) -> bytes:
    """A 128-bit BLAKE2b digest of the bytes of ``tensor`` (read on the host)."""
    flat = _flat_bytes(tensor).cpu()
    nbytes = flat.numel()
    data = (ctypes.c_char * nbytes).from_address(flat.data_ptr()) if nbytes else b""
    return hashlib.blake2b(data, digest_size=16).digest()


def _layout(tensor: torch.Tensor) -> tuple:
    strides = tensor.stride() if tensor.layout == torch.strided else tensor.layout
    return (tensor.dtype, tuple(tensor.shape), strides, tensor.device, tensor.is_conj(), tensor.is_neg())


@dataclass(eq=False)
class CapturedBytes:
    """A constant's bytes as captured, at ``version`` (see the NOTE)."""

    version: int
    layout: tuple
    copy: torch.Tensor | None  # the bytes, for at most SNAPSHOT_BYTES
    digest: bytes | None  # else their BLAKE2b digest

    @classmethod
    def of(cls, tensor: torch.Tensor, label: str) -> CapturedBytes:
        nbytes = tensor.numel() * tensor.element_size()
        if tensor.layout != torch.strided:  # no bytes to view (a sparse tensor): its values
            return cls(tensor._version, _layout(tensor), tensor.detach().clone(), None)
        if nbytes <= SNAPSHOT_BYTES:
            return cls(tensor._version, _layout(tensor), _flat_bytes(tensor).clone(), None)
        return cls(tensor._version, _layout(tensor), None, _digest(tensor))

    def unchanged(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` (the captured object, at the captured version) still holds
        the captured bytes."""
        if _layout(tensor) != self.layout:  # ``.data = other`` swaps all of it
            return False
        if self.copy is not None and tensor.layout != torch.strided:
            return torch.equal(tensor.detach(), self.copy)
        if self.copy is not None:
            return _same_bytes(_flat_bytes(tensor), self.copy)
        return _digest(tensor) == self.digest

    def restore(self, tensor: torch.Tensor) -> bool:
        """Put the captured bytes back into ``tensor`` through its ``.data`` (its version
        counter as it was); False where they cannot be (only a digest was kept, or the
        layout changed)."""
        if self.copy is None or _layout(tensor) != self.layout:
            return False
        with torch.no_grad():
            if tensor.layout != torch.strided:
                tensor.data.copy_(self.copy)
            else:
                values = self.copy if tensor.dtype == torch.uint8 else self.copy.view(tensor.dtype)
                tensor.data.copy_(values.reshape(tensor.shape))
        return True


def warn_of_large_constants(constants: list[tuple[str, torch.Tensor]], warned: set[str]) -> None:
    """Warn once (``warned``: the labels warned of, kept by the compiled step) of each
    constant of ``constants`` (label, tensor) over ``WARN_BYTES``, with what it costs a
    call and the forms read live (see the NOTE)."""
    for label, tensor in constants:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes <= WARN_BYTES or label in warned:
            continue
        warned.add(label)
        how = (
            "a copy of its bytes kept beside it (~0.4 ms a call for 4 MiB, ~25 ms for 64 MiB, on a loaded 2-core host)"
            if nbytes <= SNAPSHOT_BYTES else
            "a BLAKE2b digest of its bytes, recomputed on the host (~1 s a call for 256 MiB, on a loaded 2-core host)"
        )
        log.warning(
            "%s (%.1f MiB), read from outside the step's arguments, is a constant of the program: "
            "every call compares it with %s, to compile anew when it changes (NOTE: [constants "
            "changed through shared memory]). Hold it as a buffer of a module passed to the step "
            "(`model.register_buffer('table', t, persistent=False)`, read as `model.table`) or "
            "pass it as an argument: the program reads those live, with no comparison.",
            label, nbytes / (1 << 20), how,
        )


__all__ = ["SNAPSHOT_BYTES", "WARN_BYTES", "CapturedBytes", "warn_of_large_constants"]
