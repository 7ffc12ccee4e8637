"""Graph ids numbered from 0 on each of 2 real gloo ranks: ``DataParallel(input_index_of=...)``
(NOTE: [indices into the global batch] in ``parallel_modes/local_indices.py``).

Each rank collates its own two graphs as a torch-DDP script does (DistributedSampler +
PyG's collate): node ids in ``ei`` and graph ids in ``batch`` start at 0 on every rank.
Before, the ranks' ids were read as ids into the global batch, rank 1's pointing at rank
0's nodes and graphs: losses 1.183 / 0.932 / 0.829 against eager's 1.132 / 0.864 / 0.705
on the global batch, parameters 0.199 relative off after 3 Adam steps, no error. With
``input_index_of={'ei': 'x', 'batch': 'y'}`` the ranks train as one device does on the
global batch (float64, under ddp and fsdp), and the caller's tensors are left as passed.
Without the option, rank 1's first call warns that ``ei`` and ``batch`` look numbered from
0 on each rank, naming the option (NOTE: [ids that look numbered from 0 on each rank]);
rank 0 cannot tell, and with the option nothing warns.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.parity import full_state, launch_timeout, relative_difference
from tests.sim.test_local_index_inputs import INDEX_OF, collate, eager, graph_step, setup

pytestmark = pytest.mark.dist

WORLD_SIZE = 2


def _warned(caught: list) -> list[str]:
    return sorted(m for w in caught if "look numbered from 0" in (m := str(w.message)))


def worker(rank: int, world_size: int) -> dict:
    out: dict = {}
    share = collate([2 * rank, 2 * rank + 1])  # this rank's own graphs, ids from 0
    model, optim = setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sc.compile(DataParallel(input_batch_dim={"ei": 1}))(graph_step)(model, optim, *share)
    out["without"] = _warned(caught)
    for style in ("replicate", "fully_shard"):
        model, optim = setup()
        compiled = sc.compile(DataParallel(style, input_batch_dim={"ei": 1}, input_index_of=INDEX_OF))(graph_step)
        passed = [t.clone() for t in share]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = [float(compiled(model, optim, *share)) for _ in range(3)]
        out[style] = {
            "losses": losses, "state": full_state(model, optim, None), "warned": _warned(caught),
            "untouched": all(torch.equal(a, b) for a, b in zip(share, passed)),
        }
    return out


def test_per_rank_collated_graphs_train_as_one_device_on_the_global_batch() -> None:
    results = sc.launch(worker, WORLD_SIZE, timeout_s=launch_timeout(180))
    want, state = eager()
    assert results[0]["without"] == [], results[0]["without"]
    warned = results[1]["without"]
    assert len(warned) == 2 and "input_index_of={'batch': 'y'}" in warned[0], warned
    assert "input_index_of={'ei': 'x'}" in warned[1], warned
    for rank, got in enumerate(results):
        for style in ("replicate", "fully_shard"):
            res = got[style]
            assert not res["warned"], res["warned"]
            assert res["untouched"], f"rank {rank} {style}: the step wrote the caller's ids"
            assert max(abs(a - b) for a, b in zip(res["losses"], want)) < 1e-12, (rank, style, res["losses"], want)
            errors = {k: relative_difference(res["state"][k], v) for k, v in state.items()}
            worst = max(errors, key=errors.__getitem__)
            assert errors[worst] < 1e-12, f"rank {rank} {style}: {worst} differs by {errors[worst]:.2e}"
