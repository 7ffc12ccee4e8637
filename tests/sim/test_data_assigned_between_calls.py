"""``tensor.data = value`` between compiled calls on a parameter or buffer the first call
placed (NOTE: [data replaced between calls] in ``spmd_compiler/_torch_private.py``).

torch's ``.data`` setter swaps the DTensor wrapper but not its local shard, which the
program reads: ``w.data = w.data.clamp(-0.01, 0.01)`` (WGAN-style clipping) was silently
ignored (losses 0.972434 / 0.902185 against eager's 1.053880 / 1.014909, the weight
12.4x off). It is now refused at the assignment, naming the tensor, with nothing
changed; the in-place forms train as eager (float64, within 1e-12). A DTensor no step
placed keeps torch's setter.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel

TOL = 1e-12


def step(model, optim, x, y):
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8, dtype=torch.float64)
        self.out = nn.Linear(8, 3, dtype=torch.float64)
        self.register_buffer("shift", torch.zeros(8, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.a(x)) + self.shift)


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=gen, dtype=torch.float64), torch.randint(0, 3, (8,), generator=gen))
        for _ in range(3)
    ]


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_data_assigned_to_a_placed_tensor_is_refused_and_in_place_works(mode: str) -> None:
    torch.manual_seed(0)
    model = Net()
    eager = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    eager_optim = torch.optim.SGD(eager.parameters(), lr=0.1)
    compiled = sc.compile(parallel_mode=DataParallel(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for i, (x, y) in enumerate(_data()):
            if i == 1:
                w = model.a.weight
                before = sim.full_tensor(w).clone()
                with pytest.raises(sc.SPMDRuntimeError, match="parameter a.weight was placed"):
                    w.data = w.data.clamp(-0.01, 0.01)
                with pytest.raises(sc.SPMDRuntimeError, match="buffer shift was placed"):
                    model.shift.data = model.shift.data + 0.5
                assert torch.equal(sim.full_tensor(model.a.weight), before)
                w.data.clamp_(-0.01, 0.01)  # the in-place forms
                with torch.no_grad():
                    model.shift.add_(0.5)
                    eager.a.weight.clamp_(-0.01, 0.01)
                    eager.shift.add_(0.5)
            loss, want = compiled(model, optim, x, y), step(eager, eager_optim, x, y)
            assert abs(float(loss) - float(want)) < TOL
        full = sc.checkpoint.full_state_dict(model)["model"]
    for name, value in eager.state_dict().items():
        assert torch.allclose(full[name], value, rtol=0, atol=TOL), name


def test_a_dtensor_no_step_placed_keeps_torchs_setter() -> None:
    model = Net()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data()[0]
    with sc.simulate(world_size=2) as sim:
        sc.compile(parallel_mode=DataParallel("replicate"))(step)(model, optim, x, y)  # the property is in place
        mesh = model.a.weight.device_mesh
        other = sim.shard(torch.zeros(4, dtype=torch.float64), mesh, model.a.weight.placements)
        assert isinstance(other, DTensor)
        other.data = sim.shard(torch.ones(4, dtype=torch.float64), mesh, model.a.weight.placements)
        assert other.shape == (4,)
