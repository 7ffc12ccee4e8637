"""Train steps that return ``loss.item()`` (NOTE: [returned .item() values]).

The returned numbers equal the undecorated step's on one device on the global batch, with
the same Python types; ``.item()`` used by Python inside the step (arithmetic, ``if``,
printing) is refused as a value read, naming the line; an optimizer that reads a value is
still refused by name.
"""

from __future__ import annotations

import copy
import logging
import time
from time import perf_counter as clock

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import compare_models

TOL = 1e-12
BATCH, FEATURES, CLASSES = 8, 6, 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, CLASSES)).double()


def logged_step(model, optim, x, y):  # noqa: ANN001
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    correct = (logits.argmax(-1) == y).sum()
    return {"loss": loss.item(), "correct": correct.item(), "all_right": (correct == len(y)).item()}


def plain_item_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [
        (torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64),
         torch.randint(0, CLASSES, (BATCH,), generator=gen))
        for _ in range(3)
    ]


def _mode(name: str):  # noqa: ANN202
    if name == "tp":
        return make_mode("tp", plan={"0": ColwiseParallel(), "2": RowwiseParallel()})
    return make_mode(name)


@pytest.mark.parametrize("mode", ["ddp", "fsdp", "tp"])
@pytest.mark.parametrize("step", [logged_step, plain_item_step], ids=lambda f: f.__name__)
def test_returned_items_match_one_device(mode, step):
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optim = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    compiled = sc.compile(_mode(mode))(step)
    with sc.simulate(world_size=2) as sim:
        for batch in _batches():
            got, want = compiled(model, optim, *batch), step(reference, reference_optim, *batch)
            got_leaves = got.values() if isinstance(got, dict) else [got]
            want_leaves = want.values() if isinstance(want, dict) else [want]
            for a, b in zip(got_leaves, want_leaves, strict=True):
                assert type(a) is type(b), (a, b)
                assert abs(a - b) <= TOL * abs(b), (a, b)
        assert max(compare_models(model, reference, sim).values()) < TOL
    assert compiled.compile_count == 1  # AdamW's state made before the first program


def scaled_item_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss.item() * 2


def branch_on_item_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    if loss.item() > 1.0:
        loss = loss * 2
    loss.backward()
    optim.step()
    return loss


def rounding_comparison_step(model, optim, x, y):  # noqa: ANN001
    """An integer item against a float: exact in Python, rounded in any one dtype."""
    loss = F.cross_entropy(model(x), y)
    if (model(x).argmax(-1) == y).sum().item() > 2.5:
        loss = loss * 2
    loss.backward()
    optim.step()
    return loss


def printing_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    print(f"loss {loss.item():.3f}")
    return loss


def float_of_norm_step(model, optim, x, y):  # noqa: ANN001
    """``float()`` / ``int()`` must return the built-in type: refused, pointing at ``.item()``."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    optim.step()
    return {"loss": loss.detach(), "grad_norm": float(norm)}


def int_of_count_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss, int((model(x).argmax(-1) == y).sum())


@pytest.mark.parametrize(
    ("step", "line"),
    [(scaled_item_step, "return loss.item() * 2"),
     (float_of_norm_step, 'return {"loss": loss.detach(), "grad_norm": float(norm)}'),
     (int_of_count_step, "return loss, int((model(x).argmax(-1) == y).sum())"),
     (rounding_comparison_step, "if (model(x).argmax(-1) == y).sum().item() > 2.5:"),
     (printing_step, 'print(f"loss {loss.item():.3f}")')],
    ids=lambda v: getattr(v, "__name__", "line"),
)
def test_item_used_by_python_is_refused(step, line):
    message = _refusal_leaving_the_model_untouched(step)
    assert "reads the value of a tensor in Python" in message
    assert line in message
    conversion = {float_of_norm_step: "float", int_of_count_step: "int"}.get(step)
    if conversion:  # to return the number, the error names .item() instead
        assert f"`t.item()` gives the number where the step only returns it (`{{'value': {conversion}(t)}}`)" in message


def pointer_step(model, optim, x, y):  # noqa: ANN001
    """MoCo's enqueue: a queue pointer read with int(); `.item()` (the advice before) is
    refused as well when the number is used as a slice bound."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    pointer = int((model(x).argmax(-1) == y).sum())
    return loss, x[pointer:pointer + 2]


