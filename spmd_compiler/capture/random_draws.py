"""Random draws shaped like a tensor, as draws of the global shape.

NOTE: [random draws shaped like a tensor]
NOTE: [random numbers] makes dropout's draw a factory op of the global shape, so every
rank draws the same full tensor from the same seed and keeps its slice. Other random ops
take a tensor: ``torch.rand_like(x)`` / ``randn_like`` / ``randint_like``, ``x.normal_()``,
``x.uniform_(a, b)``, ``x.exponential_()`` (``F.gumbel_softmax``), ``torch.bernoulli(p)``,
``torch.normal(mean, std)``, ``F.rrelu`` in training. DTensor runs such an op on each
rank's shard with the same seed, so a batch-sharded rank drew the numbers of the first
shard, not those of its own slice: in a probe, ``x * torch.rand_like(x)`` on 2 ranks gave
a loss 4% off the same program on 1 rank, and nothing said so.

At capture each of these becomes ops on a draw of the global shape (``torch.rand``,
``torch.randn``, ``torch.randint``, ``torch.normal`` with a size): ``x.uniform_(a, b)`` is
``a + (b - a) * rand``, ``exponential_(l)`` is ``-log1p(-rand) / l``, ``log_normal_`` is
``exp(normal)``, ``cauchy_`` is ``median + sigma * tan(pi * (rand - 1/2))``,
``bernoulli(p)`` is ``rand < p``, ``normal(mean, std)`` is ``mean + std * randn``, and
``rrelu`` multiplies its negative inputs by ``lower + (upper - lower) * rand`` (its noise
tensor holds that factor, 1 elsewhere, as the kernel's). ``torch.multinomial(w, n)``
(``Categorical.sample()``: a policy's actions, negative sampling) with replacement and
``n > 1`` is inverse-CDF sampling, one uniform per sample searched in the rows' cumulative
weights (float64); one sample, or any number without replacement, is ATen's exponential
race (the ``n`` largest of ``w / Exp(1)``, the Exp(1) drawn in float64 and rounded to the
weights' dtype, whose order is that of drawing one by one; NOTE: [one sample is the
race]). On CPU both pick eager's categories and leave the generator where eager does
(float64, float32, float16, bfloat16 weights, stored row-major, transposed or strided:
the race draws in the weights' memory order as eager's ``empty_like`` does;
tests/sim/test_random_draws.py). Both keep
zero-weight categories out, and eager's refusal of invalid weights (negative, inf or NaN,
a row summing to 0, fewer positive categories than samples without replacement) is a
value check (NOTE: [value checks]): a call with such weights raises eager's message
before anything is written. Every rank then sees its slice of one global draw, for every
mode and world size. ``x.random_(from, to)`` / ``random_(to)`` / ``random_()`` (diffusion timesteps) write no
value they read: each is ``torch.randint`` of the tensor's shape, ATen's same kernel
(``random() % range + from``), ``random_()`` the range of the dtype's kernel
(``_RANDOM_HIGH``; int32's and int64's full ranges have no ``randint`` and stay refused);
``geometric_(p)`` is eager's ``ceil(log(u) / log1p(-p))`` of a float64 uniform.

NOTE: [eager's numbers of the in-place draws]
Where a decomposition draws what eager's CPU kernel draws, the step's numbers are
eager's and the default generator is left where eager leaves it, so every later draw of
the step is eager's too: ``rand_like``, ``randn_like``, ``randint_like``, ``uniform_``,
``normal_``, ``normal`` of tensors, ``cauchy_``, ``random_``, ``geometric_``,
``bernoulli`` of a probability tensor, and ``bernoulli_(p)``
/ ``bernoulli(x, p=p)`` with a float ``p``, whose default kernel compares one float64
uniform per element with ``p`` (it was drawn in float32: other masks, and the generator
left elsewhere). One exception, by CPU: on an Intel CPU a build with MKL draws
``bernoulli_(p)`` from MKL's MCG31 stream seeded with one 32-bit number
(``DistributionKernels.cpp``, ``cpuinfo_vendor_intel``), which no torch op draws: there
the compiled mask is another draw of the distribution (the same at every world size)
and later draws differ from eager's. Tested on AMD (tests/sim/test_random_draws.py).
The other numbers (``exponential_``, ``log_normal_``, a draw into a transposed tensor;
``rrelu`` and CUDA draws not compared) are those of the same distribution, not eager's
(CPU dropout is ``bernoulli_(1 - p)``: eager's numbers but on an Intel CPU). After capture any random op that still reads
a tensor (``torch.poisson``, ``binomial``, gamma and Dirichlet samples, ``random_()`` of
int64) is refused, naming the op, the step's line and the line inside a helper that
made it (``DRAW_MADE_AT``, recorded as the node is created: the stack traces keep only
forward frames and the step's), with a hint that works for it: a Gamma / Beta /
Dirichlet / Poisson / binomial sample is drawn outside the step and passed in.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from .. import _torch_private as private
from ..errors import innermost_model_frame_of_stack, node_error

aten = torch.ops.aten


def _like(self: torch.Tensor, dtype: Any, device: Any) -> dict[str, Any]:
    return {"dtype": dtype if dtype is not None else self.dtype,
            "device": device if device is not None else self.device}


def _rand_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return torch.rand(tuple(self.shape), **_like(self, dtype, device))


def _randn_like(self, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return torch.randn(tuple(self.shape), **_like(self, dtype, device))


def _randint_like(self, high, *, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return torch.randint(0, high, tuple(self.shape), **_like(self, dtype, device))


def _randint_like_low(self, low, high, *, dtype=None, layout=None, device=None, pin_memory=None,
                      memory_format=None):
    return torch.randint(low, high, tuple(self.shape), **_like(self, dtype, device))


def _uniform01(self: torch.Tensor) -> torch.Tensor:
    return torch.rand(tuple(self.shape), dtype=self.dtype, device=self.device)


def _normal_(self, mean=0.0, std=1.0, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return self.copy_(torch.normal(mean, std, tuple(self.shape), dtype=self.dtype, device=self.device))


def _uniform_(self, low=0.0, high=1.0, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return self.copy_(low + (high - low) * _uniform01(self))


def _exponential_(self, lambd=1.0, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return self.copy_(-torch.log1p(-_uniform01(self)) / lambd)


def _log_normal_(self, mean=1.0, std=2.0, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return self.copy_(torch.exp(torch.normal(mean, std, tuple(self.shape), dtype=self.dtype, device=self.device)))


def _cauchy_(self, median=0.0, sigma=1.0, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return self.copy_(median + sigma * torch.tan(math.pi * (_uniform01(self) - 0.5)))


def _bernoulli(self, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return (_uniform01(self) < self).to(self.dtype)


def _bernoulli_p(self, p, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    # NOTE: [eager's numbers of the in-place draws]: a float64 uniform per element
    draw = torch.rand(tuple(self.shape), dtype=torch.float64, device=self.device)
    return (draw < p).to(self.dtype)


def _bernoulli_tensor(self, p, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    draw = torch.rand(tuple(self.shape), dtype=p.dtype if p.is_floating_point() else self.dtype, device=self.device)
    return (draw < p).to(self.dtype)


def _bernoulli_tensor_(self, p, *, generator=None):
    if generator is not None:
        return NotImplemented
    return self.copy_(_bernoulli_tensor(self, p))


# the high end (exclusive) of ``random_()``'s draw for each dtype whose kernel is
# ``randint``'s: ``random() % high``, or ``random64() % high`` for float64 (int32 and
# int64 take other arithmetic: left to the refusal)
_RANDOM_HIGH = {
    torch.float64: 2**53 + 1, torch.float32: 2**24 + 1, torch.float16: 2**11 + 1,
    torch.bfloat16: 2**8 + 1, torch.int16: 2**15, torch.int8: 2**7, torch.uint8: 2**8,
    torch.bool: 2,
}


def _randint_into(self: torch.Tensor, low: int, high: int) -> torch.Tensor:
    return self.copy_(torch.randint(low, high, tuple(self.shape), dtype=self.dtype, device=self.device))


def _random_from(self, low, high=None, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    if high is None:  # [low, the dtype's largest value]: an int64 range has no randint
        if self.dtype not in _RANDOM_HIGH or self.dtype == torch.bool:
            return NotImplemented  # refused by refuse_shard_local_draws
        high = _RANDOM_HIGH[self.dtype] if self.is_floating_point() else torch.iinfo(self.dtype).max + 1
    return _randint_into(self, low, high)


def _random_to(self, high, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return _randint_into(self, 0, high)


def _random(self, *, generator=None):
    if generator is not None or self.dtype not in _RANDOM_HIGH:
        return NotImplemented  # an explicit generator, or int32 / int64: refused
    return _randint_into(self, 0, _RANDOM_HIGH[self.dtype])


def _geometric_(self, p, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    if not 0 < p < 1:
        raise RuntimeError(f"geometric_ expects p to be in (0, 1), but got p={p}")
    draw = torch.rand(tuple(self.shape), dtype=torch.float64, device=self.device)
    return self.copy_(torch.ceil(torch.log(draw) / math.log1p(-p)).to(self.dtype))


def _normal_tensor_float(mean, std=1.0, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return mean + std * torch.randn(tuple(mean.shape), dtype=mean.dtype, device=mean.device)


def _normal_float_tensor(mean, std, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return mean + std * torch.randn(tuple(std.shape), dtype=std.dtype, device=std.device)


def _normal_tensor_tensor(mean, std, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    shape = torch.broadcast_shapes(mean.shape, std.shape)
    dtype = torch.result_type(mean, std)
    return mean + std * torch.randn(tuple(shape), dtype=dtype, device=mean.device)


def _rrelu_factor(self, noise, lower, upper, training):
    """(output, noise): non-positive inputs times a uniform factor in training, times
    the mean slope in evaluation (the kernel's ``leaky_relu``)."""
    if not training:
        slope = (lower + upper) / 2
        return torch.where(self > 0, self, self * slope), noise
    factor = lower + (upper - lower) * _uniform01(self)
    negative = self <= 0
    one = torch.ones((), dtype=self.dtype, device=self.device)
    return torch.where(negative, self * factor, self), torch.where(negative, factor, one)


def _rrelu_with_noise(self, noise, lower=0.125, upper=1.0 / 3, training=False, generator=None):
    if generator is not None:
        return NotImplemented
    out, new_noise = _rrelu_factor(self, noise, lower, upper, training)
    if training:
        noise.copy_(new_noise)
    return out


def _rrelu_with_noise_(self, noise, lower=0.125, upper=1.0 / 3, training=False, generator=None):
    if generator is not None:
        return NotImplemented
    return self.copy_(_rrelu_with_noise(self, noise, lower, upper, training, generator))


def _multinomial(self, num_samples, replacement=False, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    weights = self.to(torch.float64)
    rows = weights.reshape(-1, weights.shape[-1])
    positive = (rows > 0).sum(-1)
    valid = (rows >= 0).all() & rows.isfinite().all() & (positive > 0).all()
    if not replacement:
        valid = valid & (positive >= num_samples).all()
    if not bool(valid):  # a value check (NOTE: [value checks]): eager's refusal
        raise RuntimeError(
            "multinomial: invalid weights (a negative, inf or NaN weight, a row summing to "
            "0, or fewer positive categories than samples without replacement)"
        )
    if replacement and num_samples > 1:
        # NOTE: [one sample is the race]: ATen's multinomial takes its exponential race
        # whenever num_samples == 1, with replacement or not (the two are one
        # distribution for one sample); inverse-CDF sampling there drew other actions
        # than eager's Categorical.sample() and left the generator elsewhere.
        cumulative = rows.cumsum(-1)
        draw = torch.rand((rows.shape[0], num_samples), dtype=torch.float64, device=self.device)
        picked = torch.searchsorted(cumulative, draw * cumulative[:, -1:], right=True)
        # rounding may pass the total: the last category with a positive weight
        last = (rows > 0).to(torch.long).cumsum(-1).argmax(-1, keepdim=True)
        picked = torch.minimum(picked, last)
    else:
        # eager's arithmetic: Exp(1) drawn in float64, rounded to the weights' dtype, and
        # the largest weight / Exp(1) in that dtype (its ties in float16 and bfloat16)
        flat = self.reshape(-1, self.shape[-1])
        uniform = _rand_in_memory_order(self).reshape(rows.shape)
        race = -torch.log1p(-uniform)
        ratio = flat / race.to(self.dtype)
        if num_samples == 1:
            picked = ratio.argmax(-1, keepdim=True)
        else:
            picked = torch.topk(ratio, num_samples, dim=-1).indices
    return picked.reshape(*self.shape[:-1], num_samples)


def _rand_in_memory_order(t: torch.Tensor) -> torch.Tensor:
    """``torch.rand`` (float64) of ``t``'s shape, its numbers laid out as eager's
    ``empty_like(t).exponential_()`` fills them: in ``t``'s memory order where ``t`` is
    dense (``empty_like`` keeps a dense tensor's strides: weights ``softmax(l.t(), 0).t()``
    are column-major), else in row-major order (NOTE: [one sample is the race]; a
    reviewer found 13 of 16 transposed rows picked other categories than eager's)."""
    dims = [d for d in range(t.dim()) if t.shape[d] != 1]
    strides = t.stride()
    order = sorted(dims, key=lambda d: -strides[d])  # outermost first
    expected, dense = 1, True
    for d in reversed(order):
        dense = dense and strides[d] == expected
        expected *= t.shape[d]
    if not dense or order == dims:
        return torch.rand(tuple(t.shape), dtype=torch.float64, device=t.device)
    order += [d for d in range(t.dim()) if t.shape[d] == 1]
    draw = torch.rand([t.shape[d] for d in order], dtype=torch.float64, device=t.device)
    return draw.permute([order.index(d) for d in range(t.dim())])


def _bernoulli_with_probability(
    self: torch.Tensor, p: float = 0.5, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """``x.bernoulli_(p)`` as ``x.copy_(rand(global shape) < p)``.

    NOTE: [random numbers]
    The draw is a factory op of the GLOBAL shape, so every rank draws the same full
    tensor from the same seed and keeps its slice of it (expansion treats values no
    DTensor flowed into as Replicate; using them with a shard slices locally). Replicas
    see the same numbers, shards their slice of one global draw, for every parallel mode
    and world size, and two runs with one seed are identical. (Functionalized,
    ``bernoulli_`` would also become ``bernoulli.p``, which DTensor has no rule for.)
    """
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    return self.copy_(_bernoulli_p(self, p))


def global_draw_decompositions() -> dict[Any, Any]:
    """The capture decompositions of the NOTE (in-place forms: the first trace is not
    functionalized yet)."""
    return {
        aten.rand_like.default: _rand_like,
        aten.randn_like.default: _randn_like,
        aten.randint_like.default: _randint_like,
        aten.randint_like.low_dtype: _randint_like_low,
        aten.normal_.default: _normal_,
        aten.uniform_.default: _uniform_,
        aten.exponential_.default: _exponential_,
        aten.log_normal_.default: _log_normal_,
        aten.cauchy_.default: _cauchy_,
        aten.bernoulli.default: _bernoulli,
        aten.bernoulli.p: _bernoulli_p,
        aten.bernoulli_.float: _bernoulli_with_probability,
        aten.bernoulli.Tensor: _bernoulli_tensor,
        aten.bernoulli_.Tensor: _bernoulli_tensor_,
        aten.normal.Tensor_float: _normal_tensor_float,
        aten.normal.float_Tensor: _normal_float_tensor,
        aten.normal.Tensor_Tensor: _normal_tensor_tensor,
        aten.rrelu_with_noise.default: _rrelu_with_noise,
        aten.rrelu_with_noise_.default: _rrelu_with_noise_,
        aten.multinomial.default: _multinomial,
        getattr(aten.random_, "from"): _random_from,
        aten.random_.to: _random_to,
        aten.random_.default: _random,
        aten.geometric_.default: _geometric_,
    }


SHARD_LOCAL_DRAW = (
    "This random op draws into or from a tensor ({op}). On a batch-sharded rank it would "
    "draw the numbers of another shard instead of its own slice of one global draw, so "
    "the result would depend on the number of ranks (NOTE: [random draws shaped like a "
    "tensor]); refused."
)
FACTORY_HINT = (
    "draw with a factory of the full shape (torch.rand, torch.randn, torch.randint with a "
    "size) and compute from it."
)
# samplers no factory draw builds (gamma's rejection sampling, Poisson, binomial counts):
# the value comes from outside the step
SAMPLED_OUTSIDE_HINT = (
    "a Gamma / Beta / Dirichlet / Poisson / binomial sample (torch.distributions' "
    "Beta(a, b).sample(): a mixup weight) cannot be drawn in the compiled step: draw it "
    "outside the step and pass it as an argument (a float or a 0-d tensor; a new value "
    "each call does not compile again)."
)
SAMPLED_OUTSIDE = (
    aten._standard_gamma.default, aten._sample_dirichlet.default, aten.poisson.default,
    aten.binomial.default,
)
# ``random_()`` of an int32 / int64 tensor, ``random_(from)`` of an int64 one: the draws of
# the tensor's shape left (``_random`` / ``_random_from`` decline them)
FULL_RANGE_DRAWS = (aten.random_.default, getattr(aten.random_, "from"), aten.random.default, getattr(aten.random, "from"))
FULL_RANGE_DRAW = (
    "This random op draws integers over a 32- or 64-bit tensor's whole range ({op}); no "
    "factory of the full shape draws that range as eager does, so it cannot be one global "
    "draw (NOTE: [random draws shaped like a tensor]); refused."
)
FULL_RANGE_HINT = (
    "give the range: `torch.randint(low, high, size)` (or `x.random_(low, high)`) with the "
    "bounds your code needs, e.g. `torch.randint(0, 2**31 - 1, (B,))` for seeds."
)
# the model's line that made a refused draw (a helper function's), recorded at its
# creation: the stack traces keep only forward frames and the step's
DRAW_MADE_AT = "spmd_draw_made_at"


def _reads_a_tensor(node: torch.fx.Node) -> bool:
    return any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes)


def _seeded(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def _note_draw_line(node: torch.fx.Node) -> None:
    if _seeded(node) and node.all_input_nodes:
        node.meta[DRAW_MADE_AT] = innermost_model_frame_of_stack()


def draw_lines_recorded() -> Any:
    """While the step is traced: each random op that takes a tensor records the model's
    line that made it, for ``refuse_shard_local_draws``."""
    return private.nodes_created_seen(_note_draw_line)


def refuse_shard_local_draws(gm: torch.fx.GraphModule) -> None:
    """Refuse a random op left in the first graph that reads a tensor (see the NOTE),
    naming the train step's line and the line inside a helper that made it."""
    for node in gm.graph.nodes:
        if not _seeded(node) or not _reads_a_tensor(node):
            continue
        if node.target in FULL_RANGE_DRAWS:
            raise node_error(FULL_RANGE_DRAW.format(op=node.target), node, hint=FULL_RANGE_HINT,
                             made_at=node.meta.get(DRAW_MADE_AT))
        raise node_error(
            SHARD_LOCAL_DRAW.format(op=node.target), node,
            hint=SAMPLED_OUTSIDE_HINT if node.target in SAMPLED_OUTSIDE else FACTORY_HINT,
            made_at=node.meta.get(DRAW_MADE_AT),
        )


__all__ = ["draw_lines_recorded", "global_draw_decompositions", "refuse_shard_local_draws"]
