"""Rows selected by a mask of the batch, kept in place (NOTE: [selected rows kept in place]).

``logits[labels != -100]``, ``pred[~torch.isnan(y)]``, ELECTRA's ``logits[active]``,
``labels.masked_select(labels >= 0)`` into a CTC loss and hard-example mining's
``losses[losses > threshold]`` (a mask from the model) train as on one device for any
mask (float64, 2 simulated ranks, 3 AdamW steps, batches padded differently on each
rank), with nothing to verify per call. A use of the rows that needs their count
(``.shape``, an op that mixes rows, rows returned) is compiled for the mask that selects
everything: exact on a full batch, refused with the line on a padded one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from twin_models import adamw_twins
from twin_models import finish as _finish

import spmd_compiler as sc
from spmd_compiler.errors import SPMDRuntimeError
from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

TOL = 1e-12
BATCH, TOKENS, FEATURES, CLASSES = 8, 5, 6, 4
PAD = -100


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(CLASSES, FEATURES)
        self.fc = nn.Linear(FEATURES, 16)
        self.out = nn.Linear(16, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x)))


def masked_lm_step(model, optim, x, labels):  # noqa: ANN001
    logits = model(x)
    keep = labels != PAD
    return _finish(model, optim, F.cross_entropy(logits[keep], labels[keep]))


def flattened_step(model, optim, x, labels):  # noqa: ANN001
    """Each selection with its own flattened mask: ``keep.view(-1)`` twice, and the same
    comparison computed twice; they are one selection's rows."""
    logits = model(x).view(-1, CLASSES)
    keep = labels != PAD
    loss = F.cross_entropy(logits[keep.view(-1)], labels.view(-1)[keep.view(-1)])
    flat = labels.view(-1)
    return _finish(model, optim, loss + F.cross_entropy(logits[flat != PAD], flat[flat != PAD]))


def index_tuple_step(model, optim, x, labels):  # noqa: ANN001
    """``x[mask, :]``: the same rows as ``x[mask]``."""
    keep = labels != PAD
    return _finish(model, optim, F.cross_entropy(model(x)[keep, :], labels[keep]))


def write_back_step(model, optim, x, labels):  # noqa: ANN001
    """The kept rows computed apart and written back in place, ``out[mask] = f(h[mask])``."""
    keep = labels != PAD
    hidden = torch.tanh(model.fc(x))
    out = hidden.clone()
    out[keep] = hidden[keep].pow(2) * 2 - 0.5
    loss = F.cross_entropy(model.out(out).flatten(0, 1), labels.flatten().clamp(min=0))
    return _finish(model, optim, loss)


def selected_indices_step(model, optim, x, labels):  # noqa: ANN001
    """Rows taken by the indices of a mask: ``torch.where``, ``argwhere``, ``nonzero``."""
    logits = model(x)
    keep = labels != PAD
    batch, token = torch.where(keep)
    loss = F.cross_entropy(logits[batch, token], labels[batch, token])
    flat = keep.view(-1).nonzero().squeeze(1)
    loss = loss + F.cross_entropy(logits.view(-1, CLASSES).index_select(0, flat), labels.view(-1)[flat])
    at = torch.argwhere(keep)
    rows = torch.gather(logits.view(-1, CLASSES), 0, (at[:, 0] * TOKENS + at[:, 1])[:, None].expand(-1, CLASSES))
    return _finish(model, optim, loss + rows.logsumexp(-1).mean())


def hard_examples_step(model, optim, x, labels):  # noqa: ANN001
    """Online hard example mining: the tokens whose loss is above the mean, a mask the
    model's own output decides."""
    losses = F.cross_entropy(model(x).flatten(0, 1), labels.flatten().clamp(min=0), reduction="none")
    hard = losses[losses > losses.mean().detach()]
    return _finish(model, optim, hard.mean() + 0.1 * losses.mean())


def missing_targets_step(model, optim, x, labels):  # noqa: ANN001
    """Regression with missing targets (NaN): they must not reach a gradient."""
    target = torch.where(labels == PAD, float("nan"), labels.to(x.dtype))[..., None]
    pred = model(x)[..., :1]
    keep = ~torch.isnan(target)
    return _finish(model, optim, F.mse_loss(pred[keep], target[keep]) + F.huber_loss(pred[keep], target[keep], reduction="sum"))


