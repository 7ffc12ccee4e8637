"""Fuzzing: random small models, modes and world sizes against single-device eager.

Every case either matches eager (float64, 3 steps, with or without the opt-in
``cross_iteration_overlap`` pass) or raises SPMDCompileError before touching the model;
never a silent wrong result. ``FUZZ_STATS`` counts the outcomes
(printed with ``pytest -s``).

The second test adds what a step reads besides its tensors (issue 12): Python scalars
that change between calls (a module attribute, a global, a float step argument; drawn per
step, the eager reference sees the same values), tensor constants created in forward, and
an optional attention block (``F.scaled_dot_product_attention`` with a drawn mask kind and
``scale``). ``VALUE_STATS`` counts run / refused / wrong; wrong must stay 0.
"""

from __future__ import annotations

import contextlib
import copy
import os
from collections import Counter

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.nn.attention import SDPBackend, sdpa_kernel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import DataParallel, DTensorExpandMode, TensorParallel
from spmd_compiler.tools.parity import compare_models, compare_optimizers, max_difference

FUZZ_STATS: Counter = Counter()
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "none": nn.Identity}


@st.composite
def cases(draw):
    widths = draw(st.lists(st.integers(1, 9), min_size=2, max_size=4))
    return {
        "widths": widths,
        "activation": draw(st.sampled_from(sorted(ACTIVATIONS))),
        "bias": draw(st.booleans()),
        "mode": draw(st.sampled_from(["dtensor_expand", "replicate", "fully_shard", "tp"])),
        "world_size": draw(st.sampled_from([1, 2, 4])),
        "batch": draw(st.integers(1, 9)),
        "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
        "cross_iteration": draw(st.booleans()),
        "seed": draw(st.integers(0, 1000)),
    }


def _model(case) -> nn.Module:
    torch.manual_seed(case["seed"])
    layers: list[nn.Module] = []
    widths = case["widths"]
    for i, (a, b) in enumerate(zip(widths, widths[1:])):
        layers.append(nn.Linear(a, b, bias=case["bias"]))
        if i < len(widths) - 2:
            layers.append(ACTIVATIONS[case["activation"]]())
    return nn.Sequential(*layers).double()


def _mode(case, model):
    if case["mode"] == "dtensor_expand":
        return DTensorExpandMode()
    if case["mode"] in ("replicate", "fully_shard"):
        return DataParallel(case["mode"])
    linears = [str(i) for i, m in enumerate(model) if isinstance(m, nn.Linear)]
    plan = {name: (ColwiseParallel() if k % 2 == 0 else RowwiseParallel()) for k, name in enumerate(linears)}
    return TensorParallel(plan)


