"""A step that iterates over the dimension a data-parallel mode splits as the batch
(NOTE: [a batch dimension iterated over] in ``spmd_compiler/expand/iterated_batches.py``).

A time-major argument passed without naming its batch dimension is split along time. In
simulation the global value is split and put back right, so the step matches eager
either way; the compile warns, naming the op, the module and the line, because on real
ranks the same step would read each rank's share as a longer sequence and train wrong
(refused there: ``tests/dist/test_inputs_by_name_gloo.py``). Naming the dimension
silences it, and batch-first recurrences never warn.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel, FullyShardTensorParallel
from spmd_compiler.tools.parity import compare_states, full_state

WORLD, T, BATCH = 2, 6, 4


class TimeMajor(nn.Module):
    """A tagger on nn.GRU with its default layout: (T, B, F) in, every step classified
    (so labels are (T, B) and shapes agree however the time axis is cut)."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        self.batch_first = batch_first
        self.rnn = nn.GRU(5, 8, batch_first=batch_first)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


class TimeMajorEncoder(nn.Module):
    """torch's own encoder layer with its default layout, sequence first: attention never
    walks time, it reads the whole of dimension 0 at once. ``transpose``: the step's input
    is batch-first and turned sequence-first before the layer (nothing to warn about)."""

    def __init__(self, transpose: bool = False) -> None:
        super().__init__()
        self.transpose = transpose
        self.enc = nn.TransformerEncoderLayer(5, 1, 8, dropout=0.0)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.enc(x.transpose(0, 1) if self.transpose else x)
        return self.head(out.transpose(0, 1) if self.transpose else out)


class KeywordAttention(nn.Module):
    """nn.MultiheadAttention (sequence first) called with keywords, as many models do."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(5, 1)
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(query=x, key=x, value=x, need_weights=False)[0])


class HandLoop(nn.Module):
    """A recurrence written by hand over the time steps of a time-major input."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.GRUCell(5, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, out = x.new_zeros(x.shape[1], 8), []
        for t in range(x.shape[0]):
            h = self.cell(x[t], h)
            out.append(h)
        return self.head(torch.stack(out))


