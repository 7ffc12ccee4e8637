"""The rewrite of Scalar arguments given as tensors (NOTE: [tensor hyper-parameters in
Scalar arguments] in ``spmd_compiler/capture/optimizers.py``) against the eager kernels it
stands in for, bit for bit, on real tensors: ``add`` / ``sub`` with ``alpha=`` and
``addcdiv`` / ``addcmul`` with ``value=``, in place and not, for every mix of parameter
and operand dtypes an optimizer meets (16-bit weights, a bf16 update applied to a float32
or float64 weight, ...).

The first rewrite multiplied the operand by the 0-dim scalar in the operand's dtype: a
16-bit product was rounded before the add (every bf16 Adagrad / RMSprop step differed
from eager on one rank), and Muon's bf16 update was rounded to bf16 before it reached a
float32 weight. Those cases fail here without the fix.
"""

from __future__ import annotations

import pytest
import torch

from spmd_compiler.capture.optimizers import _TensorScalars

LR = -0.014142135623730951  # Muon's adjusted learning rate for 1e-2 on a 16 x 8 weight
DTYPE_PAIRS = [
    (torch.float32, torch.float32),
    (torch.float64, torch.float64),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float16),
    (torch.float32, torch.bfloat16),
    (torch.float64, torch.bfloat16),
    (torch.float64, torch.float32),
    (torch.bfloat16, torch.float32),
]


def _operands(self_dtype: torch.dtype, other_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(0)
    n = 4096  # whole vectors: CPU kernels round 16-bit products differently in their tail loop
    param = torch.randn(n, generator=gen).to(self_dtype)
    other = torch.randn(n, generator=gen).to(other_dtype)
    divisor = (torch.rand(n, generator=gen) + 0.5).to(other_dtype)
    return param, other, divisor


CALLS = {
    "add_": lambda p, o, d, s: p.clone().add_(o, alpha=s),
    "sub_": lambda p, o, d, s: p.clone().sub_(o, alpha=s),
    "add": lambda p, o, d, s: torch.add(p, o, alpha=s),
    "sub": lambda p, o, d, s: p.sub(o, alpha=s),
    "addcdiv_": lambda p, o, d, s: p.clone().addcdiv_(o, d, value=s),
    "addcmul_": lambda p, o, d, s: p.clone().addcmul_(o, d, value=s),
    "addcdiv": lambda p, o, d, s: torch.addcdiv(p, o, d, value=s),
    "addcmul": lambda p, o, d, s: p.addcmul(o, d, value=s),
}


@pytest.mark.parametrize(("self_dtype", "other_dtype"), DTYPE_PAIRS, ids=str)
@pytest.mark.parametrize("call", list(CALLS))
def test_tensor_scalar_matches_the_eager_kernel_bit_for_bit(self_dtype, other_dtype, call):
    param, other, divisor = _operands(self_dtype, other_dtype)
    expected = CALLS[call](param, other, divisor, LR)
    with _TensorScalars():
        got = CALLS[call](param, other, divisor, torch.tensor(LR, dtype=torch.float64))
    assert got.dtype == expected.dtype
    mismatched = (got != expected).sum().item()
    assert mismatched == 0, f"{mismatched} of {expected.numel()} elements differ"


def test_python_number_scalars_are_left_alone():
    param, other, _ = _operands(torch.bfloat16, torch.bfloat16)
    with _TensorScalars():
        got = param.clone().add_(other, alpha=LR)
    assert torch.equal(got, param.clone().add_(other, alpha=LR))


MOMENTUM = 0.8999999761581421  # not a bf16 / fp16 value: rounding it first would show
CYCLED_CALLS = {  # torch's SGD: buf.mul_(momentum); Nesterov's grad.add(buf, alpha=momentum)
    "mul_": lambda p, o, m: p.clone().mul_(m),
    "mul": lambda p, o, m: torch.mul(p, m),
    "add_alpha": lambda p, o, m: p.add(o, alpha=m),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("call", list(CYCLED_CALLS))
def test_cycled_value_is_fed_as_the_eager_kernel_reads_a_float(dtype, call):
    """NOTE: [SGD's momentum as a graph input]: the momentum's tensor, where the op meets
    the float, gives eager's result bit for bit (a 16-bit buffer multiplied in float32)."""
    from spmd_compiler.capture.optimizers import CycledValue

    param, other, _ = _operands(dtype, dtype)
    expected = CYCLED_CALLS[call](param, other, MOMENTUM)
    cycled = CycledValue(MOMENTUM, torch.tensor(MOMENTUM, dtype=torch.float64), 0)
    with _TensorScalars():
        got = CYCLED_CALLS[call](param, other, cycled)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


def test_cycled_value_used_any_other_way_asks_for_a_setting():
    """Every use of the value that would keep the float it was traced with raises
    ``CycledValueUsed`` (the capture then makes it a setting of the program); its zero
    test and truth, which the program key fixes, answer in Python."""
    from spmd_compiler.capture.optimizers import CycledValue, CycledValueUsed

    cycled = CycledValue(0.9, torch.tensor(0.9, dtype=torch.float64), 3)
    assert cycled != 0 and not cycled == 0 and bool(cycled)
    x = torch.ones(4)
    uses = [
        lambda: 1 - cycled, lambda: cycled * 2, lambda: -cycled, lambda: float(cycled),
        lambda: cycled > 0.5, lambda: round(cycled),
    ]
    for use in uses:
        with pytest.raises(CycledValueUsed, match=r"optimizer\[3\]'s momentum"):
            use()
    with _TensorScalars(), pytest.raises(CycledValueUsed, match="given to lerp"):
        torch.lerp(x, x, cycled)
    with _TensorScalars(), pytest.raises(CycledValueUsed, match="given to add"):
        x.add(cycled)  # as the tensor added, not its alpha