def _step(model, optim, x, y):
    loss = F.mse_loss(model(x), y)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _optimizer(case, params):
    if case["optimizer"] == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2)


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(case=cases())
def test_random_models_match_eager_or_refuse_clearly(case):
    model = _model(case)
    reference = copy.deepcopy(model)
    optim, ref_optim = _optimizer(case, model.parameters()), _optimizer(case, reference.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    extra = ("cross_iteration_overlap",) if case["cross_iteration"] else ()
    step = sc.compile(_mode(case, model), extra_passes=extra)(_step)
    gen = torch.Generator().manual_seed(case["seed"])
    widths = case["widths"]
    batches = [
        (torch.randn(case["batch"], widths[0], generator=gen, dtype=torch.float64),
         torch.randn(case["batch"], widths[-1], generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]
    with sc.simulate(case["world_size"]) as sim:
        try:
            losses = [step(model, optim, x, y) for x, y in batches]
        except sc.SPMDCompileError:
            FUZZ_STATS["raised"] += 1
            # refused before anything ran: the model is untouched
            assert not any(isinstance(p, DTensor) for p in model.parameters())
            assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
            return
        step.flush()  # a deferred last update (cross_iteration_overlap) lands here
        ref_losses = [_step(reference, ref_optim, x, y) for x, y in batches]
        for got, want in zip(losses, ref_losses):
            assert abs(got.item() - want.item()) <= 1e-9 * max(1.0, abs(want.item()))
        diff = max_difference(
            compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim)
        )
    assert diff < 1e-9, (case, diff)
    FUZZ_STATS["matched"] += 1




# ------------------------------------------------ Python values, constants, attention

VALUE_STATS: Counter = Counter()
REFUSALS: Counter = Counter()  # first line of each refusal (printed with -s)
VALUE_EXAMPLES = int(os.environ.get("SPMD_FUZZ_EXAMPLES", "20"))  # more for a local hunt
LOSS_WEIGHT = 1.0  # a global the step reads; the test changes it between calls
SCALARS = [1.0, 0.5, 2.0, -1.5]  # few values, so a cached program is met again
MASKS = ["none", "causal", "bool", "float"]
CONSTANTS = ["none", "scalar", "vector", "list", "from_attribute"]


@st.composite
def value_cases(draw):
    heads = draw(st.sampled_from([1, 2, 4]))
    width = heads * draw(st.integers(1, 3))
    per_step = st.lists(st.sampled_from(SCALARS), min_size=3, max_size=3)
    attention = draw(st.booleans())
    mask = draw(st.sampled_from(MASKS))
    # torch 2.13's CPU fused kernel returns NaN rows for is_causal=True with a scale <= 0
    # (eager is wrong there; torch's math path and the compiled program agree), so a
    # causal case draws positive scales only.
    positive = mask == "causal"
    argument_in = draw(st.sampled_from(["loss", "activation"] + (["sdpa_scale"] if attention else [])))
    low = 0.125 if positive and argument_in == "sdpa_scale" else -2.0  # float32-exact bounds
    return {
        "in": draw(st.integers(1, 6)),
        "width": width,
        "out": draw(st.integers(1, 5)),
        "seq": draw(st.integers(1, 4)),
        "batch": draw(st.sampled_from([4, 8, 2, 3])),  # mostly divisible: cases that run
        "activation": draw(st.sampled_from(sorted(ACTIVATIONS))),
        "bias": draw(st.booleans()),
        "temperature": draw(st.none() | per_step),
        "loss_weight": draw(st.none() | per_step),
        "argument": draw(st.none() | st.lists(
            st.floats(low, 2.0, allow_nan=False, width=32), min_size=3, max_size=3)),
        "argument_in": argument_in,
        "constant": draw(st.sampled_from(CONSTANTS)),
        "constant_value": draw(st.sampled_from([0.5, -2.0, 3.0])),
        "attention": attention,
        "heads": heads,
        "mask": mask,
        "per_sample_mask": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.3, 2.0] + ([] if positive else [-0.7]))),
        "mode": draw(st.sampled_from(["dtensor_expand", "replicate", "fully_shard", "tp"])),
        "world_size": draw(st.sampled_from([1, 2, 4])),
        "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
        "seed": draw(st.integers(0, 1000)),
    }


def _mask_pattern(case, rng: torch.Generator) -> list:
    """The mask as nested Python lists (built into a tensor inside forward): every
    query sees at least its own key, so no row is fully masked."""
    n, kind = case["seq"], case["mask"]
    rows = case["batch"] if case["per_sample_mask"] else 1

    def one() -> list:
        keep = (torch.rand(n, n, generator=rng) > 0.4) | torch.eye(n, dtype=torch.bool)
        if kind == "bool":
            return keep.tolist()
        values = -2.0 * torch.rand(n, n, generator=rng, dtype=torch.float64)
        return values.masked_fill(~keep, float("-inf")).tolist()

    return [[one()] for _ in range(rows)]  # (rows, 1, n, n)


