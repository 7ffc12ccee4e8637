"""Selected rows read and written along their other dims (NOTE: [rows along their other
dims]): a rational-quadratic spline flow with linear tails (nflows'
``unconstrained_rational_quadratic_spline``, its ``outputs[inside] = spline(inputs[inside],
...)``) trains as on one device (float64, 2 simulated ranks, 3 AdamW steps, a mask that
differs per call, selects nothing in one rank's share, and everything); a use that
reads or mixes the rows' own dim is still compiled for the mask that selects everything.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from twin_models import adamw_twins
from twin_models import finish as _finish

import spmd_compiler as sc
from spmd_compiler.errors import SPMDRuntimeError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

TOL = 1e-11
D, BINS, BOUND = 4, 5, 3.0


def _bin_of(cumwidths: torch.Tensor, inputs: torch.Tensor, library: bool) -> torch.Tensor:
    if library:
        return torch.searchsorted(cumwidths, inputs[..., None], right=True)[..., 0] - 1
    cumwidths[..., -1] += 1e-6  # nflows' own searchsorted: writes the sequence in place
    return torch.sum(inputs[..., None] >= cumwidths, dim=-1) - 1


def _knots(raw: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    bins = raw.size(-1)  # rows.shape holds the rows' number: size(-1) is the form
    widths = 1e-3 + (1 - 1e-3 * bins) * F.softmax(raw, dim=-1)
    cum = F.pad(torch.cumsum(widths, dim=-1), pad=(1, 0), mode="constant", value=0.0)
    cum = (high - low) * cum + low
    cum[..., 0] = low
    cum[..., -1] = high
    return cum, cum[..., 1:] - cum[..., :-1]


def rq_spline(inputs, uw, uh, ud, library):  # noqa: ANN001, ANN201
    cumwidths, widths = _knots(uw, -BOUND, BOUND)
    cumheights, heights = _knots(uh, -BOUND, BOUND)
    derivatives = 1e-3 + F.softplus(ud)
    index = _bin_of(cumwidths, inputs, library).clamp(0, BINS - 1)[..., None]
    at_cw, at_w = cumwidths.gather(-1, index)[..., 0], widths.gather(-1, index)[..., 0]
    at_ch, at_h = cumheights.gather(-1, index)[..., 0], heights.gather(-1, index)[..., 0]
    delta = (heights / widths).gather(-1, index)[..., 0]
    d0, d1 = derivatives.gather(-1, index)[..., 0], derivatives[..., 1:].gather(-1, index)[..., 0]
    theta = (inputs - at_cw) / at_w
    mixed = theta * (1 - theta)
    denominator = delta + (d0 + d1 - 2 * delta) * mixed
    outputs = at_ch + at_h * (delta * theta.pow(2) + d0 * mixed) / denominator
    slope = delta.pow(2) * (d1 * theta.pow(2) + 2 * delta * mixed + d0 * (1 - theta).pow(2))
    return outputs, torch.log(slope) - 2 * torch.log(denominator)


def unconstrained_rq(inputs, uw, uh, ud, library):  # noqa: ANN001, ANN201
    inside = (inputs >= -BOUND) & (inputs <= BOUND)
    outside = ~inside
    outputs, logabsdet = torch.zeros_like(inputs), torch.zeros_like(inputs)
    ud = F.pad(ud, pad=(1, 1))
    ud[..., 0] = ud[..., -1] = math.log(math.exp(1 - 1e-3) - 1)
    outputs[outside] = inputs[outside]
    logabsdet[outside] = 0
    outputs[inside], logabsdet[inside] = rq_spline(
        inputs[inside], uw[inside, :], uh[inside, :], ud[inside, :], library
    )
    return outputs, logabsdet


class SplineCoupling(nn.Module):
    def __init__(self, parity: int, library: bool) -> None:
        super().__init__()
        self.library = library
        self.register_buffer("kept", torch.arange(parity, D, 2))
        self.register_buffer("moved", torch.arange(1 - parity, D, 2))
        self.net = nn.Sequential(nn.Linear(D // 2, 16), nn.Tanh(), nn.Linear(16, (D // 2) * (3 * BINS - 1)))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept, moved = x[:, self.kept], x[:, self.moved]
        p = self.net(kept).view(x.shape[0], D // 2, 3 * BINS - 1)
        moved, logabsdet = unconstrained_rq(moved, p[..., :BINS], p[..., BINS:2 * BINS], p[..., 2 * BINS:], self.library)
        y = torch.empty_like(x)
        y[:, self.kept] = kept
        y[:, self.moved] = moved
        return y, logabsdet.sum(-1)


class SplineFlow(nn.Module):
    def __init__(self, library: bool = False) -> None:
        super().__init__()
        self.couplings = nn.ModuleList([SplineCoupling(0, library), SplineCoupling(1, library)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        total = torch.zeros((), dtype=x.dtype)
        for coupling in self.couplings:
            x, logabsdet = coupling(x)
            total = total + logabsdet
        return (-0.5 * x.pow(2) - 0.5 * math.log(2 * math.pi)).sum(-1) + total


def flow_step(model, optim, x):  # noqa: ANN001
    return _finish(model, optim, -model(x).mean())


def _flow_batches() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    some = torch.randn(16, D, generator=gen, dtype=torch.float64) * 2  # some past the bound
    none_on_one_rank = torch.randn(16, D, generator=gen, dtype=torch.float64)
    none_on_one_rank[8:] = 5.0  # the second rank's share is all in the tails
    every = torch.randn(16, D, generator=gen, dtype=torch.float64) * 0.5
    return [some, none_on_one_rank, every]


def _parity(step, mode, batches, make):  # noqa: ANN001, ANN202
    model, reference, optim, reference_optim = adamw_twins(make)
    compiled = sc.compile(make_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for batch in batches:
            got, want = compiled(model, optim, *batch), step(reference, reference_optim, *batch)
            assert torch.isfinite(want).all()
            assert relative_difference(got, want) < TOL, (got, want)
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, reference_optim, sim)}.values())
    assert worst < TOL
    return compiled


@pytest.mark.parametrize("library", [False, True], ids=["nflows_searchsorted", "torch_searchsorted"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_spline_flow_with_linear_tails_matches_one_device_for_any_mask(mode, library):
    batches = _flow_batches()
    inside = [(b.abs() <= BOUND).all(-1) for b in batches]
    assert not inside[0].all() and inside[0].any() and not inside[1][8:].any() and inside[2].all()
    compiled = _parity(flow_step, mode, [(b,) for b in batches], lambda: SplineFlow(library))
    assert not compiled.last_program.captured.checks  # exact for any mask: nothing to verify


# -- one use at a time, on rows of a mask of the batch ------------------------------------
class Lifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D * BINS)


def _use(kind: str):  # noqa: ANN202
    def step(model, optim, x):  # noqa: ANN001
        h = model.lin(x).view(x.shape[0], D, BINS)
        keep = x.abs() < 1.0
        out = x.clone()
        r = h[keep, :]
        if kind == "last_dim":
            r = r * r.size(-1) + r.size(1) + r.dim()
        elif kind == "other_dims":
            r = r.reshape(-1, r.size(1)) + torch.zeros(r.size(1), dtype=r.dtype)
        elif kind == "pad":
            r = F.pad(r, (1, 0), value=0.5)[..., :-1] + F.pad(r, (0, 1), mode="replicate")[..., 1:]
        elif kind == "write":
            r = r.clone()
            r[..., 0] = 0.5
            r[:, 1:3] = r[:, 2:4] * 2
            r[..., -1] += torch.linspace(0, 1, 1, dtype=r.dtype)
        elif kind == "scatter":
            at = r.argmax(-1, keepdim=True)
            r = r.scatter(-1, at, 0.0) + torch.zeros_like(r).scatter_add(-1, at, r.gather(-1, at))
        elif kind == "take_along":
            at = torch.zeros(1, 1, dtype=torch.long).expand_as(r[..., :1])
            r = torch.take_along_dim(r, at + 2, dim=-1) * r
        elif kind == "searchsorted":
            edges = torch.linspace(-1, 1, 4, dtype=r.dtype)
            r = torch.searchsorted(edges, r.detach()).to(r.dtype) * r
        # uses of the rows' own dim: compiled for the mask that selects everything
        elif kind == "count":
            r = r * r.shape[0]
        elif kind == "leading_dims":
            r = r.gather(-1, torch.zeros(r.shape[:-1] + (1,), dtype=torch.long))
        elif kind == "pad_rows":
            r = F.pad(r, (0, 0, 1, 0))[1:]
        elif kind == "write_first_row":
            r = r.clone()
            r[0] = 0.5
        elif kind == "scatter_rows":
            r = r.scatter(0, torch.zeros_like(r, dtype=torch.long), r)
        elif kind == "searchsorted_rows":
            r = torch.searchsorted(r[:, 0].detach().sort().values, r.detach()).to(r.dtype) * r
        elif kind == "shape_equal":
            r = r * float(r.shape == torch.Size([x.numel(), D, BINS]))
        elif kind == "size_equal_left":  # torch.Size on the left compares the raw items
            r = r * float(torch.Size([x.numel(), BINS]) == r.shape)
        elif kind == "shape_is_size":
            r = r * (2.0 if isinstance(r.shape, torch.Size) and r.shape[0] == x.numel() else 1.0)
        elif kind == "searchsorted_1d":  # 1-D rows in 1-D rows: a lookup across the rows
            seq = torch.arange(x.numel(), dtype=r.dtype).view_as(x)[keep]
            r = r * torch.searchsorted(seq, r[:, 0].detach() * x.numel())[:, None].to(r.dtype)
        else:
            raise ValueError(kind)
        out[keep] = r[..., -1] * x[keep]
        return _finish(model, optim, out.pow(2).mean())

    step.__name__ = f"{kind}_step"
    return step


def _masked_batches(full: bool = False) -> list[tuple[torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for k in range(3):
        x = torch.randn(8, D, generator=gen, dtype=torch.float64)
        if full:
            x = x.clamp(-0.9, 0.9)
        elif k == 1:
            x[4:] = 2.0  # nothing selected in the second rank's share
        elif k == 2:
            x = x.clamp(-0.9, 0.9)  # everything selected
        out.append((x,))
    return out


@pytest.mark.parametrize("kind", ["last_dim", "other_dims", "pad", "write", "scatter", "take_along", "searchsorted"])
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_rows_used_along_their_other_dims_match_one_device_for_any_mask(kind, mode):
    compiled = _parity(_use(kind), mode, _masked_batches(), Lifted)
    assert not compiled.last_program.captured.checks


@pytest.mark.parametrize("kind", [
    "count", "leading_dims", "pad_rows", "write_first_row", "scatter_rows", "searchsorted_rows", "shape_equal",
    "size_equal_left", "shape_is_size", "searchsorted_1d",
])
def test_uses_of_the_rows_own_dim_are_exact_on_full_masks_and_refused_on_padded(kind):
    step = _use(kind)
    compiled = _parity(step, "ddp", _masked_batches(full=True), Lifted)
    assert compiled.last_program.captured.checks  # compiled for the mask that selects everything
    model, _, optim, _ = adamw_twins(Lifted)
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDRuntimeError) as info:
        for batch in _masked_batches():
            compiled(model, optim, *batch)
    assert "test_selected_rows_along_other_dims.py" in str(info.value) and "Nothing was updated" in str(info.value)


def test_rows_of_a_mask_read_from_a_buffer_counted_name_the_buffer_and_the_use():
    """The refusal said "a mask computed from the model" where the mask is the batch
    indexed by a buffer: it names that buffer and the op that needed the rows' number."""

    class Picked(Lifted):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("picked", torch.tensor([0, 2]))

    def step(model, optim, x):  # noqa: ANN001
        moved = x[:, model.picked]
        inside = moved.abs() < 1.0
        out = moved.clone()
        rows = model.lin(x)[:, :2][inside]
        out[inside] = rows * rows.shape[0]
        return _finish(model, optim, out.pow(2).mean())

    model, _, optim, _ = adamw_twins(Picked)
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(sc.SPMDCompileError) as info:
        compiled(model, optim, *_masked_batches()[0])
    message = str(info.value)
    assert "out[inside] = rows * rows.shape[0]" in message
    assert "(it reads buffer picked)" in message and "(by torch.Tensor.shape)" in message