def step(model, optim, x, y):
    loss = F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _batches(batch_first: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    shape = (BATCH, T) if batch_first else (T, BATCH)
    return [(torch.randn(*shape, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, shape, generator=gen))
            for _ in range(3)]


def _train(model: nn.Module, mode, batch_first: bool = False) -> tuple[list[str], dict]:
    """Three steps of ``model`` (a copy) under ``mode`` on 2 simulated ranks against the
    undecorated step; returns the warnings about iterated batches and the worst error."""
    return _train_world(model, mode, batch_first=batch_first, world=WORLD)


def _train_world(model: nn.Module, mode, batch_first: bool = False, world: int = WORLD) -> tuple[list[str], dict]:
    torch.manual_seed(0)
    eager = copy.deepcopy(model)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    compiled_model = copy.deepcopy(model)
    opt = torch.optim.AdamW(compiled_model.parameters(), lr=1e-2)
    compiled = sc.compile(parallel_mode=mode)(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sc.simulate(world_size=world):
            for x, y in _batches(batch_first):
                compiled(compiled_model, opt, x, y)
                step(eager, eager_opt, x, y)
            got = full_state(compiled_model, opt, None)
    want = full_state(eager, eager_opt, None)
    return [str(w.message) for w in caught if "the dimension the mode splits as the batch" in str(w.message)], compare_states(got, want)


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_a_time_major_gru_warns_naming_the_op_and_the_way_out_and_matches_eager(style: str) -> None:
    torch.manual_seed(0)
    warned, errors = _train(TimeMajor().double(), DataParallel(style))
    assert max(errors.values()) < 1e-12, errors
    assert len(warned) == 1, warned
    message = warned[0]
    assert "The layer 'rnn' (GRU, batch_first=False) reads dimension 0" in message
    assert "computed from the step argument(s) 'x' as time" in message
    assert "module:      rnn" in message
    # the labels, (T, B) beside x's (T, B, F), are named with it
    assert "input_batch_dim={'x': 1, 'y': 1}" in message and "input_batch_dim={'x': 0}" in message
    assert "'y' has a dimension 0 of the same size" in message
    assert "refused on real ranks" in message
    assert "test_iterated_batches.py" in message  # the train step's line


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_sequence_first_attention_warns_and_matches_eager(style: str) -> None:
    """nn.MultiheadAttention (in nn.TransformerEncoderLayer) with batch_first=False reads
    dimension 0 as the sequence: split there without a name, it is refused on real ranks
    (``tests/dist/test_inputs_by_name_gloo.py``) and warned about here."""
    torch.manual_seed(0)
    warned, errors = _train(TimeMajorEncoder().double(), DataParallel(style))
    # the key bias's gradient is zero but for rounding (softmax ignores a constant per
    # query): its Adam update is rounding divided by rounding, 1e-10 relative at worst
    assert max(errors.values()) < 1e-9, errors
    assert len(warned) == 1, warned
    assert "The layer 'enc.self_attn' (MultiheadAttention, batch_first=False) reads dimension 0" in warned[0]
    assert "input_batch_dim={'x': 1, 'y': 1}" in warned[0] and "refused on real ranks" in warned[0]
    warned, errors = _train(TimeMajorEncoder().double(), DataParallel(style, input_batch_dim={"x": 1, "y": 1}))
    assert warned == [] and max(errors.values()) < 1e-9, (warned, errors)


def test_sequence_first_attention_called_with_keywords_warns() -> None:
    torch.manual_seed(0)
    warned, errors = _train(KeywordAttention().double(), DataParallel("replicate"))
    assert max(errors.values()) < 1e-9, errors
    assert len(warned) == 1 and "The layer 'attn' (MultiheadAttention, batch_first=False)" in warned[0], warned


def test_a_batch_first_input_turned_sequence_first_does_not_warn() -> None:
    torch.manual_seed(0)
    warned, errors = _train(TimeMajorEncoder(transpose=True).double(), DataParallel("replicate"), batch_first=True)
    assert warned == [] and max(errors.values()) < 1e-9, (warned, errors)


class TurnedBatchFirst(nn.Module):
    """A time-major ``(T, B, F)`` input turned batch-first for a layer with
    ``batch_first=True``: the layer reads dimension 1 of what it is given as time, the
    dimension the split of the unnamed input lands on."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        self.layer = layer
        self.body = (
            nn.GRU(5, 5, batch_first=True) if layer == "gru"
            else nn.TransformerEncoderLayer(5, 1, 8, dropout=0.0, batch_first=True)
        )
        self.head = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.body(x.transpose(0, 1))
        return self.head((out[0] if self.layer == "gru" else out).transpose(0, 1))


@pytest.mark.parametrize(("layer", "label"), [
    ("gru", "'body' (GRU, batch_first=True)"),
    ("encoder", "'body.self_attn' (MultiheadAttention, batch_first=True)"),
])
def test_a_time_major_input_turned_batch_first_for_a_layer_warns(layer: str, label: str) -> None:
    """Before, only layers with ``batch_first=False`` were marked: on 2 gloo ranks this
    step trained 4.1e-1 (encoder) and 8.2e-2 (GRU, warned only as a hand loop) relative
    off one device, and here nothing named the layer."""
    torch.manual_seed(0)
    warned, errors = _train(TurnedBatchFirst(layer).double(), DataParallel("replicate"))
    assert max(errors.values()) < 1e-9, errors
    assert len(warned) == 1, warned
    assert f"The layer {label} reads dimension 1 of a value computed from the step argument(s) 'x'" in warned[0]
    assert "refused on real ranks" in warned[0]
    warned, errors = _train(TurnedBatchFirst(layer).double(), DataParallel("replicate", input_batch_dim={"x": 1, "y": 1}))
    assert warned == [] and max(errors.values()) < 1e-9, (warned, errors)


def test_a_named_batch_dimension_compiles_quietly_and_matches_eager() -> None:
    torch.manual_seed(0)
    for batch_dims in ({"x": 1, "y": 1}, {"x": 0}):
        warned, errors = _train(TimeMajor().double(), DataParallel("replicate", input_batch_dim=batch_dims))
        assert warned == [], (batch_dims, warned)
        assert max(errors.values()) < 1e-12, (batch_dims, errors)
    warned, _ = _train(TimeMajor().double(), DataParallel("replicate", input_batch_dim=0))
    assert warned == []  # an explicit int names every argument's dimension


def test_a_hand_written_time_loop_warns() -> None:
    """A loop by hand may walk time or samples: warned (both ways named), not refused."""
    torch.manual_seed(0)
    warned, errors = _train(HandLoop().double(), DataParallel("replicate"))
    assert max(errors.values()) < 1e-12, errors
    assert len(warned) == 1 and "aten.select.int" in warned[0], warned
    assert "a loop over samples (valid), or over the time steps" in warned[0]
    assert "refused on real ranks" not in warned[0]


class PerSample(nn.Module):
    """A batch-first step looping over its samples (``for xi in x``), and one sample picked."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.lin(xi).mean(0) for xi in x]) + 0.0 * self.lin(x[0]).sum()


def _per_sample_step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _per_sample_warnings(model: nn.Module) -> list[str]:
    """The iterated-batch warnings of one ddp call of ``_per_sample_step`` on ``model``
    (batch-first x (B, T, 5), labels y (B,))."""
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(_per_sample_step)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, T, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=gen)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sc.simulate(world_size=WORLD):
            compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    return [str(w.message) for w in caught if "the dimension the mode splits as the batch" in str(w.message)]


def test_a_loop_over_samples_warns_with_both_ways_out_and_names_only_what_can_be_named() -> None:
    torch.manual_seed(0)
    warned = _per_sample_warnings(PerSample().double())
    assert len(warned) == 1 and "input_batch_dim={'x': 0}" in warned[0], warned
    # y, (B,), has no dimension 1 to suggest
    assert "'y': 1" not in warned[0]


def _cutmix_step(model, optim, x, y, box):
    """CutMix with its box (y0, y1, x0, x1) as a tensor every rank passes whole."""
    r, c = torch.arange(x.shape[-2])[:, None], torch.arange(x.shape[-1])[None, :]
    mask = ((r >= box[0]) & (r < box[1]) & (c >= box[2]) & (c < box[3])).to(x.dtype)
    loss = F.cross_entropy(model((x * (1 - mask) + x.flip(0) * mask).flatten(1)), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("named", [False, True])
def test_a_box_argument_walked_as_the_batch_is_told_it_may_be_whole(named: bool) -> None:
    """CutMix's (4,) box read element by element is walked along its split dimension 0:
    the warning named only ``{'box': 0}``; it now gives ``{'box': None}`` too, which
    compiles quietly and matches eager (timm angle, sixty-sixth session)."""
    torch.manual_seed(0)
    model = nn.Linear(16, 3).double()
    reference = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 4, 4, generator=gen, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=gen)
    box = torch.tensor([1, 3, 0, 2])
    mode = DataParallel("replicate", input_batch_dim={"box": None}) if named else DataParallel("replicate")
    compiled = sc.compile(parallel_mode=mode)(_cutmix_step)
    want = _cutmix_step(reference, torch.optim.SGD(reference.parameters(), lr=0.1), x, y, box)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sc.simulate(world_size=WORLD) as sim:
            got = compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y, box)
            errors = compare_states(full_state(model, None, sim), full_state(reference, None, None))
            assert abs(float(sim.full_tensor(got)) - float(want)) < 1e-12
    warned = [str(w.message) for w in caught if "the dimension the mode splits as the batch" in str(w.message)]
    if named:
        assert warned == [], warned
    else:
        assert len(warned) == 1 and "input_batch_dim={'box': None}" in warned[0], warned
    assert max(errors.values()) < 1e-12, errors


