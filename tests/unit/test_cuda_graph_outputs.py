"""``Replayed``: what a program replayed as a CUDA graph hands back (NOTE: [CUDA graphs
and the program's outputs]). The graphs themselves need a GPU (tests/gpu); the handling
of the outputs is checked here with a stand-in program on CPU tensors."""

from __future__ import annotations

import torch

from spmd_compiler.cuda_graph_outputs import Replayed, gradients_not_read_back
from spmd_compiler.ir.signature import Kind, StateRef


def test_outputs_copied_back_cloned_or_left_in_the_pool() -> None:
    param, batch = torch.zeros(3), torch.ones(3)
    pool = [torch.full((3,), 2.0), torch.full((3,), 5.0), torch.tensor(7.0)]

    def program(p: torch.Tensor, x: torch.Tensor) -> list[torch.Tensor]:
        return pool  # new param, a gradient, the loss: all in the "pool"

    replayed = Replayed(program, copied_back=((0, 0),), in_pool=(1,))
    new_param, grad, loss = replayed(param, batch)
    assert new_param is param and torch.equal(param, torch.full((3,), 2.0))  # copied in
    assert grad is pool[1]  # a gradient not read back stays where the replay wrote it
    assert loss is not pool[2] and loss.item() == 7.0  # cloned out
    pool[2].fill_(0.0)  # the next replay overwrites the pool: the kept loss is unchanged
    assert loss.item() == 7.0


def test_an_output_that_is_an_input_is_handed_back_as_it_is() -> None:
    param = torch.zeros(2)
    replayed = Replayed(lambda p: [p], copied_back=(), in_pool=())
    assert replayed(param)[0] is param


def test_gradients_not_read_back() -> None:
    class Captured:
        inputs = [(StateRef(Kind.PARAM, "w"), None), (StateRef(Kind.GRAD, "b"), None)]
        outputs = [StateRef(Kind.PARAM, "w"), StateRef(Kind.GRAD, "w"), StateRef(Kind.GRAD, "b"),
                   StateRef(Kind.RETURN, "0")]

    assert gradients_not_read_back(Captured()) == (1,)
    assert gradients_not_read_back(None) == ()
