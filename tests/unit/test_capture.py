"""Capture: one functional ATen graph of forward, loss, backward and optimizer update.

Uses ``find_bindings`` + ``capture_step`` directly (no expansion, no ranks) and checks the
graph and its signature: no value reads, no in-place ops, lr as an input, updated state as
outputs, and the node metadata that errors rely on (module FQN, train-step line).
"""

from __future__ import annotations

import copy
import inspect
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spmd_compiler.capture.bindings import find_bindings
from spmd_compiler.capture.trace import capture_step
from spmd_compiler.ir.graph_utils import output_args, placeholders
from spmd_compiler.ir.node_meta import MODULE_FQN, USER_LINE
from spmd_compiler.ir.signature import CapturedStep, Kind, TensorMeta


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16))
        self.act = nn.GELU()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.act(self.encoder(x)))


class BatchNormNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.bn(self.fc(x)))


def step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}
STATE_KEYS = {
    "sgd_momentum": {"momentum_buffer"},
    "adam": {"step", "exp_avg", "exp_avg_sq"},
    "adamw_foreach": {"step", "exp_avg", "exp_avg_sq"},
}


def batch(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 8, generator=gen), torch.randint(0, 4, (n,), generator=gen)


def capture(model, optimizer, x, y, func=step) -> CapturedStep:
    bindings = find_bindings(func, (model, optimizer, x, y), {})
    return capture_step(func, bindings, [TensorMeta.of(x), TensorMeta.of(y)])


def call_nodes(captured: CapturedStep) -> list[torch.fx.Node]:
    return [n for n in captured.graph_module.graph.nodes if n.op == "call_function"]


def op_name(node: torch.fx.Node) -> str:
    """``aten::add_`` style name of an ATen op node ('' for getitem etc.)."""
    schema = getattr(node.target, "_schema", None)
    return schema.name if schema is not None else ""


def warmed_up(optimizer_name: str, model: nn.Module) -> torch.optim.Optimizer:
    """An optimizer after one eager step, so that its state exists (steady state)."""
    opt = OPTIMIZERS[optimizer_name](model.parameters())
    step(model, opt, *batch())
    return opt


@pytest.fixture(params=list(OPTIMIZERS))
def optimizer_name(request) -> str:
    return request.param


@pytest.fixture(params=["first_step", "steady_state"])
def captured(request, optimizer_name) -> CapturedStep:
    model = Net()
    if request.param == "first_step":
        opt = OPTIMIZERS[optimizer_name](model.parameters())
    else:
        opt = warmed_up(optimizer_name, model)
    return capture(model, opt, *batch())


# ---------------------------------------------------------------- functional graph


def test_no_value_reads(captured):
    ops = {op_name(n) for n in call_nodes(captured)}
    assert "aten::_local_scalar_dense" not in ops
    assert "aten::item" not in ops


def test_no_in_place_ops(captured):
    others = [n.target for n in call_nodes(captured) if not op_name(n)]
    assert set(others) <= {operator.getitem}, "every node should be an ATen op or getitem"
    names = [op_name(n) for n in call_nodes(captured)]
    in_place = [n for n in names if n.split("::")[-1].endswith("_")]
    assert in_place == []
    assert "aten::copy_" not in names
    mutating = [
        n.name
        for n in call_nodes(captured)
        if getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable
    ]
    assert mutating == []


def test_batchnorm_running_stats_are_outputs_not_mutations():
    """native_batch_norm mutates running stats without an ``_`` name: it must not stay."""
    model = BatchNormNet()
    captured = capture(model, torch.optim.SGD(model.parameters(), lr=0.1), *batch())
    mutating = [
        str(n.target)
        for n in call_nodes(captured)
        if getattr(n.target, "_schema", None) is not None and n.target._schema.is_mutable
    ]
    assert mutating == []
    buffers_out = {ref.name for ref in captured.outputs if ref.kind is Kind.BUFFER}
    assert buffers_out == {"bn.running_mean", "bn.running_var", "bn.num_batches_tracked"}


# ---------------------------------------------------------------- signature


def test_lr_is_a_hyperparam_placeholder(captured):
    lr_inputs = [
        (i, meta)
        for i, (ref, meta) in enumerate(captured.inputs)
        if ref.kind is Kind.HYPERPARAM and ref.key == "lr"
    ]
    assert len(lr_inputs) == 1
    index, meta = lr_inputs[0]
    assert meta.shape == ()
    assert meta.dtype == torch.float64
    placeholder = placeholders(captured.graph_module)[index]
    assert placeholder.users, "the lr placeholder is not used by the update"
    assert all(n.meta.get(USER_LINE) is not None for n in placeholder.users)
    assert all("optim.step()" in n.meta[USER_LINE].code for n in placeholder.users)


@pytest.mark.parametrize("optimizer_name", list(OPTIMIZERS))
def test_lr_value_is_not_baked_in(optimizer_name):
    """Two learning rates, one graph: the value appears nowhere as a constant."""
    codes = []
    for lr in (0.0123, 0.4567):
        model = Net()
        opt = OPTIMIZERS[optimizer_name](model.parameters())
        for group in opt.param_groups:
            group["lr"] = lr
        captured = capture(model, opt, *batch())
        codes.append(captured.graph_module.code)
        assert str(lr) not in captured.graph_module.code
    assert codes[0] == codes[1]


