"""Mark each parameter's gradient where ``backward()`` leaves it.

NOTE: [gradients settle after backward]
A gradient leaves backward as a partial sum on every rank (each rank's batch shard).
DTensor keeps a value partial through linear ops and reduces it where an op needs the
whole: so when the step scales or clips gradients between ``backward()`` and
``optimizer.step()`` (``clip_grad_norm_``, ``GradScaler.unscale_``, a hand-written
``p.grad.mul_(s)``), each of those ops reduced its own partial gradients. Measured
before this (2 simulated ranks, the 6-16-4 test MLP): ddp with ``clip_grad_norm_``
all-reduced the gradients twice (the norm, then the update), fsdp all-reduced the whole
gradients for the norm on top of its reduce-scatter, and the GradScaler recipe with
clipping reduced them three times; the extra reductions also read each rank's partial
gradient after it was reduced (NOTE: [buckets reduced in place by Inductor]).

So capture marks the gradient ``backward()`` leaves on each parameter with an op of
ours, ``spmd_compiler::gradient(grad, name)`` (an identity), and expansion gives every
use of a marked gradient outside backward the gradient in the mode's placement for it
(``placement_of(GRAD)``: Replicate for ddp, the parameter's shard for fsdp), reduced
once, as torch's DDP and FSDP reduce a gradient once when backward has produced it.
Uses inside a later ``backward()`` (a second backward accumulating into ``.grad``) read
the partial value, so accumulation within a step still reduces once. The mark never
reaches the per-rank program: expansion reads through it. Not marked: a gradient that
itself requires grad (``backward(create_graph=True)``), and gradients of
``torch.autograd.grad``, which are not ``.grad``.
"""

from __future__ import annotations

from collections.abc import Container

import torch
import torch.fx

from .. import _torch_private as private
from ..ir.graph_utils import placeholders
from ..ir.node_meta import BACKWARD_PHASE, PHASE, padded_gradient
from ..ir.signature import CapturedStep, Kind


@torch.library.custom_op("spmd_compiler::gradient", mutates_args=())
def _gradient(grad: torch.Tensor, name: str) -> torch.Tensor:
    """The gradient of parameter ``name`` as ``backward()`` left it (an identity)."""
    return grad.clone()


@_gradient.register_fake
def _(grad: torch.Tensor, name: str) -> torch.Tensor:
    return torch.empty_like(grad)


GRADIENT = torch.ops.spmd_compiler.gradient.default


def mark_gradients(params: dict[str, torch.Tensor]) -> None:
    """Replace each traced parameter's ``.grad`` by its marked value (see the NOTE)."""
    for name, p in params.items():
        grad = p.grad
        if grad is not None and not grad.requires_grad:
            p.grad = GRADIENT(grad, name)


def marked_gradient(node: torch.fx.Node) -> str | None:
    """The parameter whose gradient ``node`` marks, or None."""
    if node.op == "call_function" and node.target is GRADIENT:
        return str(node.args[1])
    return None


# readers of a gradient's shape and dtype only (``zero_grad(set_to_none=False)``): they
# need no reduced value
_SHAPE_READERS = frozenset({
    torch.ops.aten.zeros_like.default, torch.ops.aten.ones_like.default,
    torch.ops.aten.empty_like.default, torch.ops.aten.full_like.default,
    torch.ops.aten.zero.default, torch.ops.aten.fill.Scalar,
})


def gradient_settles(consumer: torch.fx.Node, arg: torch.fx.Node) -> bool:
    """Whether ``consumer`` reads ``arg``, a marked gradient, as settled (see the NOTE):
    outside backward, and for its value."""
    return (
        marked_gradient(arg) is not None
        and consumer.meta.get(PHASE) != BACKWARD_PHASE
        and consumer.target not in _SHAPE_READERS
    )


def settled_gradient_name(consumer: torch.fx.Node, arg: torch.fx.Node) -> str | None:
    """The parameter whose settled gradient ``consumer`` reads from ``arg``: a marked
    gradient read as ``gradient_settles`` says, or the zero pad of an uneven gradient
    where the optimizer reads it (NOTE: [padded gradients settle at their pad] in
    ``expand/retrace.py``); None where ``consumer`` reads ``arg`` as it is."""
    if gradient_settles(consumer, arg):
        return marked_gradient(arg)
    name = padded_gradient(arg)
    if name is None or consumer.meta.get(PHASE) == BACKWARD_PHASE or consumer.target in _SHAPE_READERS:
        return None
    return name


