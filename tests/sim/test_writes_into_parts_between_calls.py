"""In-place writes between compiled calls into a part of a placed parameter (NOTE:
[writes into a redistributed part of a placed tensor] in ``spmd_compiler/_torch_private.py``).

Taking a part of a parameter along a dimension the step shards (``emb.weight[PAD]``,
``w[2:5]``, ``w.narrow(0, 2, 3)``) gives, from DTensor, a view of an all-gathered
temporary: the write (``.zero_()``, ``w[3] = 0``, ``nn.init.dirac_``) was silently
dropped (fsdp, 2 simulated ranks: losses [1.4929, 2.2889, 1.9452] against eager's
[1.4929, 2.2230, 1.9759]). Now it is refused at the write, naming the parameter and
the view op, with the model unchanged; the way the message gives (``w.data =`` a whole
value built from ``w.full_tensor()``) trains as eager. Writes that reach the local
shard (whole-tensor in-place ops, a column under fsdp) are exact as before, and
``nn.init.eye_`` (``torch.eye(out=w)``, which left every rank holding the whole
identity: the next call failed at a reshape) is put back on the placements, exact.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel, make_mode

TOL = 1e-12


def step(model, optim, x, y):  # noqa: ANN001, ANN201
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16, dtype=torch.float64)
        self.mid = nn.Linear(16, 16, dtype=torch.float64)
        self.out = nn.Linear(16, 4, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mid(torch.tanh(self.a(x)))))


def _mode(name: str):  # noqa: ANN202
    if name == "tp":  # a: rows sharded (Shard(0)), mid: columns sharded (Shard(1))
        return make_mode("tp", plan={"a": ColwiseParallel(), "mid": RowwiseParallel()})
    return DataParallel(name)


def _data(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(n)
    ]


def _run(mode: str, edit: Callable[[nn.Module], None], edit_eager: Callable[[nn.Module], None] | None = None) -> None:
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    eager_optim = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    compiled = sc.compile(parallel_mode=_mode(mode))(step)
    with sc.simulate(world_size=2):
        for i, (x, y) in enumerate(_data()):
            if i == 1:
                with torch.no_grad():
                    edit(model)
                    (edit_eager or edit)(eager)
            loss, want = compiled(model, optim, x, y), step(eager, eager_optim, x, y)
            assert abs(float(loss) - float(want)) < TOL, i
        full = sc.checkpoint.full_state_dict(model)["model"]
        for name, value in eager.state_dict().items():
            assert torch.allclose(full[name], value, rtol=0, atol=TOL), name


def _row_through_data(model: nn.Module) -> None:
    """What the refusal says to do instead of ``model.a.weight[3].zero_()``."""
    w = model.a.weight
    full = w.full_tensor().clone()
    full[3] = 0
    w.data = full


@pytest.mark.parametrize("mode", ["fully_shard", "tp"])
@pytest.mark.parametrize(("write", "message"), [
    (lambda m: m.a.weight[3].zero_(), r"aten\.zero_.* parameter a\.weight taken by aten\.select"),
    (lambda m: m.a.weight.__setitem__(3, 0.0), r"parameter a\.weight taken by aten\.select"),
    (lambda m: m.a.weight.narrow(0, 2, 3).fill_(0.5), r"parameter a\.weight taken by aten\.slice"),
    (lambda m: m.a.weight[2:5][0].mul_(3.0), r"parameter a\.weight taken by aten\.slice"),
    (lambda m: nn.init.constant_(m.a.weight.chunk(4)[1], 0.1), r"parameter a\.weight taken by aten\.split"),
    (lambda m: m.a.bias[3].fill_(1.0), r"parameter a\.bias taken by aten\.select"),
], ids=["row_zero", "setitem", "narrow", "view_of_part", "chunk", "bias_element"])
def test_a_write_into_a_redistributed_part_is_refused_with_nothing_changed(
    mode: str, write: Callable[[nn.Module], None], message: str,
) -> None:
    torch.manual_seed(0)
    model = Net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=_mode(mode))(step)
    x, y = _data(1)[0]
    with sc.simulate(world_size=2):
        compiled(model, optim, x, y)
        before = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        with torch.no_grad(), pytest.raises(sc.SPMDCompileError, match=message) as raised:
            write(model)
        assert "w.data = full" in str(raised.value)
        for n, p in model.named_parameters():
            assert torch.equal(p.full_tensor(), before[n]), n
        compiled(model, optim, x, y)  # the model is still usable


@pytest.mark.parametrize("mode", ["fully_shard", "tp"])
def test_the_padding_row_written_through_data_trains_as_eager(mode: str) -> None:
    _run(mode, _row_through_data, lambda m: m.a.weight[3].zero_())


@pytest.mark.parametrize("mode", ["fully_shard", "tp"])
@pytest.mark.parametrize("edit", [
    lambda m: m.a.weight.mul_(0.5),
    lambda m: nn.init.eye_(m.a.weight),
    lambda m: nn.init.eye_(m.mid.weight),
], ids=["whole_tensor", "eye_rows_sharded", "eye_mid"])
def test_writes_that_reach_the_shard_train_as_eager(mode: str, edit: Callable[[nn.Module], None]) -> None:
    _run(mode, edit)


def test_a_column_write_under_fsdp_trains_as_eager() -> None:
    _run("fully_shard", lambda m: m.a.weight[:, 3].zero_())
