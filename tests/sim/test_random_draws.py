"""Random ops that take a tensor (NOTE: [random draws shaped like a tensor]): a batch
shard draws its slice of one global draw, so 2 ranks (ddp, fsdp) compute what 1 rank
computes, float64; a random op that still reads a tensor is refused, naming it."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spmd_compiler as sc
from spmd_compiler.errors import SPMDCompileError, SPMDRuntimeError
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.demo.steps import classification_train_step

TOL = 1e-12
STEPS = 2

FORMS = {
    "rand_like": lambda h: h * torch.rand_like(h),
    "randn_like": lambda h: h + torch.randn_like(h),
    "randint_like": lambda h: h + torch.randint_like(h, 0, 3),
    "normal_in_place": lambda h: h + h.detach().clone().normal_(0.5, 2.0),
    "uniform_in_place": lambda h: h * torch.empty_like(h).uniform_(0.5, 1.5),
    "gumbel_softmax": lambda h: F.gumbel_softmax(h, tau=0.5),  # exponential_
    "log_normal_in_place": lambda h: h * torch.empty_like(h).log_normal_(0.0, 0.25),
    "bernoulli_of_probabilities": lambda h: h * torch.bernoulli(torch.sigmoid(h.detach())),
    "bernoulli_in_place_of_a_tensor": lambda h: h * torch.empty_like(h).bernoulli_(torch.sigmoid(h.detach())),
    "normal_of_tensors": lambda h: torch.normal(h, torch.sigmoid(h.detach())),
    "distribution_rsample": lambda h: torch.distributions.Normal(h, torch.ones_like(h)).rsample(),
    "rrelu_training": lambda h: F.rrelu(h, training=True),
    "multinomial_with_replacement": lambda h: h * torch.multinomial(
        torch.softmax(h.detach(), -1), 3, replacement=True).sum(-1, keepdim=True),
    "multinomial_without_replacement": lambda h: h * torch.multinomial(
        torch.softmax(h.detach(), -1), 3).sum(-1, keepdim=True),
    "categorical_sample": lambda h: h + torch.distributions.Categorical(
        logits=h.detach()).sample()[:, None],
}


class _Net(nn.Module):
    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc = nn.Linear(6, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(FORMS[self.form](self.fc(x)))


_step = classification_train_step  # forward, cross entropy, backward, step, zero_grad


def _losses(form: str, mode: str, world: int) -> list[float]:
    torch.manual_seed(0)
    model = _Net(form).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode(mode))(_step)
    data = torch.Generator().manual_seed(1)
    losses = []
    with sc.simulate(world_size=world):
        for i in range(STEPS):
            x = torch.randn(8, 6, dtype=torch.float64, generator=data)
            y = torch.randint(0, 3, (8,), generator=data)
            torch.manual_seed(100 + i)
            losses.append(float(compiled(model, optim, x, y)))
    return losses


@pytest.mark.parametrize("form", sorted(FORMS))
def test_two_ranks_draw_what_one_rank_draws(form) -> None:
    one = _losses(form, "ddp", 1)
    for mode in ("ddp", "fsdp"):
        assert _losses(form, mode, 2) == pytest.approx(one, rel=TOL), mode


def test_a_random_op_that_reads_a_tensor_is_refused() -> None:
    FORMS["poisson"] = lambda h: h * torch.poisson(torch.sigmoid(h.detach()))
    try:
        with pytest.raises(SPMDCompileError, match="poisson") as raised:
            _losses("poisson", "ddp", 2)
    finally:
        del FORMS["poisson"]
    assert "poisson" in (raised.value.op or "") and raised.value.user_line is not None


@pytest.mark.parametrize("replacement", [True, False])
def test_multinomial_draws_from_its_distribution(replacement) -> None:
    """The decomposition, run on real tensors: the first sample's frequencies are the
    normalized weights (zero weights never drawn), within 4 standard errors."""
    from spmd_compiler.capture.random_draws import global_draw_decompositions

    multinomial = global_draw_decompositions()[torch.ops.aten.multinomial.default]
    weights = torch.tensor([0.0, 1.0, 3.0, 0.0, 4.0, 2.0])
    draws = 20000
    torch.manual_seed(0)
    picked = multinomial(weights.expand(draws, 6), 2, replacement)
    assert picked.shape == (draws, 2) and picked.dtype == torch.long
    first = torch.bincount(picked[:, 0], minlength=6).double() / draws
    expected = (weights / weights.sum()).double()
    error = (expected * (1 - expected) / draws).sqrt()
    assert ((first - expected).abs() <= 4 * error + 1e-12).all(), (first, expected)
    if not replacement:
        assert (picked[:, 0] != picked[:, 1]).all()
    assert not ((picked == 0) | (picked == 3)).any()


@pytest.mark.parametrize("layout", ["row_major", "transposed", "strided"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("samples", "replacement"), [(1, True), (1, False), (3, True), (3, False)])
def test_multinomial_draws_eagers_numbers(dtype, samples, replacement, layout) -> None:
    """The decomposition, run on real tensors, picks eager's categories and leaves the
    generator where eager leaves it (NOTE: [one sample is the race]), whatever the
    weights' layout: eager's race fills a dense tensor in its memory order (a review:
    weights stored transposed picked other categories in 13 of 16 rows)."""
    from spmd_compiler.capture.random_draws import global_draw_decompositions

    multinomial = global_draw_decompositions()[torch.ops.aten.multinomial.default]
    weights = torch.rand(200, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    weights[5, :] = 0
    weights = weights.to(dtype).t()  # (64, 200), column-major
    if layout == "row_major":
        weights = weights.contiguous()
    elif layout == "strided":  # not dense: eager's empty_like makes it row-major
        weights = torch.cat([weights, weights], 1)[:, ::2]
    torch.manual_seed(3)
    expected, after = torch.multinomial(weights, samples, replacement), torch.rand(2)
    torch.manual_seed(3)
    assert torch.equal(multinomial(weights, samples, replacement), expected)
    assert torch.equal(torch.rand(2), after)


def _sampling_policy_step(how: str):  # noqa: ANN202
    def step(model, optim, x, target):  # noqa: ANN001, ANN202
        logits = model(x)
        policy = torch.distributions.Categorical(logits=logits)
        if how == "categorical_sample":
            actions = policy.sample()
        elif how == "multinomial_of_column_major_probs":  # the race in memory order
            actions = torch.multinomial(torch.softmax(logits.t(), 0).t(), 1).squeeze(-1)
        else:
            actions = torch.multinomial(policy.probs, 1, replacement=True).squeeze(-1)
        reward = (actions == target).to(logits.dtype)
        loss = -(policy.log_prob(actions) * (reward - reward.mean())).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        return loss.detach(), actions

    return step


@pytest.mark.parametrize(
    "how", ["categorical_sample", "multinomial_one_with_replacement", "multinomial_of_column_major_probs"]
)
def test_one_sample_draws_eagers_actions(how) -> None:
    """``Categorical.sample()`` and ``multinomial(p, 1, replacement=True)`` in a step draw
    eager's actions (ddp, fsdp, 2 and 4 ranks): the same losses and parameters, and the
    generator left where eager leaves it. Before, one sample with replacement was drawn
    by inverse CDF, where ATen runs its exponential race: other actions, and
    ``torch.rand(2)`` after three steps 0.8949 where eager's is 0.2865."""
    step = _sampling_policy_step(how)
    data = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 5, generator=data, dtype=torch.float64),
                torch.randint(0, 3, (8,), generator=data)) for _ in range(3)]

    runs = [(mode, world) for mode in ("ddp", "fsdp") for world in (2, 4)]
    _assert_eagers_draws(step, batches, lambda: nn.Linear(5, 3), 0.5, 7, runs)