def test_one_lr_placeholder_per_param_group():
    model = Net()
    opt = torch.optim.AdamW(
        [
            {"params": model.encoder.parameters()},
            {"params": model.head.parameters(), "lr": 3e-2, "weight_decay": 0.5},
        ],
        lr=1e-2,
    )
    captured = capture(model, opt, *batch())
    # the learning rate and AdamW's beta1 (NOTE: [Adam's beta1 as a graph input])
    groups = [(ref.group, ref.key) for ref, _ in captured.inputs if ref.kind is Kind.HYPERPARAM]
    assert groups == [(0, "lr"), (0, "beta1"), (1, "lr"), (1, "beta1")]
    state_groups = {
        (ref.name, ref.group) for ref in captured.outputs if ref.kind is Kind.OPTIM_STATE
    }
    assert ("encoder.0.weight", 0) in state_groups
    assert ("head.weight", 1) in state_groups


def test_outputs_hold_params_and_optimizer_state(captured, optimizer_name):
    names = {n for n, _ in Net().named_parameters()}
    assert captured.outputs[0].kind is Kind.RETURN
    assert [r.kind for r in captured.outputs].count(Kind.RETURN) == 1
    assert {r.name for r in captured.outputs if r.kind is Kind.PARAM} == names
    state = {(r.name, r.key) for r in captured.outputs if r.kind is Kind.OPTIM_STATE}
    assert state == {(n, k) for n in names for k in STATE_KEYS[optimizer_name]}
    # Gradients are zeroed to None by zero_grad(): none survive the step.
    assert not [r for r in captured.outputs if r.kind is Kind.GRAD]
    assert len(output_args(captured.graph_module)) == len(captured.outputs)
    assert len(captured.output_metas) == len(captured.outputs)


def test_first_step_creates_state_steady_state_consumes_it(optimizer_name):
    model = Net()
    first = capture(model, OPTIMIZERS[optimizer_name](model.parameters()), *batch())
    assert not [r for r, _ in first.inputs if r.kind is Kind.OPTIM_STATE]
    steady = capture(model, warmed_up(optimizer_name, model), *batch())
    state_in = {(r.name, r.key) for r, _ in steady.inputs if r.kind is Kind.OPTIM_STATE}
    state_out = {(r.name, r.key) for r in steady.outputs if r.kind is Kind.OPTIM_STATE}
    assert state_in == state_out
    assert len(state_in) == len(list(model.parameters())) * len(STATE_KEYS[optimizer_name])
    step_counters = [m for r, m in steady.inputs if r.kind is Kind.OPTIM_STATE and r.key == "step"]
    assert all(m.dtype == torch.float64 and m.shape == () for m in step_counters)


def test_inputs_are_tagged_in_order(captured):
    kinds = [ref.kind for ref, _ in captured.inputs]
    assert len(kinds) == len(placeholders(captured.graph_module))
    assert kinds[-2:] == [Kind.INPUT, Kind.INPUT]
    assert [ref.index for ref, _ in captured.inputs[-2:]] == [0, 1]
    assert captured.inputs[-2][1].shape == (6, 8)
    assert kinds.count(Kind.PARAM) == len(list(Net().parameters()))


# ---------------------------------------------------------------- node metadata


def test_forward_nodes_carry_module_fqn():
    model = Net()
    captured = capture(model, torch.optim.SGD(model.parameters(), lr=0.1), *batch())
    fqn_by_op: dict[str, set] = {}
    for n in call_nodes(captured):
        if op_name(n):
            fqn_by_op.setdefault(op_name(n), set()).add(n.meta.get(MODULE_FQN))
    assert fqn_by_op["aten::addmm"] == {"encoder.0", "head"}
    assert fqn_by_op["aten::native_layer_norm"] == {"encoder.1"}
    assert fqn_by_op["aten::gelu"] == {"act"}
    # The loss is computed outside every module.
    assert fqn_by_op["aten::nll_loss_forward"] == {None}


def step_lines() -> dict[str, int]:
    source, first = inspect.getsourcelines(step)
    return {line.strip(): first + i for i, line in enumerate(source)}


def test_nodes_carry_the_train_step_line(captured):
    lines = step_lines()
    forward = lines["loss = F.cross_entropy(model(x), y)"]
    backward = lines["loss.backward()"]
    update = lines["optim.step()"]
    seen: dict[int, list[str]] = {}
    for n in call_nodes(captured):
        where = n.meta.get(USER_LINE)
        assert where is not None, f"{n.name} has no train-step line"
        assert where.filename == __file__
        seen.setdefault(where.lineno, []).append(op_name(n))
    assert set(seen) <= {forward, backward, update}
    assert "aten::addmm" in seen[forward]
    assert "aten::native_layer_norm_backward" in seen[backward]
    assert "aten::gelu_backward" in seen[backward]
    assert "aten::addmm" not in seen[update]
    assert len(seen[update]) >= len(list(Net().parameters()))
    code = {n.meta[USER_LINE].code for n in call_nodes(captured)}
    assert code == {"loss = F.cross_entropy(model(x), y)", "loss.backward()", "optim.step()"}


# ---------------------------------------------------------------- no side effects


def test_capture_leaves_model_and_optimizer_untouched(optimizer_name):
    model = Net()
    opt = warmed_up(optimizer_name, model)
    params = list(model.parameters())
    values = copy.deepcopy(model.state_dict())
    opt_state = copy.deepcopy(opt.state_dict())
    groups = opt.param_groups
    capture(model, opt, *batch())
    assert list(model.parameters()) == params
    assert all(type(p) is nn.Parameter and p.grad is None for p in params)
    for key, value in model.state_dict().items():
        assert torch.equal(value, values[key]), key
    after = opt.state_dict()
    assert after["param_groups"] == opt_state["param_groups"]
    for pid, entries in opt_state["state"].items():
        for key, value in entries.items():
            assert torch.equal(after["state"][pid][key], value), (pid, key)
            assert after["state"][pid][key].dtype == value.dtype
    assert opt.param_groups is groups
    assert all(isinstance(g["lr"], float) for g in opt.param_groups)
    assert "step" not in vars(opt)