def test_int_of_a_tensor_used_in_the_step_advises_keeping_a_tensor():
    message = _refusal_leaving_the_model_untouched(pointer_step)
    # since the sixty-seventh session the tensor form leads, and a Python int passed in
    # is said to cost a program per value (NOTE: [an index read with int()])
    assert "keep the index a tensor and index with it (`.item()` is refused there too)" in message
    assert "index_copy_" in message and "one program per distinct value" in message


def split_by_counts_step(model, optim, x, y):  # noqa: ANN001
    counts = F.one_hot(y, 3).sum(0)
    chunks = model(x).split(counts.tolist())  # MegaBlocks-style per-expert chunks
    loss = sum(F.cross_entropy(c, t) for c, t in zip(chunks, y.split(counts.tolist())))
    loss.backward()
    optim.step()
    return loss


def narrow_by_item_step(model, optim, x, y):  # noqa: ANN001
    n = (y > 0).sum().item()
    loss = F.cross_entropy(model(x).narrow(0, 0, n), y.narrow(0, 0, n))
    loss.backward()
    optim.step()
    return loss


@pytest.mark.parametrize(
    ("step", "line"),
    [(split_by_counts_step, "chunks = model(x).split(counts.tolist())"),
     (narrow_by_item_step, "loss = F.cross_entropy(model(x).narrow(0, 0, n), y.narrow(0, 0, n))")],
    ids=lambda v: getattr(v, "__name__", "line"),
)
def test_items_used_as_sizes_are_a_value_dependent_shape(step, line):
    """These reached torch's argument parser, whose raw TypeError named our internal
    type ("found element of type TracedItem")."""
    message = _refusal_leaving_the_model_untouched(step)
    assert "reads the value of a tensor in Python" in message and line in message
    assert "used as a size or index" in message and "value-dependent shape" in message
    assert "TracedItem" not in message and "TypeError" not in message


def _refusal_leaving_the_model_untouched(step) -> str:  # noqa: ANN001
    """The message of the first call's refusal; the model unchanged, nothing compiled."""
    model = _model()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    compiled = sc.compile(make_mode("ddp"))(step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, optim, *_batches()[0])
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert compiled.compile_count == 0
    return str(info.value)


_USER_LOG = logging.getLogger("user.train")


def logging_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    _USER_LOG.warning("loss %.3f", loss.item())
    return loss


def fallback_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    try:
        scale = 2.0 if float(loss) > 1.0 else 1.0
    except Exception:  # noqa: BLE001 - the user's fallback, which eager never takes
        scale = 3.0
    (loss * scale).backward()
    optim.step()
    return loss


@pytest.mark.parametrize(
    ("step", "line"),
    [(logging_step, '_USER_LOG.warning("loss %.3f", loss.item())'),
     (fallback_step, "scale = 2.0 if float(loss) > 1.0 else 1.0")],
    ids=lambda v: getattr(v, "__name__", "line"),
)
def test_an_item_use_the_step_caught_is_refused(step, line, monkeypatch):
    """logging (and a try/except) caught the error a use of .item() raised, and the trace
    went on: the log was never written on a compiled call, and the fallback was compiled
    in (scale 3 where eager scales by 2 or 1). NOTE: [an item use the step caught]."""
    # pytest's log capture re-raises a handler's error while this is set; a plain handler
    # prints "--- Logging error ---" and goes on: so do pytest's without it
    monkeypatch.setattr(logging, "raiseExceptions", False)
    message = _refusal_leaving_the_model_untouched(step)
    assert "its code caught the error this raised" in message
    assert line in message


def compared_items_step(model, optim, x, y):  # noqa: ANN001
    """Comparisons of items, branched on and returned (NOTE: [returned .item() values])."""
    loss = F.cross_entropy(model(x), y)
    if loss.item() > 1.5:  # the batches go both ways
        loss = loss * 2
    loss.backward()
    optim.step()
    right = (model(x).argmax(-1) == y).sum().item()
    return {"loss": loss.item(), "high": loss.item() >= 3.1, "some_right": 0 < right,
            "none_right": right == 0}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_an_if_on_a_compared_item_branches_and_comparisons_return(mode):
    """``if loss.item() > 1.0:`` takes the way the data goes, as an ``if`` on the tensor
    would (NOTE: [value checks]); a returned comparison is a Python bool."""
    torch.manual_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.5)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.5)
    compiled = sc.compile(make_mode(mode))(compared_items_step)
    batches = _batches()
    with sc.simulate(world_size=2) as sim:
        for x, y in [*batches, (batches[0][0] * 4, batches[0][1])]:
            got = compiled(model, optim, x, y)
            want = compared_items_step(reference, reference_optim, x, y)
            assert {k: type(v) for k, v in got.items()} == {k: type(v) for k, v in want.items()}
            assert abs(got["loss"] - want["loss"]) <= TOL * abs(want["loss"])
            assert [got[k] for k in ("high", "some_right", "none_right")] == [
                want[k] for k in ("high", "some_right", "none_right")]
        assert max(compare_models(model, reference, sim).values()) < TOL


