"""Tensor arguments that are not split on dimension 0, on 2 real gloo ranks (NOTE: [inputs
by name] in ``parallel_modes/batch_dims.py``, NOTE: [inputs every rank passes whole] in
``runtime/same_inputs.py``).

A GRU step takes its hidden state (batch in dimension 1) and class weights that hold no
batch. Each rank passes its share of ``x``, ``y`` and ``h`` and the whole weights; with
``input_batch_dim={"h": 1, "weights": None}`` the ranks train as one device does on the
global batch (float64). Before, every argument was one rank's share along dimension 0: the
hidden state could not be passed at all, and the weights were read as a table twice as
long, so the normalized weights ``w / w.sum()`` came out halved on 2 ranks (a loss and
gradients half of one device's, no error). A rank that passes other weights than its
peers is refused, every rank naming each rank's values, with nothing updated. Weights not
named are still read as each rank's share: the first call warns on every rank. Ranks
passing their own Python float (a scale) are refused the same way; before, each trained
on its own and the mean of the two differently scaled losses was applied, no error. So
are tensor-parallel ranks given their own data shards (checked on the first call). A
time-major input pooled over time, nothing named, fails capture at the global shapes the
mode builds (torch's "Expected input batch_size (4) to match target batch_size (8)"); the
error now says which dimension of each argument was taken as the batch and how to name
another (NOTE: [capture failures of split arguments]).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel, TensorParallel
from spmd_compiler.tools.parity import full_state, launch_timeout, relative_difference
from tests.sim.test_inputs_by_name import BATCH, Tagger, _batches
from tests.sim.test_inputs_by_name import rnn_step as step

pytestmark = pytest.mark.dist

WORLD_SIZE = 2


def _setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tagger().double()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _data() -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    return _batches(), torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)


def worker(rank: int, world_size: int, other_weights: bool) -> dict:
    model, optim = _setup()
    before = copy.deepcopy(full_state(model, optim, None))
    compiled = sc.compile(DataParallel("replicate", input_batch_dim={"h": 1, "weights": None}))(step)
    batches, weights = _data()
    if other_weights and rank == 1:
        weights = weights.flip(0)
    share = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    h = torch.zeros(1, BATCH, 8, dtype=torch.float64)
    losses = []
    try:
        for x, y in batches:
            loss, h = compiled(model, optim, x[share], y[share], h[:, share], weights)
            losses.append(loss.detach().clone())
    except SPMDCompileError as exc:
        after = full_state(model, optim, None)
        return {"error": str(exc), "untouched": all(torch.equal(after[k], v) for k, v in before.items())}
    return {"losses": torch.stack(losses), "h": h, "state": full_state(model, optim, None)}


def test_a_hidden_state_and_whole_class_weights_train_as_one_device() -> None:
    results = sc.launch(worker, WORLD_SIZE, args=(False,), timeout_s=launch_timeout(180))
    model, optim = _setup()
    batches, weights = _data()
    h = torch.zeros(1, BATCH, 8, dtype=torch.float64)
    losses = []
    for x, y in batches:
        loss, h = step(model, optim, x, y, h, weights)
        losses.append(loss.detach())
    state = full_state(model, optim, None)
    for rank, got in enumerate(results):
        assert "error" not in got, got.get("error")
        errors = {"losses": relative_difference(got["losses"], torch.stack(losses)),
                  "h": relative_difference(got["h"], h)}
        errors.update({k: relative_difference(got["state"][k], v) for k, v in state.items()})
        worst = max(errors, key=errors.__getitem__)
        assert errors[worst] < 1e-12, f"rank {rank}: {worst} differs by {errors[worst]:.2e}"


def unnamed_then_other_weights(rank: int, world_size: int) -> dict:
    """Weights not named: the first call warns on every rank (its loss is half one
    device's); then the refusal of ranks passing other named weights."""
    model, optim = _setup()
    compiled = sc.compile(DataParallel("replicate", input_batch_dim={"h": 1}))(step)
    (x, y), weights = _data()[0][0], _data()[1]
    share = slice(rank * BATCH // world_size, (rank + 1) * BATCH // world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss, _ = compiled(model, optim, x[share], y[share], torch.zeros(1, BATCH // world_size, 8,
                           dtype=torch.float64), weights)
    out = worker(rank, world_size, True)
    out["unnamed"] = (float(loss), [str(w.message) for w in caught if "same values" in str(w.message)])
    # a Python float each rank passes its own: NOTE: [inputs every rank passes whole]
    scaled = sc.compile(DataParallel("replicate"))(scaled_step)
    linear = nn.Linear(6, 3).double()
    try:
        scaled(linear, torch.optim.SGD(linear.parameters(), lr=0.1), x[share, 0], y[share, 0], 1.0 + rank)
    except SPMDCompileError as exc:
        out["scale"] = str(exc)
    # tensor parallel takes the same batch on every rank: a rank given its own shard
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    tp = sc.compile(TensorParallel({"0": ColwiseParallel(), "2": RowwiseParallel()}))(scaled_step)
    try:
        tp(mlp, torch.optim.SGD(mlp.parameters(), lr=0.1), x[share, 0], y[share, 0], 1.0)
    except SPMDCompileError as exc:
        out["tp"] = str(exc)
    return out