def electra_step(model, optim, x, labels):  # noqa: ANN001
    """ELECTRA's discriminator loss: logits at the attended tokens, BCE with logits."""
    logits = model(x)[..., 0]
    active = (labels != PAD).view(-1, logits.shape[1]) == 1
    return _finish(model, optim, F.binary_cross_entropy_with_logits(logits[active], (labels[active] > 1).to(x.dtype)))


def reductions_step(model, optim, x, labels):  # noqa: ANN001
    rows = model(x)[labels != PAD]
    probs = rows.log_softmax(-1).exp()
    loss = (probs * 2 + 1).pow(2).mean() + rows.sum(-1).abs().mean() + rows.amax() - rows.amin(0).sum()
    return _finish(model, optim, loss + rows.norm(dim=-1).sum() * 1e-2)


def class_losses_step(model, optim, x, labels):  # noqa: ANN001
    keep = labels != PAD
    rows, kept = model(x)[keep], labels[keep]
    loss = F.cross_entropy(rows, kept, reduction="sum", label_smoothing=0.1)
    loss = loss + F.nll_loss(rows.log_softmax(-1), kept, reduction="none").sum()
    soft = F.one_hot(kept, CLASSES).to(rows.dtype) * 0.9 + 0.025
    loss = loss + F.cross_entropy(rows, soft) + F.kl_div(rows.log_softmax(-1), soft, reduction="batchmean")
    return _finish(model, optim, loss)


def selected_ids_step(model, optim, x, labels):  # noqa: ANN001
    """Selected integer labels as indices: an embedding of them (padding never indexes)."""
    keep = labels != PAD
    targets = model.embed(labels[keep])
    return _finish(model, optim, F.mse_loss(model(x)[keep].softmax(-1) @ model.embed.weight, targets))


def mask_and_index_step(model, optim, x, labels):  # noqa: ANN001
    """``logits[keep, 0]`` (a mask beside an int, the weight of an expert's tokens in a
    router) and ``logits[keep, 1:]``: refused before as a nonzero of value-dependent
    shape; they are ``logits[:, :, 0][keep]`` and ``logits[:, :, 1:][keep]``."""
    logits = model(x)
    keep = labels != PAD
    first, rest = logits[keep, 0], logits[keep, 1:]
    return _finish(model, optim, (first.square() + rest.logsumexp(-1)).mean())


def mask_spellings_step(model, optim, x, labels):  # noqa: ANN001
    """``logits[keep, ...]``, ``logits[keep, None]`` (views of ``logits[keep]``) and
    ``logits[keep, labels[keep]]`` (each row's target logit): refused before on a padded
    batch (compiled for the mask that selects everything)."""
    logits = model(x)
    keep = labels != PAD
    target = logits[keep, labels[keep]] + logits[keep, labels[keep] - CLASSES] ** 2  # from the end too
    loss = F.cross_entropy(logits[keep, ...], labels[keep]) + (logits[keep, None] ** 2).mean()
    return _finish(model, optim, loss - target.mean() + logits[keep, ..., 1:].exp().mean())


def router_step(model, optim, x, labels):  # noqa: ANN001
    """A mixture of experts' router on the real tokens: each token's top-2 expert
    weights (``topk`` along the experts), sorted scores, ranks by ``argsort``, a running
    max and a ``kthvalue`` along the same dim, experts mixed by ``einsum`` over each
    token, the output built on ``zeros_like``. Ops along a dim other than the rows' keep
    the rows (NOTE: [ops along a dim of the rows]); before, each was compiled for the
    mask that selects everything and refused on the first padded batch."""
    rows = model(x)[labels != PAD]  # (tokens, experts)
    probs = rows.softmax(-1)
    top = probs.topk(2, dim=-1)
    loss = top.values.sum(-1).mean() + rows.gather(-1, top.indices).square().mean()
    ordered, order = torch.sort(probs, dim=-1, descending=True)
    loss = loss + (ordered[:, 0] - ordered[:, -1]).mean() + rows.gather(-1, probs.argsort(-1)[:, :1]).mean()
    loss = loss + rows.cummax(-1).values.exp().mean() + torch.kthvalue(rows, 2, 1).values.mean()
    experts = torch.linspace(-1, 1, CLASSES * 3, dtype=rows.dtype).view(CLASSES, 3)
    mixed = torch.einsum("nd,de->ne", probs, experts) + torch.einsum("nd, nd -> n", rows, probs)[:, None]
    out = torch.zeros_like(probs)  # rows of zeros, summed into over experts
    out = out + torch.full_like(probs, 0.5) * probs + torch.ones_like(rows) * rows.exp()
    loss = loss + mixed.square().mean() + torch.einsum("ij,jk", rows, experts).mean()
    return _finish(model, optim, loss + out.logsumexp(-1).mean())