def test_a_single_rank_has_no_split_to_walk() -> None:
    torch.manual_seed(0)
    warned, errors = _train_world(TimeMajor().double(), DataParallel("replicate"), world=1)
    assert warned == [] and max(errors.values()) < 1e-12, (warned, errors)


def test_dtensor_expand_mode_warns_with_its_own_way_out() -> None:
    from spmd_compiler.parallel_modes import DTensorExpandMode

    torch.manual_seed(0)
    warned, errors = _train(TimeMajor().double(), DTensorExpandMode())
    assert max(errors.values()) < 1e-12, errors
    assert len(warned) == 1 and "input_placements={i: (Shard(1),)}" in warned[0], warned


def test_batch_first_recurrence_does_not_warn() -> None:
    torch.manual_seed(0)
    warned, errors = _train(TimeMajor(batch_first=True).double(), DataParallel("replicate"), batch_first=True)
    assert warned == [] and max(errors.values()) < 1e-12, (warned, errors)


def test_fsdp_tp_warns_for_its_dp_split_too() -> None:
    torch.manual_seed(0)
    plan = {"head": ColwiseParallel()}
    mode = FullyShardTensorParallel({"head": ColwiseParallel()}, mesh_shape=(2, 1))
    warned, errors = _train(TimeMajor().double(), mode)
    assert len(warned) == 1 and "'x'" in warned[0], warned
    assert max(errors.values()) < 1e-12, errors
    named = FullyShardTensorParallel(plan, mesh_shape=(2, 1), input_batch_dim={"x": 1, "y": 1})
    warned, errors = _train(TimeMajor().double(), named)
    assert warned == [] and max(errors.values()) < 1e-12, (warned, errors)


