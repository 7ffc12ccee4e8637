"""``torch.nn.utils.prune`` between compiled calls, on parameters a compiled step placed.

NOTE: [pruning placed parameters]
After a compiled call the parameters are DTensors (NOTE: [calling a placed model
directly]). ``torch.nn.utils.prune`` between calls computes its mask from them with ops
DTensor cannot run or runs apart from eager: ``mask.view(-1)[topk.indices] = 0``
(``l1_unstructured`` under fsdp: "in-place operations that require placement changes
are not supported"), a boolean selection of the entries not yet pruned (pruning a
second time, ``global_unstructured``: "Sharding propagation failed for aten.index",
"got mixed torch.Tensor and DTensor"), and ``random_unstructured``'s draw, which a
DTensor takes from its own generator, not eager's. Each pruning method's
``compute_mask`` (torch's and any subclass of ``BasePruningMethod``, wrapped once, when
the class is made or, for those made before, when this module is imported) is handed,
where a tensor it is given or holds (``custom_from_mask``'s ``mask``) is a DTensor, the
full values as plain tensors (on real ranks a gather on every rank, as every rank
prunes; in a simulation read whole), computes eager's mask from them, and returns it
placed as the DTensor it was given (``default_mask``, placed like the weight): exact,
eager's mask. The rest of ``prune`` runs as it is: ``weight_orig`` is the placed
parameter itself (the optimizer's), the mask a buffer the next call places as the mode
places buffers (NOTE: [a buffer placed otherwise] in ``runner.py``), ``prune.remove``'s
``orig.data =`` is honoured (NOTE: [data replaced under another name]). The next call
compiles again for the new parameter and buffer names. Inside a step (traced tensors,
no DTensor) the wrapper calls through; registering the parametrization there is
refused (NOTE: [state registered in the step] in ``capture/trace.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.utils.prune as prune
from torch.distributed.tensor import DTensor

_WRAPPED = "__spmd_placed_pruning__"


def _full(t: Any, sim: Any) -> Any:
    """The full value of DTensor ``t`` as a plain tensor; anything else as it is."""
    from ..tools.parity import full_value

    return full_value(t, sim) if isinstance(t, DTensor) else t


@contextlib.contextmanager
def _held_full(method: Any, sim: Any) -> Iterator[None]:
    """The DTensors ``method`` holds (``CustomFromMask.mask``) as full plain values."""
    held = {k: v for k, v in vars(method).items() if isinstance(v, DTensor)}
    for key, value in held.items():
        setattr(method, key, _full(value, sim))
    try:
        yield
    finally:
        for key, value in held.items():
            setattr(method, key, value)


def _on_full_values(compute_mask: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    @functools.wraps(compute_mask)
    def wrapper(self: Any, t: torch.Tensor, default_mask: torch.Tensor) -> torch.Tensor:
        from .eager_calls import _placed_like
        from .simulate import simulation_for

        given = [x for x in (default_mask, t) if isinstance(x, DTensor)]
        held = [v for v in vars(self).values() if isinstance(v, DTensor)]
        if not given and not held:
            return compute_mask(self, t, default_mask)
        with simulation_for(given + held) as sim, _held_full(self, sim):
            mask = compute_mask(self, _full(t, sim), _full(default_mask, sim))
            return _placed_like(mask, given[0], sim) if given else mask

    setattr(wrapper, _WRAPPED, True)
    return wrapper


def _wrap(cls: type) -> None:
    own = cls.__dict__.get("compute_mask")
    if callable(own) and not getattr(own, _WRAPPED, False):
        cls.compute_mask = _on_full_values(own)  # type: ignore[attr-defined]


def _wrap_subclasses(cls: type) -> None:
    sub: type
    for sub in cls.__subclasses__():
        _wrap(sub)
        _wrap_subclasses(sub)


def _wrapped_when_made(cls: type, **kwargs: Any) -> None:
    super(prune.BasePruningMethod, cls).__init_subclass__(**kwargs)  # type: ignore[misc]
    _wrap(cls)


def prune_placed_on_full_values() -> None:
    """Wrap every pruning method's ``compute_mask``, now and when one is made (NOTE:
    [pruning placed parameters]); once."""
    base = prune.BasePruningMethod
    if base.__dict__.get("__init_subclass__") is not None:
        return
    base.__init_subclass__ = classmethod(_wrapped_when_made)  # type: ignore[assignment]
    _wrap_subclasses(base)


__all__ = ["prune_placed_on_full_values"]
