"""Selections by a mask of the batch (NOTE: [selections by a mask of the batch]).

``torch.nonzero``, ``x[mask]``, ``torch.where(mask)``, ``torch.argwhere`` and
``masked_select`` on a mask computed from the batch compile for the mask that selects
everything, verified every call: parity with the undecorated step on one device
(float64) under ddp, fsdp and tp; a call whose mask holds a false element raises
before anything is written, naming the line, and training goes on. ``masked_scatter``
(any mask) is plain ops of ours. A mask computed from the model stays refused at capture.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from twin_models import adamw_twins

import spmd_compiler as sc
from spmd_compiler.capture.mask_selections import every_index, mask_selection_decompositions
from spmd_compiler.errors import SPMDCompileError, SPMDRuntimeError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

TOL = 1e-12
BATCH, FEATURES, CLASSES = 8, 6, 3


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(FEATURES, 16)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


def _select(form: str, logits: torch.Tensor, labels: torch.Tensor):  # noqa: ANN202
    """The labelled rows (labels >= 0) of ``logits`` and ``labels``, written each way."""
    keep = labels >= 0
    if form == "nonzero":  # DeBERTa's classification loss
        index = keep.nonzero()
        rows = torch.gather(logits, 0, index.expand(index.size(0), logits.size(1)))
        return rows, torch.gather(labels, 0, index.view(-1))
    if form == "bool_index":
        return logits[keep], labels[keep]
    if form == "where":
        (index,) = torch.where(keep)
        return logits[index], labels[index]
    if form == "argwhere":
        index = torch.argwhere(keep).squeeze(1)
        return logits.index_select(0, index), labels.index_select(0, index)
    if form == "masked_select":
        rows = logits.masked_select(keep[:, None]).view(-1, logits.size(1))
        return rows, labels.masked_select(keep)
    raise ValueError(form)


def _step_for(form: str):  # noqa: ANN202
    def step(model, optim, x, labels):  # noqa: ANN001
        rows, kept = _select(form, model(x), labels)
        loss = F.cross_entropy(rows, kept)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    step.__name__ = f"{form}_step"
    return step


def _twins():  # noqa: ANN202
    return adamw_twins(Classifier)


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(n)
    ]


def _mode(name: str):  # noqa: ANN202
    if name == "tp":
        return make_mode("tp", plan={"fc": ColwiseParallel(), "out": RowwiseParallel()})
    return make_mode(name)


def _worst(model, reference, optim, reference_optim, sim) -> float:  # noqa: ANN001
    return max({**compare_models(model, reference, sim),
                **compare_optimizers(optim, reference_optim, sim)}.values())


FORMS = ["nonzero", "bool_index", "where", "argwhere", "masked_select"]


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp"])
@pytest.mark.parametrize("form", FORMS)
def test_selections_by_a_batch_mask_match_one_device(form, mode):
    step = _step_for(form)
    model, reference, optim, reference_optim = _twins()
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for x, labels in _batches():
            loss = compiled(model, optim, x, labels)
            assert relative_difference(loss, step(reference, reference_optim, x, labels)) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL
    checks = compiled.last_program.captured.checks
    # AdamW's state is made before the first program where no `if` on a value is
    # verified (NOTE: [optimizer state made before the first program])
    assert compiled.compile_count == (2 if checks else 1)
    if form in ("bool_index", "where", "argwhere"):  # rows kept in place: any mask, no check
        assert not checks
    else:  # one check per mask tensor (masked_select reads two: keep[:, None] and keep)
        assert checks and all("test_mask_selections.py" in check.where for check in checks)


def counted_step(model, optim, x, weights):  # noqa: ANN001
    """A mean written with the selection's row count: the count is the size the mask
    decides, so the selection is compiled as all true and verified every call."""
    kept = weights[weights > 0]
    loss = model(x).pow(2).mean() * kept.sum() / kept.shape[0]
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def returned_rows_step(model, optim, x, weights):  # noqa: ANN001
    """The selected rows returned: their eager value has the mask's size."""
    rows = model(x)[weights > 0]
    loss = rows.pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss, rows.detach()