def scaled_step(model, optim, x, y, scale):
    loss = nn.functional.cross_entropy(model(x), y) * scale
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def test_ranks_passing_other_whole_weights_are_refused_with_nothing_updated() -> None:
    results = sc.launch(unnamed_then_other_weights, WORLD_SIZE, timeout_s=launch_timeout(240))
    model, optim = _setup()
    (x, y), weights = _data()[0][0], _data()[1]
    one_device = float(step(model, optim, x, y, torch.zeros(1, BATCH, 8, dtype=torch.float64), weights)[0])
    for rank, got in enumerate(results):
        # NOTE: [the same share on every rank]: the weights read as a table twice as long
        loss, warned = got["unnamed"]
        assert abs(loss - one_device / 2) < 1e-12 * one_device, (rank, loss, one_device)
        assert len(warned) == 1 and "weights (input[3]) (3,)" in warned[0], warned
        assert "input_batch_dim={'weights': None}" in warned[0] and "can be ignored" in warned[0]
    for rank, got in enumerate(results):
        assert "The ranks pass different Python values to the train step" in got.get("scale", ""), got
        assert "rank 0: scale=1.0" in got["scale"] and "rank 1: scale=2.0" in got["scale"]
        assert "any argument under tensor parallel" in got.get("tp", ""), got
        assert "x (input[0]) (2, 6) float64 checksum" in got["tp"]
        assert "error" in got, f"rank {rank} trained with its own weights: {got}"
        message = got["error"]
        assert "pass different values for a tensor argument that every rank passes whole" in message
        assert "weights (input[3]) (3,) float64 checksum" in message
        assert got["untouched"], f"rank {rank}: the refused call changed the model or optimizer"


def _time_major_model(layer: str) -> nn.Module:
    from tests.sim.test_iterated_batches import TimeMajor, TimeMajorEncoder

    torch.manual_seed(0)
    return (TimeMajor() if layer == "rnn" else TimeMajorEncoder()).double()