# NOTE: [a kept gradient the step does not read]
# A gradient left on a parameter by the previous call is an input of the next program
# (``StepBindings.state_refs``: every ``p.grad`` that is not None), whatever the step does
# with it. A step that starts with ``optimizer.zero_grad()`` (torchdiffeq's examples and
# many training loops) never reads its value: ``set_to_none=True`` (the default) leaves
# the input without a reader, ``set_to_none=False`` reads it through ``zero_``, whose
# result depends on its shape and dtype only. Tensor parallel with a dimension the ranks
# do not divide refused every kept gradient of a padded parameter
# (``padding.pad_uneven_state``), so such a step compiled at call 1 (no gradient yet) and
# was refused at call 2 ("grad 2.weight is kept across steps"); fully_shard padded the
# input and gathered its true rows for ``zero_``: an all-gather of a tensor about to be
# zeroed (832 instead of 416 all-gathered bytes, 6-wide MLP on 4 ranks). Such an input is
# now taken out of the program (``drop_unread_gradient_inputs``): each shape reader becomes
# a factory of its result (``zero_(grad)`` -> ``full(shape, 0)``), the placeholder goes,
# and the gradient the step leaves is an output as before. A gradient the step reads for
# its value (backward accumulates into it: no ``zero_grad``, or ``zero_grad`` only at the
# end with ``set_to_none=False``) stays an input.


def _fill_value(node: torch.fx.Node) -> bool | int | float | None:
    """The value ``node``, a shape reader, fills its result with, or None where it is not
    a Python number (``full_like(g, t.item())``: read as a value, left as it is)."""
    aten = torch.ops.aten
    if node.target in (aten.zero.default, aten.zeros_like.default, aten.empty_like.default):
        return 0
    if node.target is aten.ones_like.default:
        return 1
    value = node.args[1] if len(node.args) > 1 else node.kwargs.get("fill_value", node.kwargs.get("value"))
    return value if isinstance(value, (bool, int, float)) else None


def _shape_read_only(placeholder: torch.fx.Node) -> bool:
    """Whether every reader of ``placeholder`` reads only its shape and dtype: as the
    input of a shape reader filling its result with a Python number."""
    return all(
        user.target in _SHAPE_READERS and user.all_input_nodes == [placeholder]
        and _fill_value(user) is not None and isinstance(user.meta.get("val"), torch.Tensor)
        for user in placeholder.users
    )


def unread_gradient_inputs(captured: CapturedStep, names: Container[str]) -> list[str]:
    """The parameters among ``names`` whose kept gradient (a GRAD input) the program does
    not read for its value (NOTE: [a kept gradient the step does not read])."""
    return [
        ref.name for ref, node in zip(captured.input_refs(), placeholders(captured.graph_module), strict=True)
        if ref.kind is Kind.GRAD and ref.name in names and _shape_read_only(node)
    ]


def drop_unread_gradient_inputs(captured: CapturedStep, names: Container[str]) -> list[str]:
    """Take the gradient inputs ``unread_gradient_inputs`` finds out of ``captured``: each
    shape reader becomes a ``full`` of its result's shape, dtype and device, and the
    placeholder is erased. Returns the parameters whose gradient input went; none: the
    graph is unchanged."""
    dropped = unread_gradient_inputs(captured, names)
    if not dropped:
        return dropped
    gm = captured.graph_module
    graph = gm.graph
    kept = []
    for (ref, meta), node in zip(captured.inputs, placeholders(gm), strict=True):
        if ref.kind is not Kind.GRAD or ref.name not in dropped:
            kept.append((ref, meta))
            continue
        for user in list(node.users):
            val = user.meta["val"]
            with graph.inserting_before(user):
                filled = graph.call_function(
                    torch.ops.aten.full.default, ([int(size) for size in val.shape], _fill_value(user)),
                    {"dtype": val.dtype, "layout": torch.strided, "device": val.device, "pin_memory": False},
                )
            filled.meta = dict(user.meta)
            user.replace_all_uses_with(filled)
            graph.erase_node(user)
        graph.erase_node(node)
    captured.inputs = kept
    private.use_plain_codegen(gm)  # flat inputs, fewer of them
    return dropped


__all__ = [
    "GRADIENT", "drop_unread_gradient_inputs", "gradient_settles", "mark_gradients", "marked_gradient",
    "settled_gradient_name", "unread_gradient_inputs",
]