def _assert_eagers_draws(step, batches, make_model, lr, seed, runs) -> None:  # noqa: ANN001
    """``step`` (returning its loss and what it drew) compiled for each ``(mode, world)``
    of ``runs`` gives eager's draws, losses and parameters, and leaves the default
    generator where eager leaves it."""

    def run(mode, world):  # noqa: ANN001, ANN202
        torch.manual_seed(0)
        model = make_model().double()
        optim = torch.optim.SGD(model.parameters(), lr=lr)
        torch.manual_seed(seed)
        if mode is None:
            outs = [step(model, optim, *batch) for batch in batches]
            return outs, [p.detach().clone() for p in model.parameters()], torch.rand(2)
        compiled = sc.compile(make_mode(mode))(step)
        with sc.simulate(world_size=world):
            outs = [compiled(model, optim, *batch) for batch in batches]
            params = [p.full_tensor().clone() for p in model.parameters()]
        return outs, params, torch.rand(2)

    eager_outs, eager_params, eager_after = run(None, 1)
    for mode, world in runs:
        outs, params, after = run(mode, world)
        for (loss, drawn), (eager_loss, eager_drawn) in zip(outs, eager_outs):
            assert torch.equal(drawn, eager_drawn), (mode, world)
            assert float(loss) == pytest.approx(float(eager_loss), rel=TOL, abs=1e-15), (mode, world)
        for p, e in zip(params, eager_params):
            torch.testing.assert_close(p, e, rtol=TOL, atol=1e-15)
        assert torch.equal(after, eager_after), (mode, world)


