"""Index-valued arguments numbered from 0 on each rank: ``DataParallel(input_index_of=...)``
(NOTE: [indices into the global batch] in ``parallel_modes/local_indices.py``).

A graph-classification step takes node features ``x``, an ``edge_index`` ``ei`` of node
ids into ``x`` (batch in dimension 1), a ``batch`` vector of graph ids per node into the
labels ``y``. A data-parallel mode reads each rank's tensors as its share of one global
batch, so such ids are ids into the global batch; a torch-DDP script's per-rank collate
numbers them from 0 on each rank, and on real ranks trained 0.199 relative off eager
without a word. ``input_index_of={'ei': 'x', 'batch': 'y'}`` moves each rank's ids by
rank * the indexed argument's local size on real ranks (``tests/dist/
test_local_index_inputs_gloo.py``); in simulation the global batch is passed, its ids
global, and nothing is added. Here: that simulation, the option's checks, and the move
itself, and the first call's warning on real ranks where ids look numbered from 0 on
each rank (NOTE: [ids that look numbered from 0 on each rank]), run here on a simulated
program as rank 1 would.
"""

from __future__ import annotations

import copy
import types
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.parallel_modes.local_indices import (
    checked_index_of,
    global_ids,
    index_inputs,
    warn_on_local_ids,
)
from spmd_compiler.tools.parity import full_state, relative_difference

SIZES = [3, 5, 5, 3]  # nodes per graph: each rank's two graphs hold 8 nodes
INDEX_OF = {"ei": "x", "batch": "y"}


class GraphNet(nn.Module):
    """Two message-passing layers (index_select, index_add) and mean pooling per graph."""

    def __init__(self, features: int = 4, hidden: int = 8, classes: int = 3) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(features, hidden), nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def conv(self, lin: nn.Linear, x: torch.Tensor, ei: torch.Tensor) -> torch.Tensor:
        h = lin(x)
        return F.relu(h + torch.zeros_like(h).index_add_(0, ei[1], h[ei[0]]))

    def forward(self, x: torch.Tensor, ei: torch.Tensor, batch: torch.Tensor, graphs: int) -> torch.Tensor:
        h = self.conv(self.l2, self.conv(self.l1, x, ei), ei)
        count = torch.zeros(graphs, dtype=h.dtype).index_add_(0, batch, torch.ones(batch.shape[0], dtype=h.dtype))
        pooled = torch.zeros(graphs, h.shape[1], dtype=h.dtype).index_add_(0, batch, h) / count.unsqueeze(-1)
        return self.out(pooled)