def test_a_loop_over_samples_in_an_installed_library_is_not_warned_about(tmp_path, monkeypatch) -> None:
    """transformers' LLaVA walks its images (batch-first by convention): a library's loop
    is no time loop of the user's; the same loop in the step's own code warns (above)."""
    library = tmp_path / "site-packages"
    library.mkdir()
    (library / "per_sample_library.py").write_text(
        "import torch\n\n\nclass PerSample(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.lin = torch.nn.Linear(5, 3)\n\n"
        "    def forward(self, x):\n        return torch.stack([self.lin(xi).mean(0) for xi in x])\n"
    )
    monkeypatch.syspath_prepend(str(library))
    import per_sample_library

    torch.manual_seed(0)
    assert not _per_sample_warnings(per_sample_library.PerSample().double())


def test_values_read_out_with_tolist_are_no_walk() -> None:
    """``.tolist()`` of batch-shaped results (predictions kept for metrics) walks the batch
    dimension only to read each element out: no warning, and eager's lists."""

    def predictions(model, optim, x, y):
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss, logits.argmax(-1).tolist(), logits.detach()[:, :2].tolist()

    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    eager = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(BATCH, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (BATCH,), generator=gen)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(predictions)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sc.simulate(world_size=WORLD):
            _, got, rows = compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    _, want, want_rows = predictions(eager, torch.optim.SGD(eager.parameters(), lr=0.1), x, y)
    assert not [w for w in caught if "the dimension the mode splits as the batch" in str(w.message)]
    assert got == want and len(rows) == BATCH
    assert max(abs(a - b) for r, s in zip(rows, want_rows) for a, b in zip(r, s)) < 1e-12


