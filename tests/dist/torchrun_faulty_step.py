"""Run by test_torchrun.py under torchrun: rank 1 raises at its third step; rank 0's
error must name it (NOTE: [fault attribution] in spmd_compiler/runtime/faults.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.tools.demo.steps import classification_train_step
from spmd_compiler.parallel_modes import DataParallel

info = sc.init_from_env(collective_timeout_s=10)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
step = sc.compile(DataParallel("replicate"))(classification_train_step)
for i in range(4):
    if i == 2 and info.rank == 1:
        raise ValueError("the data loader broke")
    step(model, optim, torch.randn(4, 8), torch.randint(0, 4, (4,)))
