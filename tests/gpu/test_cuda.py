"""The CUDA path: simulated ranks on CUDA tensors and NCCL at world size 1.

Skipped without a GPU. All passed on a lent H200 (torch 2.11.0+cu130) on 2026-11-27,
run by ``scripts/gpu_check.sh``.
"""

from __future__ import annotations

import pytest
import torch

from spmd_compiler.tools.demo.run import DemoConfig, run_demo

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


def _lowered_worker(rank: int, world: int, cuda_graphs: bool) -> dict:
    import spmd_compiler as sc
    from spmd_compiler.tools.demo.steps import classification_train_step
    from spmd_compiler.tools.parity import full_state

    torch.cuda.set_device(rank)
    model, optim, batches = _mlp_case("cuda")
    step = sc.compile(backend="inductor", cuda_graphs=cuda_graphs)(classification_train_step)
    # kept on the device until the end: each loss must outlive the replays after it
    # (NOTE: [CUDA graphs and the program's outputs])
    kept = [step(model, optim, x, y) for x, y in batches]
    losses = [loss.detach().cpu() for loss in kept]
    state = {k: v.cpu() for k, v in full_state(model, optim, None).items()}
    return {"losses": losses, "state": state}


def _mlp_case(device: str):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8)
    ).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 32, generator=gen).to(device),
         torch.randint(0, 8, (16,), generator=gen).to(device))
        for _ in range(8)  # CUDA graphs: a warm-up, a recording, then replays
    ]
    return model, optim, batches


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_inductor_backend_on_nccl(cuda_graphs):
    import spmd_compiler as sc
    from spmd_compiler.tools.demo.steps import classification_train_step
    from spmd_compiler.tools.parity import full_state, relative_difference

    result = sc.launch(_lowered_worker, 1, backend="nccl", args=(cuda_graphs,), timeout_s=600)[0]
    model, optim, batches = _mlp_case("cuda")
    losses = [classification_train_step(model, optim, x, y).detach().cpu() for x, y in batches]
    for got, want in zip(result["losses"], losses, strict=True):
        assert relative_difference(got, want) <= 1e-5
    state = full_state(model, optim, None)
    worst = max(relative_difference(result["state"][k], v.cpu()) for k, v in state.items())
    assert worst <= 1e-5, worst


def _steady_steps_worker(rank: int, world: int, cuda_graphs: bool) -> list[str]:
    import warnings

    import spmd_compiler as sc
    from spmd_compiler.tools.demo.steps import classification_train_step

    torch.cuda.set_device(rank)
    model, optim, batches = _mlp_case("cuda")
    step = sc.compile(backend="inductor", cuda_graphs=cuda_graphs)(classification_train_step)
    for x, y in batches[:4]:  # compiles, warm-up, CUDA-graph recording
        step(model, optim, x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for x, y in batches[4:]:
                step(model, optim, x, y)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in caught if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_steady_steps_do_not_wait_for_the_device(cuda_graphs):
    """A steady-state step queues its work without waiting for the GPU, so the host can
    run ahead (NOTE: [hyper-parameters without a device sync]: the learning rate was fed
    by a blocking copy, which waited for the previous step)."""
    import spmd_compiler as sc

    syncs = sc.launch(_steady_steps_worker, 1, backend="nccl", args=(cuda_graphs,), timeout_s=600)[0]
    assert syncs == [], syncs
