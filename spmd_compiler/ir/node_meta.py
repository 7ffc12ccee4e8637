"""What the stages write on fx nodes (``node.meta``), with typed accessors.

NOTE: [node meta schema]
Every key the project writes on a node is named here, with the stage that writes it and
the type of its value. Read and write through the accessors, not the raw keys, so a
reader can find every writer and reader of a key by its accessor's name.

| key | written by | value |
|---|---|---|
| ``MODULE_FQN`` | capture (module forward hooks) | FQN of the innermost module whose forward traced the node |
| ``TIME_MAJOR_RNN`` | capture (module forward hooks) | ``"'fqn' (Class, batch_first=...)"`` of the ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` whose forward traced the node (a walk there is along time) |
| ``TIME_MAJOR_INPUT`` | capture (module forward pre-hooks) | ``("'fqn' (Class, batch_first=...)", dim)``: an ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` / ``nn.MultiheadAttention`` reads the node's value with time on dimension ``dim`` (0 time-major or unbatched, 1 batch-first) |
| ``RNN_HIDDEN`` | capture (module forward hooks) | ``(num_layers * directions, hidden sizes)`` of the ``nn.RNN`` / ``nn.GRU`` / ``nn.LSTM`` whose forward traced the node: the shape of its hidden state (NOTE: [a hidden state's layers walked] in ``expand/iterated_batches.py``) |
| ``USER_LINE`` | capture | ``errors.SourceLocation`` of the train-step line |
| ``PHASE`` | capture | ``Phase.BACKWARD`` / ``Phase.OPTIMIZER``; absent means forward (and loss) |
| ``AUTOGRAD`` | capture | True on a node autograd traced (``Tensor.backward``, ``torch.autograd.backward`` / ``grad``): where anomaly detection would check values |
| ``ITEM_SNAPSHOT`` | capture (``.item()`` of a traced tensor) | True on the ``clone`` that holds the value an ``.item()`` read (NOTE: [an item is its value at the read] in ``capture/traced_items.py``) |
| ``PADDED`` | a mode's padding of uneven state | ``(true size, padded size, dim)`` of a value held padded |
| ``PADDED_GRADIENT`` | a mode's padding of uneven state | name of the parameter whose gradient the node zero-pads where the optimizer reads it (settled there: NOTE: [padded gradients settle at their pad] in ``expand/retrace.py``) |
| ``ORIGIN`` | expansion | name of the captured node a per-rank node was expanded from |
| ``PLACEMENT`` | expansion | DTensor placements of the node's output |
| ``CREATED_BY`` | pass manager | name of the pass that created the node |
| ``DEFERRED`` | cross-iteration overlap pass | True on a reduction the next call uses |
| ``BUCKET_MEMBERS`` | bucketing pass | ``[(label, payload bytes), ...]`` of a bucketed collective |

Keys are carried from a captured node to the nodes expansion makes for it by
``graph_utils.CARRIED_META``.
"""

from __future__ import annotations

import enum

import torch.fx

MODULE_FQN = "spmd_module_fqn"
TIME_MAJOR_RNN = "spmd_time_major_rnn"
TIME_MAJOR_INPUT = "spmd_time_major_input"
RNN_HIDDEN = "spmd_rnn_hidden"
USER_LINE = "spmd_user_line"
PLACEMENT = "spmd_placement"
ORIGIN = "spmd_origin"
CREATED_BY = "spmd_created_by"
PHASE = "spmd_phase"
PADDED = "spmd_padded"
PADDED_GRADIENT = "spmd_padded_gradient"
DEFERRED = "spmd_deferred"
BUCKET_MEMBERS = "spmd_bucket_members"
AUTOGRAD = "spmd_autograd"
ITEM_SNAPSHOT = "spmd_item_snapshot"


class Phase(str, enum.Enum):
    """Which part of the train step traced a node. A ``str`` enum: ``Phase.BACKWARD ==
    "backward"``, so values stay readable in ``print(graph)`` and in saved metadata."""

    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


# the raw values written in node.meta[PHASE] (kept for readers of older graphs and tests)
BACKWARD_PHASE = Phase.BACKWARD.value
OPTIMIZER_PHASE = Phase.OPTIMIZER.value


def phase(node: torch.fx.Node) -> Phase:
    """The phase that traced ``node``; untagged nodes (forward and loss) are FORWARD."""
    value = node.meta.get(PHASE)
    return Phase(value) if value is not None else Phase.FORWARD


def set_phase(node: torch.fx.Node, value: Phase, *, overwrite: bool = True) -> None:
    if overwrite or PHASE not in node.meta:
        node.meta[PHASE] = value.value



def set_traced_by_autograd(node: torch.fx.Node) -> None:
    node.meta[AUTOGRAD] = True


def traced_by_autograd(node: torch.fx.Node) -> bool:
    """Whether autograd traced ``node`` (a backward, a ``torch.autograd.grad``); a
    ``Tensor.backward`` node is tagged ``Phase.BACKWARD`` as well."""
    return bool(node.meta.get(AUTOGRAD, False)) or phase(node) is Phase.BACKWARD


def in_module_forward(node: torch.fx.Node) -> bool:
    """Traced inside some module's forward and not by the optimizer: a module-level
    forward computation (a recomputed forward inside backward counts too)."""
    return MODULE_FQN in node.meta and phase(node) is not Phase.OPTIMIZER





def set_item_snapshot(node: torch.fx.Node) -> None:
    node.meta[ITEM_SNAPSHOT] = True


def is_item_snapshot(node: torch.fx.Node) -> bool:
    """Whether ``node`` is the copy an ``.item()`` read made (NOTE: [an item is its value
    at the read] in ``capture/traced_items.py``)."""
    return bool(node.meta.get(ITEM_SNAPSHOT, False))


def padded_gradient(node: torch.fx.Node) -> str | None:
    """The parameter whose gradient ``node`` zero-pads for the optimizer, or None."""
    name = node.meta.get(PADDED_GRADIENT)
    return None if name is None else str(name)


def set_padded_gradient(node: torch.fx.Node, name: str) -> None:
    node.meta[PADDED_GRADIENT] = name


def is_deferred(node: torch.fx.Node) -> bool:
    return bool(node.meta.get(DEFERRED, False))


def set_deferred(node: torch.fx.Node) -> None:
    node.meta[DEFERRED] = True


def bucket_members(node: torch.fx.Node) -> list[tuple[str, int]]:
    return list(node.meta.get(BUCKET_MEMBERS, ()))


def set_bucket_members(node: torch.fx.Node, members: list[tuple[str, int]]) -> None:
    node.meta[BUCKET_MEMBERS] = members