def time_major_worker(rank: int, world_size: int, layer: str) -> dict:
    """A time-major GRU or encoder layer input, each rank passing its share of the batch
    (dimension 1): refused with the mode's default batch dimension (NOTE: [a batch
    dimension iterated over]), trained with ``input_batch_dim={'x': 1, 'y': 1}`` (the
    labels are (T, B))."""
    from tests.sim.test_iterated_batches import _batches
    from tests.sim.test_iterated_batches import step as gru_step

    model = _time_major_model(layer)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = copy.deepcopy(full_state(model, optim, None))
    batches = _batches()
    batch = batches[0][1].shape[1]
    share = slice(rank * batch // world_size, (rank + 1) * batch // world_size)
    out: dict = {}
    try:
        sc.compile(DataParallel("replicate"))(gru_step)(model, optim, batches[0][0][:, share], batches[0][1][:, share])
    except SPMDCompileError as exc:
        after = full_state(model, optim, None)
        out["error"] = str(exc)
        out["untouched"] = all(torch.equal(after[k], v) for k, v in before.items())
    try:  # the input named, its (T, B) labels not (NOTE: [arguments laid out alike])
        sc.compile(DataParallel("replicate", input_batch_dim={"x": 1}))(gru_step)(
            model, optim, batches[0][0][:, share], batches[0][1][:, share]
        )
    except SPMDCompileError as exc:
        after = full_state(model, optim, None)
        out["labels_error"] = str(exc)
        out["untouched"] &= all(torch.equal(after[k], v) for k, v in before.items())
    named = sc.compile(DataParallel("replicate", input_batch_dim={"x": 1, "y": 1}))(gru_step)
    for x, y in batches:
        named(model, optim, x[:, share], y[:, share])
    out["state"] = full_state(model, optim, None)
    if layer == "rnn":
        out.update(pooled_worker(rank, world_size))
    return out


def pooled_step(model, optim, x, y):
    """A time-major (S, B, E) input pooled over time, with (B,) labels."""
    loss = nn.functional.cross_entropy(model(x.mean(0)), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _pooled_setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    x, y = torch.randn(6, 8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), x, y


def pooled_worker(rank: int, world_size: int) -> dict:
    """NOTE: [capture failures of split arguments]: nothing named, ``x`` is captured as
    (12, 4, 5) beside (8,) labels and torch's cross_entropy refuses the batch sizes; the
    error says which dimensions were taken as the batch and how to name another."""
    model, optim, x, y = _pooled_setup()
    before = copy.deepcopy(full_state(model, optim, None))
    share = slice(rank * 8 // world_size, (rank + 1) * 8 // world_size)
    out: dict = {}
    try:
        sc.compile(DataParallel("replicate"))(pooled_step)(model, optim, x[:, share], y[share])
    except SPMDCompileError as exc:
        after = full_state(model, optim, None)
        out["pooled_error"] = str(exc)
        out["pooled_untouched"] = all(torch.equal(after[k], v) for k, v in before.items())
    named = sc.compile(DataParallel("replicate", input_batch_dim={"x": 1}))(pooled_step)
    out["pooled_loss"] = float(named(model, optim, x[:, share], y[share]))
    return out


@pytest.mark.parametrize(("layer", "fqn"), [("rnn", "'rnn' (GRU, batch_first=False)"), ("attention", "'enc.self_attn' (MultiheadAttention, batch_first=False)")])
def test_a_time_major_input_is_refused_unless_its_batch_dimension_is_named(layer: str, fqn: str) -> None:
    from tests.sim.test_iterated_batches import _batches
    from tests.sim.test_iterated_batches import step as gru_step

    results = sc.launch(time_major_worker, WORLD_SIZE, args=(layer,), timeout_s=launch_timeout(180))
    model = _time_major_model(layer)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in _batches():
        gru_step(model, optim, x, y)
    want = full_state(model, optim, None)
    for rank, got in enumerate(results):
        message = got.get("error", "")
        assert f"The layer {fqn} reads dimension 0" in message, (rank, got)
        assert "input_batch_dim={'x': 1, 'y': 1}" in message
        labels = got.get("labels_error", "")
        assert "The step argument(s) 'y' is laid out like 'x'" in labels, (rank, labels)
        assert "input_batch_dim={'x': 1, 'y': 1}" in labels and "{'y': 0}" in labels
        assert got["untouched"], f"rank {rank}: the refused call changed the model or optimizer"
        errors = {k: relative_difference(got["state"][k], v) for k, v in want.items()}
        worst = max(errors, key=errors.__getitem__)
        # attention: the key bias's gradient is rounding only (the sim test says why)
        assert errors[worst] < (1e-12 if layer == "rnn" else 1e-9), f"rank {rank}: {worst} differs by {errors[worst]:.2e}"
    if layer != "rnn":
        return
    model, optim, x, y = _pooled_setup()
    want_loss = float(pooled_step(model, optim, x, y))
    for rank, got in enumerate(results):
        message = got.get("pooled_error", "")
        assert "Expected input batch_size (4) to match target batch_size (8)" in message, (rank, got)
        assert "'x' along dimension 0 (this rank's (6, 4, 5) as (12, 4, 5))" in message, message
        assert "'y' along dimension 0 (this rank's (4,) as (8,))" in message, message
        assert "input_batch_dim={'x': 1}" in message, message
        assert got["pooled_untouched"], f"rank {rank}: the refused call changed the model"
        assert abs(got["pooled_loss"] - want_loss) <= 1e-12 * abs(want_loss)
