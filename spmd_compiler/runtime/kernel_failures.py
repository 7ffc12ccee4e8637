"""Where a compiled program failed while it ran: its node, op, module and train-step line.

NOTE: [where a program failed]
A kernel that raises inside the per-rank program (an index out of range in an
embedding, a shape a data-dependent op did not expect) surfaced as torch's bare message
("index out of range in self"), which names nothing of the user's step. On real ranks it
was worse: every rank that failed that way waited for another rank's record and then
said "No other rank recorded a failure: one may be stuck elsewhere", blaming a peer for
a failure of its own (2 gloo ranks, an embedding index out of range on both).

The interpreted program is an fx ``GraphModule``, whose generated code fx maps back to
its nodes (``private.graph_node_at_line``): the innermost frame of such code in the
traceback is the node that raised, and its meta carry the op, the module FQN and the
train-step line. A failure at a collective's node is a peer's (NOTE: [fault
attribution] names the rank that failed first); any other node's is this rank's own
computation: the rank records it at once, so that its peers, whose collectives break
when it leaves, name it and its cause, and says so instead of looking for another rank.
A program lowered by Inductor runs no such code: its failures are told as before.
"""

from __future__ import annotations

import types

import torch.fx

from .. import _torch_private as private
from ..errors import innermost_model_frame_of_stack_trace, node_op
from ..ir.collectives import is_collective, is_wait
from ..ir.node_meta import MODULE_FQN, USER_LINE


def failing_node(exc: BaseException) -> torch.fx.Node | None:
    """The node of the innermost graph-module frame in ``exc``'s traceback, or None."""
    site = failing_site(exc)
    return site[1] if site is not None else None


def failing_site(
    exc: BaseException,
) -> tuple[torch.fx.GraphModule, torch.fx.Node, dict[str, object]] | None:
    """The innermost graph-module frame in ``exc``'s traceback: its graph module, the node
    that raised, and the frame's locals (the values the program had computed, by the
    generated code's names), or None."""
    found = None
    tb: types.TracebackType | None = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        gm = frame.f_locals.get("self")
        if (
            isinstance(gm, torch.fx.GraphModule)
            and frame.f_code is getattr(type(gm).forward, "__code__", None)
        ):
            node = private.graph_node_at_line(gm, tb.tb_lineno)
            if node is not None:
                found = (gm, node, dict(frame.f_locals))
        tb = tb.tb_next
    return found


def in_a_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` sends or waits: its failure is a peer's, not this rank's."""
    return is_collective(node) or is_wait(node)


def where(node: torch.fx.Node) -> str:
    """``aten.embedding.default (graph node embedding) in module 'emb', train step line
    f.py:12: "out = model(x)", op made at model.py:30: "h = self.emb(ids)"``: the last
    part, the innermost line of the model or a library module it calls in the node's
    recorded stack trace, where it is another line than the train step's (a failing write
    deep in transformers' ``modeling_wav2vec2.py`` was named by the harness's ``out =
    model(**batch)`` alone)."""
    text = f"{node_op(node)} (graph node {node.name})"
    fqn = node.meta.get(MODULE_FQN)
    if fqn is not None:
        text += f" in module '{fqn}'" if fqn else " in the root module"
    line = node.meta.get(USER_LINE)
    if line:
        text += f", train step line {line}"
    made = innermost_model_frame_of_stack_trace(node.meta.get("stack_trace"))
    if made is not None and (
        not line or (made.filename, made.lineno) != (getattr(line, "filename", None), getattr(line, "lineno", None))
    ):
        text += f", op made at {made}"
    return text