def index_put_step(model, optim, x, labels):  # noqa: ANN001
    """``out.index_put((mask,), rows)``, the functional spelling of ``out[mask] = rows``,
    and ``index_put_`` accumulating: each kept row written to its own place. Before,
    they were compiled for the mask that selects everything (the ``__setitem__``
    spelling was exact)."""
    keep = labels != PAD
    hidden = torch.tanh(model.fc(x))
    out = torch.zeros_like(hidden).index_put((keep,), hidden[keep].pow(2) * 2 - 0.5)
    out.index_put_((keep,), torch.sin(hidden[keep]), accumulate=True)
    out = torch.index_put(out, (keep,), out[keep] * 3, True)
    loss = F.cross_entropy(model.out(out + hidden).flatten(0, 1), labels.flatten().clamp(min=0))
    return _finish(model, optim, loss)


CASES = {
    "router": router_step,
    "index_put": index_put_step,
    "mask_spellings": mask_spellings_step,
    "mask_and_index": mask_and_index_step,
    "masked_lm": masked_lm_step,
    "flattened_masks": flattened_step,
    "index_tuple": index_tuple_step,
    "write_back": write_back_step,
    "selected_indices": selected_indices_step,
    "hard_examples": hard_examples_step,
    "missing_targets": missing_targets_step,
    "electra": electra_step,
    "reductions": reductions_step,
    "class_losses": class_losses_step,
    "selected_ids": selected_ids_step,
}


def _batches(padded: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    out = []
    for k in range(3):
        x = torch.randn(BATCH, TOKENS, FEATURES, generator=gen, dtype=torch.float64)
        labels = torch.randint(0, CLASSES, (BATCH, TOKENS), generator=gen)
        if padded and k == 0:
            labels[5:, 2:] = PAD  # the second rank's half only
        elif padded and k == 1:
            labels[:, 3:] = PAD
            labels[6, 1:] = PAD
        out.append((x, labels))
    return out


def _twins():  # noqa: ANN202
    return adamw_twins(Tagger)


def _mode(name: str):  # noqa: ANN202
    if name == "tp":
        return make_mode("tp", plan={"fc": ColwiseParallel(), "out": RowwiseParallel()})
    return make_mode(name)


def _parity(step, mode: str, batches, make=Tagger):  # noqa: ANN001, ANN202
    model, reference, optim, reference_optim = adamw_twins(make)
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for x, labels in batches:
            got, want = compiled(model, optim, x, labels), step(reference, reference_optim, x, labels)
            assert torch.isfinite(want).all()
            assert relative_difference(got, want) < TOL, (got, want)
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, reference_optim, sim)}.values())
    assert worst < TOL
    return compiled


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_losses_on_selected_rows_match_one_device_for_any_mask(name, mode):
    compiled = _parity(CASES[name], mode, _batches())
    checks = compiled.last_program.captured.checks
    if name == "reductions":  # amax and amin of no rows raise in eager: that one check
        assert checks and all("rows.amax()" in c.where for c in checks)
    else:
        assert not checks  # exact for any mask: nothing to verify per call


def test_selected_rows_under_tensor_parallel():
    compiled = _parity(masked_lm_step, "tp", _batches())
    assert not compiled.last_program.captured.checks


