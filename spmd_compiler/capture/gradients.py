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

import torch
import torch.fx

from ..ir.node_meta import BACKWARD_PHASE, PHASE, padded_gradient


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


__all__ = ["GRADIENT", "gradient_settles", "mark_gradients", "marked_gradient", "settled_gradient_name"]
