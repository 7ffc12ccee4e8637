"""``torch.distributed`` called inside the step runs as on a world of one (NOTE:
[torch.distributed inside the step]).

A step ported from DDP normalizes by the world size, all-reduces its logged loss,
gathers predictions: compiled, it computes what the same step computes on one device on
the global batch (float64, 2 simulated ranks, within 1e-12). Before, the world size was
baked in (the loss divided by twice the global batch) and a collective failed with an unrelated error.
"""

from __future__ import annotations

import copy
import logging
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import all_reduce, get_rank, get_world_size
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.nn.functional import all_gather as gather_with_gradient

import spmd_compiler as sc
from spmd_compiler import errors
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models, compare_optimizers, relative_difference

TOL = 1e-12
BATCH, FEATURES, CLASSES = 8, 6, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)).double()


def ported_from_ddp_step(model, optim, x, y):  # noqa: ANN001
    """A DDP step: loss normalized by the global batch, the logged loss averaged over the
    ranks, predictions gathered into a buffer sized by the world size, asynchronously."""
    world = dist.get_world_size()
    loss = F.cross_entropy(model(x), y, reduction="sum") / (x.shape[0] * world)
    loss.backward()
    optim.step()
    optim.zero_grad()
    logged = loss.detach().clone()
    dist.all_reduce(logged, op=dist.ReduceOp.SUM)
    logged /= world
    predictions = model(x).argmax(-1)
    gathered = torch.empty(world * predictions.shape[0], dtype=predictions.dtype)
    dist.all_gather_into_tensor(gathered, predictions, async_op=True).wait()
    pieces = [torch.empty_like(y) for _ in range(world)]
    dist.all_gather(pieces, y)
    right = (gathered == torch.cat(pieces)).sum()
    if dist.get_rank() == 0:
        right = right + 0  # rank-0-only logging in a ported step
    dist.barrier()
    return logged, right


def one_device_step(model, optim, x, y):  # noqa: ANN001
    """What ``ported_from_ddp_step`` computes on one device: a world of one."""
    loss = F.cross_entropy(model(x), y, reduction="sum") / x.shape[0]
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach(), (model(x).argmax(-1) == y).sum()


def _batches(n: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64),
             torch.randint(0, CLASSES, (BATCH,), generator=gen)) for _ in range(n)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_step_ported_from_ddp_computes_as_one_device(mode, caplog, monkeypatch):
    monkeypatch.setattr(errors, "_WARNED_LINES", set())  # once per line and process
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode(mode))(ported_from_ddp_step)
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"), sc.simulate(world_size=2) as sim:
        for x, y in _batches():
            loss, right = compiled(model, optim, x, y)
            expected_loss, expected_right = one_device_step(reference, reference_optim, x, y)
            assert relative_difference(loss, expected_loss) < TOL
            assert int(right) == int(expected_right)
        worst = max({**compare_models(model, reference, sim),
                     **compare_optimizers(optim, reference_optim, sim)}.values())
    assert worst < TOL
    warned = [r.getMessage() for r in caplog.records if "world of one" in r.getMessage()]
    for name in ("get_world_size", "all_reduce", "all_gather_into_tensor", "all_gather", "get_rank"):
        assert any(f"torch.distributed.{name} at" in w and "test_distributed_calls.py" in w
                   for w in warned), name


def test_a_gathered_list_sized_outside_the_step_is_refused():
    world = 2  # read outside the step: the list is sized for two ranks

    def step(model, optim, x, y):  # noqa: ANN001
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        pieces = [torch.empty_like(loss) for _ in range(world)]
        dist.all_gather(pieces, loss.detach())
        return torch.stack(pieces).mean()

    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="2 output tensors") as info:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches(1)[0])
    assert "dist.all_gather(pieces" in str(info.value)  # the line
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_point_to_point_calls_are_refused():
    def step(model, optim, x, y):  # noqa: ANN001
        loss = F.cross_entropy(model(x), y)
        dist.send(loss.detach(), dst=1)
        loss.backward()
        optim.step()
        return loss

    model = _model()
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="dist.send|distributed.send") as info:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches(1)[0])
    assert "no peer" in str(info.value) and "test_distributed_calls.py" in str(info.value)


def test_the_process_group_is_answered_as_before_after_the_trace():
    """Only the trace sees a world of one: after the call, torch.distributed is torch's."""
    model = _model()
    compiled = sc.compile(make_mode("ddp"))(one_device_step)
    with sc.simulate(world_size=2):
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches(1)[0])
        assert dist.get_world_size() == 2
        assert dist.all_reduce is dist.distributed_c10d.all_reduce


class _TwoTowers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.image = nn.Linear(FEATURES, 8).double()
        self.text = nn.Linear(FEATURES, 8).double()