class _FuzzAttention(nn.Module):
    def __init__(self, case, rng: torch.Generator) -> None:
        super().__init__()
        width = case["width"]
        self.heads, self.mask, self.scale = case["heads"], case["mask"], case["scale"]
        # no q/k/v bias: a key bias has a zero gradient that Adam turns into noise
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.o = nn.Linear(width, width, bias=case["bias"])
        self.pattern = _mask_pattern(case, rng) if self.mask in ("bool", "float") else None

    def forward(self, h: torch.Tensor, scale=None) -> torch.Tensor:  # noqa: ANN001
        b, n, width = h.shape
        q, k, v = (
            f(h).view(b, n, self.heads, width // self.heads).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        kwargs: dict = {"scale": self.scale if scale is None else scale}
        if self.mask == "causal":
            kwargs["is_causal"] = True
        elif self.pattern is not None:
            dtype = torch.bool if self.mask == "bool" else h.dtype
            kwargs["attn_mask"] = torch.tensor(self.pattern, dtype=dtype)
        out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return self.o(out.transpose(1, 2).reshape(b, n, width))


class _FuzzNet(nn.Module):
    """Linear, activation, Python scalars and constants, optional attention, Linear."""

    def __init__(self, case) -> None:
        super().__init__()
        torch.manual_seed(case["seed"])
        rng = torch.Generator().manual_seed(case["seed"])
        self.inp = nn.Linear(case["in"], case["width"], bias=case["bias"])
        self.act = ACTIVATIONS[case["activation"]]()
        self.attn = _FuzzAttention(case, rng) if case["attention"] else None
        self.out = nn.Linear(case["width"], case["out"], bias=case["bias"])
        self.constant, self.c = case["constant"], case["constant_value"]
        self.temperature = 1.0  # changed between calls when the case draws it

    def forward(self, x: torch.Tensor, scale=None, scale_in: str = "") -> torch.Tensor:  # noqa: ANN001
        h = self.act(self.inp(x)) * self.temperature
        h = self._with_constant(h)
        if scale_in == "activation" and scale is not None:
            h = h * scale
        if self.attn is not None:
            h = h + self.attn(h, scale if scale_in == "sdpa_scale" else None)
        return self.out(h).mean(1)

    def _with_constant(self, h: torch.Tensor) -> torch.Tensor:
        width = h.shape[-1]
        if self.constant == "scalar":
            return h * torch.tensor(self.c)
        if self.constant == "vector":
            return h + torch.ones(width) * self.c
        if self.constant == "list":
            return h - torch.tensor([self.c * i for i in range(width)], dtype=h.dtype)
        if self.constant == "from_attribute":  # the value of a changing attribute, baked in
            return h + torch.tensor(self.temperature)
        return h


def _value_step(scale_in: str):
    """The train step; the float argument (when given) goes where ``scale_in`` says."""

    def step(model, optim, x, y, scale=None):  # noqa: ANN001
        out = model(x, scale, scale_in) if scale_in != "loss" else model(x)
        loss = F.mse_loss(out, y) * LOSS_WEIGHT
        if scale is not None and scale_in == "loss":
            loss = loss * scale
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss

    return step


def _value_mode(case, model):
    if case["mode"] != "tp":
        return _mode(case, model)
    plan = {"inp": ColwiseParallel(), "out": RowwiseParallel()}
    if model.attn is not None:  # heads sharded: q/k/v column-wise, o row-wise
        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                "attn.v": ColwiseParallel(), "attn.o": RowwiseParallel()}
    return TensorParallel(plan)


def _set_values(case, i: int, model) -> tuple:
    """Sets step ``i``'s attribute and global; returns its extra step arguments."""
    global LOSS_WEIGHT
    if case["temperature"] is not None:
        model.temperature = case["temperature"][i]
    if case["loss_weight"] is not None:
        LOSS_WEIGHT = case["loss_weight"][i]
    return () if case["argument"] is None else (float(case["argument"][i]),)


def _reset_global() -> None:
    global LOSS_WEIGHT
    LOSS_WEIGHT = 1.0


def _value_batches(case) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(case["seed"])
    shape = (case["batch"], case["seq"], case["in"])
    return [
        (torch.randn(shape, generator=gen, dtype=torch.float64),
         torch.randn(case["batch"], case["out"], generator=gen, dtype=torch.float64))
        for _ in range(3)
    ]


def _run_eager(case, model, optim, batches) -> list[float]:
    step = _value_step(case["argument_in"])
    return [step(model, optim, x, y, *_set_values(case, i, model)).item()
            for i, (x, y) in enumerate(batches)]


def _eager_reference(case, model, batches, *, math_kernel: bool):
    """The eager reference: a copy of the (untouched) model and its optimizer after
    ``batches``, with its losses; ``math_kernel`` runs SDPA on torch's math kernel."""
    reference = copy.deepcopy(model)
    optim = _optimizer(case, reference.parameters())
    try:
        with sdpa_kernel([SDPBackend.MATH]) if math_kernel else contextlib.nullcontext():
            losses = _run_eager(case, reference, optim, batches)
    finally:
        _reset_global()
    return reference, optim, losses


# NOTE: [eager's own attention kernels disagree]
# Eager on CPU picks the fused flash kernel where it can, and its math path elsewhere. The
# two are different roundings of the same function, and on an ill-conditioned step they
# disagree visibly: the case below (a step whose loss grows 65 -> 3.8e8 -> 2.4e53, with
# the gradient of the first layer a near-cancelling sum) gives 5.3e-6 relative between
# eager-flash and eager-math. Until 2026-12-02 the compiled program always computed the
# math formulation (0.0 from eager-math on that case); since NOTE: [the CPU flash kernel
# at capture] it runs the kernel eager runs, and matches default eager on it. Where the
# program cannot follow eager's choice (grouped-query attention keeps the math
# formulation) and the two differ past the bound in a case with attention, the test asks
# the math kernel's eager run, which must match within the same bound: eager's own
# disagreement is not counted as ours, anything else is.
EAGER_KERNELS_DISAGREE_CASE = {
    "in": 1, "width": 6, "out": 2, "seq": 1, "batch": 4, "activation": "gelu", "bias": True,
    "temperature": None, "loss_weight": None, "argument": None, "argument_in": "loss",
    "constant": "list", "constant_value": 3.0, "attention": True, "heads": 2, "mask": "float",
    "per_sample_mask": False, "scale": None, "mode": "dtensor_expand", "world_size": 1,
    "optimizer": "sgd", "seed": 0,
}


def _within(losses, ref_losses, diff) -> bool:
    loss_ok = all(abs(g - w) <= 1e-9 * max(1.0, abs(w)) for g, w in zip(losses, ref_losses))
    return loss_ok and diff < 1e-9


# derandomize: CI meets the same examples every run; SPMD_FUZZ_EXAMPLES widens a local hunt
@settings(
    max_examples=VALUE_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
    derandomize=True,
)
@given(case=value_cases())
def test_changing_python_values_constants_attention_match_eager_or_refuse(case):
    """A refusal may come at a later step (a changed value compiles a new program): the
    state must then be the eager state after the steps that ran."""
    model = _FuzzNet(case).double()
    pristine = copy.deepcopy(model)
    optim = _optimizer(case, model.parameters())
    step = sc.compile(_value_mode(case, model))(_value_step(case["argument_in"]))
    batches = _value_batches(case)
    losses: list[float] = []
    with sc.simulate(case["world_size"]) as sim:
        try:
            try:
                for i, (x, y) in enumerate(batches):
                    losses.append(step(model, optim, x, y, *_set_values(case, i, model)).item())
            finally:
                _reset_global()
        except sc.SPMDCompileError as e:
            VALUE_STATS["refused"] += 1
            REFUSALS[str(e).splitlines()[0][:100]] += 1
        if not losses:
            assert not any(isinstance(p, DTensor) for p in model.parameters())

        def difference(math_kernel: bool) -> tuple[list[float], float]:
            reference, ref_optim, ref_losses = _eager_reference(
                case, pristine, batches[: len(losses)], math_kernel=math_kernel
            )
            if not losses:
                return ref_losses, max_difference(compare_models(model, reference, None))
            return ref_losses, max_difference(
                compare_models(model, reference, sim), compare_optimizers(optim, ref_optim, sim)
            )

        ref_losses, diff = difference(math_kernel=False)
        if not _within(losses, ref_losses, diff) and case["attention"]:
            VALUE_STATS["eager kernels disagree"] += 1  # NOTE: [eager's own attention kernels disagree]
            ref_losses, diff = difference(math_kernel=True)
    if not _within(losses, ref_losses, diff):
        VALUE_STATS["wrong"] += 1
    assert all(abs(g - w) <= 1e-9 * max(1.0, abs(w)) for g, w in zip(losses, ref_losses)), (
        case, losses, ref_losses)
    assert diff < 1e-9, (case, diff)
    if len(losses) == len(batches):
        VALUE_STATS["run"] += 1
        changing = [case[k] for k in ("temperature", "loss_weight", "argument") if case[k]]
        VALUE_STATS["run with values changing"] += any(len(set(v)) > 1 for v in changing)
        VALUE_STATS["run with a constant"] += case["constant"] != "none"
        VALUE_STATS["run with attention"] += case["attention"]


def teardown_module(module):
    print(f"\nfuzz: {dict(FUZZ_STATS)}")
    print(f"fuzz (python values, constants, attention): {dict(VALUE_STATS)}")
    for reason, count in REFUSALS.most_common():
        print(f"  refused {count}x: {reason}")


def test_eager_kernel_disagreement_is_not_counted_as_a_wrong_result() -> None:
    """The case of NOTE: [eager's own attention kernels disagree]: default eager differs
    from eager-math past the bound; the compiled program, running eager's flash kernel,
    matches default eager without asking eager-math."""
    case = dict(EAGER_KERNELS_DISAGREE_CASE)
    model = _FuzzNet(case).double()
    batches = _value_batches(case)
    flash, flash_optim, _ = _eager_reference(case, model, batches, math_kernel=False)
    math, math_optim, _ = _eager_reference(case, model, batches, math_kernel=True)
    eager_disagreement = max_difference(
        compare_models(flash, math, None), compare_optimizers(flash_optim, math_optim, None)
    )
    assert eager_disagreement > 1e-7, eager_disagreement  # eager's two kernels: ~5e-6
    inner = test_changing_python_values_constants_attention_match_eager_or_refuse
    asked_math = VALUE_STATS["eager kernels disagree"]
    inner.hypothesis.inner_test(case=case)  # asserts the compiled step within 1e-9 of eager
    assert VALUE_STATS["eager kernels disagree"] == asked_math