@pytest.mark.parametrize("model", ["rnn", "attention"])
def test_labels_laid_out_like_a_named_time_major_input_warn(model: str) -> None:
    """NOTE: [arguments laid out alike] in ``parallel_modes/batch_dims.py``: the input
    named time-major, its (T, B) labels not: warned here (refused on real ranks,
    ``tests/dist/test_inputs_by_name_gloo.py``); naming both, or the labels' dimension 0
    explicitly, is quiet."""
    torch.manual_seed(0)
    layer = TimeMajor() if model == "rnn" else TimeMajorEncoder()

    def alike(mode) -> tuple[list[str], dict]:
        eager = copy.deepcopy(layer).double()
        compiled = sc.compile(parallel_mode=mode)(step)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with sc.simulate(world_size=WORLD):
                trained = copy.deepcopy(layer).double()
                opt, eager_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (trained, eager))
                for x, y in _batches():
                    compiled(trained, opt, x, y)
                    step(eager, eager_opt, x, y)
                got = full_state(trained, opt, None)
        return [str(w.message) for w in caught if "laid out like" in str(w.message)], compare_states(
            got, full_state(eager, eager_opt, None))

    warned, errors = alike(DataParallel("replicate", input_batch_dim={"x": 1}))
    assert len(warned) == 1 and "The step argument(s) 'y' is laid out like 'x'" in warned[0], warned
    assert "refused on real ranks" in warned[0] and max(errors.values()) < 1e-9, errors
    for quiet in ({"x": 1, "y": 1}, {"x": 1, "y": 0}):
        warned, _ = alike(DataParallel("replicate", input_batch_dim=quiet))
        assert warned == [], (quiet, warned)


class TimeMajorConv(nn.Module):
    """A convolution over time of a ``(T, B, C)`` input: split unnamed along time, the
    convolution's local result cannot be computed from a share of its length."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(5, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x.permute(1, 2, 0))).permute(2, 0, 1))


@pytest.mark.parametrize("mode", ["fsdp_tp", "dtensor_expand"])
def test_a_convolution_over_a_time_major_argument_split_unnamed_is_refused(mode) -> None:
    """A convolution's input sharded on a spatial dimension is gathered where tensor
    parallelism put the shard (sequence parallelism); over the mesh dimensions a mode
    splits the arguments on, it is an argument split along time, which on real ranks
    would join the ranks' samples along time: refused there (a first version of the
    gather compiled it: found by CI of the fifty-seventh session)."""
    from spmd_compiler.parallel_modes import DTensorExpandMode

    made = FullyShardTensorParallel({}, mesh_shape=(WORLD, 1)) if mode == "fsdp_tp" else DTensorExpandMode()
    x, y = _batches()[0]
    model = TimeMajorConv().double()
    with sc.simulate(world_size=WORLD), pytest.raises(sc.SPMDCompileError, match="local result"):
        sc.compile(made)(step)(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)


def test_a_local_shape_refusal_of_a_split_argument_names_input_batch_dim() -> None:
    """The refusal's hint was only about sharding strategies; the way out, naming the
    time-major argument's batch dimension, trains as eager."""
    torch.manual_seed(0)
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(step)
    x, y = _batches()[0]
    model = TimeMajorConv().double()
    with sc.simulate(world_size=WORLD), pytest.raises(sc.SPMDCompileError) as info:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), x, y)
    assert "if 'x' holds the batch on another dimension" in str(info.value)
    assert "input_batch_dim={'x': <its batch dimension>}" in str(info.value)
    warned, errors = _train(TimeMajorConv().double(), DataParallel("replicate", input_batch_dim={"x": 1, "y": 1}))
    assert warned == [] and max(errors.values()) < 1e-12, (warned, errors)


