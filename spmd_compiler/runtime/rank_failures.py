"""A rank whose program fails on its own data: every rank's call fails, nothing updated.

NOTE: [a rank whose program fails alone]
A kernel of the per-rank program that raises on one rank's data only (a label out of
range in that rank's share of the batch: ``nll_loss`` raised ``IndexError: Target 7 is
out of bounds`` on rank 1) failed that rank's call, while its peers waited in the
program's next collective (the gradient all-reduce) for a contribution that never came.
Rank 1's error said "ranks given such data fail alike", which they did not; rank 0 got
no notice until rank 1's next call, whose input round landed in that all-reduce: gloo
aborted rank 1 (``gloo::EnforceNotMet``, SIGABRT) and every later call of rank 0 failed
with "Connection reset by peer" (2 gloo ranks under ``sc.launch``; a rank that slept
20 s before its next call kept its peer waiting 20 s, under torchrun up to the
collective timeout, 30 minutes).

So on real ranks, for a program the interpreter runs (an fx graph, whose failing node
``failing_site`` finds):

- the failing rank goes on through the rest of its program's collectives in the
  program's order, each fed zeros of its inputs' recorded shapes and dtypes and waited
  at once, computing nothing else (``drain_collectives``): its peers' collectives
  complete, on values the call then throws away. A failure in the part that runs while
  the input round is in flight (``LoweredGraph.early``) finishes the round first, then
  goes through all of the program's collectives;
- every rank's status (0: its program ran, 1: it failed) travels before any state is
  written (``insert_status``, on the interpreter's copy of the program on real ranks):
  as one more element of the program's last collective where that is a sum all-reduce
  of a flat float bucket on the CPU (data parallelism's gradient bucket:
  ``StatusRider``, read after its wait by ``StatusCheck``, before the first write,
  which waits for the last collective: NOTE: [interpreted programs update state in
  place]); else in a round of its own, ``InputAgreement.start_status``, issued right
  after the program's last collective (``StatusIssue``) and waited for before its
  first write (the ``StateWrites`` call; at the program's end for one that writes
  nothing in place). When a status says a rank failed, every rank gathers the failures
  (an all-gather of one line each, on this path only) and raises the same error,
  naming each failing rank, where its program failed and how, before anything is
  written: every rank's model and optimizer hold the state of the last completed step,
  the ranks stay in step, and the next call runs on every rank.

Cost on the normal path, per call (``python -m benchmarks.status_cost``: an MLP 16x32
ddp step, 2 gloo ranks, AdamW, three compiled steps' calls interleaved, 400 each, on a
machine loaded ~9 on 2 cores; two runs): 3.87-3.91 ms with no status, 3.96-4.01 riding
on the bucket (median paired difference 0.07-0.14 ms), 4.35-4.40 with a round of its
own (0.50-0.55 ms; the round alone, ranks in step, 0.2-0.4 ms).

Not covered: a program lowered by Inductor (its kernels run no fx code, so no node is
found: its failure is told as before, NOTE: [fault attribution]; it sends no status);
a failure after this rank sent its status (between the last collective's issue and the
state writes, or in the update: under data parallelism every rank computes the same
there, so such failures are every rank's; the error then says the ranks may no longer
hold the same state); a rank that dies (NOTE: [fault attribution] names it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.fx

from .. import _torch_private as private
from .._torch_private import pytree
from ..ir.collectives import is_collective, is_wait
from ..state_donation import STATUS, STATUS_RIDER

_WAIT = private.functional_collective_ops().wait_tensor.default


def drain_collectives(
    gm: torch.fx.GraphModule,
    after: torch.fx.Node | None,
    computed: dict[str, Any],
    issue: Callable[[str], None],
    ride: Callable[[str], None],
    failure: str,
) -> None:
    """Issue the collectives of ``gm`` that follow ``after`` (all of them when None), in
    the graph's order, on zeros of their inputs' shapes and dtypes, waiting each at once;
    send this rank's ``failure`` where the program sends its status: ``issue`` it at a
    ``StatusIssue`` call, ``ride`` it on the last all-reduce, whose ``StatusRider``
    element is 1 here. ``computed``: the failed frame's locals, which hold
    the collectives it issued before it failed and had not waited for yet (waited
    here)."""
    env: dict[torch.fx.Node, Any] = {}

    def value(node: torch.fx.Node) -> Any:
        """The node's value: zeros for a tensor (or a list of them), evaluated for a
        value the program computes from no tensor (a process group looked up on the
        mesh), the attribute for a ``get_attr``."""
        if node in env:
            return env[node]
        val = node.meta.get("val")
        if node.op == "get_attr":
            out = _attribute(gm, str(node.target))
        elif isinstance(val, torch.Tensor) or (
            isinstance(val, (list, tuple)) and val and all(isinstance(v, torch.Tensor) for v in val)
        ):
            out = pytree.tree_map(_zeros_like, val)
        elif node.op == "call_function":
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
            out = node.target(*args, **kwargs)  # type: ignore[operator]
        else:
            raise ValueError(f"cannot make a stand-in for {node.op} {node.name}")
        env[node] = out
        return out

    started = after is None
    for node in gm.graph.nodes:
        if not started:
            started = node is after
            continue
        if node.op == "call_module" and node.target == STATUS:
            issue(failure)
        elif node.op == "call_module" and node.target == STATUS_RIDER:
            rider = gm.get_submodule(STATUS_RIDER)
            ride(failure)
            env[node] = rider().fill_(1)
        elif node.op != "call_function":
            continue
        elif is_collective(node):
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
            issued = node.target(*args, **kwargs)  # type: ignore[operator]
            for t in pytree.tree_leaves(issued):
                if isinstance(t, torch.Tensor):
                    _WAIT(t)
            env[node] = issued
        elif is_wait(node):
            issuer = node.args[0]
            if isinstance(issuer, torch.fx.Node) and issuer not in env:
                pending = computed.get(issuer.name)  # issued before the failure
                for t in pytree.tree_leaves(pending):
                    if isinstance(t, torch.Tensor):
                        _WAIT(t)


def _attribute(gm: torch.nn.Module, target: str) -> Any:
    out: Any = gm
    for part in target.split("."):
        out = getattr(out, part)
    return out


def _zeros_like(val: Any) -> Any:
    if not isinstance(val, torch.Tensor):
        return val
    device = val.device if val.device.type != "meta" else torch.device("cpu")
    return torch.zeros(tuple(val.shape), dtype=val.dtype, device=device)


def failed_everywhere(
    failed: list[tuple[int, str]], rank: int, state: str,
) -> str:
    """The error every rank raises when ``failed`` ranks' programs failed (each rank and
    its failure); ``state``: what this rank's state holds (``_state_after_failure``)."""
    ranks = ", ".join(str(r) for r, _ in failed)
    plural = "s" if len(failed) > 1 else ""
    if len(failed) == 1:
        what = f"The compiled step failed on rank {failed[0][0]}: its program raised {failed[0][1]}."
    else:
        what = f"The compiled step failed on ranks {ranks}:\n" + "\n".join(
            f"    rank {r}: {text}" for r, text in failed
        )
    if any(r == rank for r, _ in failed):
        mine = (
            " It failed on this rank's data (its share of the batch)"
            + (", not on every rank's" if len(failed) < dist.get_world_size() else "")
            + "; this rank went on through its program's collectives with stand-in values, "
            "and the ranks exchanged their status before any update,"
        )
    else:
        mine = (
            f" This rank (rank {rank}) ran its program on rank{plural} {ranks}'s stand-in "
            "values and threw its results away: the ranks exchanged their status before any "
            "update,"
        )
    return (
        f"{what}{mine} so this call failed on every rank alike (NOTE: [a rank whose program "
        f"fails alone]). {state} The ranks stay in step: the next call runs on every rank "
        "(skip or fix the offending batch)."
    )
