"""``ir.graph_utils.returns_alias``: the one test of "does this op's result share its
input's memory" that state donation, the in-place bucket hazard and the leading split use."""

from __future__ import annotations

import operator

import torch
import torch.fx

from spmd_compiler.ir.graph_utils import returns_alias

aten = torch.ops.aten


def _node(graph: torch.fx.Graph, target, *args) -> torch.fx.Node:
    return graph.call_function(target, args)


def test_views_reshapes_splits_and_unsafe_view_alias_their_input() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    for target, args in [
        (aten.view.default, ([4],)), (aten.reshape.default, ([4],)), (aten.t.default, ()),
        (aten.contiguous.default, ()), (aten.split.Tensor, (2,)),
        (aten._unsafe_view.default, ([4],)),  # its schema does not say so; it is a view
    ]:
        assert returns_alias(_node(g, target, x, *args)), target


def test_computing_ops_getitem_and_placeholders_do_not() -> None:
    g = torch.fx.Graph()
    x = g.placeholder("x")
    pieces = _node(g, aten.split.Tensor, x, 2)
    for node in [_node(g, aten.add.Tensor, x, x), _node(g, aten.clone.default, x),
                 _node(g, operator.getitem, pieces, 0), x]:
        assert not returns_alias(node), node