def gathered_contrastive_step(model, optim, x, t):  # noqa: ANN001
    """open_clip's loss as DDP code writes it: features gathered with their gradient
    (``torch.distributed.nn.all_gather``), labels offset by the rank."""
    import torch.distributed.nn as dist_nn

    image, text = F.normalize(model.image(x), dim=-1), F.normalize(model.text(t), dim=-1)
    all_image, all_text = torch.cat(dist_nn.all_gather(image)), torch.cat(dist_nn.all_gather(text))
    labels = torch.arange(image.shape[0]) + dist.get_rank() * image.shape[0]
    loss = (F.cross_entropy(10 * image @ all_text.T, labels)
            + F.cross_entropy(10 * text @ all_image.T, labels)) / 2
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def contrastive_on_one_device(model, optim, x, t):  # noqa: ANN001
    image, text = F.normalize(model.image(x), dim=-1), F.normalize(model.text(t), dim=-1)
    labels = torch.arange(image.shape[0])
    loss = (F.cross_entropy(10 * image @ text.T, labels) + F.cross_entropy(10 * text @ image.T, labels)) / 2
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_features_gathered_with_their_gradient_compute_as_one_device(mode):
    model, reference = _TwoTowers(), _TwoTowers()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = sc.compile(make_mode(mode))(gathered_contrastive_step)
    gen = torch.Generator().manual_seed(6)
    with sc.simulate(world_size=2) as sim:
        for _ in range(3):
            x, t = (torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64) for _ in range(2))
            loss = compiled(model, optim, x, t)
            assert relative_difference(loss, contrastive_on_one_device(reference, reference_optim, x, t)) < TOL
        assert max(compare_models(model, reference, sim).values()) < TOL


def named_imports_step(model, optim, x, y):  # noqa: ANN001
    """A DDP step whose torch.distributed functions were imported by name at the top of
    its file (``from torch.distributed import get_world_size, all_reduce, get_rank``)."""
    loss = F.cross_entropy(model(x), y, reduction="sum") / (x.shape[0] * get_world_size())
    loss.backward()
    optim.step()
    optim.zero_grad()
    logged = loss.detach().clone()
    all_reduce(logged)
    if get_rank() == 0:
        logged = logged + 0
    right = (torch.cat(gather_with_gradient(model(x).argmax(-1))) == y).sum()
    return logged / get_world_size(), right


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_functions_imported_by_name_compute_as_one_device(mode, caplog, monkeypatch):
    """NOTE: [names of torch.distributed's functions]. Before, the name imported before
    the trace held torch's own function: the world size 2 was baked in (the loss half of
    one device's, parameters 0.53 off after 3 steps), and all_reduce was refused as a draw
    from Python's random module."""
    monkeypatch.setattr(errors, "_WARNED_LINES", set())
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.5)
    compiled = sc.compile(make_mode(mode))(named_imports_step)
    torch_code = all_reduce.__code__  # the trace swaps the code, not the function object
    with caplog.at_level(logging.WARNING, logger="spmd_compiler"), sc.simulate(world_size=2) as sim:
        for x, y in _batches():
            loss, right = compiled(model, optim, x, y)
            expected_loss, expected_right = one_device_step(reference, reference_optim, x, y)
            assert relative_difference(loss, expected_loss) < TOL
            assert int(right) == int(expected_right)
        assert max(compare_models(model, reference, sim).values()) < TOL
        assert get_world_size() == 2 and all_reduce.__code__ is torch_code  # torch's again
    warned = [r.getMessage() for r in caplog.records if "world of one" in r.getMessage()]
    assert any("torch.distributed.all_reduce at" in w and "all_reduce(logged)" in w
               and "read outside the step" in w for w in warned)


MESH = None  # made by the user outside the step


def group_and_mesh_sizes_step(model, optim, x, y):  # noqa: ANN001
    """The world size learnt from the process group and from a mesh of the user's."""
    world = dist.group.WORLD.size() * MESH.size() * MESH.shape[0]
    loss = F.cross_entropy(model(x), y, reduction="sum") / (x.shape[0] * world)
    loss = loss + 0 * (dist.group.WORLD.rank() + MESH.get_rank() + MESH.get_local_rank())
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_process_group_and_mesh_sizes_read_as_one_device(mode, monkeypatch):
    """NOTE: [process groups and meshes inside the step]. Before, dist.group.WORLD.size()
    and mesh.size() read 2: the loss half of one device's, parameters 0.53 off."""
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.5)
    compiled = sc.compile(make_mode(mode))(group_and_mesh_sizes_step)
    with sc.simulate(world_size=2) as sim:
        monkeypatch.setattr(sys.modules[__name__], "MESH", init_device_mesh("cpu", (2,)))
        for x, y in _batches():
            loss = compiled(model, optim, x, y)
            assert relative_difference(loss, one_device_step(reference, reference_optim, x, y)[0]) < TOL
        assert max(compare_models(model, reference, sim).values()) < TOL
        assert dist.group.WORLD.size() == 2 and MESH.size() == 2  # torch's again


def test_a_launcher_variable_read_in_the_step_is_refused(monkeypatch):
    """NOTE: [launcher variables inside the step]. Before, int(os.environ["WORLD_SIZE"])
    baked 2 into the program on 2 ranks (the loss half of one device's), silently."""
    monkeypatch.setenv("WORLD_SIZE", "2")

    def step(model, optim, x, y):  # noqa: ANN001
        loss = F.cross_entropy(model(x), y, reduction="sum") / (x.shape[0] * int(os.environ.get("WORLD_SIZE", "1")))
        loss.backward()
        optim.step()
        return loss.detach()

    model = _model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="WORLD_SIZE") as info:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches(1)[0])
    assert 'int(os.environ.get("WORLD_SIZE"' in str(info.value)  # the line
    assert "dist.get_world_size()" in str(info.value)  # what to do
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_functional_collective_is_refused_as_already_global():
    """torch.distributed._functional_collectives traces as an op: refused saying the
    value is already global (before: DTensor's hint to register a sharding rule)."""
    import torch.distributed._functional_collectives as funcol

    def step(model, optim, x, y):  # noqa: ANN001
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optim.step()
        return funcol.all_reduce(loss.detach(), "sum", dist.group.WORLD)

    model = _model()
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="already global") as info:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches(1)[0])
    assert "drop the collective" in str(info.value) and "register_sharding" not in str(info.value)
