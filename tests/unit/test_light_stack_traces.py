"""NOTE: [stack traces without the whole stack]: the capture's cheaper stack traces are
the text torch's own extraction gives, node for node."""

from __future__ import annotations

import contextlib

import torch
import torch.fx
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

from spmd_compiler import _torch_private as private


def _traces(gm: torch.fx.GraphModule) -> list[str | None]:
    return [node.meta.get("stack_trace") for node in gm.graph.nodes]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.inner(x)) * 2


def test_make_fx_traces_are_torchs_own() -> None:
    model = nn.Sequential(_Block(), nn.Linear(4, 2))

    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).square().mean()
        loss.backward()
        return loss.detach() + 1

    private.register_stack_trace_anchor(train_step)

    def traced(light: bool) -> list[str | None]:
        model.zero_grad(set_to_none=True)  # the same graph both times: no accumulation
        with private.light_stack_traces() if light else contextlib.nullcontext():
            return _traces(make_fx(train_step, record_stack_traces=True)(torch.randn(3, 4)))

    light, torchs = traced(True), traced(False)
    assert light == torchs
    # the step's own lines, the model's forward lines and backward's nodes all have one
    assert any(t and "in train_step" in t and "in forward" in t for t in light)
    assert any(t and "loss.backward()" in t for t in light)
    assert sum(t is not None for t in light) > len(light) // 2


def test_a_tracer_keeping_every_frame_gets_torchs_extraction() -> None:
    """A plain fx tracer keeps every frame from the first ``forward`` on, which the
    frame walk does not: it falls back to ``CapturedTraceback``."""

    def traced(light: bool) -> list[str | None]:
        tracer = torch.fx.Tracer()
        tracer.record_stack_traces = True
        with private.light_stack_traces() if light else contextlib.nullcontext():
            graph = tracer.trace(_Block())
        return [node.meta.get("stack_trace") for node in graph.nodes]

    light, torchs = traced(True), traced(False)
    assert light == torchs
    assert any(t and "in forward" in t for t in light)


def test_restored_after_and_nested() -> None:
    import torch.fx.proxy as fx_proxy

    real = fx_proxy.CapturedTraceback
    with private.light_stack_traces():
        inside = fx_proxy.CapturedTraceback
        with private.light_stack_traces():
            assert fx_proxy.CapturedTraceback is inside
        assert fx_proxy.CapturedTraceback is inside
    assert fx_proxy.CapturedTraceback is real
    with contextlib.suppress(RuntimeError), private.light_stack_traces():
        raise RuntimeError
    assert fx_proxy.CapturedTraceback is real
