"""The first trace made functional by rewriting its in-place ops, where that is what a
trace under ``torch.func.functionalize`` would give.

NOTE: [functional by rewriting]
The capture's graph holds in-place ops: the optimizer's updates (``mul_``, ``add_``,
``addcdiv_``, ``lerp_`` on parameters and state), a step counter's ``add_``, a model's
``relu_``. The programs are functional, so capture traced the graph once more under
``functionalize`` (NOTE: [capture in two traces]): a third of a capture's time (3.6 s of
the 8-layer demo GPT's 10.6 s), to turn each in-place op into its out-of-place twin and
read the new value wherever the old tensor was read after it.

Most graphs need nothing more than that, so ``functional_by_rewriting`` does it directly
when it can tell the result is the retrace's, and leaves the graph untouched otherwise
(the caller then traces under ``functionalize`` as before). It rewrites only if every
node passes:
- every op is an ``OpOverload`` (or ``getitem`` of one's results); aliasing is read off
  the schemas (``Tensor(a)`` returns are views of the argument of the same alias set);
- every op that writes writes its ``self`` alone and returns it (``add_``), and has an
  out-of-place twin of the same name without ``_`` and the same overload and argument
  names (``add.Tensor``) that returns a fresh tensor (not ``t_``'s view twin, not the
  random ``bernoulli_`` whose twin has another overload name);
- the tensor written is not a view (writing through a view writes its base), nor a
  constant, nor a graph input other than training state (the retrace names a step
  argument written in place, ``_drop_copy_back``);
- no view of it taken before the write is read after it (it would see the old value
  where eager reads the new one);
- each twin, run on the fake values of its node's arguments, gives the shape, dtype and
  strides the in-place op gave the tensor it wrote (a float32 tensor ``add_``-ing a
  float64 one stays float32 in place; out of place it would not). Its result is the
  node's value from then on, a fresh tensor as the retrace's.
Then each in-place node becomes its twin, keeping its metadata (module, line, phase).
make_fx already records a read of a tensor after an in-place op on it as a read of that
op's node (the op returns the tensor it wrote, and the trace follows the tensor); the
reads it leaves on an older node are those through a view taken before the write, which
the checks above refuse. Should a graph hold another read of the written node after the
write, it is pointed at the new value, as functionalization reads it. The other nodes
keep their values: make_fx records detached snapshots, with no autograd, as the
retrace's. Any check failing restores the graph as it was.

The result is the retrace's program, compared in ``tests/sim/test_functional_rewrite.py``
on six steps, each node by what it computes from the inputs (op, arguments, value's
shape, dtype, strides and grad flag), the random draws in order and the outputs. Nodes
may stand elsewhere: the retrace emits a view of a written tensor where it is first read
(Mixtral's router weights), the rewrite where the step took it. Measured on the 8-layer
demo GPT (ddp, 2 simulated ranks, the machine loaded by other work), in one process
alternating: this part of the capture took 5.4 / 6.3 / 6.8 / 7.3 s as a retrace and
2.6 / 2.6 s with a fake-tensor propagation over every node for the values (since
dropped), 1.3 / 1.0 s as it is now.
"""

from __future__ import annotations

import logging
import operator
from collections import defaultdict
from typing import Any

import torch
import torch.fx

from .. import _torch_private as private
from ..ir.graph_utils import ALIASING_UNANNOTATED, placeholders
from ..ir.signature import STATE_KINDS, StateRef

log = logging.getLogger(__name__)


class _NotRewritten(Exception):
    """Why a graph keeps the retrace."""


def functional_by_rewriting(gm: torch.fx.GraphModule, refs: list[StateRef], fake_mode: Any) -> bool:
    """Rewrite ``gm``'s in-place ops into their functional twins (NOTE: [functional by
    rewriting]). Returns whether it did; when not, ``gm`` is as it was."""
    try:
        plan = _plan(gm, refs)
    except Exception as exc:  # noqa: BLE001 - _NotRewritten, or a node this reading missed
        log.debug("functionalized by a retrace: %s", exc)
        return False
    saved = [(n, n.target, n.args, n.kwargs, n.meta.get("val")) for n in gm.graph.nodes]
    for node, (args, kwargs) in plan.arguments.items():
        node.args, node.kwargs = args, kwargs
    try:
        for node, twin in plan.twins.items():
            node.meta["val"] = _twin_value(node, twin, fake_mode)
            node.target = twin
    except Exception as exc:  # noqa: BLE001 - any failure: the retrace, on the graph as it was
        for node, target, args, kwargs, val in saved:
            node.target, node.args, node.kwargs = target, args, kwargs
            if val is None:
                node.meta.pop("val", None)
            else:
                node.meta["val"] = val
        log.debug("functionalized by a retrace: %s: %s", type(exc).__name__, exc)
        return False
    return True


def _twin_value(node: torch.fx.Node, twin: Any, fake_mode: Any) -> torch.Tensor:
    """The value of ``twin`` on ``node``'s arguments, a fresh tensor; it must have the
    shape, dtype and strides the in-place op gave the tensor it wrote."""
    before = node.meta.get("val")

    def value(a: torch.fx.Node) -> Any:
        v = a.meta.get("val")
        if v is None:
            raise _NotRewritten(f"{a.name} has no value")
        return v

    args = torch.fx.node.map_arg(node.args, value)
    kwargs = torch.fx.node.map_arg(node.kwargs, value)
    with fake_mode, torch.no_grad():
        after = twin(*args, **kwargs)
    if not (isinstance(before, torch.Tensor) and isinstance(after, torch.Tensor)) or (
        (after.shape, after.dtype, after.stride()) != (before.shape, before.dtype, before.stride())
    ):
        raise _NotRewritten(f"{node.name}'s out-of-place result differs from its in-place one")
    return after


