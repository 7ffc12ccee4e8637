"""An ``.item()`` read before the step writes the tensor it read (NOTE: [an item is its
value at the read]).

Eagerly ``before = model.scale.item(); model.scale.mul_(2)`` leaves ``before`` the old
number. The compiled step returned the new one (2048 for 1024, and ``after > before``
False), because the item held a view of the tensor. Here every way of reading a number
out of a tensor the step then writes, on 2 simulated ranks against the undecorated step
on one device (float64, the scale buffer float32): ``.item()`` and comparisons of items,
``.tolist()``, a view's element, a parameter's element before ``optimizer.step()``,
Adam's step count before the step, an item read in one branch of an ``if``, an item put
back into a tensor after the write, and one kept in an attribute. The copy that holds
the value is made only where a write follows.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers

TOL = 1e-12


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4)).double()
        self.register_buffer("scale", torch.tensor(1024.0))  # float32, as GradScaler's
        self.register_buffer("counts", torch.arange(3, dtype=torch.float64))
        self.last_scale = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Scaled()


def reads_before_writes_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y) * model.scale.double() / 1024
    loss.backward()
    before = model.scale.item()
    counts = model.counts.tolist()
    middle = model.counts[1].item()
    weight = model.net[0].weight[0, 1].item()
    p = model.net[0].weight
    count = optim.state[p]["step"].item() if p in optim.state else -1.0
    model.last_scale = model.scale.item()  # kept: stored as eager's number after the call
    in_branch = model.scale.item() if loss > 0 else 0.0
    with torch.no_grad():
        model.scale.mul_(2.0)
        model.counts.add_(1.0)
    after = model.scale.item()
    written = torch.zeros(2, dtype=torch.float64)
    written[0] = before
    optim.step()
    optim.zero_grad()
    return {
        "before": before, "after": after, "grew": after > before, "fell": before > after,
        "counts": counts, "middle": middle, "weight": weight,
        "weight_after": model.net[0].weight[0, 1].item(), "count": count, "in_branch": in_branch,
        "written": written, "as_tensor": torch.tensor([before, after], dtype=torch.float64),
        "loss": loss.item(),
    }


def _mode(name: str):  # noqa: ANN202
    if name == "tp":
        return make_mode("tp", plan={"net.0": ColwiseParallel(), "net.2": RowwiseParallel()})
    return make_mode(name)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randint(0, 4, (8,), generator=gen))
        for _ in range(3)
    ]


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.allclose(a, b, rtol=TOL, atol=0)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and abs(a - b) <= TOL * abs(b)  # type: ignore[operator]


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp"])
def test_numbers_read_before_a_write_are_the_values_read(mode):
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    compiled = sc.compile(_mode(mode))(reads_before_writes_step)
    with sc.simulate(world_size=2) as sim:
        for x, y in _batches():
            got = compiled(model, optim, x, y)
            want = reads_before_writes_step(reference, reference_optim, x, y)
            assert want["grew"] and not want["fell"] and want["weight"] != want["weight_after"]
            wrong = {k: (got[k], v) for k, v in want.items() if not _same(got[k], v)}
            assert not wrong, wrong
            assert model.last_scale == reference.last_scale
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, reference_optim, sim)}.values())
    assert worst < TOL


def test_a_copy_is_made_only_where_a_write_follows():
    """``loss.item()`` of a value the step computes, and ``.item()`` of the scale after
    its write or of the weight after the update, read the value itself (no op added);
    each number read before a write of its tensor is a copy (of a one-element view)."""
    from spmd_compiler.capture.traced_items import _viewed
    from spmd_compiler.ir.node_meta import is_item_snapshot

    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode("ddp"))(reads_before_writes_step)
    with sc.simulate(world_size=2):
        for x, y in _batches()[:2]:
            compiled(model, optim, x, y)
    captured = compiled.last_program.captured
    graph = captured.graph_module.graph
    ref_of = dict(zip(graph.find_nodes(op="placeholder"), captured.input_refs(), strict=True))
    copied = []
    for node in graph.nodes:
        if is_item_snapshot(node) and node.target is torch.ops.aten.clone.default:
            ref = ref_of[_viewed(node.args[0])]
            copied.append(f"{ref.name} {ref.key}".strip())
    # scale: before, last_scale, in_branch; counts: .tolist() (3) and counts[1]
    assert sorted(copied) == ["counts"] * 4 + ["net.0.weight", "net.0.weight step"] + ["scale"] * 3
