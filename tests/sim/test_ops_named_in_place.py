"""Python's bit operators in a compiled step (``t << k``, ``t >> k``, ``<<=``, ``>>=``,
``aten.__and__`` and the other ops named with a trailing ``_`` that write nothing) give
eager's numbers: DTensor took them for in-place ops and gave back their input
(``arange(-4, 4) << 10`` came out ``[-4, ..., 3]``; a shift-xor hash grid trained 0.059
off eager in 3 steps). 2 simulated ranks, float64 (NOTE: [ops named like in-place ones])."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.capture.ops_named_in_place import (
    named_in_place_decompositions,
    named_in_place_without_writing,
)
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import TensorParallel, make_mode

TOL = 1e-12
aten = torch.ops.aten


def _ops_named_in_place() -> set[object]:
    """Every ATen overload on this torch named with a trailing ``_`` that writes nothing
    and takes a tensor first (the ``.int`` / ``.bool`` overloads take Python numbers)."""
    found = set()
    for name in dir(aten):
        packet = getattr(aten, name, None)
        for overload in getattr(packet, "overloads", list)():
            op = getattr(packet, overload)
            arguments = op._schema.arguments
            if named_in_place_without_writing(op) and [str(a.type) for a in arguments[:1]] == ["Tensor"]:
                found.add(op)
    return found


def test_every_aten_op_named_in_place_without_writing_is_traced_as_its_twin():
    """A torch that adds such an op fails here: give it a twin in ``_TWINS``."""
    table = named_in_place_decompositions()
    assert _ops_named_in_place() <= set(table)
    assert aten.__lshift__.Scalar in table and aten.__ilshift__.Tensor in table
    a, s = torch.arange(-5, 5), torch.tensor([0, 1, 2, 3, 63, 64, -1, 5, 6, 7])
    for op, decomposition in table.items():
        other = s if "Tensor" in op._overloadname else 3
        out = {"out": torch.empty_like(a)} if "out" in op._overloadname else {}
        assert torch.equal(decomposition(a.clone(), other, **out), op(a.clone(), other, **out)), op


def _operators(model: nn.Module, c: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        h = c.clone()
        h <<= 3
        g = c.clone()
        g >>= s
        k = c.clone()
        aten.__iand__.Scalar(k, 6)
        aten.__ixor__.Tensor(k, s)
        o = torch.empty_like(c)
        aten.__lshift__.Scalar_out(c, 2, out=o)
        return (
            c << 10, c >> 1, c << s, c >> s, h, g, k, o,
            aten.__and__.Tensor(c, s), aten.__or__.Scalar(c, 5), aten.__xor__.Scalar(c, 9),
            model(c.double()).sum(),
        )


_TP_PLAN = {"0": ColwiseParallel(), "1": RowwiseParallel()}
_OPERATOR_MODES = {  # mode: (its maker, world size)
    "ddp": (lambda: make_mode("ddp"), 2),
    "fsdp": (lambda: make_mode("fsdp"), 2),
    "dtensor_expand": (lambda: make_mode("dtensor_expand"), 2),
    "tp": (lambda: TensorParallel(_TP_PLAN), 2),
    "fsdp_tp": (lambda: make_mode("fsdp_tp", plan=_TP_PLAN, mesh_shape=(2, 2)), 4),
}
_OPERATOR_CASES = [(mode, dtype) for mode in sorted(_OPERATOR_MODES) for dtype in (torch.int32, torch.int64)]


_CASES_RUN = [c for c in _OPERATOR_CASES if c != ("fsdp_tp", torch.int32)]


@pytest.mark.parametrize("mode,dtype", _CASES_RUN, ids=[f"{m}-{str(d)[6:]}" for m, d in _CASES_RUN])
def test_shift_and_bit_operators_match_eager(mode, dtype):
    """Negative values, scalar and tensor shift amounts, in-place forms."""
    make, world = _OPERATOR_MODES[mode]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2)).double()
    c = torch.arange(-8, 8, dtype=dtype).reshape(8, 2)
    s = torch.arange(16, dtype=dtype).remainder(5).reshape(8, 2)
    expected = _operators(model, c, s)
    with sc.simulate(world_size=world):
        got = sc.compile(make())(_operators)(model, c, s)
    for i, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert g.dtype == e.dtype and torch.allclose(g, e, rtol=TOL, atol=0), (i, g.tolist(), e.tolist())


class _HashGrid(nn.Module):
    """A multi-resolution hash-grid field (instant-NGP style): corner cells hashed by
    shifts and xors into embedding tables, trilinearly blended, decoded by an MLP."""

    def __init__(self, table: int = 64, resolutions: tuple[int, ...] = (4, 6, 9)) -> None:
        super().__init__()
        self.table, self.resolutions = table, resolutions
        self.tables = nn.ModuleList(nn.Embedding(table, 2) for _ in resolutions)
        corners = [[i >> 2 & 1, i >> 1 & 1, i & 1] for i in range(8)]
        self.register_buffer("corners", torch.tensor(corners))
        self.mlp = nn.Sequential(nn.Linear(2 * len(resolutions), 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = []
        for resolution, table in zip(self.resolutions, self.tables, strict=True):
            scaled = x * resolution
            low = scaled.floor()
            fraction = scaled - low
            cells = low.long()[:, None] + self.corners
            h = cells[..., 0] ^ (cells[..., 1] << 10) ^ (cells[..., 2] << 20)
            h = h ^ (h >> 7)
            weights = torch.where(self.corners.bool(), fraction[:, None], 1 - fraction[:, None]).prod(-1)
            features.append((weights[..., None] * table(h % self.table)).sum(1))
        return self.mlp(torch.cat(features, -1)).squeeze(-1)


def _field_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _points() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(3):
        x = torch.rand(16, 3, generator=gen, dtype=torch.float64)
        batches.append((x, torch.sin(5 * x[:, 0]) + x[:, 2]))
    return batches


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "dtensor_expand"])
def test_a_hash_grid_hashed_by_shifts_trains_as_eager(mode, run_parity):
    result = run_parity(
        lambda: _HashGrid().double(), lambda m: torch.optim.Adam(m.parameters(), lr=1e-2), 2,
        _points(), step=_field_step, mode=make_mode(mode),
    )
    result.assert_close(TOL)
    assert result.compile_counts[-1] == 1


@torch.library.custom_op("spmd_test_named::halved_", mutates_args=())
def halved_(x: torch.Tensor) -> torch.Tensor:
    return x / 2


@halved_.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _halving_step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> Any:
    loss = F.mse_loss(model(x).squeeze(-1), halved_(y))
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_another_op_named_in_place_without_writing_is_refused_by_name():
    model = nn.Linear(3, 1).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _points()[0]
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as raised:
        sc.compile(make_mode("ddp"))(_halving_step)(model, optim, x, y)
    text = str(raised.value)
    assert "spmd_test_named.halved_.default has a name ending in '_' but writes none" in text
    assert "test_ops_named_in_place.py:" in text and "rename it" in text
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
