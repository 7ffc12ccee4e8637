"""A kernel that raises inside the compiled program names its op, graph node, module and
train-step line, and leaves the state as it was (NOTE: [where a program failed] in
``spmd_compiler/runtime/kernel_failures.py``). Before, simulation raised torch's bare
``IndexError: index out of range in self``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel
from spmd_compiler.tools.demo.steps import classification_train_step


@pytest.mark.parametrize("mode", ["replicate", "fully_shard"])
def test_an_index_out_of_range_names_the_lookup_and_keeps_the_state(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 8), nn.Flatten(), nn.Linear(16, 4))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(DataParallel(mode))(classification_train_step)
    x, y = torch.randint(0, 10, (4, 2)), torch.randint(0, 4, (4,))
    with sc.simulate(2):
        step(model, optim, x, y)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        x[3, 1] = 50
        with pytest.raises(sc.SPMDRuntimeError) as info:
            step(model, optim, x, y)
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), before[name]), name
    text = str(info.value)
    assert text.startswith(
        "The compiled step failed at aten.embedding.default (graph node embedding) in "
        "module '0', train step line "
    ), text
    assert "steps.py" in text and "model(x)" in text
    assert "IndexError: index out of range in self" in text
    assert "hold the state of the last completed step" in text
    assert isinstance(info.value.__cause__, IndexError)


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.out = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        return self.out(h.flatten(1))


def checked_lookup_step(model, optim, x, y):  # noqa: ANN001
    logits = model(x)
    if (y >= 0).all():
        logits = logits * 2
    loss = nn.functional.cross_entropy(logits, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def test_a_failure_inside_a_module_names_the_ops_own_line_and_both_causes() -> None:
    """The op's own line in the model (or a library module: transformers'
    ``modeling_wav2vec2.py``), from the node's recorded stack trace, follows the train
    step line, which named only ``model(x)``; with a condition the program verifies after
    it runs, the message said "this call may be one where one does not hold" alone, and
    now says the failure may as well be the op's own."""
    torch.manual_seed(0)
    model = Lookup()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    step = sc.compile(DataParallel("replicate"))(checked_lookup_step)
    x, y = torch.randint(0, 10, (4, 2)), torch.randint(0, 4, (4,))
    with sc.simulate(2):
        step(model, optim, x, y)
        x[3, 1] = 50
        with pytest.raises(sc.SPMDRuntimeError) as info:
            step(model, optim, x, y)
    text = str(info.value)
    assert 'train step line ' in text and '"logits = model(x)", op made at ' in text, text
    assert 'test_kernel_failures.py' in text and '"h = self.emb(ids)"' in text, text
    assert '"if (y >= 0).all():"; it failed before it could verify them' in text, text
    assert "if they all hold, the failure is that op's own" in text, text
