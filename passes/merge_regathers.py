"""merge_regathers: let backward read forward's gathered parameters where gathering them
again would lower no memory peak.

NOTE: [re-gathers that save nothing]
Under fully_shard's ``reshard_after_forward`` forward's gathered parameters are freed
after their last forward use and backward gathers them again: one more all-gather of
those bytes, bought to hold less memory between the two uses. That buys something only
if the program's peak falls in that gap. It often does not:

- the parameters forward reads last and backward first (the last layer before the loss,
  an output embedding tied to the input one) have almost no gap;
- in a program whose peak lies in backward (gradients and a re-gathered bucket beside the
  activations), keeping forward's copies instead holds no more at the peak: the
  benchmark MLP's one re-gather bucket is such a case.

Where the gap does hold the peak the re-gather stays: the demo GPT's activations are
largest around the loss, and keeping forward's copies would raise gpt-2x64's estimated
peak by 4.8%.

This pass takes each gather (a bucket, or a lone one) whose every member re-gathers a value
an earlier gather already made (the same shard, or the same cast of it, in the same
group) and estimates (NOTE: [live bytes estimate] in ``live_bytes.py``) the program's peak
if its members' uses read the earlier results instead: the earlier storages live on to
the last of those uses, the gather's own buffers go. If that peak is no higher than the
program's, the gather is removed; otherwise it stays, as the mode asked. A bucket is merged
whole or not at all. It runs after bucketing (the buckets decide where memory peaks) and
before ``schedule_overlap`` (which then prefetches only the gathers that remain).

It never changes a value: a merged member reads a result computed from the same shard
node, and a shard written in place between the two gathers (none is, before the optimizer's
final copy) stops the merge.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable
from dataclasses import dataclass

import torch
import torch.fx

from spmd_compiler.ir.node_meta import bucket_members

from . import bucket_collectives as _ordered_after  # noqa: F401  (registers it)
from .collective_graph import ALL_GATHER, erase_if_unused, parse_collective, value_key, wait_of
from .live_bytes import LiveBytes, live_bytes
from .manager import PassContext, register_pass

_aten = torch.ops.aten

# ops through which a member's source still names the same values: a parameter shard, its
# low-precision cast, a view of it
_SAME_VALUES = frozenset(
    {
        _aten._to_copy.default,
        _aten.view.default,
        _aten.reshape.default,
        _aten.alias.default,
        torch.ops.prims.convert_element_type.default,
    }
)


@dataclass
class _Gather:
    """One all-gather collective and, per member, the value it gathers (``source``) and
    the node its readers read (``result``); ``nodes`` are those that go with it."""

    collective: torch.fx.Node
    sources: list[torch.fx.Node]
    results: list[torch.fx.Node]
    nodes: list[torch.fx.Node]
    group: Hashable


@register_pass(
    "merge_regathers",
    "reuse forward's gathered parameters in backward where re-gathering lowers no peak",
    after=("bucket_collectives",),
    before=("schedule_overlap",),
    changes_collectives=True,
)
def merge_regathers(program, context: PassContext) -> bool:
    """Remove re-gathers whose freed gap holds no memory peak (NOTE: [re-gathers that save
    nothing]).

    Why: fully_shard gathers in backward what forward gathered and freed; where freeing it
    saves no memory at the program's peak, that second all-gather is pure cost (on 2 gloo
    ranks it was half the MLP's fully_shard step). A no-op (returns False) when every
    re-gather lowers the estimated peak, or there is none.

    Before::

        w = wait_tensor(all_gather(shard)); h = mm(x, w)        # forward
        ...
        w2 = wait_tensor(all_gather(shard)); g = mm(dy, w2)     # backward re-gather

    After (the gap between ``h`` and ``g`` is not where the program peaks)::

        w = wait_tensor(all_gather(shard)); h = mm(x, w)
        ...
        g = mm(dy, w)

    Args:
        program: the per-rank program; its graph is changed in place.
        context: the pass context (unused).

    Returns:
        Whether any gather was removed.
    """
    graph = program.graph_module.graph
    if not any(node.target is ALL_GATHER for node in graph.nodes):
        return False  # nothing to merge (ddp): no estimate to make
    memory = live_bytes(graph)
    made: dict[Hashable, torch.fx.Node] = {}  # (source key, group) -> latest result
    changed = False
    for node in list(graph.nodes):
        gather = _parse_gather(node)
        if gather is None:
            continue
        keys = [(_source_key(s), gather.group) for s in gather.sources]
        earlier = [made.get(k) for k in keys]
        if all(e is not None for e in earlier) and _unwritten(gather, memory):
            kept = [e for e in earlier if e is not None]
            if (
                _same_values(gather.results, kept) and _defined_before_readers(gather, kept, memory)
                and _peak_if_merged(memory, gather, kept) <= memory.peak
            ):
                _merge(gather, kept)
                memory = live_bytes(graph)
                changed = True
                continue
        made.update(zip(keys, gather.results))
    return changed


def _parse_gather(node: torch.fx.Node) -> _Gather | None:
    """``node`` as a lone all-gather or a bucket of ``bucket_collectives``'s layout (NOTE:
    [bucket layout]); None for anything else, or a layout this pass does not know."""
    call = parse_collective(node)
    if call is None or node.target is not ALL_GATHER:
        return None
    wait = wait_of(node)
    if wait is None:
        return None
    group = (call.group_size, value_key(call.group))
    if not bucket_members(node):
        return _Gather(node, [call.tensor], [wait], [wait, node], group)
    packed = call.tensor  # cat([reshape(source_i, [n_i]), ...])
    if packed.target is not _aten.cat.default or len(packed.users) != 1:
        return None
    flats = _nodes(packed.args[0])
    if flats is None or not all(f.target is _aten.reshape.default and len(f.users) == 1 for f in flats):
        return None
    if len(wait.users) != 1:
        return None
    [rows] = list(wait.users)
    if rows.target is not _aten.reshape.default or len(rows.users) != 1:
        return None
    [split] = list(rows.users)
    if split.target is not _aten.split_with_sizes.default:
        return None
    results: list[torch.fx.Node | None] = [None] * len(flats)
    parts, copies = [], []
    for part in split.users:
        index = part.args[1] if part.target is operator.getitem else None
        if not isinstance(index, int) or len(part.users) != 1 or results[index] is not None:
            return None
        [result] = list(part.users)
        if result.target is _aten.clone.default and len(result.users) == 1:
            copies.append(result)  # NOTE: [bucket results stay contiguous]
            [result] = list(result.users)
        if result.target is not _aten.reshape.default:
            return None
        results[index] = result
        parts.append(part)
    if any(r is None for r in results):
        return None
    done = [r for r in results if r is not None]
    nodes = [*done, *copies, *parts, split, rows, wait, node, packed, *flats]
    sources = _nodes([f.args[0] for f in flats])
    return None if sources is None else _Gather(node, sources, done, nodes, group)


def _nodes(value: object) -> list[torch.fx.Node] | None:
    """``value`` as a list of nodes, None if it is not a list or tuple of nodes only."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, torch.fx.Node) for v in value):
        return None
    return list(value)