def test_multinomial_of_invalid_weights_raises_eagers_refusal() -> None:
    """Eager refuses negative weights: the compiled step too, before writing anything."""

    def sampling_step(model, optim, x, y):  # noqa: ANN001
        h = model.fc(x)
        picked = torch.multinomial(h.detach() - h.detach().min() + y[:, None], 2, True)
        loss = (model.out(h) * picked.sum(-1, keepdim=True)).mean()
        loss.backward()
        optim.step()
        return loss

    torch.manual_seed(0)
    model = _Net("rand_like").double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode("ddp"))(sampling_step)
    x = torch.randn(8, 6, dtype=torch.float64)
    with sc.simulate(world_size=2):
        compiled(model, optim, x, torch.ones(8, dtype=torch.float64))
        before = [p.full_tensor().clone() for p in model.parameters()]
        negative = torch.ones(8, dtype=torch.float64)
        negative[5] = -1.0  # on the second rank: one row gets a negative weight
        with pytest.raises(SPMDRuntimeError, match="invalid weights"):
            compiled(model, optim, x, negative)
        assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))


def _forward_draw_step(how: str):  # noqa: ANN202
    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        if how == "dropout":
            out = model(F.dropout(x, 0.5))
        elif how == "noise":
            out = model(x + torch.randn_like(x))
        elif how == "scalar":
            out = model(x * torch.rand(()))
        elif how == "row":
            out = model(x + torch.randn(1, x.shape[1], dtype=x.dtype))
        else:
            out = F.linear(x, model.weight + 0.1 * torch.randn_like(model.weight), model.bias)
        loss = F.cross_entropy(out, y)
        loss.backward()
        optim.step()
        return loss

    return step


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
@pytest.mark.parametrize(
    "how,checked", [("dropout", False), ("noise", False), ("scalar", True), ("row", True), ("weight", True)]
)
def test_only_forward_draws_each_rank_slices_skip_the_generator_check(how, checked, mode):
    """NOTE: [generators agree across ranks]: a forward draw is left out of the per-rank
    generator check only where the per-rank program slices it on every mesh dimension
    (dropout, noise shaped like the batch). A 0-d mixup weight, a row of noise and noise
    on a weight are read whole by every rank; they were left out by op name (per-rank
    seeds then trained each rank on its own value, silently)."""
    from spmd_compiler.runtime.same_inputs import drawn_devices
    from spmd_compiler.runtime.step_executable import _batch_split_everywhere

    torch.manual_seed(0)
    model = nn.Linear(8, 8).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    compiled = sc.compile(make_mode(mode))(_forward_draw_step(how))
    with sc.simulate(world_size=2):
        compiled(model, optim, torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,)))
    (program,) = [ex.program for entries in compiled._cache.values() for _, ex in entries]
    assert _batch_split_everywhere(program)
    drawn = drawn_devices(program.captured.graph_module, True, program.graph_module, program.mesh.ndim)
    assert drawn == (("cpu",) if checked else ())


def _trunc_normal_step(model, optim, x, y):  # noqa: ANN001, ANN202
    with torch.no_grad():
        nn.init.trunc_normal_(model.weight, std=0.02)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optim.step()
    return loss


def test_trunc_normal_in_the_step_is_refused_naming_torchs_loop():
    """``nn.init.trunc_normal_`` redraws until no value is out of bounds (an ``if`` on a
    tensor's value per round): refused as more than 16 ``if``s, with a hint that asked to
    rewrite the loop with torch.where; it now names torch's function and says to
    initialise outside the step or use normal_ + clamp_."""
    model = nn.Linear(8, 4).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(4, 8, dtype=torch.float64), torch.randint(0, 4, (4,))
    with sc.simulate(world_size=1), pytest.raises(SPMDCompileError) as info:
        sc.compile(make_mode("ddp"))(_trunc_normal_step)(model, optim, x, y)
    message = str(info.value)
    assert "torch.nn.init.trunc_normal_" in message and "clamp_" in message
    assert "outside the compiled step" in message


