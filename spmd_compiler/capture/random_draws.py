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
mode and world size. Except for ``multinomial``, the numbers are those of the same
distribution, not eager's (as for dropout). After capture any random op that still reads
a tensor (``random_``, ``torch.poisson``, gamma and Dirichlet samples) is refused, naming the op and the line (``refuse_shard_local_draws``), also
into a tensor made by factories alone: in a probe ``torch.empty(n).geometric_(0.5)``
still gave other losses on 2 simulated ranks than on 1.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx

from ..errors import node_error

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
    return (_uniform01(self) < p).to(self.dtype)


def _bernoulli_tensor(self, p, *, generator=None):
    if generator is not None:
        return NotImplemented  # traced as it is: refused by refuse_explicit_generators
    draw = torch.rand(tuple(self.shape), dtype=p.dtype if p.is_floating_point() else self.dtype, device=self.device)
    return (draw < p).to(self.dtype)


def _bernoulli_tensor_(self, p, *, generator=None):
    if generator is not None:
        return NotImplemented
    return self.copy_(_bernoulli_tensor(self, p))


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
    draw = torch.rand(tuple(self.shape), dtype=torch.float32, device=self.device)
    return self.copy_((draw < p).to(self.dtype))


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
    }


SHARD_LOCAL_DRAW = (
    "This random op draws from a tensor argument ({op}). On a batch-sharded rank it would "
    "draw the numbers of another shard instead of its own slice of one global draw, so "
    "the result would depend on the number of ranks (NOTE: [random draws shaped like a "
    "tensor]); refused."
)


def refuse_shard_local_draws(gm: torch.fx.GraphModule) -> None:
    """Refuse a random op left in the first graph that reads a tensor (see the NOTE)."""
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
            continue
        if any(isinstance(a.meta.get("val"), torch.Tensor) for a in node.all_input_nodes):
            raise node_error(
                SHARD_LOCAL_DRAW.format(op=node.target), node,
                hint="draw with a factory of the full shape (torch.rand, torch.randn, "
                "torch.randint with a size) and compute from it.",
            )


__all__ = ["global_draw_decompositions", "refuse_shard_local_draws"]