@pytest.mark.parametrize("step,bad_value", [
    (counted_step, 0.0),             # the row count is read
    (returned_rows_step, 0.0),       # the rows leave the step
    (_step_for("nonzero"), -100),    # cross entropy fails on the label first
], ids=["counted", "returned", "cross_entropy"])
def test_a_mask_with_a_false_element_raises_and_writes_nothing(step, bad_value):
    model, reference, optim, reference_optim = _twins()
    compiled = sc.compile(make_mode("fsdp"))(step)
    (x, labels), (x2, labels2), _ = _batches()
    if "nonzero" not in step.__name__:  # weights, not labels
        labels, labels2 = torch.rand(BATCH, dtype=torch.float64) + 0.5, labels2 + 1.0
    bad = labels.clone()
    bad[6] = bad_value  # on the second rank's half
    with sc.simulate(world_size=2) as sim:
        compiled(model, optim, x, labels)
        step(reference, reference_optim, x, labels)
        with pytest.raises(SPMDRuntimeError) as info:
            compiled(model, optim, x, bad)
        message = str(info.value)
        assert "test_mask_selections.py" in message and "Nothing was updated" in message
        if step is counted_step:
            assert "MaskWithFalseElements: the mask has false elements" in message
            assert "ignore_index" in message  # the advice is not cut off
            assert "kept.shape[0]" in message  # the line that needs the count
        if step is returned_rows_step:  # reported at the selection
            assert "rows = model(x)[weights > 0]" in message
        # nothing was written: training goes on as if the call never happened
        loss = compiled(model, optim, x2, labels2)
        expected = step(reference, reference_optim, x2, labels2)
        for got, want in zip(*(v if isinstance(v, tuple) else (v,) for v in (loss, expected)), strict=True):
            assert relative_difference(got, want) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL


class Routed(nn.Module):
    """Rows chosen by the model's own gate (a mask computed from parameters), averaged
    over their count: a size the routing decides."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(FEATURES, 2)
        self.expert = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = x[self.gate(x).argmax(-1) == 0]
        return self.expert(chosen).sum() / len(chosen) + 0 * self.gate.weight.sum()


def test_a_mask_computed_from_the_model_is_refused_at_capture():
    model = Routed().double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(model, optim, x):  # noqa: ANN001
        loss = model(x)
        loss.backward()
        optim.step()
        return loss

    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, optim, _batches(1)[0][0])
    assert "value-dependent shape" in str(info.value)
    assert "return self.expert(chosen).sum() / len(chosen)" in str(info.value)


class Experts(nn.Module):
    """Top-1 routing written as the refusal's hint says, ``out[m] += expert(h[m]) *
    w[m, None]``, and the tokens the gate is unsure of replaced by a learned token
    (``x[m] = token``): masks computed from the model, exact for any routing."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(FEATURES, 2)
        self.experts = nn.ModuleList(nn.Linear(FEATURES, 16) for _ in range(2))
        self.unsure = nn.Parameter(torch.randn(FEATURES))
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        weight, choice = probs.max(-1)
        x = x.clone()
        x[weight.detach() < 0.55] = self.unsure
        out = torch.zeros(x.shape[0], 16, dtype=x.dtype)
        for e, expert in enumerate(self.experts):
            m = choice == e
            out[m] += torch.tanh(expert(x[m])) * weight[m, None]
        return self.out(out)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_routing_by_a_model_mask_with_the_mask_beside_the_rows_matches_one_device(mode):
    """``w[m, None]`` was refused at capture with torch's raw ``aten.nonzero`` error
    (``w[m][:, None]`` was exact), and ``x[m] = token`` likewise; both are kept in place."""
    model, reference, optim, reference_optim = adamw_twins(Experts)
    step = _step_for("bool_index")
    compiled = sc.compile(make_mode(mode))(step)
    routed = set()
    with sc.simulate(world_size=2) as sim:
        for x, labels in _batches():
            routed.add(int((reference.gate(x).argmax(-1) == 0).sum()))
            loss = compiled(model, optim, x, labels)
            assert relative_difference(loss, step(reference, reference_optim, x, labels)) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL and routed - {0, BATCH}  # some batch routed to both experts
    assert not compiled.last_program.captured.checks