class _Plan:
    def __init__(self) -> None:
        self.twins: dict[torch.fx.Node, Any] = {}  # in-place node -> its out-of-place op
        # node -> its arguments reading the latest value of what was written before it
        self.arguments: dict[torch.fx.Node, tuple[Any, Any]] = {}


def _plan(gm: torch.fx.GraphModule, refs: list[StateRef]) -> _Plan:
    nodes = list(gm.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    ref_of = dict(zip(placeholders(gm), refs, strict=True))
    root: dict[torch.fx.Node, torch.fx.Node] = {}  # a node -> the tensor whose memory it is
    views: dict[torch.fx.Node, list[torch.fx.Node]] = defaultdict(list)
    results_alias: dict[torch.fx.Node, torch.fx.Node | None] = {}  # multi-output op -> root
    latest: dict[torch.fx.Node, torch.fx.Node] = {}  # a written tensor -> its new value
    plan = _Plan()

    def now(a: Any) -> Any:
        while isinstance(a, torch.fx.Node) and a in latest:
            a = latest[a]
        return a

    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            root[n] = n
            continue
        if n.op == "output":
            args = torch.fx.node.map_arg(n.args, now)
            if args != n.args:
                plan.arguments[n] = (args, n.kwargs)
            continue
        if n.op != "call_function":
            raise _NotRewritten(f"{n.op} node {n.name}")
        args, kwargs = torch.fx.node.map_arg(n.args, now), torch.fx.node.map_arg(n.kwargs, now)
        if args != n.args or kwargs != n.kwargs:
            plan.arguments[n] = (args, kwargs)
        if n.target is operator.getitem:
            source = args[0]
            base = results_alias.get(source) if isinstance(source, torch.fx.Node) else None
            root[n] = base if base is not None else n
            if base is not None:
                views[base].append(n)
            continue
        if not private.is_op_overload(n.target):
            raise _NotRewritten(f"{n.name} calls {n.target}")
        schema = n.target._schema  # type: ignore[union-attr]
        writes = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        if writes:
            _plan_write(n, args, schema, writes, root, views, position, ref_of, plan)
            latest[args[0]] = n
            root[n] = n
            continue
        if n.target in ALIASING_UNANNOTATED:
            # matmul's ``_unsafe_view`` of a fresh product, unannotated: a view where
            # anything else reads its input, so that a write to either while the other
            # is read later refuses
            aliased = args[0] if len(args[0].users) > 1 else None
        else:
            aliased = _aliased_argument(schema, args, kwargs)
        if aliased is None:
            root[n] = n
            results_alias[n] = None
        else:
            base = root.get(aliased, aliased)
            root[n] = base
            views[base].append(n)
            results_alias[n] = base
    return plan


def _plan_write(
    n: torch.fx.Node, args: tuple, schema: Any, writes: list[int],
    root: dict, views: dict, position: dict, ref_of: dict, plan: _Plan,
) -> None:
    """Check that in-place ``n`` can be its out-of-place twin, and plan it."""
    if writes != [0] or len(schema.returns) != 1 or schema.returns[0].alias_info is None:
        raise _NotRewritten(f"{n.name} ({schema.name}) writes other than its self")
    twin = private.out_of_place_twin(n.target)
    if twin is None:
        raise _NotRewritten(f"{n.name} ({schema.name}) has no out-of-place twin")
    first = args[0] if args else None
    if not isinstance(first, torch.fx.Node):
        raise _NotRewritten(f"{n.name} writes no node")
    written: torch.fx.Node = first
    if root.get(written) is not written:
        raise _NotRewritten(f"{n.name} writes through a view")
    if written.op == "get_attr":
        raise _NotRewritten(f"{n.name} writes a constant")
    if written.op == "placeholder" and ref_of[written].kind not in STATE_KINDS:
        raise _NotRewritten(f"{n.name} writes the input {ref_of[written]}")
    for view in views.get(written, ()):
        if any(position[user] > position[n] for user in view.users):
            raise _NotRewritten(f"{view.name}, a view of what {n.name} writes, is read after it")
    plan.twins[n] = twin


def _aliased_argument(schema: Any, args: tuple, kwargs: dict) -> torch.fx.Node | None:
    """The argument an op's result is a view of (its alias set's), or None."""
    sets: set[str] = set()
    for r in schema.returns:
        if r.alias_info is not None:
            sets |= set(r.alias_info.before_set)
    if not sets:
        return None
    for i, a in enumerate(schema.arguments):
        if a.alias_info is None or not (set(a.alias_info.before_set) & sets):
            continue
        value = args[i] if i < len(args) else kwargs.get(a.name)
        if isinstance(value, torch.fx.Node):
            return value
        raise _NotRewritten(f"{schema.name} aliases a list or non-node argument")
    raise _NotRewritten(f"{schema.name} returns an alias of no argument")