class MaskedTokens(Tagger):
    """BERT's / MAE's mask token (wav2vec2's ``masked_spec_embed``): a parameter written
    over the masked positions, ``h[mask] = self.mask_token``."""

    def __init__(self) -> None:
        super().__init__()
        self.mask_token = nn.Parameter(torch.randn(16))

    def forward(self, x: torch.Tensor, masked: torch.Tensor | None = None) -> torch.Tensor:
        h = torch.tanh(self.fc(x))
        if masked is not None:
            h = h.clone()
            h[masked] = self.mask_token
            h[masked, ...] = h[masked] * 0.5  # rows of the mask: written back in place
        return self.out(h)


def mask_token_step(model, optim, x, labels):  # noqa: ANN001
    masked = labels == PAD
    return _finish(model, optim, F.cross_entropy(model(x, masked).flatten(0, 1), labels.flatten().clamp(min=0)))


def broadcast_values_step(model, optim, x, labels):  # noqa: ANN001
    """Values of one row in other shapes: a detached token, ``(1, D)``, a 0-dim tensor,
    and ``ones`` over a 2-D mask's trailing dims."""
    masked = labels == PAD
    h = torch.tanh(model.fc(x)).clone()
    h[masked] = model.mask_token.detach() * 2
    h[masked[:, -1]] = model.mask_token[None] + h[:, 0].sum(0)  # (BATCH,) mask: (TOKENS, 16) rows
    g = model.out(h).clone()
    g[masked] = torch.tensor(0.25, dtype=g.dtype)
    g[masked[:, -1]] = torch.ones(CLASSES, dtype=g.dtype)
    return _finish(model, optim, F.cross_entropy(g.flatten(0, 1), labels.flatten().clamp(min=0)))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("step", [mask_token_step, broadcast_values_step])
def test_a_value_broadcast_over_masked_positions_matches_one_device_for_any_mask(step, mode):
    """``x[mask] = v`` with ``v`` one row broadcast over the selected rows was compiled
    for the mask that selects everything, and refused on every padded batch; it is
    ``torch.where(mask, v, x)``: exact for any mask, ``v``'s gradient as eager's."""
    compiled = _parity(step, mode, _batches(), make=MaskedTokens)
    assert not compiled.last_program.captured.checks


def contrastive_step(model, optim, x, labels):  # noqa: ANN001
    """wav2vec2's contrastive logits: negatives gathered from the whole flattened batch,
    the batch in dim 1 of ``(K + 1, B, T)`` logits, the negatives equal to their positive
    masked by ``logits[1:][neg_is_pos] = -inf`` (a write into a slice view)."""
    h = torch.tanh(model.fc(x))  # (B, T, 16)
    q = torch.round(h * 2) / 2  # coarse: negatives equal to their positive are common
    flat = labels.clamp(min=0).view(-1)
    index = torch.stack([(flat * 7 + 3 * k) % flat.numel() for k in range(2)], -1)  # (B*T, K)
    index[0, 0] = 0  # the first position's own vector among its negatives
    negs = q.reshape(-1, 16)[index.view(-1)].view(BATCH, TOKENS, 2, 16).permute(2, 0, 1, 3)
    logits = torch.cat([(q * h).sum(-1)[None], (negs * h[None]).sum(-1)], 0)  # (K + 1, B, T)
    neg_is_pos = (q == negs).all(-1)  # (K, B, T)
    logits[1:][neg_is_pos] = float("-inf")
    return _finish(model, optim, F.cross_entropy(logits.permute(1, 2, 0).flatten(0, 1), torch.zeros_like(flat)))


def class_masks_step(model, optim, x, labels):  # noqa: ANN001
    """Masks of ``(CLASSES, B, T)`` scores, the batch in dim 1: the masks' own dim 1 (an
    int written, a value added: ``index_put_(..., accumulate=True)``), and a mask after a
    leading dim (``x[:, mask] = v``, ``index_put`` with ``None`` first) with a value per
    leading row."""
    scores = model(x).permute(2, 0, 1).clone()
    hits = labels[None] == torch.arange(CLASSES)[:, None, None]  # (CLASSES, B, T)
    scores[hits] = 1
    scores.index_put_((hits.flip(0),), torch.tensor(0.25, dtype=scores.dtype), accumulate=True)
    scores[:, labels == PAD] = torch.arange(CLASSES, dtype=scores.dtype)[:, None] * 0.5
    return _finish(model, optim, F.cross_entropy(scores.permute(1, 2, 0).flatten(0, 1), labels.flatten().clamp(min=0)))


