"""What a program replayed as a CUDA graph hands back to the runtime.

NOTE: [CUDA graphs and the program's outputs]
With ``cuda_graphs=True`` Inductor records the lowered program once and replays it
(``torch._inductor.cudagraph_trees``). Its outputs live in the graphs' memory pool and a
replay writes them again: when a new step starts, the tensors a previous replay returned
are invalidated ("accessing tensor output of CUDAGraphs that has been overwritten by a
subsequent run"). The per-rank program is functional, so without care its new state is
such an output, and the next step feeds it back in: that failed on an H200 (torch 2.11,
2026-11-27) on every model of the lowering benchmark. And an input that is not static,
one the graphs cannot assume at the same address on every call, is copied into the pool
before each replay.

So a program replayed as a CUDA graph, per output:

- state the program reads and writes, donated (NOTE: [state donation]): the graph writes
  the new value into the input; the input is static and comes back as the output;
- state it reads and writes that may not be donated inside the graph (torch 2.11's
  reordering hazard, ``not_read_by``), but could be in place: the new value is copied
  into the input after the replay (one ``_foreach_copy_``), the input is static and comes
  back as the output;
- a gradient the program does not read back: left in the pool (the next step writes the
  next one there, as torch's own optimizers would; a caller keeping a reference across
  steps gets the error above, never stale numbers);
- anything else, the values the step returns (the loss a caller may keep in a list) and
  state that stays functional (a program with value checks, a deferred part, padded
  state): cloned out of the pool.

Each call starts a new step for the graphs (``torch.compiler.cudagraph_mark_step_begin``):
this program runs outside Dynamo, whose frame entries otherwise mark it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _torch_private as private
from .ir.signature import Kind
from .state_donation import Pairs


def gradients_not_read_back(captured: Any) -> tuple[int, ...]:
    """Positions of the gradients among ``captured``'s outputs (a ``CapturedStep``) that
    are not also among its inputs: a replay may leave them in the graphs' pool."""
    if captured is None:
        return ()
    reads = {ref for ref, _ in captured.inputs}
    return tuple(
        j for j, ref in enumerate(captured.outputs) if ref.kind is Kind.GRAD and ref not in reads
    )


class Replayed:
    """Call a program lowered with CUDA graphs and make its outputs safe to keep across
    replays (NOTE: [CUDA graphs and the program's outputs]).

    ``copied_back``: (input, output) pairs whose new value is copied into the input;
    ``in_pool``: positions of outputs left in the graphs' pool.
    """

    def __init__(
        self, inner: Callable[..., Sequence[Any]], copied_back: Pairs, in_pool: Sequence[int]
    ) -> None:
        self.inner = inner
        self.copied_back = copied_back
        self.in_pool = frozenset(in_pool)

    def __call__(self, *inputs: Any) -> list[Any]:
        torch.compiler.cudagraph_mark_step_begin()
        outs = list(self.inner(*inputs))
        if self.copied_back:
            private.foreach_copy(
                [inputs[i] for i, _ in self.copied_back], [outs[j] for _, j in self.copied_back]
            )
            for i, j in self.copied_back:
                outs[j] = inputs[i]
        given = {id(t) for t in inputs}
        return [
            o.clone()
            if isinstance(o, torch.Tensor) and j not in self.in_pool and id(o) not in given
            else o
            for j, o in enumerate(outs)
        ]