_IN_PLACE_DRAWS = {
    # a classifier-free-guidance drop mask (a float p)
    "bernoulli_float_p": lambda b, t: torch.empty(b, dtype=t).bernoulli_(0.3),
    "bernoulli_p_keyword_float32": lambda b, t: torch.bernoulli(torch.empty(b, dtype=torch.float32), p=0.3).to(t),
    # diffusion timesteps, their number T = 50
    "random_from_to": lambda b, t: torch.empty(b, dtype=torch.long).random_(0, 50).to(t) / 50,
    "random_to": lambda b, t: torch.empty(b, dtype=torch.long).random_(50).to(t) / 50,
    "random_float": lambda b, t: torch.empty(b, dtype=torch.float32).random_().to(t) / 2**24,
    "random_from_float16": lambda b, t: torch.empty(b, dtype=torch.float16).random_(3).to(t) / 2**11,
    "random_uint8": lambda b, t: torch.empty(b, dtype=torch.uint8).random_().to(t) / 256,
    "geometric": lambda b, t: torch.empty(b, dtype=t).geometric_(0.4) / 4,
}


@pytest.mark.parametrize("form", sorted(_IN_PLACE_DRAWS))
def test_in_place_draws_are_eagers_numbers(form) -> None:
    """``torch.empty(B).bernoulli_(p)`` with a float ``p`` drew ``rand(float32) < p`` where
    eager's CPU kernel compares one float64 uniform per element (other masks: a loss
    1.6674 for eager's 1.4054, and every later draw other numbers); ``random_`` (diffusion
    timesteps) and ``geometric_`` were refused as draws "from a tensor argument". They are
    now one global draw of the tensor's shape with eager's arithmetic: eager's losses,
    parameters and generator state after, at 1, 2 and 4 ranks (ddp, fsdp)."""
    draw = _IN_PLACE_DRAWS[form]

    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        scale = draw(x.shape[0], x.dtype)
        loss = F.mse_loss(model(x * (1 - scale[:, None])), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        return loss.detach(), scale

    data = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 4, generator=data, dtype=torch.float64),
                torch.randn(8, 2, generator=data, dtype=torch.float64)) for _ in range(3)]

    runs = (("ddp", 1), ("ddp", 2), ("fsdp", 2), ("ddp", 4))
    _assert_eagers_draws(step, batches, lambda: nn.Linear(4, 2), 0.1, 42, runs)


def _timesteps(b: int) -> torch.Tensor:
    t = torch.empty(b, dtype=torch.long)
    t.random_()  # int64's full range: no factory draws it (refused, this line named)
    return t % 50


def _mixup_weight() -> torch.Tensor:
    return torch.distributions.Beta(0.4, 0.4).sample()


@pytest.mark.parametrize("helper", ["timesteps", "beta"])
def test_a_refused_draw_names_its_own_line_and_a_way_that_works(helper) -> None:
    """A refused draw inside a helper function named only the step's call line
    (``t = sample_timesteps(B)``), as a draw "from a tensor argument" for a tensor made in
    the step; a Beta sample (a mixup weight) got the hint to draw with torch.rand, which
    builds no Beta sample. The error names the helper's line too, and for Gamma / Beta /
    Dirichlet / Poisson / binomial samples says to pass the value in as an argument."""
    import inspect

    def step(model, optim, x, y):  # noqa: ANN001, ANN202
        scale = _timesteps(x.shape[0])[:, None].to(x.dtype) / 50 if helper == "timesteps" else _mixup_weight()
        F.mse_loss(model(x * scale), y).backward()
        optim.step()

    model = nn.Linear(4, 2).double()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    with sc.simulate(world_size=2), pytest.raises(SPMDCompileError) as raised:
        sc.compile(make_mode("ddp"))(step)(model, optim, x, y)
    error, message = raised.value, str(raised.value)
    assert "tensor argument" not in message
    assert error.user_line is not None and "scale = _timesteps" in str(error.user_line)
    if helper == "timesteps":  # its reason is the range, not the shards (a review)
        line = inspect.getsourcelines(_timesteps)[1] + 2
        assert error.made_at is not None and error.made_at.lineno == line, error.made_at
        assert "t.random_()" in message and "whole range" in message and "another shard" not in message
        assert "torch.randint(low, high, size)" in message
    else:
        assert "draws into or from a tensor" in message  # torch.distributions' own line, the model's innermost
        assert "_sample_dirichlet" in (error.op or "")
        assert "draw it outside the step and pass it as an argument" in message
        assert "torch.rand," not in message
