"""fuse_optimizer_updates: turn per-parameter optimizer ops into ``_foreach`` ops.

NOTE: [foreach fusion]
A single-tensor optimizer (``foreach=False``, or any optimizer traced one parameter at
a time) leaves one chain of element-wise ops per parameter. Ops of the optimizer phase
(``node.meta[PHASE] == "optimizer"``) that have the same target, the same non-tensor
arguments, tensor arguments of the same dtype, device and rank-0-ness position by
position, and that do not depend on each other, become one ``aten._foreach_*`` call plus
one ``getitem`` per member. Only the ops in ``_RULES`` are fused: each maps to a foreach
overload whose CPU kernel applies the same ATen op to every list element, so results are
bit-identical (``tests/unit/test_fuse_optimizer_updates.py`` checks every rule); a fused
node whose fake results differ in dtype or shape from the members' is not kept.

Placement: the fused node goes where the group's first member was, or right after the
group's last-defined input where that comes later. Not at the last input alone: a weight
decay (``param * (1 - lr * wd)``) reads only graph inputs and would run at the top of the
program, its results held through forward and backward (interpreted MLP-512 ddp, one gloo
rank: step peak 24 -> 16 MiB once placed at its members). Ops that use a member and sit
before that point (the rest of that parameter's chain, which is
interleaved parameter by parameter) are moved, in their order, to just after the
``getitem``s. Moving a pure op later is always safe for its inputs; it is done only when
every moved node is a pure ``call_function`` (no collective, wait or side effect) and no
side effect lies between the first moved node and the insertion point (NOTE: [side
effects in scheduling]). A group that fails this is skipped; members that depend on an
earlier member of the group are left for a later group. Groups are fused in graph order
of their first member, so each chain level is gathered before the next one is tried.
"""

from __future__ import annotations

import operator
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from spmd_compiler.ir.graph_utils import CARRIED_META
from spmd_compiler.ir.node_meta import CREATED_BY, Phase, phase

from . import remove_dead_nodes as _ordered_after  # noqa: F401  (registers it)
from .checks import is_collective, is_wait
from .collective_graph import deferred_part, is_barrier, positions, value_key
from .manager import PassContext, register_pass

_aten = torch.ops.aten

# "T": one tensor per member, passed as a list; "S": a non-tensor shared by the group.
_Pattern = tuple[str, ...]


@dataclass(frozen=True)
class _Rule:
    pattern: _Pattern
    target: Any  # the foreach overload
    kwargs: frozenset[str] = frozenset()  # keyword arguments passed on unchanged


def _binary(op: Any, tensor_kwargs: frozenset[str] = frozenset()) -> list[_Rule]:
    return [_Rule(("T", "T"), op.List, tensor_kwargs), _Rule(("T", "S"), op.Scalar)]


_UNARY = ("sqrt", "neg", "reciprocal", "exp", "abs", "sign")
_RULES: dict[Any, list[_Rule]] = {
    **{
        getattr(_aten, name).default: [_Rule(("T",), getattr(_aten, f"_foreach_{name}").default)]
        for name in _UNARY
    },
    _aten.mul.Tensor: _binary(_aten._foreach_mul),
    _aten.div.Tensor: _binary(_aten._foreach_div),
    # add/sub with a scalar ``other`` and an alpha are not fused (``_foreach_add.Scalar``
    # has no alpha); with a tensor ``other`` the List overload takes alpha as given.
    _aten.add.Tensor: _binary(_aten._foreach_add, frozenset({"alpha"})),
    _aten.sub.Tensor: _binary(_aten._foreach_sub, frozenset({"alpha"})),
    _aten.maximum.default: [_Rule(("T", "T"), _aten._foreach_maximum.List)],
    _aten.minimum.default: [_Rule(("T", "T"), _aten._foreach_minimum.List)],
    _aten.clamp_min.default: [_Rule(("T", "S"), _aten._foreach_clamp_min.Scalar)],
    _aten.clamp_max.default: [_Rule(("T", "S"), _aten._foreach_clamp_max.Scalar)],
    _aten.lerp.Scalar: [_Rule(("T", "T", "S"), _aten._foreach_lerp.Scalar)],
    _aten.lerp.Tensor: [_Rule(("T", "T", "T"), _aten._foreach_lerp.List)],
    _aten.addcmul.default: [
        _Rule(("T", "T", "T"), _aten._foreach_addcmul.Scalar, frozenset({"value"}))
    ],
    _aten.addcdiv.default: [
        _Rule(("T", "T", "T"), _aten._foreach_addcdiv.Scalar, frozenset({"value"}))
    ],
    _aten.pow.Scalar: [_Rule(("S", "T"), _aten._foreach_pow.ScalarAndTensor)],
    _aten.pow.Tensor_Scalar: [_Rule(("T", "S"), _aten._foreach_pow.Scalar)],
    _aten.pow.Tensor_Tensor: [_Rule(("T", "T"), _aten._foreach_pow.List)],
}