def row_to_every_selected_step(model, optim, x, labels):  # noqa: ANN001
    """A row added to every selected position through a leading mask
    (``index_put_((mask,), row, accumulate=True)``, ``row`` one value per feature): one
    value per selection, not rows; it was read as rows and refused on any mask with a
    false element (the second review)."""
    h = torch.tanh(model.fc(x))
    out = h.clone()
    out.index_put_((labels == 1,), h.mean((0, 1)).detach(), accumulate=True)
    return _finish(model, optim, F.cross_entropy(model.out(out).flatten(0, 1), labels.flatten().clamp(min=0)))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("step", [contrastive_step, class_masks_step, row_to_every_selected_step])
def test_a_mask_write_of_one_value_with_the_batch_in_dim_one_matches_one_device(step, mode):
    """``x[mask] = v`` (``v`` the same for every selected element) on a tensor whose batch
    is in dim 1 failed on its first call: DTensor's ``index_put`` rule takes a boolean
    mask for one indexed dim, left ``x`` sharded on the mask's second dim and gave it the
    whole mask ("The shape of the mask [3, 4, 6] at index 1 does not match the shape of
    the indexed tensor [3, 2, 6]"). It is ``torch.where`` (NOTE: [mask writes of one
    value]): exact for any mask, with nothing to verify per call."""
    compiled = _parity(step, mode, _batches())
    assert not compiled.last_program.captured.checks


def rows_written_past_the_batch_dim_step(model, optim, x, labels):  # noqa: ANN001
    """``x[:, mask] = rows`` on ``(16, T, B)`` features: the batch in the mask's second dim."""
    h = torch.tanh(model.fc(x))
    s = h.permute(2, 1, 0).clone()
    s[:, labels.T > -1000] = torch.sin(h.permute(2, 1, 0).reshape(16, -1))
    return _finish(model, optim, F.cross_entropy(model.out(s.permute(2, 1, 0)).flatten(0, 1), labels.flatten().clamp(min=0)))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_rows_written_by_a_mask_over_the_batch_dim_match_one_device(mode):
    """A write of rows by a mask of 2 dims whose second is the batch failed on its first
    call as the writes of one value did; it is the write on the mask's dims flattened,
    which DTensor indexes right (NOTE: [mask writes of one value])."""
    _parity(rows_written_past_the_batch_dim_step, mode, _batches())


def where_indexed_step(model, optim, x, labels):  # noqa: ANN001
    """``x[torch.where(mask)]``: the same rows as ``x[mask]``."""
    logits = model(x)
    index = torch.where(labels != PAD)
    loss = F.cross_entropy(logits[index], labels[index])
    flat, = torch.where(labels.view(-1) != PAD)
    rows = logits.reshape(-1, CLASSES).index_select(0, flat)
    return _finish(model, optim, loss + rows.logsumexp(-1).mean())


def test_rows_by_where_indices_keep_the_batch_sharded():
    """Indexing by the whole ``torch.where(mask)`` keeps ``x[mask]``'s rows in place (a
    view of the batch): under ddp the program all-reduces and gathers nothing, where a
    gather by every index gathered the batch before."""
    compiled = _parity(where_indexed_step, "ddp", _batches())
    stats = collective_stats(compiled.last_program.graph_module)
    assert set(stats.counts) == {"all_reduce"}, stats.counts


def ctc_step(model, optim, x, labels):  # noqa: ANN001
    """transformers' ForCTCLoss: padded labels flattened with masked_select."""
    logits = model(x)
    keep = labels >= 0
    log_probs = F.log_softmax(logits, -1).transpose(0, 1)
    frames = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
    loss = F.ctc_loss(log_probs, labels.masked_select(keep), frames, keep.sum(-1), blank=0, zero_infinity=True)
    return _finish(model, optim, loss)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_ctc_targets_flattened_by_masked_select_match_one_device(mode):
    batches = [(x, labels.masked_fill(labels == 0, 1)) for x, labels in _batches()]  # no blanks
    _parity(ctc_step, mode, batches)


