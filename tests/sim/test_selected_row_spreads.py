"""``var`` / ``std`` / ``var_mean`` / ``std_mean`` of rows selected by a mask of the batch
(NOTE: [spreads of selected rows]).

Pitch normalised by the statistics of the valid frames, ``(p - p[mask].mean()) /
p[mask].std()``: before the sixty-sixth session ``std`` was compiled for the mask that
selects everything and the first padded batch was refused at run time ("the step raises
there", of a step that raises nothing). Now every spelling trains as on one device
(float64, 2 simulated ranks, ddp and fsdp, 3 AdamW steps: a full batch, a batch with few
true elements, one padded differently on each rank), with nothing to verify per call;
a count at or under the correction gives eager's nan / inf. A reduction with no exact
answer (``median``) is exact on full batches and refused on a padded one, the error
naming the op, the line and a form that compiles for any mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from twin_models import adamw_twins
from twin_models import finish as _finish

import spmd_compiler as sc
from spmd_compiler.errors import SPMDRuntimeError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

TOL = 1e-12
BATCH, FRAMES, FEATURES = 8, 6, 3


def predictor() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Tanh(), nn.Linear(8, FEATURES))


def pitch_step(model, optim, x, mask):  # noqa: ANN001
    """The prober's TTS step: pitch normalised by its mean and std over the valid frames."""
    pitch = model(x)[..., 0]
    normalised = (pitch - pitch[mask].mean()) / pitch[mask].std()
    # (the normalised pitch does not move with the output's bias: the last term does, so
    # that its gradient is not rounding noise alone)
    return _finish(model, optim, (normalised[mask] - x[..., 1][mask]).square().mean() + 0.1 * pitch[mask].mean())


def spellings_step(model, optim, x, mask):  # noqa: ANN001
    """Every argument form: unbiased positional and named, correction (a float too), a
    dim over the rows with and without keepdim, dims past the rows, var_mean / std_mean;
    ``nanmean`` and ``sum(dim=[])`` over the rows."""
    rows = model(x)[mask]  # (valid frames, FEATURES)
    loss = rows.var() + torch.std(rows, False) + rows.var(unbiased=False) * 0.5
    loss = loss + rows.std(correction=0.5) + torch.var(rows, dim=(0, 1), correction=2)
    loss = loss + rows.std(0).sum() + rows.var(0, True, True).sum() * 0.3 + torch.std(rows, [0], keepdim=True).sum()
    var, mean = torch.var_mean(rows, 0)
    std, whole = torch.std_mean(rows, dim=None, correction=0)
    loss = loss + (var * mean).sum() + std * whole + rows.std(-1).mean()  # a dim past the rows
    # dim=[] is every dim, as eager (before, ``sum(dim=[])`` summed the dropped rows too)
    return _finish(model, optim, loss + rows.sum(dim=[]) * 0.1 + rows.nanmean(0).square().sum())


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    lengths = [
        [FRAMES] * BATCH,                # every frame valid
        [2, 0, 0, 0, 0, 0, 0, 1],        # three frames in all
        [6, 4, 3, 5, 2, 6, 1, 4],        # padded differently on each rank
    ]
    out = []
    for row_lengths in lengths:
        x = torch.randn(BATCH, FRAMES, FEATURES, generator=gen, dtype=torch.float64)
        mask = torch.arange(FRAMES)[None] < torch.tensor(row_lengths)[:, None]
        out.append((x, mask))
    return out


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize("step", [pitch_step, spellings_step])
def test_spreads_of_selected_rows_match_one_device_for_any_mask(step, mode):
    model, reference, optim, reference_optim = adamw_twins(predictor)
    compiled = sc.compile(make_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for x, mask in _batches():
            got, want = compiled(model, optim, x, mask), step(reference, reference_optim, x, mask)
            assert torch.isfinite(want) and relative_difference(got, want) < TOL, (got, want)
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, reference_optim, sim)}.values())
    assert worst < TOL
    assert not compiled.last_program.captured.checks  # exact for any mask: nothing to verify


def too_few_step(model, optim, x, mask):  # noqa: ANN001
    """Statistics of at most ``correction`` rows: eager's nan (0 / 0) and inf."""
    rows = model(x)[mask]
    stats = torch.stack([rows.var(), rows.std(correction=40), torch.var_mean(rows[:, 0], 0)[0],
                         rows.std(correction=0)])
    return _finish(model, optim, rows.square().sum()), stats.detach()


def test_a_count_at_or_under_the_correction_gives_eager_nan_and_inf():
    model, reference, optim, reference_optim = adamw_twins(predictor)
    compiled = sc.compile(make_mode("ddp"))(too_few_step)
    x = torch.randn(BATCH, FRAMES, FEATURES, dtype=torch.float64)
    for lengths in ([1] + [0] * (BATCH - 1), [0] * BATCH, [3, 0, 0, 0, 0, 0, 2, 0]):
        mask = torch.arange(FRAMES)[None] < torch.tensor(lengths)[:, None]
        with sc.simulate(world_size=2), pytest.warns(UserWarning, match="degrees of freedom"):
            (got_loss, got), (want_loss, want) = (compiled(model, optim, x, mask),
                                                  too_few_step(reference, reference_optim, x, mask))
        torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-12, atol=0)
        assert relative_difference(got_loss, want_loss) < TOL
    assert not torch.isfinite(want).all()  # the last mask: 5 rows, correction 40 -> inf


def median_step(model, optim, x, mask):  # noqa: ANN001
    pitch = model(x)[..., 0]
    centre = pitch[mask].median()
    return _finish(model, optim, (pitch[mask] - centre).abs().mean())


def test_a_median_of_a_selection_is_refused_on_a_padded_batch_with_a_form_for_any_mask():
    model, reference, optim, reference_optim = adamw_twins(predictor)
    compiled = sc.compile(make_mode("ddp"))(median_step)
    full, _, padded = _batches()
    with sc.simulate(world_size=2):
        got, want = compiled(model, optim, *full), median_step(reference, reference_optim, *full)
        assert relative_difference(got, want) < TOL
        with pytest.raises(SPMDRuntimeError) as info:
            compiled(model, optim, *padded)
    message = str(info.value)
    assert "centre = pitch[mask].median()" in message, message
    assert "the step itself raises nothing there" in message, message
    assert "the step raises there" not in message, message
    assert "torch.Tensor.median of a mask selection is compiled only for masks with no false element" in message
    assert "torch.where(mask, x, float('nan')).nanmedian()" in message, message
    assert "Nothing was updated" in message