@register_pass(
    "fuse_optimizer_updates",
    "fuse per-parameter element-wise optimizer ops into aten._foreach_* calls",
    after=("remove_dead_nodes",),
    before=("bucket_collectives",),
)
def fuse_optimizer_updates(program, context: PassContext) -> bool:
    """Replace same-kind, independent optimizer ops of many parameters by one foreach op.

    Why: a single-tensor optimizer runs ~10 small kernels per parameter; one foreach call
    per op kind launches once for all parameters (NOTE: [foreach fusion]). A no-op
    (returns False) when no two optimizer-phase ops can be fused, e.g. in a program
    without an optimizer section.

    Before::

        m1 = lerp(exp_avg1, g1, 0.1); v1 = mul(exp_avg_sq1, 0.999); ...   # parameter 1
        m2 = lerp(exp_avg2, g2, 0.1); v2 = mul(exp_avg_sq2, 0.999); ...   # parameter 2

    After::

        ms = _foreach_lerp.Scalar([exp_avg1, exp_avg2], [g1, g2], 0.1)
        m1 = getitem(ms, 0); m2 = getitem(ms, 1)
        vs = _foreach_mul.Scalar([exp_avg_sq1, exp_avg_sq2], 0.999)
        v1 = getitem(vs, 0); v2 = getitem(vs, 1); ...

    Args:
        program: the per-rank program; its graph is changed in place.
        context: unused.

    Returns:
        Whether any group of two or more ops was fused.
    """
    graph = program.graph_module.graph
    groups = _candidates(graph)
    changed = False
    position = positions(graph)
    pending = sorted(groups.items(), key=lambda item: min(position[m] for m in item[1]))
    barriers: dict[torch.fx.Node, bool] = {}  # is_barrier per node: fusing moves pure ops only
    for (_, _, rule), members in pending:
        while len(members) > 1:
            independent, members = _split_independent(graph, members)
            if len(independent) > 1:
                changed |= _fuse(graph, rule, independent, barriers)
    return changed


def _candidates(graph: torch.fx.Graph) -> dict[tuple, list[torch.fx.Node]]:
    """Fusable optimizer-phase nodes by (fusion key, rule), in graph order."""
    groups: dict[tuple, list[torch.fx.Node]] = defaultdict(list)
    deferred = set(deferred_part(graph))  # fused only among themselves
    for node in graph.nodes:
        if node.op != "call_function" or phase(node) is not Phase.OPTIMIZER:
            continue
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for rule in _RULES.get(node.target, ()):
            key = _fusion_key(node, rule)
            if key is not None:
                groups[(key, node in deferred, rule)].append(node)
                break
    return groups


def _fusion_key(node: torch.fx.Node, rule: _Rule) -> tuple | None:
    """What members of one group share, or None if ``node`` does not fit ``rule``."""
    if len(node.args) != len(rule.pattern) or not set(node.kwargs) <= rule.kwargs:
        return None
    key: list[Any] = [node.target]
    for kind, arg in zip(rule.pattern, node.args, strict=True):
        if kind == "T":
            val = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
            if not isinstance(val, torch.Tensor):
                return None
            key.append((val.dtype, val.device, val.dim() == 0))
        elif isinstance(arg, torch.fx.Node) or not isinstance(arg, (int, float, bool)):
            return None
        else:
            key.append((type(arg), arg))
    for name, value in sorted(node.kwargs.items()):
        if isinstance(value, torch.fx.Node):
            return None
        key.append((name, type(value), value_key(value)))
    return tuple(key)