class _Doubled(torch.autograd.Function):
    """A custom function returning its input: autograd makes the output, which no torch
    function mode sees."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad


def _use(kind: str):  # noqa: ANN202
    def step(model, optim, x, labels):  # noqa: ANN001
        rows = model(x)[labels != PAD]
        if kind == "count":
            loss = rows.sum() / rows.shape[0]
        elif kind == "literal_view":  # eager fails on a padded batch: so must we
            loss = rows.view(BATCH * TOKENS, -1).pow(2).mean()
        elif kind == "running_sum":
            loss = rows.cumsum(0).pow(2).mean()
        elif kind == "first_row":
            loss = rows[0].sum() + rows.pow(2).mean()
        elif kind == "gram":
            loss = (rows.T @ rows).sum()
        elif kind == "norm_over_rows":  # norm(p, dim): the rows' dim is the second argument
            loss = rows.norm(1, 0).sum()
        elif kind == "topk_over_rows":  # along the rows' own dim: their number matters
            loss = rows.topk(2, dim=0).values.mean()
        elif kind == "sort_over_rows":
            loss = (rows.sort(0).values * torch.linspace(0, 1, CLASSES, dtype=rows.dtype)).mean()
        elif kind == "einsum_over_rows":  # the rows' letter summed over: a Gram matrix
            loss = torch.einsum("nd,ne->de", rows, rows).sum()
        elif kind == "custom_function":
            loss = _Doubled.apply(rows).mean()
        else:
            raise ValueError(kind)
        return _finish(model, optim, loss)

    step.__name__ = f"{kind}_step"
    return step


@pytest.mark.parametrize("kind", [
    "count", "literal_view", "running_sum", "first_row", "gram", "norm_over_rows", "custom_function",
    "topk_over_rows", "sort_over_rows", "einsum_over_rows",
])
def test_a_use_that_needs_the_row_count_is_exact_on_full_batches_and_refused_on_padded(kind):
    step = _use(kind)
    compiled = _parity(step, "ddp", _batches(padded=False))
    assert compiled.last_program.captured.checks  # compiled for the mask that selects everything
    model, _, optim, _ = _twins()
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDRuntimeError) as info:
        for x, labels in _batches(padded=True):
            compiled(model, optim, x, labels)
    assert "test_selected_rows.py" in str(info.value) and "Nothing was updated" in str(info.value)
    if kind in _USED_BY:  # the op that needed the rows' number
        assert f"where its size matters (by {_USED_BY[kind]})" in str(info.value), str(info.value)


_USED_BY = {"running_sum": "torch.Tensor.cumsum", "topk_over_rows": "torch.Tensor.topk",
            "sort_over_rows": "torch.Tensor.sort", "einsum_over_rows": "torch.einsum",
            "custom_function": "_Doubled.apply"}


def test_rows_paired_with_a_tensor_of_their_count_are_refused_naming_the_selection():
    """Labels already selected outside the step (BEiT's masked image modeling takes them
    so): their size is the rows' number, which a program cannot have. The capture error
    says the rows were traced as all selected, naming the selection's line."""

    def step(model, optim, x, keep, chosen):  # noqa: ANN001
        rows = model(x)[keep]
        return _finish(model, optim, F.cross_entropy(rows, chosen))

    model, _, optim, _ = _twins()
    x, labels = _batches()[0]
    keep = labels != PAD
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        compiled(model, optim, x, keep, labels[keep])
    message = str(info.value)
    assert "rows = model(x)[keep]" in message and "as if the mask selected every element" in message


def test_indices_of_a_model_mask_used_by_count_are_refused_with_what_to_do():
    """A mixture of experts' ``index_add`` of the rows ``torch.where`` found for an
    expert: the message said the step read a tensor's value in Python (it reads none)."""

    def step(model, optim, x, labels):  # noqa: ANN001
        h = model(x)
        rows, cols = torch.where(h.argmax(-1) == 0)
        y = torch.zeros_like(h).index_add(0, rows, h[rows, cols])
        return _finish(model, optim, y.square().mean())

    model, _, optim, _ = _twins()
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        compiled(model, optim, *_batches()[0])
    message = str(info.value)
    assert "uses rows a mask selects where their number matters" in message
    assert "keep the rows in place" in message and "reads the value of a tensor" not in message