def timed_step(model, optim, x, y):  # noqa: ANN001
    start = time.perf_counter()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item(), time.perf_counter() - start


def test_a_clock_read_in_the_step_is_refused():
    """NOTE: [host clock at capture]: the returned elapsed time was the capture's on every
    call; now refused with the line, the model untouched, and the clock is torch's again."""
    model = _model()
    before = copy.deepcopy(model)
    compiled = sc.compile(make_mode("ddp"))(timed_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match="reads the clock") as info:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches()[0])
    assert "start = time.perf_counter()" in str(info.value)
    assert "outside the compiled step" in str(info.value)
    assert max(compare_models(model, before, None).values()) == 0.0
    assert time.perf_counter.__module__ == "time"


def step_timed_by_an_imported_clock(model, optim, x, y):  # noqa: ANN001
    start = clock()  # `from time import perf_counter as clock` at the top of this file
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.item(), clock() - start


def test_a_clock_imported_by_name_is_refused_too():
    """The clock bound to a name of the user's module was not the patched ``time``
    attribute: the capture's elapsed time was returned on every call."""
    model = _model()
    compiled = sc.compile(make_mode("ddp"))(step_timed_by_an_imported_clock)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError, match=r"reads the clock \(time.perf_counter") as info:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches()[0])
    assert "start = clock()" in str(info.value)
    assert clock is time.perf_counter  # the module's name holds the real clock again


def numpy_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach().numpy()


def test_numpy_in_the_step_says_what_to_do():
    """torch's own words ("not supported for tensor subclasses") named nothing the user
    wrote; the hint says to return the tensor and call .numpy() on the result."""
    model = _model()
    compiled = sc.compile(make_mode("ddp"))(numpy_step)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as info:
        compiled(model, torch.optim.SGD(model.parameters(), lr=0.1), *_batches()[0])
    assert "return loss.detach().numpy()" in str(info.value)
    assert "call .numpy() on what the call returns" in str(info.value)


