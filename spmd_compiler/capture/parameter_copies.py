"""Deep copies of the step's parameters made while it is traced, as eager makes them.

NOTE: [deep copies of the step's parameters]
Reptile and first-order MAML clone the model in every call (``fast = copy.deepcopy(model)``)
and train the clone. Eager copies each ``nn.Parameter`` with ``Parameter.__deepcopy__``: a
new leaf ``Parameter`` of the cloned values with the same ``requires_grad``, and nothing
else: no ``.grad``, none of the Python attributes code set on it. While the step is
traced the modules hold the capture's stand-ins instead, plain (fake) tensors that carry
the gradient the call starts from and the parameter's Python attributes (NOTE: [Python
attributes of parameters] in ``trace.py``), and ``Tensor.__deepcopy__`` copied both. A
clone made after a call that left gradients on the model (``p.grad = p - p_fast`` and the
meta step, ``zero_grad`` only at the next call's end) then started with the model's
gradients, and the clone's first ``backward()`` added to them: with the inner update
written by hand or as ``inner.step()`` before ``inner.zero_grad()``, every call after the
second was off with no error (a 1-8-1 tanh MLP, SGD meta step, float64, 3 calls: loss
2.4785 against eager's 2.4695, ws 1 and 2, until the sixty-ninth session). While the step
is traced, a deep copy of a stand-in whose parameter copies itself as ``nn.Parameter``
does is made as ``Parameter.__deepcopy__`` makes it; everything else is copied as before.
``tests/sim/test_optimizers_made_in_the_call.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

import torch


@contextlib.contextmanager
def parameters_copied_as_eager(real: Mapping[str, torch.Tensor], traced: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """Inside: ``copy.deepcopy`` of a stand-in in ``traced`` copies it as its parameter in
    ``real`` copies itself (NOTE: [deep copies of the step's parameters])."""
    copies = {
        id(traced[name]): (traced[name], type(p) if issubclass(type(p), torch.nn.Parameter) else torch.nn.Parameter)
        for name, p in real.items()
        if name in traced and _copied_as_a_parameter(p)
    }
    if not copies:
        yield
        return
    tensor_copy = torch.Tensor.__deepcopy__

    def deepcopy(self: torch.Tensor, memo: dict[int, Any]) -> Any:
        entry = copies.get(id(self))
        if entry is None or entry[0] is not self:
            return tensor_copy(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        result = entry[1](self.data.clone(memory_format=torch.preserve_format), self.requires_grad)
        memo[id(self)] = result
        return result

    with mock.patch.object(torch.Tensor, "__deepcopy__", deepcopy):
        yield


def _copied_as_a_parameter(p: torch.Tensor) -> bool:
    """Whether eager copies ``p`` with ``Parameter.__deepcopy__``: an ``nn.Parameter`` whose
    class copies itself as torch's does, or a parameter a compiled call placed (a DTensor
    flagged as a parameter), which stands for the ``nn.Parameter`` the user made."""
    if not isinstance(p, torch.nn.Parameter):
        return False
    own = getattr(type(p), "__deepcopy__", None)
    return own is torch.nn.Parameter.__deepcopy__ or (
        not issubclass(type(p), torch.nn.Parameter) and own is torch.Tensor.__deepcopy__
    )
