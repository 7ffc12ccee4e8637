"""Mixtures of experts by ``F.grouped_mm`` (NOTE: [grouped_mm's fake kernel]).

transformers' default experts implementation sorts the token-expert pairs by expert and
runs each projection as one ``torch._grouped_mm`` over the sorted rows. torch's fake
kernel accepted only bfloat16 while the kernels run float32 too; with our fill a float32
step compiles and trains as on one device (float32: the MoE rows are computed on every
rank as on one device, the rest is data parallel, so differences are float32 rounding of
gradient sums). float64, which no kernel runs, is refused at capture with the line.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler._torch_private import install_dtensor_gap_fills
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode

if not hasattr(torch, "_grouped_mm"):
    pytest.skip("this torch has no grouped_mm", allow_module_level=True)

DIM, HIDDEN, EXPERTS, TOP_K, CLASSES = 16, 32, 4, 2, 4
# float32: relative differences of a few ulps after two SGD steps
TOL = 2e-5


class GroupedExperts(nn.Module):
    """Top-2 routing with the experts run as transformers' grouped_mm implementation
    runs them: pairs sorted by expert, offsets from a histogram, one grouped matmul per
    projection, results weighted and added back per token."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.up = nn.Parameter(torch.randn(EXPERTS, DIM, HIDDEN) * DIM**-0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, HIDDEN, DIM) * HIDDEN**-0.5)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.router(x).softmax(-1).topk(TOP_K, dim=-1)
        expert_of_pair, order = torch.sort(chosen.reshape(-1))
        token = order // TOP_K
        counts = torch.histc(expert_of_pair.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        hidden = F.grouped_mm(x[token], self.up, offs=offsets).relu()
        out = F.grouped_mm(hidden, self.down, offs=offsets) * weights.reshape(-1)[order, None]
        return self.head(x + torch.zeros_like(x).index_add(0, token, out))


def _batches(steps: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, ...]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(8, DIM, generator=gen, dtype=dtype), torch.randint(0, CLASSES, (8,), generator=gen))
        for _ in range(steps)
    ]


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_grouped_mm_experts_match_one_device(run_parity, train_step, mode: str) -> None:
    result = run_parity(GroupedExperts, _sgd, 2, _batches(3), step=train_step, mode=make_mode(mode))
    result.assert_close(TOL)


def test_float64_grouped_mm_is_refused_at_capture(train_step) -> None:
    """No kernel runs float64 (eager raises too): refused at capture, naming the op's line."""
    model = GroupedExperts().double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    compiled = sc.compile(make_mode("ddp"))(train_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, _sgd(model), *_batches(1, torch.float64)[0])
    message = str(info.value)
    assert "grouped_mm" in message and "Float32, BFloat16 or Float16" in message
    assert "F.grouped_mm(x[token], self.up, offs=offsets)" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("a_shape", "b_shape", "offs"), [
    ((10, 8), (3, 8, 4), [3, 3, 9]),  # rows grouped by offsets (the forward)
    ((-8, 10), (10, 4), [3, 3, 9]),  # both 2-D, the contraction grouped (a weight's gradient:
    # mat_a is the sorted rows transposed, (-8, 10) below)
    ((3, 5, 8), (8, 12), [4, 8, 12]),  # columns grouped
    ((3, 5, 8), (3, 8, 4), None),  # batched, no offsets
])
def test_fake_kernel_shapes_the_output_as_the_kernel_does(a_shape, b_shape, offs) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    install_dtensor_gap_fills()
    a = torch.randn(a_shape[1], -a_shape[0]).t() if a_shape[0] < 0 else torch.randn(a_shape)
    b = torch.randn(b_shape)
    offsets = None if offs is None else torch.tensor(offs, dtype=torch.int32)
    real = torch._grouped_mm(a, b, offs=offsets)
    with FakeTensorMode() as mode:
        fake = torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b),
                                 offs=None if offsets is None else mode.from_tensor(offsets))
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())


def test_fake_kernel_refuses_what_the_kernel_refuses() -> None:
    """Unaligned strides (a 6-wide float32 row is 24 bytes) fail in the kernel and at
    capture alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    install_dtensor_gap_fills()
    a, b = torch.randn(10, 8), torch.randn(3, 8, 6)
    offs = torch.tensor([3, 3, 9], dtype=torch.int32)
    with pytest.raises(RuntimeError):
        torch._grouped_mm(a, b, offs=offs)
    with FakeTensorMode() as mode, pytest.raises(RuntimeError, match="16-byte aligned"):
        torch._grouped_mm(mode.from_tensor(a), mode.from_tensor(b), offs=mode.from_tensor(offs))
