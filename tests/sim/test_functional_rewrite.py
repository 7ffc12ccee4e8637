"""NOTE: [functional by rewriting]: the capture's graph made functional by rewriting its
in-place ops is the graph the retrace under ``functionalize`` gives, and the steps it
cannot rewrite take the retrace."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler import _torch_private as private
from spmd_compiler.capture import trace
from spmd_compiler.tools.demo.gpt import GPT, GPTConfig, gpt_train_step
from spmd_compiler.tools.demo.steps import classification_train_step


def _value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (tuple(v.shape), str(v.dtype), v.stride(), v.requires_grad)
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_value(x) for x in v))
    return type(v).__name__


def _canonical(gm: torch.fx.GraphModule) -> tuple[collections.Counter, list[int], int]:
    """Each node by what it computes from the inputs (op, arguments' keys, its value's
    shape, dtype, strides and grad flag): independent of node names and of where a view
    is placed (the retrace emits a view of a written tensor where it is first read). The
    random ops in order, and the outputs."""
    key: dict[torch.fx.Node, Any] = {}
    drawn: list[int] = []
    for k, node in enumerate(gm.graph.nodes):
        if node.op == "placeholder":
            key[node] = ("input", k, _value(node.meta.get("val")))
            continue
        args = torch.fx.node.map_arg(node.args, key.__getitem__)
        kwargs = torch.fx.node.map_arg(node.kwargs, key.__getitem__)
        value = None if node.op == "output" else _value(node.meta.get("val"))
        key[node] = hash((node.op, str(node.target), repr(args), repr(kwargs), value))
        if private.random_op(node.target):
            drawn.append(key[node])
    return collections.Counter(key.values()), drawn, key[gm.graph.output_node()]


def _captured(build: Callable[[], tuple], rewrite: bool, monkeypatch: pytest.MonkeyPatch) -> list:
    """The captured graphs of a step's first call, rewritten or retraced."""
    graphs: list[torch.fx.GraphModule] = []
    finish = trace._finish

    def keep(first: Any, start: float) -> Any:
        captured = finish(first, start)
        graphs.append(captured.graph_module)
        return captured

    with monkeypatch.context() as patch:
        patch.setattr(trace, "REWRITE_FUNCTIONAL", rewrite)
        patch.setattr(trace, "_finish", keep)
        model, optim, step, args = build()
        with sc.simulate(world_size=2):
            sc.compile()(step)(model, optim, *args)
    return [_canonical(gm) for gm in graphs]


def _clipped(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optim.step()
    optim.zero_grad()
    return loss


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(8, 8), torch.randint(0, 4, (8,))


def _gpt() -> tuple:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    idx = torch.randint(0, 32, (4, 8))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), gpt_train_step, (idx, idx)


def _batch_norm() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(inplace=True), nn.Linear(16, 4))
    return model, torch.optim.Adam(model.parameters()), classification_train_step, _batch()


def _dropout_clipped() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.1), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), foreach=True), _clipped, _batch()


def _momentum() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), classification_train_step, _batch()