def _gru_with_h0_step(model, optim, x, h0):  # noqa: ANN001
    out, _ = model(x, h0)
    loss = out.pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_a_recurrent_layers_initial_hidden_state_is_named_by_the_way_out() -> None:
    """A batch-first GRU given ``h0`` (layers, B, H) unnamed: the layer walks over h0's
    dimension 0, warned of in simulation with the way out ``input_batch_dim={'h0': 1}``
    (on real ranks the GRU's shape check refuses it, the hint naming h0: tests/unit/
    test_errors.py) and the root module named as such (it was ''); named, it compiles
    quietly and matches eager."""
    torch.manual_seed(0)
    model = nn.GRU(5, 8, num_layers=2, batch_first=True).double()
    eager, other = copy.deepcopy(model), copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, T, 5, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, BATCH, 8, generator=gen, dtype=torch.float64)
    compiled = sc.compile(parallel_mode=DataParallel("replicate", input_batch_dim={"h0": 1}))(_gru_with_h0_step)
    unnamed = sc.compile(parallel_mode=DataParallel("replicate"))(_gru_with_h0_step)
    with warnings.catch_warnings(record=True) as caught, sc.simulate(world_size=WORLD):
        warnings.simplefilter("always")
        loss = unnamed(other, torch.optim.SGD(other.parameters(), lr=0.1), x, h0)
        named = compiled(model, optim, x, h0)
    assert torch.allclose(named, _gru_with_h0_step(eager, eager_opt, x, h0), rtol=1e-13, atol=0)
    assert torch.allclose(loss, named, rtol=1e-13, atol=0)
    warned = [str(w.message) for w in caught if "the dimension the mode splits as the batch" in str(w.message)]
    assert len(warned) == 1, warned  # the unnamed compile's only
    assert "The layer <root module> (GRU, batch_first=True)" in warned[0]
    assert "input_batch_dim={'h0': 1}" in warned[0]
    # NOTE: [a hidden state's layers walked]: dimension 0 of h0 is its layers, not time
    # (the message said "reads dimension 0 of ... 'h0' as time", sixty-fourth session)
    assert "walks dimension 0 of a value computed from the step argument(s) 'h0', its hidden state's layers" in warned[0]
    assert "as time" not in warned[0] and "time-major" not in warned[0], warned[0]


class TokenLM(nn.Module):
    """A batch-first language model: Embedding of (B, T) tokens into a batch_first GRU."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 5)
        self.rnn = nn.GRU(5, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


@pytest.mark.parametrize("model", ["tokens", "floats"])
def test_a_named_batch_dimension_a_recurrent_layer_reads_as_time_is_refused(model: str) -> None:
    """NOTE: [a named batch dimension read as time]: batch-first x named {'x': 1} into a
    batch_first=True GRU (through an Embedding, or directly) compiled with no warning and,
    on 2 gloo ranks, trained wrong (weights up to 0.188 relative off, sixty-fourth
    session). Refused in simulation too, naming the layer, the argument and the
    dimensions; the model and optimizer as found."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if model == "tokens":
        net: nn.Module = TokenLM().double()
        x = torch.randint(0, 11, (BATCH, T), generator=gen)
    else:
        net = TimeMajor(batch_first=True).double()
        x = torch.randn(BATCH, T, 5, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (BATCH, T), generator=gen)
    optim = torch.optim.AdamW(net.parameters(), lr=1e-2)
    before = copy.deepcopy(full_state(net, optim, None))
    compiled = sc.compile(parallel_mode=DataParallel("replicate", input_batch_dim={"x": 1, "y": 1}))(step)
    with sc.simulate(world_size=WORLD), pytest.raises(sc.SPMDCompileError) as info:
        compiled(net, optim, x, y)
    message = str(info.value)
    assert "input_batch_dim names the batch of 'x' as dimension 1" in message, message
    # through an Embedding the layer's input is marked (dimension 1); passed directly,
    # the walk inside the layer is of its transposed (T, B, F) value (dimension 0)
    assert "(GRU, batch_first=True) reads dimension" in message and "computed from it as time" in message
    assert "leave it out of input_batch_dim or name it {'x': 0}" in message
    after = full_state(net, optim, None)
    assert all(torch.equal(after[k], v) for k, v in before.items())
    # left at dimension 0, it trains as eager
    warned, errors = _train(net, DataParallel("replicate"), batch_first=True) if model == "floats" else ([], {"": 0.0})
    assert warned == [] and max(errors.values()) < 1e-12, (warned, errors)


