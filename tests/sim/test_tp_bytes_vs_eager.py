"""The compiled TP step moves no more bytes than torch's eager tensor parallel
(``parallelize_module`` with the same plan) on the demo GPT; both are measured."""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils._python_dispatch import TorchDispatchMode

import spmd_compiler as sc
from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.parallel_modes import TensorParallel
from spmd_compiler.tools.demo.gpt import gpt_tp_plan, gpt_train_step
from spmd_compiler.tools.demo.run import DemoConfig, build

PAYLOAD_FROM_OUTPUT = ("all_gather",)


class CollectiveBytes(TorchDispatchMode):
    """Counts functional collectives and their per-rank payload bytes (the collectives module's rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if getattr(func, "namespace", None) == "_c10d_functional" and "wait" not in func._opname:
            tensor = out if func._opname.startswith(PAYLOAD_FROM_OUTPUT) else args[0]
            self.count += 1
            self.bytes += tensor.numel() * tensor.element_size()
        return out


def test_compiled_tp_moves_no_more_bytes_than_eager_tp():
    config = DemoConfig(steps=1, n_layer=2)
    model, optim, data = build(config)
    eager, eager_optim, _ = build(config)
    x, y = data[0]
    with sc.simulate(2):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2,))
        step = sc.compile(TensorParallel(gpt_tp_plan(), mesh=mesh))(gpt_train_step)
        step(model, optim, x, y)
        compiled = collective_stats(step.last_program.graph_module)

        parallelize_module(eager, mesh, gpt_tp_plan())
        eager_optim = torch.optim.AdamW(eager.parameters(), lr=config.lr, eps=config.eps)
        counter = CollectiveBytes()
        with step_ranks(), counter:
            gpt_train_step(eager, eager_optim, x, y)
    assert counter.count > 0 and compiled.total_count > 0
    assert compiled.total_bytes <= counter.bytes, (compiled.bytes, counter.bytes)
    # Megatron on this model: forward all-reduce after both row-wise Linears of each
    # layer; backward one all-reduce per column-wise input group. Eager reduces the
    # gradient of q, k and v separately (3 per attention); the compiled step sums the
    # three partial gradients first and reduces once.
    assert compiled.total_bytes < counter.bytes


def step_ranks():
    from spmd_compiler.runtime.simulate import active_simulation

    return active_simulation().ranks()