def _same_values(results: list[torch.fx.Node], kept: list[torch.fx.Node]) -> bool:
    """Every earlier result has the shape and dtype of the one it would replace."""
    for result, earlier in zip(results, kept):
        new, old = result.meta.get("val"), earlier.meta.get("val")
        if not isinstance(new, torch.Tensor) or not isinstance(old, torch.Tensor):
            return False
        if new.shape != old.shape or new.dtype != old.dtype:
            return False
    return True


def _defined_before_readers(gather: _Gather, kept: list[torch.fx.Node], memory: LiveBytes) -> bool:
    """Every earlier result comes before each reader of the result it would replace. An
    earlier bucket is issued first but unpacked where its members are first read, which
    can be after this gather's readers; pointing them there read a value before it was
    defined (fsdp_tp 2x2 with SGD's momentum: two buckets of the same shards gathered
    around the update, the pass failing its graph check)."""
    for result, earlier in zip(gather.results, kept):
        defined = memory.position[earlier]
        if any(memory.position[user] <= defined for user in result.users):
            return False
    return True


def _source_key(source: torch.fx.Node) -> Hashable:
    """Equal for two nodes that compute the same values from the same graph input."""
    if source.op == "call_function" and source.target in _SAME_VALUES:
        inner = source.args[0]
        if isinstance(inner, torch.fx.Node):
            rest = value_key(tuple(source.args[1:])), value_key(dict(source.kwargs))
            return (source.target, _source_key(inner), rest)
    return source


def _unwritten(gather: _Gather, memory: LiveBytes) -> bool:
    """No node on a member's source chain (the source, the casts and views under it, the
    shard) is written in place before the gather."""
    at = memory.position[gather.collective]
    for node in (n for s in gather.sources for n in _chain(s)):
        for user in node.users:
            schema = getattr(user.target, "_schema", None)
            if schema is not None and schema.is_mutable and memory.position[user] < at:
                return False
    return True


def _chain(source: torch.fx.Node) -> list[torch.fx.Node]:
    """``source`` and the nodes under it through ``_SAME_VALUES`` ops."""
    chain = [source]
    while chain[-1].op == "call_function" and chain[-1].target in _SAME_VALUES:
        inner = chain[-1].args[0]
        if not isinstance(inner, torch.fx.Node):
            break
        chain.append(inner)
    return chain


def _peak_if_merged(memory: LiveBytes, gather: _Gather, kept: list[torch.fx.Node]) -> int:
    """The estimated peak if the members' readers read ``kept`` and the gather's nodes go."""
    delta = [0] * (len(memory.profile) + 1)
    extended: dict = {}
    for result, earlier in zip(gather.results, kept):
        storage, replaced = memory.storage_of(earlier), memory.storage_of(result)
        if storage is None or replaced is None:
            continue
        last = memory.storages[replaced][2]
        extended[storage] = max(extended.get(storage, last), last)
    for storage, last in extended.items():
        nbytes, _, old_last = memory.storages[storage]
        if last > old_last:
            delta[old_last + 1] += nbytes
            delta[last + 1] -= nbytes
    gone = {memory.storage_of(n) for n in gather.nodes} - {None}
    for storage in gone:
        if storage is not None and storage[0] in gather.nodes:
            nbytes, first, last = memory.storages[storage]
            delta[first] -= nbytes
            delta[last + 1] += nbytes
    peak, running = 0, 0
    for base, change in zip(memory.profile, delta):
        running += change
        peak = max(peak, base + running)
    return peak


def _merge(gather: _Gather, kept: list[torch.fx.Node]) -> None:
    """Point the members' readers at ``kept`` and erase the gather's nodes."""
    graph = gather.collective.graph
    for result, earlier in zip(gather.results, kept):
        result.replace_all_uses_with(earlier)
    group = gather.collective.args[-1]
    for node in gather.nodes:  # readers first: each is unused once those before it went
        graph.erase_node(node)
    erase_if_unused([group])
