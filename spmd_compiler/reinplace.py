"""Interpreted programs compute their temporaries in place where nothing reads them again.

NOTE: [interpreted programs reuse their temporaries]
The per-rank program is functional: every op writes a new tensor. Inductor plans its own
buffers; the interpreter (backend "eager", simulated ranks) allocates each result, so an
optimizer's chain (``v * beta2``, then ``addcmul`` of that, then ``sqrt`` ...) holds a
new parameter-sized list per op until its last reader, and a weight decay
(``param * (1 - lr * wd)``) holds a copy of every parameter until the update reads it.
torch's optimizers write those in place.

``reinplace`` runs after ``donate_in_order`` (NOTE: [interpreted programs update state
in place]) on the program as it will run, in its order, and turns an element-wise op (a
pointwise ATen op, or one of the foreach ops ``fuse_optimizer_updates`` makes) with an
in-place variant (``aten.mul.Tensor`` -> ``aten.mul_.Tensor``, ``aten._foreach_mul.Scalar``
-> ``aten._foreach_mul_.Scalar``) into it when every tensor it would write, its first
argument (each element of it for a foreach op):

- is a temporary the program made (not an input, not a view of anything, nor a piece of
  an op returning views), or a donated state input (one ``donate_in_order`` copies a new
  value into), or a tensor an earlier rewrite wrote into one of those;
- is read by nothing after the op, through any alias (views, getitems, the results of
  ops that write in place), and is not returned; a collective reads its input until its
  wait (an all-gather sends its input while in flight);
- has the op's result's shape and dtype (no broadcasting into it, no type promotion),
  float32 or float64 (in 16-bit floats a CPU in-place kernel may round otherwise:
  ``aten.mul_.Scalar`` and ``aten._foreach_mul_.Scalar`` round the scalar to bfloat16
  first, which broke the bit-exact one-rank SGD and RMSprop tests in bfloat16), and
  appears in no other argument of the op except at its own position (an element-wise op
  reading and writing the same element is exact; reading another element that the op has
  already written is not: ``addmm`` written into an operand it multiplies gave Muon NaNs,
  hence element-wise ops only);
- for a state input: the op comes after the program's last collective or wait (a peer
  that fails in one leaves the state as it was), and every op that writes into that
  input in place is on the chain that ends in the value ``donate_in_order`` copies into
  it, which then needs no copy. Where that does not hold for an input, nothing is
  written into it in place and the copy stays.

A foreach op's in-place variant returns nothing: its results' readers read the tensors it
wrote. The ``StateWrites`` call moves before the first write into a state input. Each
variant used is checked to give the functional op's bits in both dtypes
(``tests/unit/test_reinplace.py``); every simulated parity test runs through this.

Cost, once per program on its first call: 0.4-1.5 s for the 8-layer demo GPT's
~5,000-node programs (2 simulated ranks, the machine busy with a test run), most of it
fx's deepcopy of the graph and its code generation; the in-order copies 0.01-0.24 s.
The interpreter hands ``reinplace`` the program it prepared and a way to prepare another
(``fresh``): the first try rewrites that program itself, and only a retry (a state whose
writes miss its new value) prepares a new one. The rewrite had deep-copied the program
for every try: gpt-8x64 ddp, 2 simulated ranks, both programs, 1.09 -> 0.31 s.

Step peak (profiler CPU allocation totals, 2 gloo ranks, MiB; functional -> donated in
order -> and reinplaced; torch's eager peer in brackets): MLP-512 ddp 44.6 -> 32.6 ->
16.6 (16.0), tp 20.7 -> 12.6 -> 4.9 (8.0); gpt-2x64 ddp 4.97 -> 4.13 -> 3.29 (2.71).
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from . import _torch_private as private
from .ir.collectives import is_collective, is_wait
from .ir.graph_utils import may_return_alias
from .state_donation import DONATION_COPY, WRITES

_Node = torch.fx.Node


# Element-wise foreach ops (the ones fuse_optimizer_updates makes); their in-place
# variants give the same bits in these dtypes (tests/unit/test_reinplace.py checks each).
FOREACH_ELEMENTWISE = frozenset({
    "_foreach_abs", "_foreach_add", "_foreach_addcdiv", "_foreach_addcmul",
    "_foreach_clamp_max", "_foreach_clamp_min", "_foreach_div", "_foreach_exp",
    "_foreach_lerp", "_foreach_maximum", "_foreach_minimum", "_foreach_mul", "_foreach_neg",
    "_foreach_pow", "_foreach_reciprocal", "_foreach_sign", "_foreach_sqrt", "_foreach_sub",
})
# Not 16-bit floats: there a CPU in-place kernel may round differently from the
# functional one (``aten.mul_.Scalar`` and ``aten._foreach_mul_.Scalar`` in bfloat16 and
# float16 on torch 2.13: the scalar is rounded to the tensor's dtype first).
REINPLACED_DTYPES = (torch.float32, torch.float64)


def inplace_variant(target: Any) -> Any:
    """The in-place overload of ``target`` (``aten.mul.Tensor`` -> ``aten.mul_.Tensor``)
    taking the same arguments and writing its first one only, for an element-wise op (a
    pointwise ATen op, or a foreach op of ``FOREACH_ELEMENTWISE``), or None."""
    if not private.is_op_overload(target):
        return None
    name = target.overloadpacket.__name__
    if not (torch.Tag.pointwise in target.tags or name in FOREACH_ELEMENTWISE):
        return None
    variant = private.overload_named(target, name + "_")
    if variant is None:
        return None
    writes = [a.alias_info is not None and a.alias_info.is_write for a in variant._schema.arguments]
    return variant if writes[:1] == [True] and not any(writes[1:]) else None


def reinplace(
    gm: torch.fx.GraphModule, fresh: Callable[[], torch.fx.GraphModule] | None = None
) -> tuple[torch.fx.GraphModule, int]:
    """``gm`` (after ``donate_in_order``) rewritten to compute temporaries in place (NOTE:
    [interpreted programs reuse their temporaries]), and how many ops now write in place.
    A state input whose writes would not end in its new value is left alone (the rewrite
    is tried again without it). ``fresh``: makes another ``gm`` as it was given, for a
    retry; then ``gm`` itself is rewritten (no copy when the first try holds, the common
    case). Without it ``gm`` is left as it is and each try rewrites a deep copy."""
    excluded: set[str] = set()
    trial = gm if fresh is not None else copy.deepcopy(gm)
    while True:
        rewritten, failed = _rewrite(trial, excluded)
        if not failed:
            break
        excluded |= failed
        trial = fresh() if fresh is not None else copy.deepcopy(gm)
    if not rewritten:  # unchanged: the program given, or (after a retry) the fresh one
        return (gm if fresh is None else trial), 0
    trial.recompile()
    return trial, rewritten


def _rewrite(gm: torch.fx.GraphModule, excluded: set[str]) -> tuple[int, set[str]]:
    graph = gm.graph
    nodes = list(graph.nodes)
    order = {n: k for k, n in enumerate(nodes)}
    copies = {n.args[0]: n for n in nodes if n.meta.get(DONATION_COPY)}
    communication = [order[n] for n in nodes if is_collective(n) or is_wait(n)]
    last_communication = max(communication, default=-1)
    root: dict[_Node, _Node] = {}  # a node written in place -> the tensor it wrote into
    writes: dict[_Node, list[_Node]] = {}  # a state input -> the ops writing into it
    rewritten = 0
    for node in nodes:
        if node.op != "call_function" or may_return_alias(node):
            continue
        variant = inplace_variant(node.target)
        if variant is None:
            continue
        each = isinstance(node.args[0], (list, tuple))
        targets = list(node.args[0]) if each else [node.args[0]]
        vals = node.meta.get("val")
        vals = list(vals) if each and isinstance(vals, (list, tuple)) else [vals]
        found = [
            _writable(node, k, t, vals[k] if k < len(vals) else None, root, order, copies,
                      excluded, last_communication)
            for k, t in enumerate(targets)
        ]
        owners = [o for o in found if o is not None]
        if len(owners) < len(found) or len(set(owners)) != len(owners):
            continue
        if each and any(u.target is not operator.getitem for u in node.users):
            continue  # its list read whole: keep the op's own results
        node.target = variant
        rewritten += 1
        for owner in owners:
            if owner.op == "placeholder":
                writes.setdefault(owner, []).append(node)
        if not each:
            root[node] = owners[0]
            continue
        for user in list(node.users):  # getitems: their readers read what was written
            user.replace_all_uses_with(targets[user.args[1]])
            graph.erase_node(user)
    failed = set()
    for state, ops in writes.items():
        # every write into the state must come before its copy and end in the value
        # copied: then the state holds that value and the copy would copy it onto itself
        donation = copies[state]
        new = donation.args[1]
        last = max(order[op] for op in ops)
        if root.get(new, new) is not state or last > order[donation]:
            failed.add(state.name)
            continue
        donation.replace_all_uses_with(new)
        graph.erase_node(donation)
    if failed:
        return rewritten, failed
    _move_marker(graph, [n for ops in writes.values() for n in ops])
    graph.lint()
    return rewritten, set()


def _writable(
    node: _Node, position: int, target: Any, val: Any, root: dict[_Node, _Node],
    order: dict[_Node, int], copies: dict[_Node, _Node], excluded: set[str],
    last_communication: int,
) -> _Node | None:
    """The tensor ``node`` may write its ``position``-th result into, through ``target``
    (its first argument, or that list's element), or None."""
    if not isinstance(target, torch.fx.Node):
        return None
    owner = root.get(target, target)
    if owner.op == "placeholder":
        if owner not in copies or owner.name in excluded or order[node] < last_communication:
            return None
    elif not _fresh(owner):
        return None
    mine = target.meta.get("val")
    if not (
        isinstance(mine, torch.Tensor) and isinstance(val, torch.Tensor)
        and mine.shape == val.shape and mine.dtype == val.dtype
        and mine.dtype in REINPLACED_DTYPES
    ):
        return None
    memory, readers = _memory(owner)
    if any(r.op == "output" or order[r] > order[node] for r in readers if r is not node):
        return None
    if any(r.kwargs.get("non_blocking") for r in readers):
        return None  # a copy that may still be reading when the op writes
    # the op reads its own element only where it writes it (NOTE: [interpreted programs
    # reuse their temporaries])
    for arg in [*node.args[1:], *node.kwargs.values()]:
        pieces = list(arg) if isinstance(arg, (list, tuple)) else [arg]
        for k, piece in enumerate(pieces):
            same_place = piece is target and (len(pieces) == 1 or k == position)
            if isinstance(piece, torch.fx.Node) and piece in memory and not same_place:
                return None
    return owner


def _memory(owner: _Node) -> tuple[set[_Node], set[_Node]]:
    """The nodes that may share ``owner``'s memory, and the nodes that read it. A
    donation's copy reads its value (second argument) and writes its state (first): the
    state's later readers read through the copy only once ``_rewrite`` has checked the
    writes into the state end in the value copied."""
    memory, readers, todo = {owner}, set(), [owner]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.meta.get(DONATION_COPY) and user.args[0] is node:
                continue
            readers.add(user)
            if is_collective(user):
                # a collective reads its input until its wait (an all-gather's or a
                # reduce-scatter's input is sent while it is in flight)
                readers.update(u for u in user.users if is_wait(u))
            if user not in memory and may_return_alias(user):
                memory.add(user)
                todo.append(user)
    return memory, readers


def _fresh(node: _Node) -> bool:
    """A tensor the program made itself: an ATen op's result that is no view, or one
    result of an ATen op returning several."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        producer = node.args[0]
        return isinstance(producer, torch.fx.Node) and _fresh(producer)
    return private.is_op_overload(node.target) and not may_return_alias(node)


def _move_marker(graph: torch.fx.Graph, state_writes: list[_Node]) -> None:
    marker = next((n for n in graph.nodes if n.op == "call_module" and n.target == WRITES), None)
    if marker is None or not state_writes:
        return
    order = {n: k for k, n in enumerate(graph.nodes)}
    first = min(state_writes, key=order.__getitem__)
    if order[first] < order[marker]:
        first.prepend(marker)
