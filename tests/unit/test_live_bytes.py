"""live_bytes: the estimate of bytes alive per node (NOTE: [live bytes estimate])."""

from __future__ import annotations

import operator

import torch
from collective_pass_harness import TinyGraph

from spmd_compiler.passes.live_bytes import live_bytes

aten = torch.ops.aten


def test_new_tensors_live_until_their_last_reader_and_inputs_do_not_count():
    g = TinyGraph()
    x = g.input("x", 4, 4)  # the caller's: not counted
    a = g.op("a", aten.mul.Tensor, x, 2.0)  # 64 bytes
    b = g.op("b", aten.mul.Tensor, a, 3.0)  # 64 bytes; a's last reader
    c = g.op("c", aten.sum.default, b)  # 4 bytes, returned
    g.program(c)

    memory = live_bytes(g.graph)

    assert [memory.profile[memory.position[n]] for n in (x, a, b, c)] == [0, 64, 128, 68]
    assert memory.peak == 128


def test_views_extend_their_base_and_a_reshape_of_a_slice_is_a_copy():
    g = TinyGraph()
    x = g.input("x", 4, 4)
    a = g.op("a", aten.mul.Tensor, x, 2.0)  # 64 bytes
    view = g.op("view", aten.t.default, a)  # shares a
    column = g.op("column", aten.slice.Tensor, view, 1, 0, 2)  # a view, not contiguous
    copied = g.op("copied", aten.reshape.default, column, [8])  # 32 bytes of its own
    out = g.op("out", aten.mul.Tensor, copied, 1.0)  # 32 bytes
    g.program(out, view)

    memory = live_bytes(g.graph)

    assert memory.storage_of(view) == memory.storage_of(column) == memory.storage_of(a)
    assert memory.storage_of(copied) == (copied, 0)
    assert memory.storages[(a, 0)][2] == len(g.graph.nodes) - 1  # returned through a view
    assert memory.profile[memory.position[out]] == 64 + 32 + 32


def test_each_result_of_a_tuple_lives_on_its_own():
    g = TinyGraph()
    x = g.input("x", 4, 8)
    norm = g.op("norm", aten.native_layer_norm.default, x, [8], None, None, 1e-5)
    y = g.op("y", operator.getitem, norm, 0)  # 128 bytes; mean and rstd: 16 bytes each
    mean = g.op("mean", operator.getitem, norm, 1)
    z = g.op("z", aten.mul.Tensor, y, 2.0)
    g.program(z, mean)

    memory = live_bytes(g.graph)

    assert memory.storage_of(y) == (norm, 0) and memory.storage_of(mean) == (norm, 1)
    assert memory.storages[(norm, 2)][2] == memory.position[mean]  # rstd: freed at once
    assert memory.profile[memory.position[z]] == 128 + 16 + 128


def test_a_multi_result_node_is_sized_once_not_once_per_reader(monkeypatch):
    """A foreach node with one ``getitem`` reader per parameter: its results were sized
    again for every reader (results x readers: 4.4 s of one call on the 10k-node graph of
    150 x Linear(4, 4) with AdamW). Counted, not timed: ``value_bytes`` calls stay linear
    (NOTE: [storages read once per node])."""
    from spmd_compiler.passes import live_bytes as module

    n = 64
    g = TinyGraph()
    xs = [g.input(f"x{i}", 4) for i in range(n)]
    fused = g.op("fused", aten._foreach_mul.Scalar, xs, 2.0)  # 16 bytes per result
    items = [g.op(f"item{i}", operator.getitem, fused, i) for i in range(n)]
    outs = [g.op(f"out{i}", aten.mul.Tensor, item, 3.0) for i, item in enumerate(items)]
    g.program(*outs)
    calls = []
    sized = module.value_bytes

    def counted(value):
        calls.append(value)
        return sized(value)

    monkeypatch.setattr(module, "value_bytes", counted)
    memory = live_bytes(g.graph)

    assert len(calls) <= 4 * n  # was n * n + 2 * n
    assert memory.storages[(fused, 0)][2] == memory.position[outs[0]]
    assert memory.peak == (n + 1) * 16  # at out0: every result, and out0
