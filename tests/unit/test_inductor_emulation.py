"""Lowered optimizer updates stay fused under cast emulation (NOTE: [unfused fallbacks
under cast emulation] in ``spmd_compiler/_torch_private.py``): on a torch whose Inductor
has no lowering for an op that the emulation keeps from being decomposed (2.11:
``_foreach_addcdiv.Scalar``, AdamW's update), the op must not run as the unfused ATen
kernel, which makes every input and output a parameter-sized buffer."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.profiler import ProfilerActivity, profile

from spmd_compiler import _torch_private as private

pytestmark = pytest.mark.inductor


def _adam_like_update(p0, p1, a0, a1, d0, d1):
    return torch._foreach_addcdiv([p0, p1], [a0, a1], [d0, d1], value=-1e-2)


def test_lowered_foreach_addcdiv_runs_no_aten_kernel_and_matches_eager() -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(64, 32, generator=gen) for _ in range(2)]
    avgs = [torch.randn(64, 32, generator=gen) for _ in range(2)]
    denoms = [torch.rand(64, 32, generator=gen) + 0.5 for _ in range(2)]
    inputs = [*params, *avgs, *denoms]
    gm = make_fx(_adam_like_update)(*inputs)
    compiled = private.inductor_compile(gm, inputs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = compiled(*inputs)
    ran = {e.name for e in prof.events()}
    assert "aten::_foreach_addcdiv" not in ran, sorted(n for n in ran if n.startswith("aten::"))
    want = _adam_like_update(*inputs)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7)


def test_every_op_the_emulation_keeps_undecomposed_is_lowered_or_decomposed() -> None:
    """The table handed to Inductor under emulation leaves no op that the plain table
    decomposes without either a lowering or its decomposition."""
    from torch._inductor import config as inductor_config  # noqa: TID251 (test reads Inductor's tables)
    from torch._inductor.decomposition import select_decomp_table  # noqa: TID251
    from torch._inductor.lowering import lowerings  # noqa: TID251

    with inductor_config.patch(emulate_precision_casts=False):
        plain = select_decomp_table()
    with inductor_config.patch(emulate_precision_casts=True):
        table = private._emulation_decompositions(True) or select_decomp_table()
    missing = [op for op in plain if op not in table and op not in lowerings]
    assert not missing, missing
