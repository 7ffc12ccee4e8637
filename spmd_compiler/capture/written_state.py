"""Each piece of state a step writes leaves the program in memory of its own.

NOTE: [state written as another state's value]
A step may write one state tensor with another's value: a DQN's hard target update
``q_targ.load_state_dict(q.state_dict())`` (or ``pt.copy_(p)``, ``pt.data.copy_(p.data)``),
or a copy taken after ``optimizer.step()``. Functionalized, ``pt.copy_(p)`` is ``p``
itself (``graph_utils._replace_functional_copy``: DTensor has no rule for ``aten.copy``),
so the program returned ``q``'s input tensor as ``q_targ``'s new value, and ``q``'s new
value after the update too. Every executor then went wrong:

- ``q`` is donated (NOTE: [state donation]; interpreted: NOTE: [interpreted programs
  update state in place]): its update is written into its input, the very tensor handed
  back as ``q_targ``, which the runtime installed after the program ran: ``q_targ`` came
  out equal to ``q`` after the update, not before it (2 simulated ranks, float64, SGD:
  2.17e-2 off after the first call, ddp and fsdp alike; a DQN with Adam and a copy every
  other call: 9.9e-2 off in ``exp_avg_sq`` after 5 calls; the same on 2 gloo ranks);
- not donated, ``q_targ`` and ``q`` were installed as one tensor (eager keeps two): any
  later write into one, a program's in-place update or the user's ``mul_`` between calls,
  moved the other.

So ``copy_state_values`` ends the capture by giving each such output a ``clone``: a
state output that is (a view of) a placeholder other than its own state's, or that
another state output already is (through views). It costs one copy of the state copied,
as eager's ``copy_`` does. The interpreter needs nothing more (its copy into ``q``'s
input waits for the clone, its last reader). Inductor does: it removes a clone as a
no-op where its result is not a graph output, so the donated ``copy_(q_targ, clone(q))``
became ``copy_(q_targ, q)``, run after ``q``'s own update (2 gloo ranks,
backend="inductor": ``q_targ`` 2.46e-2 off after the first call with the clone alone);
``state_donation.not_copies_of_inputs`` leaves such a state out of a lowered program's
donation (its clone is then an output Inductor keeps). And ``donatable`` keeps an input
that another state's output still is out of the donated set, should a later stage hand
one back.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

from ..ir.graph_utils import output_args, placeholders, returns_alias, set_outputs
from ..ir.node_meta import PHASE, USER_LINE
from ..ir.signature import STATE_KINDS, StateRef


def copy_state_values(gm: torch.fx.GraphModule, inputs: list[StateRef], outputs: list[StateRef]) -> int:
    """Give each state output of ``gm`` that shares memory with another state's input or
    with an earlier state output a ``clone`` of its own (see the NOTE); returns how many.
    A no-op where every state output is fresh or its own input."""
    ref_of = dict(zip(placeholders(gm), inputs, strict=True))
    values = output_args(gm)
    claimed: set[torch.fx.Node] = set()
    copies = 0
    for j, (value, ref) in enumerate(zip(values, outputs, strict=True)):
        if ref.kind not in STATE_KINDS or not isinstance(value, torch.fx.Node):
            continue
        memory = _memory_of(value)
        if memory in claimed or (memory.op == "placeholder" and ref_of.get(memory) != ref):
            values[j] = _clone(gm.graph, value)
            copies += 1
        else:
            claimed.add(memory)
    if copies:
        set_outputs(gm, values)
        gm.recompile()
    return copies


def _memory_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory ``node`` is: followed through views and through a piece
    (``getitem``) of an op returning views, to a placeholder or a fresh tensor."""
    while node.op == "call_function":
        source = node.args[0] if node.args else None
        if node.target is operator.getitem and isinstance(source, torch.fx.Node) and returns_alias(source):
            node = source
        elif returns_alias(node) and isinstance(source, torch.fx.Node):
            node = source
        else:
            break
    return node


def _clone(graph: torch.fx.Graph, value: torch.fx.Node) -> torch.fx.Node:
    """A ``clone`` of ``value`` placed right after it (after the last placeholder for an
    input): the value as the step's copy took it."""
    where = value
    if value.op == "placeholder":
        where = [n for n in graph.nodes if n.op == "placeholder"][-1]
    with graph.inserting_after(where):
        copy = graph.call_function(torch.ops.aten.clone.default, (value,))
    for key in (PHASE, USER_LINE):
        if key in value.meta:
            copy.meta[key] = value.meta[key]
    val = value.meta.get("val")
    if isinstance(val, torch.Tensor):
        copy.meta["val"] = torch.ops.aten.clone.default(val)
    return copy