def pruned_by_threshold_step(model, optim, x, y):  # noqa: ANN001
    """peft AdaLoRA's budget mask in miniature: a threshold read with ``.item()``,
    compared with tensors (both ways round, and an integer item with an integer tensor)."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    with torch.no_grad():
        weight = model[0].weight
        score = (weight * weight.grad).abs()
        threshold = torch.kthvalue(score.flatten(), k=20)[0].item()
        weight.masked_fill_(score <= threshold, 0.0)
        model[0].bias.mul_(torch.where(threshold < model[0].bias.abs(), 1.0, 0.5))
        counts = F.one_hot(y, CLASSES).sum(0)
        most = counts.max().item()
        model[2].bias.add_((counts == most).to(model[2].bias.dtype) * 0.1)
    optim.zero_grad()
    return loss


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_a_tensor_compared_with_an_item_is_the_tensor_comparison(mode):
    """Before 2026-12-05 refused as "used as a size or index": ``score <= threshold``
    made a ``TracedItem`` of the whole mask, which ``masked_fill_`` could not take."""
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(make_mode(mode))(pruned_by_threshold_step)
    with sc.simulate(world_size=2) as sim:
        for batch in _batches():
            loss = compiled(model, optim, *batch)
            expected = pruned_by_threshold_step(reference, reference_optim, *batch)
            assert abs(float(loss) - float(expected)) <= TOL * abs(float(expected))
        assert max(compare_models(model, reference, sim).values()) < TOL
    assert int((reference[0].weight == 0).sum()) >= 20  # the mask pruned


def where_with_an_item_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    with torch.no_grad():
        bound = model[0].weight.abs().mean().item()
        model[0].weight.copy_(torch.where(model[0].weight.abs() > bound, model[0].weight, bound))
    optim.step()
    return loss


def test_an_item_passed_as_a_number_operand_says_to_keep_the_tensor():
    """It was told "used as a size or index (a split size, a narrow length, a shape)"."""
    message = _refusal_leaving_the_model_untouched(where_with_an_item_step)
    assert "passed to where() as a number operand" in message
    assert "Keep it a tensor: pass the 0-d tensor .item() was called on" in message
    assert "size or index" not in message and "TracedItem" not in message
    assert "model[0].weight.copy_(torch.where(model[0].weight.abs() > bound, model[0].weight, bound))" in message


def loop_over_constant_tolist_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    for t in torch.linspace(3, 0, 2).long().tolist():  # diffusers-style timesteps
        loss = loss + t
    loss.backward()
    optim.step()
    return loss


def fill_from_constant_tolist_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    for t in torch.linspace(3, 0, 2).long().tolist():
        loss = loss + torch.full((1,), t).sum()
    loss.backward()
    optim.step()
    return loss


@pytest.mark.parametrize(
    ("step", "said"),
    [(loop_over_constant_tolist_step, "the values of .tolist() are computed by the program"),
     (fill_from_constant_tolist_step, "a value of .tolist() is passed to full() as a number operand")],
    ids=lambda v: getattr(v, "__name__", "said"),
)
def test_a_tolist_value_used_in_python_says_tolist(step, said):
    """NOTE: [values of .tolist() in messages]: `for t in torch.linspace(...).tolist():`
    used as numbers was told about ".item()" (`loss + t`) and, for `torch.full(.., t)`,
    to "pass the 0-d tensor .item() was called on"; now .tolist(), and to compute the
    list in Python."""
    message = _refusal_leaving_the_model_untouched(step)
    assert said in message, message
    assert ".item() was called on" not in message and "value of .item()" not in message
    assert "compute a list the step uses as numbers (loop counts, timesteps) in Python" in message


def estimated_loss_step(model, optim, x, y):  # noqa: ANN001
    """nanoGPT's estimate_loss in the step: items written back into tensors made in it."""
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    with torch.no_grad():
        losses = torch.zeros(3, dtype=torch.float64)
        for k in range(3):
            losses[k] = F.cross_entropy(model(x[k:]), y[k:]).item()
        halves = torch.tensor([F.cross_entropy(model(x[:4]), y[:4]).item(), losses[0].item(), 0.5],
                              dtype=torch.float64)
        counts = torch.tensor([[(model(x).argmax(-1) == y).sum().item(), 2], [True, 1]])
        first = torch.tensor(loss.item())  # a float item, in the default dtype
    return {"losses": losses.mean(), "halves": halves, "counts": counts, "first": first}


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_items_written_into_a_tensor_are_its_elements(mode):
    """Before 2026-12-06 ``losses[k] = loss.item()`` was refused as "used as a size or
    index", and ``torch.tensor([a.item(), ...])`` raised "Could not infer dtype of
    TracedItem" (NOTE: [items kept in a tensor])."""
    model = _model()
    reference = copy.deepcopy(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    compiled = sc.compile(make_mode(mode))(estimated_loss_step)
    with sc.simulate(world_size=2) as sim:
        for batch in _batches():
            got, want = compiled(model, optim, *batch), estimated_loss_step(reference, reference_optim, *batch)
            assert got.keys() == want.keys()
            for key in want:
                g, w = torch.as_tensor(got[key]), want[key]
                assert g.dtype == w.dtype and g.shape == w.shape, key
                assert torch.allclose(g, w, rtol=TOL, atol=0), (key, g, w)
        assert max(compare_models(model, reference, sim).values()) < TOL


def float_item_into_an_integer_tensor_step(model, optim, x, y):  # noqa: ANN001
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    totals = torch.zeros(2, dtype=torch.long)
    totals[0] = loss.item()
    return loss, totals


def test_an_item_assigned_with_another_conversion_says_to_keep_the_tensor():
    """Eager converts a float into an int64 tensor with an overflow check; refused, saying
    what to write, without torch's TypeError or our type's name."""
    message = _refusal_leaving_the_model_untouched(float_item_into_an_integer_tensor_step)
    assert "totals[0] = loss.item()" in message
    assert "is assigned into a torch.int64 tensor" in message and "`losses[k] = loss.detach()`" in message
    assert "size or index" not in message and "TracedItem" not in message
