"""bucket_collectives: merge small collectives of one kind into few large ones.

NOTE: [bucket layout]
Members of a bucket share the op, the group (NOTE: [collective groups] in
``collective_graph.py``), the dtype, the reduce op and the group size G. Each member's
input is flattened into one buffer and one collective runs on it; the result is split
and reshaped back to each member's result shape. The buffer is laid out so that the
one collective computes exactly the members' results:

- all_reduce: ``cat(flat x_i)``; element-wise, so any layout works.
- all_gather (dim-0 shards): ``cat(flat x_i)`` is each rank's segment; the gathered
  ``(G * N,)`` buffer viewed as ``(G, N)`` holds rank r's segment in row r, so member i
  is columns ``[off_i, off_i + n_i)``, which reshaped to ``(G * rows_i, ...)`` is the
  rank-ordered concatenation that ``all_gather_into_tensor`` returns.
- reduce_scatter (dim-0 shards): rank-major, ``cat(x_i.reshape(G, m_i), dim=1)``
  flattened: row r of the ``(G, M)`` buffer holds every member's r-th chunk, so rank r's
  reduced ``(M,)`` segment splits into each member's r-th reduced chunk.

All reductions of a bucket add the same values in the same rank order as the members
did, so results are bit-identical.

NOTE: [bucket placement]
A bucket must be issued after its last input is computed and be waited before any
member's result is first used, so members are grouped only while ``last input <
first use`` holds (gradients reduced in the optimizer always qualify; the loss's total
weight, needed at the start of backward, never joins them), and never across a side
effect (NOTE: [side effects in scheduling]). Reductions are grouped in the order their
inputs become ready and issued right after the last one (DDP's bucket order). Gathers
are grouped in the order their results are first used and issued where the earliest of
them was (or after their inputs, if later): their inputs (parameter shards) are ready at
the start of the program, and issuing every gather there would hold the whole gathered
model at once; how much earlier to issue them is ``schedule_overlap``'s decision, made
under its in-flight byte cap. The bucket's wait directly follows the collective; the
split sits before the first use of any member and each member's slice before its own
first use, so ``schedule_overlap`` can sink the wait.

NOTE: [bucket results stay contiguous]
A collective's result is contiguous, and kernels may rely on it: eager's
``_weight_norm_interface_backward`` refuses a non-contiguous ``v`` ("saved_v must be
contiguous"). A gathered member's columns of the ``(G, N)`` buffer are strided by ``N``;
reshaping them copies, except where the member's shape splits as ``(G, n_i)`` (a rank's
shard is one row: ``Linear(16, 4)``'s weight or bias at G = 4), where the
reshape is a view with the buffer's row stride. There (decided on the fake values, so
once per compile) the part is copied to contiguous memory before the reshape: the same
one copy every other member gets from its reshape. Reduced members' parts are
contiguous slices of a 1-D buffer and stay views.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.fx

from spmd_compiler.ir.collectives import check_byte_count, check_kinds
from spmd_compiler.ir.node_meta import (
    CREATED_BY,
    MODULE_FQN,
    bucket_members,
    is_deferred,
    set_bucket_members,
    set_deferred,
)

from . import remove_duplicate_collectives as _ordered_after  # noqa: F401  (registers it)
from .collective_graph import (
    WAIT,
    CollectiveCall,
    erase_if_unused,
    first_use,
    getitem,
    hoist_free,
    is_barrier,
    is_free,
    new_node,
    non_free_inputs,
    options_for,
    parse_collective,
    payload_bytes,
    positions,
    value_key,
    wait_of,
)
from .manager import PassContext, register_pass

_aten = torch.ops.aten


_BUCKETED_KINDS = frozenset({"all_reduce", "all_gather", "reduce_scatter"})


@dataclass(frozen=True)
class BucketOptions:
    """Options of ``bucket_collectives``.

    Args:
        cap_bytes: most payload bytes of one bucket (all_reduce: input; all_gather:
            gathered output; reduce_scatter: full input; the ``ir.collectives`` convention).
            A collective larger than the cap stays alone.
        kinds: which collectives to bucket (``all_reduce``, ``all_gather``,
            ``reduce_scatter``).
        first_bucket_bytes: reductions only: the first bucket (in ready order) closes
            once it holds this many bytes, as DDP's 1 MiB first bucket does, so the
            gradients backward computes first start reducing while it computes the rest
            (under the cap; None: every bucket fills up to the cap). On 2 gloo ranks the
            MLP with 8 MiB of gradients stepped in 25.6 ms with two buckets and 29.7 ms
            with one.
    """

    cap_bytes: int = 25 * 2**20
    first_bucket_bytes: int | None = 2**20
    kinds: frozenset[str] = frozenset({"all_reduce", "all_gather", "reduce_scatter"})

    def __post_init__(self) -> None:
        # NOTE: options checked when made: a misspelt kind bucketed nothing and a
        # negative cap was taken, both silently
        check_byte_count("BucketOptions", "cap_bytes", self.cap_bytes)
        check_byte_count("BucketOptions", "first_bucket_bytes", self.first_bucket_bytes, allow_none=True)
        check_kinds("BucketOptions", self.kinds, _BUCKETED_KINDS)


@dataclass
class _Member:
    collective: torch.fx.Node
    wait: torch.fx.Node
    call: CollectiveCall
    nbytes: int
    barrier: torch.fx.Node | None  # the last side effect before the collective
    ready: int  # position of the last input (or side effect) before the collective
    used: int  # position of the first use of the result


@register_pass(
    "bucket_collectives",
    "merge all_reduce / reduce_scatter / all_gather of one group and dtype under a byte cap",
    after=("remove_duplicate_collectives",),
    options=BucketOptions,
    changes_collectives=True,
)
def bucket_collectives(program, context: PassContext) -> bool:
    """Replace collectives of the same kind, group, dtype and reduce op by one per bucket.

    Why: every collective pays a fixed latency; DDP and FSDP reduce gradients and gather
    parameters in buckets of a few MiB. A no-op (returns False) when no two compatible
    collectives fit in a bucket (NOTE: [bucket placement]).

    Before::

        g1 = ...; g2 = ...                              # two gradients, backward
        a1 = all_reduce(g1, "sum", pg); w1 = wait_tensor(a1); p1 = sub(x1, w1)
        a2 = all_reduce(g2, "sum", pg); w2 = wait_tensor(a2); p2 = sub(x2, w2)

    After (NOTE: [bucket layout])::

        g1 = ...; g2 = ...
        buf = cat([reshape(g1, [n1]), reshape(g2, [n2])])
        a = all_reduce(buf, "sum", pg); w = wait_tensor(a)
        parts = split_with_sizes(w, [n1, n2])
        p1 = sub(x1, reshape(parts[0], shape1)); p2 = sub(x2, reshape(parts[1], shape2))

    Args:
        program: the per-rank program; its graph is changed in place.
        context: ``context.options`` is a ``BucketOptions``.

    Returns:
        Whether any bucket of two or more collectives was made.
    """
    options = options_for(context, "bucket_collectives", BucketOptions())
    graph = program.graph_module.graph
    changed = False
    while True:  # NOTE: [buckets in rounds]
        merged = False
        for kind, members in _candidates(graph, options, first_round=not changed).items():
            gathers = kind[0] == "all_gather"
            first = None if gathers else options.first_bucket_bytes
            for bucket in _plan(members, options.cap_bytes, gathers, first):
                if len(bucket) > 1:
                    merged |= _rewrite(graph, bucket)
        if not merged:
            return changed
        changed = True


# NOTE: [buckets in rounds]
# A collective's place in the bucket plan (its last input, its first use) is read off the
# graph before any bucket is made. Where one collective feeds another, the first one's
# bucket moves the second's inputs: under FSDP x TP each gradient is summed over tp
# (all_reduce) and its result reduce-scattered over dp, and the parameters gathered over
# dp are gathered again over tp. Planned on the graph before, each dp reduce-scatter's
# input was computed just before its own result was read, so none could share a bucket;
# once the tp all-reduces are one bucket, all their inputs are ready together. So the
# pass plans again after a round that made a bucket, until one makes none (each round
# removes at least one collective, so this ends). Later rounds plan only the
# collectives no round has merged: a bucket holds no record of its members' inputs, so
# the check that keeps a second gather of the same shards (FSDP's backward re-gather)
# out of the first one's bucket could not see it. Two more changes let those
# reduce-scatters share buckets: the optimizer is fused before this pass (one foreach op
# reads every result, not a per-parameter op right after each), and the expansion drops
# DTensor's second wait on each result (``_drop_repeated_waits`` in expand/retrace.py).
# The demo GPT under fsdp_tp 2x2, all three together: reduce_scatter 26 -> 6 per step
# for the same bytes (1 layer: 13 -> 4, and 7 with the rounds alone undone).


def _candidates(
    graph: torch.fx.Graph, options: BucketOptions, first_round: bool = True
) -> dict[tuple, list[_Member]]:
    """Bucketable collectives by (kind, dtype, reduce op, group size, group); after the
    first round only those no round merged (NOTE: [buckets in rounds])."""
    position = positions(graph)
    groups: dict[tuple, list[_Member]] = defaultdict(list)
    barrier = None
    for node in graph.nodes:
        if is_barrier(node):
            barrier = node
        call = parse_collective(node)
        wait = wait_of(node) if call is not None else None
        if call is None or wait is None or not wait.users or call.kind not in options.kinds:
            continue
        if not first_round and bucket_members(node):
            continue
        val = call.tensor.meta.get("val")
        if not isinstance(val, torch.Tensor) or not isinstance(wait.meta.get("val"), torch.Tensor):
            continue
        if call.kind == "reduce_scatter" and (val.dim() == 0 or val.shape[0] % call.ranks):
            continue
        inputs = [position[n] for n in non_free_inputs(node)]
        ready = max(inputs + [position[barrier] if barrier is not None else -1])
        used = position[first_use(wait, position)]
        key = (
            call.kind, val.dtype, call.reduce_op, call.group_size, value_key(call.group),
            is_deferred(node),  # never mix deferred and other reductions
        )
        groups[key].append(_Member(node, wait, call, payload_bytes(node), barrier, ready, used))
    return groups


def _plan(
    members: list[_Member], cap_bytes: int, by_first_use: bool, first_bytes: int | None = None
) -> list[list[_Member]]:
    """Greedy buckets in ready order (gathers: first-use order) under the cap, each
    issuable before any member is used (NOTE: [bucket placement]). A second collective of
    the same input (fully_shard's backward re-gather) starts a new bucket: moving the same
    data twice in one collective is never useful. The first bucket to hold
    ``first_bytes`` closes there (DDP's first bucket; a lone scalar closed earlier
    because it is needed before backward does not count)."""
    order = sorted(members, key=(lambda m: m.used) if by_first_use else (lambda m: m.ready))
    buckets: list[list[_Member]] = []
    current: list[_Member] = []
    first_open = first_bytes is not None  # until a bucket has reached first_bytes
    for m in order:
        if first_open and first_bytes is not None and sum(c.nbytes for c in current) >= first_bytes:
            buckets.append(current)
            current = []
            first_open = False
        if current:
            nbytes = sum(c.nbytes for c in current) + m.nbytes
            ready = max(m.ready, *(c.ready for c in current))
            used = min(m.used, *(c.used for c in current))
            repeated = any(c.call.tensor is m.call.tensor for c in current)
            if nbytes > cap_bytes or ready >= used or repeated:
                buckets.append(current)
                current = []
        current.append(m)
    if current:
        buckets.append(current)
    return buckets


def _rewrite(graph: torch.fx.Graph, bucket: list[_Member]) -> bool:
    """Replace the bucket's collectives by one; False (nothing changed) if an earlier
    bucket moved an input so that the bucket no longer fits before its first use."""
    for m in bucket:  # an earlier bucket may have replaced an input (a wait it erased)
        call = parse_collective(m.collective)
        assert call is not None, f"{m.collective.name} is no longer a collective"
        m.call = call
    position = positions(graph)
    ready = max(
        (n for m in bucket for n in [*non_free_inputs(m.collective), m.barrier] if n is not None),
        key=position.__getitem__,
    )
    uses = [first_use(m.wait, position) for m in bucket]
    earliest_use = min(uses, key=position.__getitem__)
    if position[ready] >= position[earliest_use]:
        return False
    anchor = ready.next
    while anchor.op == "placeholder" or is_free(anchor):  # the group must go before anchor
        anchor = anchor.next
    if bucket[0].call.kind == "all_gather":
        earliest = min((m.collective for m in bucket), key=position.__getitem__)
        anchor = max(anchor, earliest, key=position.__getitem__)
    call = bucket[0].call
    if isinstance(call.group, torch.fx.Node):
        hoist_free(call.group, anchor)
    with graph.inserting_before(anchor):
        wait = _issue(graph, bucket)
    with graph.inserting_before(earliest_use):
        parts = _split(graph, bucket, wait)
    for index, (m, use) in enumerate(zip(bucket, uses)):
        with graph.inserting_before(use):
            part = getitem(graph, parts, index)
            result = _member_result(graph, part, m.wait)
        result.meta.update({k: v for k, v in m.wait.meta.items() if k not in ("val", CREATED_BY)})
        m.wait.replace_all_uses_with(result)
        graph.erase_node(m.wait)
        graph.erase_node(m.collective)
        erase_if_unused([m.call.group])
    return True


def _issue(graph: torch.fx.Graph, bucket: list[_Member]) -> torch.fx.Node:
    """Pack the members' inputs (NOTE: [bucket layout]), one collective, its wait."""
    call = bucket[0].call
    if call.kind == "reduce_scatter":
        size = call.ranks
        rows = [
            new_node(graph, _aten.reshape.default, (m.call.tensor, [size, _numel(m) // size]))
            for m in bucket
        ]
        packed = new_node(graph, _aten.cat.default, (rows, 1))
        buffer = new_node(graph, _aten.reshape.default, (packed, [packed.meta["val"].numel()]))
        args: tuple = (buffer, call.reduce_op, size, call.group)
        out_numel = buffer.meta["val"].numel() // size
    else:
        flats = [
            new_node(graph, _aten.reshape.default, (m.call.tensor, [_numel(m)])) for m in bucket
        ]
        buffer = new_node(graph, _aten.cat.default, (flats,))
        if call.kind == "all_gather":
            args = (buffer, call.group_size, call.group)
            out_numel = buffer.meta["val"].numel() * call.group_size
        else:
            args = (buffer, call.reduce_op, call.group)
            out_numel = buffer.meta["val"].numel()
    target = bucket[0].collective.target
    collective = new_node(graph, target, args, buffer.meta["val"].new_empty([out_numel]))
    if is_deferred(bucket[0].collective):
        set_deferred(collective)
    set_bucket_members(collective, [(_member_label(m), m.nbytes) for m in bucket])
    return new_node(graph, WAIT, (collective,), collective.meta["val"])


def _split(graph: torch.fx.Graph, bucket: list[_Member], wait: torch.fx.Node) -> torch.fx.Node:
    """The members' pieces of the bucket's result (NOTE: [bucket layout])."""
    call = bucket[0].call
    numels = [_numel(m) for m in bucket]
    if call.kind == "all_gather":
        size = call.group_size
        rows = new_node(graph, _aten.reshape.default, (wait, [size, sum(numels)]))
        return new_node(graph, _aten.split_with_sizes.default, (rows, numels, 1))
    if call.kind == "reduce_scatter":
        numels = [n // call.ranks for n in numels]
    return new_node(graph, _aten.split_with_sizes.default, (wait, numels))


def _member_result(graph: torch.fx.Graph, part: torch.fx.Node, wait: torch.fx.Node) -> torch.fx.Node:
    """``part`` of the bucket's result reshaped to the shape of the member's result
    ``wait``, contiguous where that was (NOTE: [bucket results stay contiguous])."""
    shape = list(wait.meta["val"].shape)
    result = new_node(graph, _aten.reshape.default, (part, shape))
    if result.meta["val"].is_contiguous() or not wait.meta["val"].is_contiguous():
        return result
    graph.erase_node(result)
    copy = graph.call_function(
        _aten.clone.default, (part,), {"memory_format": torch.contiguous_format}
    )
    copy.meta["val"] = part.meta["val"].clone(memory_format=torch.contiguous_format)
    result = new_node(graph, _aten.reshape.default, (copy, shape))
    assert result.meta["val"].is_contiguous(), f"{wait.name}: a reshaped copy is not contiguous"
    return result


def _member_label(m: _Member) -> str:
    """What a member carries, for ``explain``: the placeholder it gathers (a parameter
    shard) or the placeholder its result meets first (a gradient reduced for the
    optimizer meets the parameter's state, or, a few ops on, the parameter), else its
    module FQN or node name."""
    source = m.call.tensor
    for _ in range(4):  # through a few casts / views of a parameter shard
        if source.op == "placeholder":
            return source.name
        inputs = non_free_inputs(source) or source.all_input_nodes
        if len(inputs) != 1:
            break
        source = inputs[0]
    met = _placeholder_met(m.wait)
    return met or m.collective.meta.get(MODULE_FQN) or m.collective.name


def _placeholder_met(value: torch.fx.Node, depth: int = 3) -> str | None:
    """The first placeholder read beside ``value``, else beside what its readers compute
    from it, up to ``depth`` ops on, nearest first. A gradient RMSprop or Adadelta reads
    meets no placeholder at its first ops (``addcmul(alpha * state, g, g)``, ``-lr * g``)
    but the parameter one op on: its reduction was labelled by the collective's node
    name (``reduce_scatter_tensor_3``) where other optimizers' named the parameter."""
    frontier = [value]
    for _ in range(depth):
        following: list[torch.fx.Node] = []
        for v in frontier:
            for user in v.users:
                for arg in _beside(user, v):
                    if isinstance(arg, torch.fx.Node) and arg.op == "placeholder":
                        return arg.name
                following.extend(_results_at(user, v))
        frontier = following
    return None


def _results_at(user: torch.fx.Node, value: torch.fx.Node) -> list[torch.fx.Node]:
    """What ``user`` computes from ``value``: for a foreach op the ``getitem`` of
    ``value``'s index, else ``user`` itself."""
    for values in (a for a in user.args if isinstance(a, (list, tuple))):
        if value in values:
            index = list(values).index(value)
            return [u for u in user.users if u.target is operator.getitem and u.args[1] == index]
    return [user] if user.op == "call_function" else []


def _beside(user: torch.fx.Node, value: torch.fx.Node) -> list:
    """The arguments ``user`` reads with ``value``: its inputs, or for a foreach op (the
    optimizer is fused before bucketing) the entries of its lists at ``value``'s index."""
    lists = [a for a in user.args if isinstance(a, (list, tuple))]
    for values in lists:
        if value in values:
            index = list(values).index(value)
            return [other[index] for other in lists if len(other) > index]
    return list(user.all_input_nodes)


def _numel(m: _Member) -> int:
    return m.call.tensor.meta["val"].numel()
