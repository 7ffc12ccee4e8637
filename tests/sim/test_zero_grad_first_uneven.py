"""``optimizer.zero_grad()`` as the first line of the step (torchdiffeq's examples, many
training loops) on parameters whose sharded dimension does not divide the ranks, float64
on 4 simulated ranks against the undecorated step on one device on the global batch
(NOTE: [a kept gradient the step does not read] in ``capture/gradients.py``).

The gradients the previous call left are inputs of the next program. Under tensor
parallel with a hidden width of 6 on 4 ranks, call 1 ran and call 2 was refused ("grad
2.weight is kept across steps ... a padded tensor-parallel gradient cannot be kept
between steps"), though the step drops them (``set_to_none=True``) or zeroes them
(``set_to_none=False``) before anything reads them. Such gradients are no input now;
a gradient the step really reads (backward accumulating over calls) is refused as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.ir.collectives import collective_stats
from spmd_compiler.ir.signature import Kind
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import full_value, relative_difference

TOL = 1e-12
WORLD = 4
HIDDEN = 5  # divides neither the 4 tp ranks nor the 2 of a 2x2 mesh
PLAN = {"0": ColwiseParallel(), "2": RowwiseParallel()}


def _mode(name: str):  # noqa: ANN202
    if name == "tp":
        return make_mode("tp", plan=PLAN)
    if name == "fsdp_tp":
        return make_mode("fsdp_tp", plan=PLAN, mesh_shape=(2, 2))
    return make_mode("fsdp")


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(2, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 2)).double()


def _batches(steps: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 2, generator=gen, dtype=torch.float64), torch.randn(8, 2, generator=gen, dtype=torch.float64))
        for _ in range(steps)
    ]


def _zero_grad_first(set_to_none: bool):  # noqa: ANN202
    def step(func, optim, y0, y1):  # noqa: ANN001, ANN202
        optim.zero_grad(set_to_none=set_to_none)  # torchdiffeq: the iteration's first line
        loss = (func(y0) - y1).abs().mean()
        loss.backward()
        optim.step()
        return loss

    return step


def _zero_grad_last(func, optim, y0, y1):  # noqa: ANN001, ANN202
    loss = (func(y0) - y1).abs().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("mode", ["tp", "fsdp_tp", "fsdp"])
def test_zero_grad_first_matches_eager_on_an_uneven_width(run_parity, mode, set_to_none):
    """3 calls of RMSprop (ode_demo's optimizer): the loss, every parameter, the optimizer
    state and the gradients the step leaves on the parameters match eager's; call 2 and 3
    run one program."""
    step = _zero_grad_first(set_to_none)

    def gradients_match(sim, result) -> None:  # noqa: ANN001
        for (name, p), q in zip(result.model.named_parameters(), result.reference.parameters(), strict=True):
            assert p.grad is not None, name
            assert relative_difference(full_value(p.grad, sim), q.grad) < TOL, name

    result = run_parity(
        _model, lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2), WORLD, _batches(),
        step=step, mode=_mode(mode), check_simulation=gradients_match,
    )
    result.assert_close(TOL)
    assert result.compile_counts == [1, 2, 2]
    if mode == "tp":  # the padded parameters' kept gradients are no input: nothing pads them
        program = result.compiled.last_program
        assert sorted(program.padded) == ["0.bias", "0.weight", "2.weight"]
        grads = [ref.name for ref in program.captured.input_refs() if ref.kind is Kind.GRAD]
        assert grads == ["2.bias"]


def _collective_bytes(mode: str, step) -> dict[str, int]:  # noqa: ANN001
    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(WORLD):
        for batch in _batches(2):
            compiled(model, optim, *batch)
    return collective_stats(compiled.last_program.graph_module).bytes


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("mode", ["tp", "fsdp"])
def test_zero_grad_first_moves_what_zero_grad_last_moves(mode, set_to_none):
    """The program of a step with zero_grad first gathers and reduces what the one with
    zero_grad at the end does (the 5-wide MLP on 4 ranks, fsdp): a zeroed kept gradient,
    a padded input, had its true rows all-gathered to be zeroed (768 all-gathered bytes,
    384 with zero_grad at the end), and the gradient the step leaves was reduce-scattered
    a second time for its output (768 reduce-scattered bytes, 384): NOTE: [a kept gradient
    leaves at its pad] in parallel_modes/padding.py."""
    first = _collective_bytes(mode, _zero_grad_first(set_to_none))
    last = _collective_bytes(mode, _zero_grad_last)
    assert first == last


def test_gradients_accumulated_over_calls_stay_refused_under_uneven_tp():
    """No zero_grad: the next call's backward adds into the kept gradient, which a padded
    tensor-parallel dimension cannot keep; the refusal names the op, the step's line and
    how to write the step."""

    def accumulate(func, optim, y0, y1):  # noqa: ANN001, ANN202
        loss = (func(y0) - y1).abs().mean()
        loss.backward()  # the line the refusal names
        optim.step()
        return loss

    torch.manual_seed(0)
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(_mode("tp"))(accumulate)
    batch = _batches(1)[0]
    with sc.simulate(WORLD):
        compiled(model, optim, *batch)  # no gradient yet: compiles
        with pytest.raises(sc.SPMDCompileError, match="cannot be kept between steps") as err:
            compiled(model, optim, *batch)
    message = str(err.value)
    assert "backward accumulates into it" in message and "op:          aten.add" in message
    assert "loss.backward()  # the line the refusal names" in message
    assert "zero_grad() before loss.backward()" in message
