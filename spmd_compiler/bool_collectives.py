"""Bool tensors a lowered program gathers travel as bytes.

NOTE: [bool collectives as bytes]
A per-rank program may gather a bool tensor: transformers' causal mask indexes the
padding mask with ``arange`` over the global batch, a replicated index, so each rank
all-gathers the mask (``b8[4, 16]`` into ``b8[8, 16]`` on 2 ranks) and builds the global
mask from it. Interpreted, that runs. Lowered by Inductor's C++ backend, the gathered
bool feeding ``where`` failed to compile (torch 2.13: ``AssertionError: CppCSEVariable(...
dtype: torch.int64 ...)`` in ``_get_mask_cast``), so GPT-2 and Llama with an attention
mask failed on their second call with ``backend="inductor"`` on real ranks. The same
function with the gather replaced by a copy compiles, and with the gather on ``uint8``
too (a pure-torch repro, 1-rank gloo group, ``torch.compile``).

So before Inductor compiles a whole program, each gather, all-to-all or broadcast of a
bool tensor moves it as ``uint8`` (``_to_copy`` before the collective, ``_to_copy`` back
to bool after its wait): the same bytes (a bool is one byte, 0 or 1) through the same
collective, so every rank gets the same values as before. Reductions are left alone
(summing bools is not summing bytes). Compute regions need nothing: their collectives
run outside the compiled code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx

from . import _torch_private as private
from .ir.collectives import is_wait

_c10d = private.functional_collective_ops()
# collectives that move values without combining them
_MOVES = (
    _c10d.all_gather_into_tensor.default,
    _c10d.all_to_all_single.default,
    _c10d.broadcast.default,
)


def gather_bools_as_bytes(gm: torch.fx.GraphModule) -> int:
    """Move every bool tensor a collective of ``_MOVES`` carries as ``uint8`` (NOTE:
    [bool collectives as bytes]); returns how many collectives changed."""
    graph = gm.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _MOVES:
            continue
        source = node.args[0]
        val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if not isinstance(val, torch.Tensor) or val.dtype is not torch.bool:
            continue
        if not node.users or not all(is_wait(user) for user in node.users):
            continue
        with graph.inserting_before(node):
            as_bytes = graph.call_function(
                torch.ops.aten._to_copy.default, (source,), {"dtype": torch.uint8}
            )
        as_bytes.meta.update(source.meta, val=_as(val, torch.uint8))
        node.replace_input_with(source, as_bytes)
        node.meta["val"] = _as(node.meta.get("val"), torch.uint8)
        for wait in list(node.users):
            with graph.inserting_after(wait):
                back = graph.call_function(
                    torch.ops.aten._to_copy.default, (wait,), {"dtype": torch.bool}
                )
            back.meta.update(wait.meta, val=wait.meta.get("val"))
            wait.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
            wait.meta["val"] = _as(wait.meta.get("val"), torch.uint8)
        changed += 1
    if changed:
        graph.lint()
        gm.recompile()
    return changed


def _as(val: Any, dtype: torch.dtype) -> Any:
    """``val`` (a fake tensor, or none) as ``dtype``, for the metadata."""
    return val.to(dtype) if isinstance(val, torch.Tensor) else val