def _descendants(
    nodes: Iterable[torch.fx.Node], limit: int, position: dict[torch.fx.Node, int]
) -> set[torch.fx.Node]:
    """Nodes at or before position ``limit`` that use any of ``nodes``, transitively."""
    found: set[torch.fx.Node] = set()
    stack = list(nodes)
    while stack:
        for user in stack.pop().users:
            if user not in found and position[user] <= limit:
                found.add(user)
                stack.append(user)
    return found


def _split_independent(
    graph: torch.fx.Graph, members: list[torch.fx.Node]
) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(members none of which uses another, in graph order; the rest)."""
    position = positions(graph)
    members = sorted(members, key=position.__getitem__)
    limit = position[members[-1]]
    chosen: list[torch.fx.Node] = []
    rest: list[torch.fx.Node] = []
    below: set[torch.fx.Node] = set()
    for m in members:
        if m in below:
            rest.append(m)
        else:
            chosen.append(m)
            below |= _descendants([m], limit, position)
    return chosen, rest


def _movable(node: torch.fx.Node) -> bool:
    if node.op != "call_function" or is_collective(node) or is_wait(node) or node.is_impure():
        return False
    schema = getattr(node.target, "_schema", None)
    return not (schema is not None and schema.is_mutable)


def _fuse(
    graph: torch.fx.Graph, rule: _Rule, members: list[torch.fx.Node],
    barriers: dict[torch.fx.Node, bool],
) -> bool:
    """Replace ``members`` by one foreach node; False (graph untouched) if the group
    cannot be placed or the foreach op's results do not match (NOTE: [foreach fusion]).
    ``barriers`` remembers ``is_barrier`` per node across the pass's groups."""
    position = positions(graph)
    first = min(members, key=position.__getitem__)
    # where the first member was, or after the last input if that comes later: not
    # earlier, where the results would be held for longer (NOTE: [foreach fusion])
    ready = max(
        (first.prev, *(i for m in members for i in m.all_input_nodes)), key=position.__getitem__
    )
    moved = sorted(_descendants(members, position[ready], position), key=position.__getitem__)
    if not all(_movable(n) for n in moved):
        return False
    if _crosses_side_effect([*members, *moved, ready], position, barriers):
        return False
    args = _fused_args(rule, members)
    kwargs = dict(members[0].kwargs)
    vals = _fake_results(rule, members, args, kwargs)
    if vals is None:
        return False
    with graph.inserting_after(ready):
        fused = graph.call_function(rule.target, args, kwargs)
    fused.meta.update({k: members[0].meta[k] for k in CARRIED_META if k in members[0].meta})
    fused.meta["val"] = vals
    anchor = fused
    replaced: dict[torch.fx.Node, torch.fx.Node] = {}
    for index, member in enumerate(members):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (fused, index))
        anchor.meta.update({k: v for k, v in member.meta.items() if k != CREATED_BY})
        anchor.meta["val"] = vals[index]
        replaced[member] = anchor
    _replace_uses(replaced)
    for node in moved:
        anchor.append(node)
        anchor = node
    for member in members:
        graph.erase_node(member)
    return True


def _replace_uses(replaced: dict[torch.fx.Node, torch.fx.Node]) -> None:
    """Point every reader of a member at its ``getitem``, rewriting each reader once.

    NOTE: [one rewrite per reader]
    The output returns every updated parameter and state tensor, and a foreach node fused
    earlier may read a whole group; fx rewrites a reader's whole argument list for each
    input replaced in it, so replacing member by member cost group size x that list per
    group, quadratic in the parameter count (1.3 of the pass's 5.7 s with 304 parameters,
    most of its growth)."""
    readers = {user: None for member in replaced for user in member.users}
    for reader in readers:
        reader.args = torch.fx.node.map_arg(reader.args, lambda n: replaced.get(n, n))
        reader.kwargs = torch.fx.node.map_arg(reader.kwargs, lambda n: replaced.get(n, n))