def test_rows_selected_again_by_a_model_mask_are_refused_with_what_to_do():
    """``sel[conf > t]`` on rows already selected: refused with the advice to combine
    with the mask, not torch's raw error on ``aten.nonzero``."""

    def step(model, optim, x, labels):  # noqa: ANN001
        keep = labels > 0
        sel = model(x)[keep]
        conf = sel.softmax(-1).amax(-1).detach()
        loss = F.cross_entropy(sel[conf > 0.4], labels[keep][conf > 0.4])
        loss.backward()
        optim.step()
        return loss

    model, _, optim, _ = _twins()
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, optim, *_batches(1)[0])
    message = str(info.value)
    assert "sel[conf > 0.4]" in message and "aten.nonzero" not in message
    assert "a mask computed from the model" in message and "y[mask] += expert(h[mask])" in message


class Captioner(nn.Module):
    """A vision-language model's merge: image features written into the text embeddings
    at the image tokens (``masked_scatter``; a mask with false elements)."""

    IMAGE_TOKEN = 1

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, FEATURES)
        self.vision = nn.Linear(4, FEATURES)
        self.head = nn.Linear(FEATURES, 8)

    def forward(self, ids: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        embeds = self.embed(ids)
        features = self.vision(patches).reshape(-1, FEATURES)
        mask = (ids == self.IMAGE_TOKEN)[..., None].expand_as(embeds)
        return self.head(embeds.masked_scatter(mask, features))


def captioner_step(model, optim, ids, patches, targets):  # noqa: ANN001
    loss = F.cross_entropy(model(ids, patches).flatten(0, 1), targets.flatten())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_masked_scatter_with_any_mask_matches_one_device(mode):
    torch.manual_seed(0)
    model = Captioner().double()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode(mode))(captioner_step)
    gen = torch.Generator().manual_seed(4)
    with sc.simulate(world_size=2) as sim:
        for _ in range(3):
            ids = torch.randint(2, 8, (BATCH, 5), generator=gen)
            ids[:, 1:3] = Captioner.IMAGE_TOKEN  # two image tokens per example
            patches = torch.randn(BATCH, 2, 4, generator=gen, dtype=torch.float64)
            targets = torch.randint(0, 8, (BATCH, 5), generator=gen)
            loss = compiled(model, optim, ids, patches, targets)
            expected = captioner_step(reference, reference_optim, ids, patches, targets)
            assert relative_difference(loss, expected) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL
    assert not compiled.last_program.captured.checks  # any mask: nothing to verify


@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4), (3, 0, 2)])
def test_every_index_is_nonzero_of_an_all_true_tensor(shape):
    assert torch.equal(every_index(torch.Size(shape), torch.device("cpu")),
                       torch.ones(shape, dtype=torch.bool).nonzero())


@pytest.mark.parametrize("mask_shape", [(4, 5), (4, 1), (5,)])
def test_masked_scatter_in_plain_ops_is_torchs(mask_shape):
    table = mask_selection_decompositions()
    aten = torch.ops.aten
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    mask = torch.rand(mask_shape, generator=gen) > 0.4
    count = int(torch.broadcast_to(mask, x.shape).sum())
    source = torch.randn(count + 3, generator=gen, dtype=torch.float64)
    assert torch.equal(table[aten.masked_scatter.default](x, mask, source),
                       x.masked_scatter(mask, source))
    grad = torch.randn(4, 5, generator=gen, dtype=torch.float64)
    expected = aten.masked_scatter_backward.default(grad, mask, [count + 3])
    assert torch.equal(
        table[aten.masked_scatter_backward.default](grad, mask, [count + 3]), expected
    )


def rows_by_index_step(model, optim, x, index):  # noqa: ANN001
    loss = model(x)[index].pow(2).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_rows_taken_by_an_index_match_one_device(mode):
    """The backward of ``x[index]`` is an ``index_put`` with as many dimensions as ``x``:
    torch 2.11's rule sharded it on the indexed dimension (a fill of ours,
    ``_torch_private._install_index_put_checked_strategy``)."""
    model, reference, optim, reference_optim = _twins()
    compiled = sc.compile(make_mode(mode))(rows_by_index_step)
    index = torch.tensor([5, 0, 7, 7, 2, 3, 1, 6])
    with sc.simulate(world_size=2) as sim:
        for x, _ in _batches():
            loss = compiled(model, optim, x, index)
            expected = rows_by_index_step(reference, reference_optim, x, index)
            assert relative_difference(loss, expected) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL


# -- NOTE: [rows of one count] --------------------------------------------------------

TOKENS, WIDTH, HIDDEN, VISIBLE = 6, 5, 12, 2  # no size equal to BATCH but the batch's


class MaskedAutoencoder(nn.Module):
    """MAE / VideoMAE pretraining: encode the visible tokens of each example
    (``x[~mask].reshape(B, -1, C)``), put them back among mask tokens, reconstruct the
    masked ones."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(WIDTH, HIDDEN)
        self.encoder = nn.Linear(HIDDEN, HIDDEN)
        self.decoder = nn.Linear(HIDDEN, WIDTH)
        self.mask_token = nn.Parameter(torch.randn(HIDDEN))

    def forward(self, x: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        visible = self.embed(x)[~masked].reshape(b, -1, HIDDEN)
        visible = torch.tanh(self.encoder(visible))
        tokens = self.mask_token.expand(b, n, HIDDEN).clone()
        tokens[~masked] = visible.reshape(-1, HIDDEN)
        reconstructed = self.decoder(tokens)[masked].reshape(b, -1, WIDTH)
        target = x.masked_select(masked[..., None]).reshape(b, -1, WIDTH)
        first = masked.nonzero()  # (B * K, 2): each example's first masked token
        weights = 1.0 + first[:, 1].reshape(b, -1).to(x.dtype) / n
        return (F.mse_loss(reconstructed, target, reduction="none").mean(-1) * weights).mean()


def mae_step(model, optim, x, masked):  # noqa: ANN001
    loss = model(x, masked)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _mae_batches(n: int, visible: int = VISIBLE) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [
        (torch.randn(BATCH, TOKENS, WIDTH, generator=gen, dtype=torch.float64),
         torch.stack([torch.randperm(TOKENS, generator=gen) >= visible for _ in range(BATCH)]))
        for _ in range(n)
    ]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_masks_of_one_count_per_example_match_one_device(mode):
    """Every example keeps VISIBLE tokens: the selections are compiled for that count,
    read from the real mask at capture, and verified every call."""
    model, reference, optim, reference_optim = adamw_twins(MaskedAutoencoder)
    compiled = sc.compile(make_mode(mode))(mae_step)
    with sc.simulate(world_size=2) as sim:
        for x, masked in _mae_batches(3):
            loss = compiled(model, optim, x, masked)
            assert relative_difference(loss, mae_step(reference, reference_optim, x, masked)) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL
    # the selections' count is verified every call: AdamW's first step is a program of its own
    assert compiled.compile_count == 2
    program = compiled.last_program
    assert program.captured.counted and "reshape(b, -1, HIDDEN)" in program.captured.counted[0]
    if mode == "ddp":  # each example's rows are gathered in place: the batch stays sharded
        assert set(program.collectives_before_passes) == {"all_reduce"}


def test_a_call_with_another_count_raises_and_writes_nothing():
    model, reference, optim, reference_optim = adamw_twins(MaskedAutoencoder)
    compiled = sc.compile(make_mode("ddp"))(mae_step)
    (x, masked), (x2, masked2) = _mae_batches(2)
    other = _mae_batches(1, visible=VISIBLE + 1)[0][1]
    with sc.simulate(world_size=2) as sim:
        for _ in range(2):  # the steady-state program (AdamW's state made) is the second
            compiled(model, optim, x, masked)
            mae_step(reference, reference_optim, x, masked)
        with pytest.raises(SPMDRuntimeError) as info:
            compiled(model, optim, x, other)
        message = str(info.value)
        assert "Nothing was updated" in message and "test_mask_selections.py" in message
        assert f"does not hold {VISIBLE} in every row" in message  # ~masked: the visible
        loss = compiled(model, optim, x2, masked2)
        assert relative_difference(loss, mae_step(reference, reference_optim, x2, masked2)) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL


class PairwiseInteractions(nn.Module):
    """A factorization-machine style layer: every pair of feature embeddings multiplied,
    the pairs listed by ``torch.combinations`` (which selects the upper triangle of an
    index grid with a mask made from shapes alone) and by a boolean triangle."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(1, 4)
        self.out = nn.Linear(2 * FEATURES * (FEATURES - 1) // 2, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x.unsqueeze(-1))  # (batch, features, 4)
        pairs = torch.combinations(torch.arange(FEATURES), r=2)
        products = (e[:, pairs[:, 0]] * e[:, pairs[:, 1]]).sum(-1)
        upper = torch.ones(FEATURES, FEATURES, dtype=torch.bool).triu(1)
        gram = (e @ e.transpose(1, 2))[:, upper]  # the same pairs, by a boolean index
        return self.out(torch.cat([products, gram], 1))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_masks_made_from_shapes_alone_select_their_value(mode):
    """NOTE: [masks made from shapes alone]: before 2026-12-02 ``torch.combinations`` in a
    step failed on every call ("the mask has false elements": its triangle was compiled
    as all true)."""
    step = _step_for("bool_index")
    model, reference, optim, reference_optim = adamw_twins(PairwiseInteractions)
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for x, labels in _batches():
            loss = compiled(model, optim, x, labels.clamp(min=0))
            assert relative_difference(loss, step(reference, reference_optim, x, labels.clamp(min=0))) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL


def info_nce_loss(features: torch.Tensor, n: int, temperature: float = 0.2) -> torch.Tensor:
    """sthalles/SimCLR's ``info_nce_loss``, as written there: the positives and negatives
    of each view selected by masks made from shapes alone (``torch.eye``, ``arange ==
    arange``), their rows read by ``.view(2n, -1)``."""
    labels = torch.cat([torch.arange(n) for _ in range(2)], dim=0)
    labels = (labels.unsqueeze(0) == labels.unsqueeze(1)).float()
    features = F.normalize(features, dim=1)
    similarity_matrix = torch.matmul(features, features.T)
    mask = torch.eye(labels.shape[0], dtype=torch.bool)
    labels = labels[~mask].view(labels.shape[0], -1)
    similarity_matrix = similarity_matrix[~mask].view(similarity_matrix.shape[0], -1)
    positives = similarity_matrix[labels.bool()].view(labels.shape[0], -1)
    negatives = similarity_matrix[~labels.bool()].view(similarity_matrix.shape[0], -1)
    logits = torch.cat([positives, negatives], dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(logits.shape[0], dtype=torch.long))


def simclr_step(model, optim, a, b):  # noqa: ANN001
    loss = info_nce_loss(model(torch.cat([a, b])), a.shape[0])
    optim.zero_grad()
    loss.backward()
    optim.step()
    return loss.detach()


@pytest.mark.parametrize(("mode", "world"), [("ddp", 2), ("fsdp", 2), ("ddp", 4), ("fsdp", 4)])
def test_rows_of_a_mask_made_from_shapes_alone_read_by_their_number(mode, world):
    """NOTE: [masks made from shapes alone]: the rows SimCLR's loss selects by
    ``~torch.eye(2n)`` and reads by ``.view(2n, -1)`` were refused at capture as a
    value-dependent shape ("a mask made from shapes and Python values alone"), although
    the count is the constant's. Now the loss over the global batch (its similarity
    matrix pairs every example with every other, across ranks) is eager's."""
    model, reference, optim, reference_optim = adamw_twins(Classifier)
    compiled = sc.compile(_mode(mode))(simclr_step)
    gen = torch.Generator().manual_seed(5)
    with sc.simulate(world_size=world) as sim:
        for _ in range(3):
            a, b = (torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64) for _ in range(2))
            loss = compiled(model, optim, a, b)
            assert relative_difference(loss, simclr_step(reference, reference_optim, a, b)) < TOL
        worst = _worst(model, reference, optim, reference_optim, sim)
    assert worst < TOL
    assert not compiled.last_program.captured.checks  # constants: nothing to verify
