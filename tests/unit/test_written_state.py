"""Each state output in memory of its own (NOTE: [state written as another state's value]
in ``spmd_compiler/capture/written_state.py``), on tiny graphs."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler.capture.written_state import copy_state_values
from spmd_compiler.ir.graph_utils import output_args
from spmd_compiler.ir.signature import Kind, StateRef

W, T, M = (StateRef(Kind.PARAM, name) for name in ("0.w", "1.w", "0.m"))
X = StateRef(Kind.INPUT, "x", index=0)
LOSS = StateRef(Kind.RETURN, index=0)


def _graph(fn):
    return make_fx(fn)(*(torch.randn(3, dtype=torch.float64) for _ in range(3)))


def _clones(gm) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.aten.clone.default]


def test_another_states_input_is_cloned():
    gm = _graph(lambda x, w, t: ((x * w).sum(), w - x, w.view(3)))
    assert copy_state_values(gm, [X, W, T], [LOSS, W, T]) == 1
    (clone,) = _clones(gm)
    assert output_args(gm)[2] is clone
    assert clone.args[0].op == "call_function"  # the view of w, cloned
    assert clone.meta["val"].shape == (3,)


def test_one_value_written_as_two_states_is_cloned_once():
    gm = _graph(lambda x, w, t: ((x * w).sum(), (w - x), (w - x)))
    outs = output_args(gm)
    new = outs[1]
    gm.graph.output_node().args = ((outs[0], new, new),)
    assert copy_state_values(gm, [X, W, T], [LOSS, W, T]) == 1
    outs = output_args(gm)
    assert outs[1] is new and outs[2].target is torch.ops.aten.clone.default


def test_fresh_values_and_unchanged_state_are_left_as_they_are():
    gm = _graph(lambda x, w, m: (w.sum(), w - x, m * 0.5, w))
    before = str(gm.graph)
    # w returned (a RETURN output) and w's own input: nothing to copy
    assert copy_state_values(gm, [X, W, M], [LOSS, W, M, StateRef(Kind.RETURN, index=1)]) == 0
    assert str(gm.graph) == before
