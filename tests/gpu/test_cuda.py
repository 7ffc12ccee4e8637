"""The CUDA path: simulated ranks on CUDA tensors and NCCL at world size 1.

Skipped without a GPU (no GPU was lent when this was written, so these have not run yet).
"""

from __future__ import annotations

import pytest
import torch

from spmd_compiler.demo.run import DemoConfig, run_demo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp"])
def test_simulated_ranks_on_cuda_tensors(mode):
    report = run_demo(DemoConfig(mode=mode, world_size=2, steps=3, device="cuda"))
    assert report.parity_ok, report.max_param_rel_diff


def test_nccl_world_size_one():
    report = run_demo(DemoConfig(mode="ddp", world_size=1, steps=3, backend="nccl", device="cuda"))
    assert report.parity_ok, report.max_param_rel_diff