def _crosses_side_effect(
    span: list[torch.fx.Node], position: dict[torch.fx.Node, int],
    barriers: dict[torch.fx.Node, bool],
) -> bool:
    """Whether a side effect outside ``span`` lies between its first and last node: the
    members move to the insertion point and the moved nodes after it."""
    inside = set(span)
    node = max(span, key=position.__getitem__)
    start = min(position[n] for n in span)
    while position[node] > start:
        barrier = barriers.get(node)
        if barrier is None:
            barrier = barriers[node] = is_barrier(node)
        if barrier and node not in inside:
            return True
        node = node.prev
    return False


def _layout(val: Any) -> tuple | None:
    """What a fake result's metadata is, or None where a size is symbolic."""
    if not isinstance(val, torch.Tensor):
        return None
    sizes = (*val.shape, *val.stride(), val.storage_offset())
    if not all(isinstance(n, int) for n in sizes):
        return None
    return (tuple(val.shape), val.stride(), val.storage_offset(), val.dtype, val.device)


def _fake_results(
    rule: _Rule, members: list[torch.fx.Node], args: tuple, kwargs: dict[str, Any]
) -> list[torch.Tensor] | None:
    """The fused node's fake results, or None if the foreach op rejects the group or its
    results differ from the members' (NOTE: [foreach fusion]).

    A foreach op's meta kernel computes each list position from that position's tensors
    alone, so the op runs on one member per distinct layout of its tensor arguments (an
    optimizer's parameters share a few shapes: 18 groups of ~200 members each took over half
    of this pass on a 16-layer GPT). Where every member's own value has the layout its
    representative's result has, the members' values are the fused node's results;
    otherwise the op runs on the whole group, as it did before."""
    tensor_positions = [i for i, kind in enumerate(rule.pattern) if kind == "T"]
    layouts = [
        tuple(_layout(m.args[i].meta.get("val")) for i in tensor_positions)  # type: ignore[union-attr]
        for m in members
    ]
    own = [_layout(m.meta.get("val")) for m in members]
    if all(None not in key for key in layouts) and None not in own:
        first: dict[tuple, int] = {}
        for index, key in enumerate(layouts):
            first.setdefault(key, index)
        picked = list(first.values())
        reduced = tuple(
            [arg[j] for j in picked] if kind == "T" else arg
            for arg, kind in zip(args, rule.pattern, strict=True)
        )
        sampled = _run_fake(rule, reduced, kwargs, [members[j] for j in picked])
        if sampled is None:
            return None
        result = {key: _layout(v) for key, v in zip(first, sampled, strict=True)}
        if all(result[key] == mine for key, mine in zip(layouts, own, strict=True)):
            return [m.meta["val"] for m in members]
    return _run_fake(rule, args, kwargs, members)


def _run_fake(
    rule: _Rule, args: tuple, kwargs: dict[str, Any], members: list[torch.fx.Node]
) -> list[torch.Tensor] | None:
    fake = torch.fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    try:
        vals = rule.target(*fake[0], **fake[1])
    except Exception:  # noqa: BLE001 - an op the foreach kernel rejects is just not fused
        return None
    return list(vals) if _same_results(vals, members) else None


def _fused_args(rule: _Rule, members: list[torch.fx.Node]) -> tuple:
    return tuple(
        [m.args[i] for m in members] if kind == "T" else members[0].args[i]
        for i, kind in enumerate(rule.pattern)
    )


def _same_results(vals: Any, members: list[torch.fx.Node]) -> bool:
    if not isinstance(vals, (list, tuple)) or len(vals) != len(members):
        return False
    return all(
        isinstance(v, torch.Tensor)
        and v.dtype == m.meta["val"].dtype
        and v.shape == m.meta["val"].shape
        for v, m in zip(vals, members, strict=True)
    )