def graph_step(model, optim, x, ei, batch, y):
    loss = F.cross_entropy(model(x, ei, batch, y.shape[0]), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def collate(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """PyG's collate of graphs ``ids``: node ids and graph ids numbered from 0."""
    xs, eis, batch, offset = [], [], [], 0
    for j, i in enumerate(ids):
        g = torch.Generator().manual_seed(100 + i)
        n = SIZES[i]
        xs.append(torch.randn(n, 4, generator=g, dtype=torch.float64))
        eis.append(torch.randint(0, n, (2, 2 * n), generator=g) + offset)
        batch.append(torch.full((n,), j))
        offset += n
    return torch.cat(xs), torch.cat(eis, 1), torch.cat(batch), torch.tensor([i % 3 for i in ids])


def setup() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GraphNet().double()
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def eager(steps: int = 3) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, optim = setup()
    losses = [float(graph_step(model, optim, *collate([0, 1, 2, 3]))) for _ in range(steps)]
    return losses, full_state(model, optim, None)


@pytest.mark.parametrize("style", ["replicate", "fully_shard"])
def test_the_global_batch_in_simulation_trains_as_one_device(style: str) -> None:
    """Simulated ranks are passed the global batch, whose ids are global: nothing moves."""
    want, state = eager()
    model, optim = setup()
    compiled = sc.compile(DataParallel(style, input_batch_dim={"ei": 1}, input_index_of=INDEX_OF))(graph_step)
    with sc.simulate(world_size=2) as sim:
        got = [float(compiled(model, optim, *collate([0, 1, 2, 3]))) for _ in range(3)]
        after = full_state(model, optim, sim)
    assert max(abs(a - b) for a, b in zip(got, want)) < 1e-12, (got, want)
    assert max(relative_difference(after[k], v) for k, v in state.items()) < 1e-12


@pytest.mark.parametrize(
    ("index_of", "batch_dims", "dtype", "expected"),
    [
        ({"edges": "x"}, {"ei": 1}, torch.long, "no tensor argument of this call is 'edges'"),
        ({"ei": "nodes"}, {"ei": 1}, torch.long, "no tensor argument of this call is 'nodes'"),
        ({"ei": "x"}, {"ei": 1}, torch.float64, "is a torch.float64 tensor"),
        ({"ei": "x"}, {"ei": None}, torch.long, "does not split 'ei'"),
        ({"batch": "y"}, {"ei": 1, "y": None}, torch.long, "does not split 'y'"),
    ],
)
def test_a_bad_entry_is_refused_naming_it_with_the_model_untouched(index_of, batch_dims, dtype, expected) -> None:
    model, optim = setup()
    before = copy.deepcopy(model.state_dict())
    x, ei, batch, y = collate([0, 1, 2, 3])
    if dtype != torch.long:  # the check comes before any op reads it
        ei = ei.to(dtype)
    compiled = sc.compile(DataParallel(input_batch_dim=batch_dims, input_index_of=index_of))(graph_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=expected):
        compiled(model, optim, x, ei, batch, y)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    assert not optim.state


@pytest.mark.parametrize(
    ("bad", "error"),
    [(["ei"], TypeError), ({"ei": 1}, TypeError), ({"ei": "ei"}, ValueError),
     ({"b['i']": "x", 'b["i"]': "y"}, ValueError)],
)
def test_input_index_of_of_another_type_is_refused(bad, error) -> None:
    with pytest.raises(error):
        DataParallel(input_index_of=bad)


def test_names_are_spelled_as_argument_paths() -> None:
    assert checked_index_of({'data["edge_index"]': "data['x']"}) == {"data['edge_index']": "data['x']"}
    assert "input_index_of={'ei': 'x'}" in repr(DataParallel(input_index_of={"ei": "x"}))


def test_each_rank_ids_move_by_its_rank_times_the_local_size_in_a_new_tensor() -> None:
    """What a real rank feeds (``global_ids``): the caller's tensor is not written."""
    x, ei, batch, y = collate([2, 3])
    names, tensors = ["x", "ei", "batch", "y"], [x, ei, batch, y]
    placements = [(Shard(0),), (Shard(1),), (Shard(0),), (Shard(0),)]
    entries = index_inputs({"ei": "x", "batch": "y"}, names, tensors, placements)
    assert entries == [(1, 0, 0), (2, 3, 0)]
    kept = ei.clone(), batch.clone()
    rank1 = types.SimpleNamespace(ndim=1, get_local_rank=lambda: 1)
    moved = global_ids(entries, tensors, rank1)  # type: ignore[arg-type]
    assert torch.equal(moved[1], kept[0] + 8) and torch.equal(moved[2], kept[1] + 2)
    assert torch.equal(ei, kept[0]) and torch.equal(batch, kept[1])
    assert moved[0] is x and moved[3] is y
    rank0 = types.SimpleNamespace(ndim=1, get_local_rank=lambda: 0)
    assert global_ids(entries, tensors, rank0)[1] is ei  # type: ignore[arg-type]
    with pytest.raises(SPMDCompileError, match="does not split 'x'"):
        index_inputs({"ei": "x"}, names, tensors, [(Replicate(),), *placements[1:]])



def rank_1_of(program: object) -> types.SimpleNamespace:
    """``program`` as rank 1 of 2 real ranks holds it: what ``warn_on_local_ids`` reads."""
    rank1 = types.SimpleNamespace(ndim=1, size=lambda: 2, get_local_rank=lambda: 1)
    return types.SimpleNamespace(mesh=rank1, captured=program.captured,  # type: ignore[attr-defined]
                                 input_placements=program.input_placements)  # type: ignore[attr-defined]

@pytest.mark.parametrize("how", ["local", "global", "named"])
def test_rank_1_warns_where_its_ids_look_numbered_from_0(how: str) -> None:
    """What rank 1 of 2 checks at its first call: its own collate's ids (all below its 8
    nodes and 2 graphs) warn naming each argument, the op, the line and the option; its
    slice of the global collate (global ids) and ids the mode moves do not."""
    model, optim = setup()
    compiled = sc.compile(DataParallel(input_batch_dim={"ei": 1}))(graph_step)
    with sc.simulate(world_size=2):
        compiled(model, optim, *collate([0, 1, 2, 3]))
    as_rank1 = rank_1_of(compiled.last_program)
    if how == "global":
        x, ei, batch, y = collate([0, 1, 2, 3])
        share = x[8:], ei[:, ei.shape[1] // 2:], batch[8:], y[2:]
    else:
        share = collate([2, 3])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_on_local_ids(as_rank1, list(share), INDEX_OF if how == "named" else {})  # type: ignore[arg-type]
    messages = [str(w.message) for w in caught if "look numbered from 0" in str(w.message)]
    if how != "local":
        assert not messages, messages
        return
    assert len(messages) == 2, messages
    ei_warning, batch_warning = sorted(messages, key=lambda m: "'batch'" in m)
    assert "Argument 'ei' indexes dimension 0" in ei_warning and "lies in [0, 8)" in ei_warning
    assert "input_index_of={'ei': 'x'}" in ei_warning and "op:          aten.index" in ei_warning
    assert "input_index_of={'batch': 'y'}" in batch_warning and "aten.index_add" in batch_warning
    assert "train step:  " + __file__ in batch_warning


def label_step(model, optim, x, y, class_weights):
    logp = torch.log_softmax(model(x), -1)
    loss = -(logp.gather(1, y[:, None]).squeeze(1) * class_weights[y]).mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_labels_into_a_class_dimension_or_a_whole_table_do_not_warn() -> None:
    """4 classes and a global batch of 4: rank 1's labels all below 2 index the classes
    of ``logp`` (dimension 1) and the whole ``class_weights``, no split dimension."""
    torch.manual_seed(0)
    model = nn.Linear(3, 4).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y, weights = torch.randn(4, 3, dtype=torch.float64), torch.tensor([3, 2, 0, 1]), torch.rand(4).double()
    compiled = sc.compile(DataParallel(input_batch_dim={"class_weights": None}))(label_step)
    with sc.simulate(world_size=2):
        compiled(model, optim, x, y, weights)
    as_rank1 = rank_1_of(compiled.last_program)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_on_local_ids(as_rank1, [x[2:], y[2:], weights], {})  # type: ignore[arg-type]
    assert not [w for w in caught if "look numbered from 0" in str(w.message)]


def test_local_batch_of_an_index_argument_is_refused() -> None:
    """``local_batch`` cuts the global batch's slice (global ids); the runtime would add
    the rank's offset again, out of range on 2 ranks and silently wrong from 3."""
    mode = DataParallel("replicate", input_batch_dim={"ei": 1}, input_index_of={"ei": "x"})
    ei = torch.zeros(2, 8, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"local_batch\('ei'\).*input_index_of"):
        mode.local_batch(ei, 1, name="ei")



class NormNet(nn.Module):
    """Node classification with GraphNorm's per-graph mean, counted by ``graphs``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.out = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, ei: torch.Tensor, batch: torch.Tensor, graphs: int) -> torch.Tensor:
        h = self.l1(x)
        h = h + torch.zeros_like(h).index_add_(0, ei[1], h[ei[0]])
        count = torch.zeros(graphs, dtype=h.dtype).index_add_(0, batch, torch.ones(batch.shape[0], dtype=h.dtype))
        mean = torch.zeros(graphs, h.shape[1], dtype=h.dtype).index_add_(0, batch, h) / count[:, None]
        return self.out(F.relu(h - mean[batch]))


def count_step(model, optim, x, ei, batch, y, num_graphs):
    """PyG's ``size=data.num_graphs``: the graph count passed as a Python int; a label per node."""
    loss = F.cross_entropy(model(x, ei, batch, num_graphs), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@pytest.mark.parametrize("how", ["per_rank_count", "global_count"])
def test_rank_1_warns_where_ids_index_rows_counted_by_an_int_argument(how: str) -> None:
    """NOTE: [counts passed as Python ints]: on 2 gloo ranks each rank collates its own 2
    graphs (ids from 0) and passes ``num_graphs=2``; the step is captured with
    ``zeros(2)`` rows, no split size, and pooled every rank's graph j together (5.99e-2
    off eager in the prober's GraphNorm, no word). Rank 1 warns naming ``batch`` and
    ``num_graphs``; the global count (4) with its slice of the global ids does not."""
    torch.manual_seed(0)
    model = NormNet().double()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, ei, batch, _ = collate([0, 1, 2, 3])
    y = torch.arange(16) % 3
    local = collate([2, 3])
    if how == "per_rank_count":  # what real ranks capture: each rank's own ids, its count
        batch, count, share = torch.cat([collate([0, 1])[2], local[2]]), 2, (*local[:3], y[8:])
    else:
        count, share = 4, (x[8:], ei[:, ei.shape[1] // 2:], batch[8:], y[8:])
    compiled = sc.compile(DataParallel(input_batch_dim={"ei": 1}, input_index_of={"ei": "x"}))(count_step)
    with sc.simulate(world_size=2):
        compiled(model, optim, x, ei, batch, y, count)
    as_rank1 = rank_1_of(compiled.last_program)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_on_local_ids(as_rank1, list(share), {"ei": "x"}, [("num_graphs", count)])  # type: ignore[arg-type]
    messages = [str(w.message) for w in caught if "int argument" in str(w.message)]
    if how == "global_count":
        assert not messages, messages
        return
    assert len(messages) == 1, messages
    assert "Argument 'batch' is split" in messages[0] and "the int argument 'num_graphs'" in messages[0]
    assert "input_index_of={'batch': 'graphs'}" in messages[0] and "graphs.shape[0]" in messages[0]
    assert "aten.index_add" in messages[0] and "train step:  " + __file__ in messages[0]