class EdgeIndexLayer(nn.Module):
    """A GNN layer over an edge_index (2, E): messages from ``ei[0]`` summed at ``ei[1]``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 3)

    def forward(self, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        return torch.zeros_like(h).index_add_(0, ei[1], h[ei[0]])


def test_an_edge_index_walked_by_its_rows_suggests_its_edges_dimension() -> None:
    """NOTE: [fixed rows walked]: an edge_index (2, E) left at batch dimension 0, read as
    ``ei[0]`` / ``ei[1]``: the hint named ``{'ei': 0}``, which silences the warning and on
    real ranks keeps the wrong split (sixty-first session). It names the edges'
    dimension, ``{'ei': 1}``, or None; in simulation ``{'ei': 0}`` only as "if dimension
    0 is the batch"."""
    torch.manual_seed(0)
    model = EdgeIndexLayer().double()

    def step(model, optim, x, ei, y):  # noqa: ANN001
        loss = F.mse_loss(model(x, ei), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(6, 5, generator=gen, dtype=torch.float64), torch.randn(6, 3, generator=gen, dtype=torch.float64)
    ei = torch.randint(0, 6, (2, 10), generator=gen)
    compiled = sc.compile(parallel_mode=DataParallel("replicate", input_batch_dim={"x": None, "y": None}))(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sc.simulate(world_size=WORLD):
            compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), x, ei, y)
    warned = [str(w.message) for w in caught if "the dimension the mode splits as the batch" in str(w.message)]
    assert len(warned) == 1, warned
    assert "name the dimension that holds the samples" in warned[0], warned
    assert "input_batch_dim={'ei': 1}" in warned[0] and "input_batch_dim={'ei': None}" in warned[0]
    assert "{'ei': 0} only if dimension 0 is the batch and the step loops over its 2 samples" in warned[0]


def test_on_real_ranks_a_walk_of_each_ranks_rows_never_suggests_dimension_0() -> None:
    """NOTE: [fixed rows walked], the real-rank case without the ranks (tested end to end
    by the GNN probe on 2 gloo ranks): each rank passed (2, E), the program reads (4, E)
    and the step walks 2 positions. The warning says dimension 0 holds fixed rows, and
    its hint names ``{'ei': 1}`` or None, never ``{'ei': 0}``."""
    from spmd_compiler.expand.iterated_batches import IteratedBatch, check_iterated_batches

    graph = torch.fx.symbolic_trace(lambda ei: ei[0] + ei[1]).graph
    node = next(n for n in graph.nodes if n.op == "call_function")
    record = IteratedBatch(node, ("ei",), 0, None, walked=2, size=4, share=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_iterated_batches([record], lambda name: False, {"ei": (0, (4, 10))}, simulated=False)
    warned = [str(w.message) for w in caught]
    assert len(warned) == 1, warned
    assert "walks 2 positions along dimension 0" in warned[0] and "fixed number of rows" in warned[0]
    assert "dimension 2 times longer" in warned[0]
    assert "input_batch_dim={'ei': 1}" in warned[0] and "{'ei': None}" in warned[0]
    assert "{'ei': 0}" not in warned[0]
    # a walk of all of the global batch (a loop over samples) keeps both ways out
    record = IteratedBatch(node, ("ei",), 0, None, walked=4, size=4, share=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_iterated_batches([record], lambda name: False, {"ei": (0, (4, 10))}, simulated=False)
    assert "input_batch_dim={'ei': 0} if dimension 0 is the batch" in str(caught[0].message)
