"""cross_iteration_overlap: finish the last gradient bucket in the next step.

NOTE: [cross-iteration overlap]
The gradients backward computes last (the first layers') are reduced after all of
backward, and the optimizer waits for them: that reduction is fully exposed. This pass
picks those reductions, the last-ready gradient reductions up to one bucket of bytes
(``CrossIterationOptions.cap_bytes``, by default ``bucket_collectives``'s cap), and marks
them ``DEFERRED``. Everything computed from their results (their wait and the optimizer
update of their parameters, the *deferred part*) then moves into the next call of the
step: the collective is still issued in step i, right after its inputs, and the next call
waits for it and applies step i's update just before the forward first reads those
parameters, so the reduction overlaps the time between the two calls and the start of
the next forward. The numbers are exactly those of the step without the pass; only when
the update lands changes.

The pass only marks nodes; ``bucket_collectives`` never merges a deferred reduction with
another, ``fuse_optimizer_updates`` never fuses a deferred op with another, and after the
pipeline ``spmd_compiler.runtime.cross_iteration.split_program`` cuts the marked program into the
three programs the runtime runs: *first* (the step without the deferred part; it hands
the values the deferred part reads to the next call), *steady* (the previous step's
deferred part, then this step) and *finish* (the deferred part alone: ``flush()``).

A reduction qualifies when everything computed from its result is pure, issues no
collective, and only produces new parameters and optimizer state that the step also
reads (so the first program can hand back the old value): not the returned loss, not a
``.grad`` the user keeps, not state the step creates. A program without such reductions
(the first step, which creates the optimizer state) is left as it is. Where every update
depends on the last reduction (gradient clipping: the norm needs every gradient), every
update is deferred; the result is still exact.

The pass is off by default (``extra_passes=("cross_iteration_overlap",)``): between two
calls the deferred parameters hold the previous step's values, so code that reads the
model between steps must call ``step.flush()`` first (``spmd_compiler.runtime.checkpoint`` and the
end of a simulation flush by themselves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx

from spmd_compiler.ir.graph_utils import output_values
from spmd_compiler.ir.node_meta import DEFERRED, is_deferred, set_deferred
from spmd_compiler.ir.signature import Kind

from . import remove_duplicate_collectives as _ordered_after  # noqa: F401  (registers it)
from .bucket_collectives import BucketOptions
from .collective_graph import (
    deferred_part,
    is_barrier,
    options_for,
    parse_collective,
    payload_bytes,
    positions,
    wait_of,
)
from .manager import PassContext, is_collective, is_wait, register_pass

__all__ = ["DEFERRED", "CrossIterationOptions", "cross_iteration_overlap", "deferred_part"]

_REDUCTIONS = ("all_reduce", "reduce_scatter")
_STATE_KINDS = (Kind.PARAM, Kind.OPTIM_STATE)


@dataclass(frozen=True)
class CrossIterationOptions:
    """Options of ``cross_iteration_overlap``.

    Args:
        cap_bytes: most payload bytes deferred (one bucket); None uses the cap of this
            pipeline's ``bucket_collectives``. At least one reduction is deferred when
            any qualifies.
    """

    cap_bytes: int | None = None


@register_pass(
    "cross_iteration_overlap",
    "defer the last gradient bucket's wait and optimizer update to the next step",
    after=("remove_duplicate_collectives",),
    before=("bucket_collectives", "fuse_optimizer_updates"),
    options=CrossIterationOptions,
)
def cross_iteration_overlap(program, context: PassContext) -> bool:
    """Mark the last-ready gradient reductions whose results only update state as deferred.

    Why: see NOTE: [cross-iteration overlap]. Only ``node.meta`` changes here; the graph
    is split after the pipeline. A no-op (returns False) when no reduction qualifies, or
    when the program is already marked.

    Before::

        g1 = ...; g2 = ...                    # g2 is the last gradient backward computes
        r2 = all_reduce(g2); w2 = wait_tensor(r2); p2_new = sub(p2, mul(w2, lr))

    After (one graph; the meta flag decides the split)::

        r2 = all_reduce(g2)                   # r2.meta[DEFERRED] = True
        w2 = wait_tensor(r2); p2_new = ...    # moved into the next call by split_program

    Args:
        program: the per-rank program; ``node.meta`` is updated in place.
        context: ``context.options`` is a ``CrossIterationOptions``.

    Returns:
        Whether any reduction was marked.
    """
    options = options_for(context, "cross_iteration_overlap", CrossIterationOptions())
    cap = options.cap_bytes
    if cap is None:  # one bucket of this pipeline's bucket_collectives
        bucket = getattr(context, "bound_options", {}).get("bucket_collectives")
        cap = (bucket if isinstance(bucket, BucketOptions) else BucketOptions()).cap_bytes
    graph = program.graph_module.graph
    if any(is_deferred(n) for n in graph.nodes):
        return False
    outputs = _state_outputs(program)
    position = positions(graph)
    candidates = []
    for node in graph.nodes:
        call = parse_collective(node)
        if call is None or call.kind not in _REDUCTIONS:
            continue
        wait = wait_of(node)
        if wait is None or not _only_updates_state(wait, outputs):
            continue
        ready = max((position[a] for a in node.all_input_nodes), default=-1)
        candidates.append((ready, node))
    chosen: list[torch.fx.Node] = []
    total = 0
    for _, node in sorted(candidates, key=lambda c: c[0], reverse=True):
        nbytes = payload_bytes(node)
        if chosen and total + nbytes > cap:
            break
        chosen.append(node)
        total += nbytes
    for node in chosen:
        set_deferred(node)
    return bool(chosen)


def _state_outputs(program) -> dict[int, bool]:
    """Output position -> whether it may come from a deferred part (new parameter or
    optimizer state that is also a program input)."""
    captured = program.captured
    inputs = {ref for ref, _ in captured.inputs}
    return {
        j: ref.kind in _STATE_KINDS and ref in inputs for j, ref in enumerate(captured.outputs)
    }


def _only_updates_state(wait: torch.fx.Node, outputs: dict[int, bool]) -> bool:
    stack, seen = [wait], set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for user in node.users:
            if user.op == "output":
                flat = output_values(user)
                if any(v is node and not outputs.get(j, False) for j, v in enumerate(flat)):
                    return False
                continue
            if is_collective(user) or is_wait(user) or is_barrier(user) or user.is_impure():
                return False
            stack.append(user)
    return True
