"""A script that replaces one of torch's functions with a wrapper of the original
(NOTE: [torch's functions replaced by the user] in ``spmd_compiler/_torch_private.py``,
NOTE: [torch's functions replaced] in ``capture/guards.py``): compiled against the same
code run eagerly on one device (float64, 2 simulated ranks)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel

ORIGINAL_SILU = F.silu
ORIGINAL_SDPA = F.scaled_dot_product_attention


def doubled_silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    return ORIGINAL_SILU(x) * 2.0


def tempered_attention(q, k, v, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003
    return ORIGINAL_SDPA(q * 0.5, k, v, *args, **kwargs)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, 2, 2, 4).unbind(1)  # (batch, heads, seq, dim)
        h = F.scaled_dot_product_attention(q, k, v).reshape(x.shape[0], 2, 8)
        return self.out(F.silu(h)).mean(1)


def step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _replace_both(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(F, "silu", doubled_silu)
    monkeypatch.setattr(F, "scaled_dot_product_attention", tempered_attention)


def _compare(monkeypatch, replace_after: int | None, make=None, replace=_replace_both) -> int:  # noqa: ANN001
    """Compiled and eager twins over 4 calls, the functions replaced before call
    ``replace_after`` (None: before the first); returns the number of programs."""
    torch.manual_seed(0)
    model = (make or Block)().double()
    twin = copy.deepcopy(model)
    optim, twin_optim = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, twin))
    compiled = sc.compile(parallel_mode=DataParallel("replicate"))(step)
    gen = torch.Generator().manual_seed(1)
    with sc.simulate(world_size=2):
        for i in range(4):
            if i == (replace_after or 0):
                replace(monkeypatch)
            x = torch.randn(8, 2, 8, dtype=torch.float64, generator=gen)
            y = torch.randint(0, 4, (8,), generator=gen)
            got, want = compiled(model, optim, x, y).item(), step(twin, twin_optim, x, y).item()
            assert abs(got - want) <= 1e-12 * abs(want), (i, got, want)
    return len(compiled.records)


def test_a_wrapper_of_torchs_function_runs_once(monkeypatch):
    """The wrapper was handed to every function mode of the capture, each running it again:
    a loss of 32.8 against eager's 1.52 on the first call (F.silu doubled 2 ** 7 times)."""
    assert _compare(monkeypatch, replace_after=None) == 1


@pytest.mark.parametrize("replace_after", [2])
def test_a_function_replaced_between_calls_recompiles(monkeypatch, replace_after):
    """torch's modules were not walked: the program of the old function ran silently."""
    assert _compare(monkeypatch, replace_after) == 2


class ThroughNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.silu(self.fc(x))).mean(1)  # F reached through nn


def test_a_function_reached_through_a_submodule_path_is_guarded(monkeypatch):
    """``nn.functional.silu`` is torch.nn's attribute ``functional``'s ``silu``: the walk
    stopped at the submodule, and a replacement ran the old program (found by a review)."""
    programs = _compare(monkeypatch, 1, ThroughNN, lambda mp: mp.setattr(F, "silu", doubled_silu))
    assert programs == 2


def test_a_class_forward_is_guarded_once_per_class():
    """Each module instance added its own guard on ``Linear.forward`` (a class's
    ``__dict__`` is a new proxy each time it is read)."""
    from spmd_compiler.capture.bindings import find_bindings
    from spmd_compiler.capture.guards import build_guards

    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(5)])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 4), torch.randint(0, 4, (2,))
    guards = build_guards(step, find_bindings(step, (model, optim, x, y), {}), frozenset())
    assert sum(name == "class Linear.forward" for name in guards.names) == 1