class _RowWrite(nn.Module):
    """Writes a row of a buffer in place: a write through a view."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 4)
        self.register_buffer("seen", torch.zeros(2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.lin(x)
        with torch.no_grad():
            self.seen[0].add_(out.mean(0))
        return out + self.seen[1]


def _row_write() -> tuple:
    torch.manual_seed(0)
    model = _RowWrite()
    return model, torch.optim.SGD(model.parameters(), lr=0.1), classification_train_step, _batch()


def _view_read_after(model, optim, x, y):  # noqa: ANN001
    h = model[0](x)
    before = h.t()
    h.relu_()  # `before` sees the new values: a view read after a write
    loss = F.cross_entropy(model[1](h), y) + before.sum() * 0.01
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _view_read() -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), _view_read_after, _batch()


REWRITTEN = {"gpt_adamw": _gpt, "batch_norm_inplace_relu": _batch_norm,
             "dropout_foreach_clip": _dropout_clipped, "sgd_momentum": _momentum}
RETRACED = {"row_of_a_buffer_written": _row_write, "view_read_after_a_write": _view_read}


@pytest.mark.parametrize("name", [*REWRITTEN, *RETRACED])
def test_rewrite_is_the_retrace(name, monkeypatch, caplog):
    build = {**REWRITTEN, **RETRACED}[name]
    with caplog.at_level(logging.DEBUG, logger="spmd_compiler.capture.functional_rewrite"):
        rewritten = _captured(build, True, monkeypatch)
    retraced = _captured(build, False, monkeypatch)
    assert rewritten and len(rewritten) == len(retraced)
    for (nodes, drawn, output), (nodes_r, drawn_r, output_r) in zip(rewritten, retraced, strict=True):
        assert nodes == nodes_r
        assert drawn == drawn_r
        assert output == output_r
    fell_back = [r.getMessage() for r in caplog.records if "by a retrace" in r.getMessage()]
    if name in RETRACED:
        assert fell_back, "a write the rewrite cannot make was rewritten"
    else:
        assert not fell_back, fell_back


def _writes_its_argument(model, optim, x, y):  # noqa: ANN001
    x.mul_(2)
    return classification_train_step(model, optim, x, y)


def test_a_step_writing_its_argument_is_refused_as_before():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError, match="modifies its tensor argument"):
        sc.compile()(_writes_its_argument)(model, optim, *_batch())


def test_out_of_place_twins():
    aten = torch.ops.aten
    assert private.out_of_place_twin(aten.add_.Tensor) is aten.add.Tensor
    assert private.out_of_place_twin(aten.addcdiv_.default) is aten.addcdiv.default
    assert private.out_of_place_twin(aten.lerp_.Scalar) is aten.lerp.Scalar
    assert private.out_of_place_twin(aten.copy_.default) is aten.copy.default
    assert private.out_of_place_twin(aten.t_.default) is None  # its twin is a view
    assert private.out_of_place_twin(aten.bernoulli_.float) is None  # no twin of that name
    assert private.out_of_place_twin(aten.add.Tensor) is None  # not in place


def _running_mean_step(model, optim, running_mean, x, y):  # noqa: ANN001
    running_mean.copy_(running_mean.lerp(x.pow(2).mean(), 0.01))  # kept across calls
    return classification_train_step(model, optim, x, y)


def test_an_argument_written_in_place_is_named_as_written_with_its_line_and_the_buffer_fix():
    """StyleGAN's pl_mean passed as the step's third argument (NOTE: [a tensor argument
    written in place]): the refusal named "input[0] (pl_mean)" at node copy__4 with no
    user line, and did not say that a buffer keeps a running value."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        sc.compile()(_running_mean_step)(model, optim, torch.zeros(()), *_batch())
    message = str(info.value)
    assert "modifies its tensor argument `running_mean` in place" in message, message
    assert "input[0]" not in message, message
    assert "running_mean.copy_(running_mean.lerp(" in message, message  # the user's line
    assert 'model.register_buffer("running_mean", torch.zeros(()))' in message, message


def _cleans_its_batch(model, optim, x, y):  # noqa: ANN001
    x.nan_to_num_(0.0)
    return classification_train_step(model, optim, x, y)


def test_a_batch_cleaned_in_place_is_told_the_out_of_place_form_first():
    """``x.nan_to_num_(0.0)`` on the batch: the hint opened with registering a buffer
    (a running value's fix) and gave the copy as "otherwise"; it now opens with the
    out-of-place form of the op written, the buffer after."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        sc.compile()(_cleans_its_batch)(model, optim, *_batch())
    message = str(info.value)
    assert "x.nan_to_num_(0.0)" in message, message  # the user's line
    hint = message[message.index("what to do"):]
    assert hint.index("`x = x.nan_to_num(...)` in place of `x.nan_to_num_(...)`") < hint.index("register_buffer"), hint