# -- random chains of row-wise ops between a selection and a loss ------------------------
_ROW_OPS = [
    lambda r: r.tanh(),
    lambda r: r * 2 - 1,
    lambda r: r.log_softmax(-1),
    lambda r: F.gelu(r),
    lambda r: r.clamp(min=-0.5),
    lambda r: torch.where(r > 0, r, 0.1 * r),
    lambda r: r @ torch.linspace(-1, 1, CLASSES * CLASSES, dtype=r.dtype).view(CLASSES, CLASSES),
    lambda r: F.normalize(r, dim=-1),
    lambda r: torch.cat([r, r.exp()], -1)[:, :CLASSES] + r.exp(),
    lambda r: r.view(-1, 2, 2).transpose(1, 2).reshape(-1, CLASSES),
    lambda r: r - r.mean(-1, keepdim=True),
    lambda r: r.softmax(-1) * r.unsqueeze(1).squeeze(1),
]
_SINKS = [
    lambda r, kept: r.mean(),
    lambda r, kept: r.sum(),
    lambda r, kept: r.pow(2).sum(-1).mean(),
    lambda r, kept: F.cross_entropy(r, kept),
    lambda r, kept: F.mse_loss(r, r.detach() * 0.5),
    lambda r, kept: F.binary_cross_entropy_with_logits(r, (kept[:, None] == torch.arange(CLASSES)).to(r.dtype)),
    lambda r, kept: F.kl_div(r.log_softmax(-1), F.one_hot(kept, CLASSES).to(r.dtype) * 0.9 + 0.025,
                             reduction="batchmean"),
    lambda r, kept: F.huber_loss(r, torch.zeros(CLASSES, dtype=r.dtype), reduction="sum"),
]


def _by_where(logits: torch.Tensor, labels: torch.Tensor):  # noqa: ANN202
    index = torch.where(labels != PAD)
    return logits[index], labels[index]


def _by_flat_nonzero(logits: torch.Tensor, labels: torch.Tensor):  # noqa: ANN202
    index = (labels.view(-1) != PAD).nonzero().squeeze(1)
    return logits.reshape(-1, CLASSES).index_select(0, index), labels.view(-1)[index]


_SELECTIONS = [
    lambda logits, labels: (logits[labels != PAD], labels[labels != PAD]),
    _by_where,
    _by_flat_nonzero,
]


def _random_chain_step(seed: int):  # noqa: ANN202
    gen = torch.Generator().manual_seed(seed)
    ops = [_ROW_OPS[int(i)] for i in torch.randint(0, len(_ROW_OPS), (int(torch.randint(1, 4, (), generator=gen)),), generator=gen)]
    sinks = [_SINKS[int(i)] for i in torch.randperm(len(_SINKS), generator=gen)[:2]]
    select = _SELECTIONS[int(torch.randint(0, len(_SELECTIONS), (), generator=gen))]

    def step(model, optim, x, labels):  # noqa: ANN001
        rows, kept = select(model(x), labels)
        for op in ops:
            rows = op(rows)
        return _finish(model, optim, sum(sink(rows, kept) for sink in sinks))

    return step


def _random_masks(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + seed)
    out = []
    for x, labels in _batches(padded=False):
        density = 0.3 + 0.7 * float(torch.rand((), generator=gen))
        drop = torch.rand(labels.shape, generator=gen) > density
        drop[0, 0] = False  # never an empty selection (eager's mean of none is NaN)
        out.append((x, labels.masked_fill(drop, PAD)))
    return out


@pytest.mark.parametrize("seed", range(8))
def test_random_chains_on_randomly_masked_rows_match_one_device(seed):
    compiled = _parity(_random_chain_step(seed), "ddp", _random_masks(seed))
    assert not compiled.last_program.captured.checks
