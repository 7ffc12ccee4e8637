"""Programs update the state they are given in place: lowered ones at their end, interpreted
ones where each old value was last read.

NOTE: [state donation]
The per-rank program is functional: it reads each parameter, buffer and optimizer-state
tensor and returns its new value, and the runtime swaps the new tensor into the DTensor
(NOTE: [state ownership] in runtime/runner.py). That costs one fresh allocation per
state tensor per step, every new value held until the program returns (interpreted
below). Lowered, it costs more: Inductor's fused optimizer
kernel writes three fresh parameter-sized buffers, and on CPU glibc hands large buffers
back to the kernel when they are freed, so every step page-faults them in again (MLP-512
ddp, 2 gloo ranks: ~1,400 page faults per step; 24.0 ms a step, 21.8 ms with glibc told
to keep its memory). torch's optimizers write in place and allocate nothing.

So a lowered program (Inductor, on a real rank) is given each state tensor it both reads
and writes as a donated input: before Inductor sees the graph, the new value is copied
into the input (``aten.copy_`` at the end of the graph, which Inductor turns into kernels
that write to the input's memory) and dropped from the outputs; the runtime gets the input
tensor itself back in its place, so the swap it does is a no-op. Not donated:

- a program with value checks (NOTE: [value checks]): a check that fails must leave the
  state as it was, and the other program runs from it;
- a program with a deferred part (NOTE: [cross-iteration overlap]): its ``first`` /
  ``steady`` / ``finish`` programs pass state through a carry;
- state the runtime pads before feeding it (NOTE: [uneven shards]): the program gets a
  padded copy, not the state itself;
- an input whose memory another input shares (Inductor's kernels would see one write
  through the other);
- on a torch release where donation was not checked to come out right
  (``_torch_private.DONATION_VERIFIED_RELEASES``: 2.11 and 2.13);
- on torch 2.11, an input read (directly or through views) by a kernel Inductor calls
  out to, a library matmul or convolution, a collective, an ATen fallback
  (``_torch_private.inductor_calls_out``, ``not_read_by``): 2.11's peak-memory reordering
  ran a weight's in-place update before the backward's matmul reading the old weight
  (tp 0.12 off after 3 steps). Switching the reordering off instead, as from the 25th to
  the 27th of November 2026, kept every input donated but raised the GPT's peak above
  torch's (2.11 CPU, one gloo rank, GPT 2x128 ddp: 12.6 MiB against torch's 10.2; H200
  gpt-4x256: 94 against 75 MiB). Now, reordering on: GPT 9.6 MiB, MLP-512 16.0 (torch
  16.0; 8.6 with every input donated and no reordering);
- gradients: a program writes ``param.grad`` as a fresh tensor (the user may hold the
  previous step's);
- an input returned as another state's new value, and, lowered, a state whose new value
  is a plain copy of another input (NOTE: [state written as another state's value] in
  ``capture/written_state.py``: Inductor drops the copy and reads the other input after
  its update).

With ``cuda_graphs=True`` the donated inputs are static inputs of the graphs, and state
that may be updated in place but is not donated on 2.11 is copied in after each replay
(NOTE: [CUDA graphs and the program's outputs] in ``cuda_graph_outputs.py``).

The cost: a lowered step that fails part-way (a peer died in a collective) may leave part
of its update in the state; the runtime's error says so for a donating program.

NOTE: [interpreted programs update state in place]
The interpreter (backend "eager", simulated ranks, a program that runs once) donates the
same pairs (``donatable``; not a new value that is itself a view of an input), placed
for a program that runs in its written order: each new value is copied into its input
right after the later of the value and the last node that reads the old value (directly,
through a view or a getitem), and the nodes after the copy that read the new value read
the input instead, so fx frees the value at the copy. State updated early frees its new
value early: AdamW's ``exp_avg`` is written back before ``exp_avg_sq`` is computed, not
held with every other new tensor until the program returns. Step peak (profiler CPU
allocation totals, 2 gloo ranks, MLP-512, MiB, before -> after; torch's eager peer in
brackets): ddp 44.6 -> 32.6 (16.0), tp 20.7 -> 12.6 (8.0). The rest was the functional
optimizer's temporaries (a foreach op writes a new list where torch's writes in place):
``reinplace.py`` (NOTE: [interpreted programs reuse their temporaries]) takes ddp to 16.6
and tp to 4.9. Copies wait for the program's last collective: a peer that dies in one
leaves this rank's state as it was. A ``StateWrites`` call just before the first write
into the state tells the runtime whether a step that failed may have left part of its
update there (its error says which).
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from . import _torch_private as private
from .ir.collectives import ALL_REDUCE, is_collective, is_wait, wait_of
from .ir.graph_utils import (
    aliases_of,
    may_return_alias,
    output_values,
    placeholders,
    returns_alias,
    set_outputs,
)
from .ir.signature import Kind

DONATED_KINDS = (Kind.PARAM, Kind.BUFFER, Kind.OPTIM_STATE)

Pairs = tuple[tuple[int, int], ...]  # (input position, output position)


def donation_pairs(program: Any) -> Pairs:
    """The state ``program`` (a ``DistributedProgram``) reads at input ``i`` and writes at
    output ``j``, as ``(i, j)`` pairs it may update in place (NOTE: [state donation])."""
    captured = program.captured
    if program.deferred is not None or captured.checks:
        return ()
    inputs = {
        ref: i
        for i, (ref, _) in enumerate(captured.inputs)
        if ref.kind in DONATED_KINDS and not program.pads(ref)
    }
    return tuple((inputs[ref], j) for j, ref in enumerate(captured.outputs) if ref in inputs)


def _storages(t: torch.Tensor) -> list[int]:
    """Where ``t``'s memory is: one storage, or one per rank for a simulated tensor."""
    if isinstance(t, private.local_tensor_type()):
        return [v.untyped_storage().data_ptr() for v in private.per_rank_tensors(t).values()]
    return [t.untyped_storage().data_ptr()]


def donatable(gm: torch.fx.GraphModule, pairs: Pairs, inputs: Sequence[torch.Tensor]) -> Pairs:
    """The pairs of ``pairs`` whose input may take its new value in place: not an input
    sharing memory with another, nor one returned as it was, as the step's result or as
    another state's new value (it must keep its value), nor one whose output has another
    shape, dtype or device."""
    if not pairs:
        return ()
    inputs_of = placeholders(gm)
    outs = output_values(gm.graph.output_node())
    shared = Counter(p for t in inputs if isinstance(t, torch.Tensor) for p in _storages(t))
    donated = {j for _, j in pairs}
    returned = {_viewed_input(o) for j, o in enumerate(outs) if j not in donated}
    # another state's new value that is this input (NOTE: [state written as another
    # state's value]: the capture copies it; kept here should a later stage not)
    returned |= {v for i, j in pairs if (v := _viewed_input(outs[j])) is not inputs_of[i]}
    kept = []
    for i, j in pairs:
        t, value = inputs[i], outs[j]
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        if (
            isinstance(val, torch.Tensor)
            and all(shared[p] == 1 for p in _storages(t))
            and inputs_of[i] not in returned
            and (tuple(val.shape), val.dtype, val.device) == (tuple(t.shape), t.dtype, t.device)
        ):
            kept.append((i, j))
    return tuple(kept)


def donate(gm: torch.fx.GraphModule, pairs: Pairs, inputs: Sequence[torch.Tensor]) -> Pairs:
    """Rewrite ``gm`` to copy each donated state's new value into its input and drop it
    from the outputs; returns the pairs kept (``donatable``)."""
    kept = donatable(gm, pairs, inputs)
    if not kept:
        return ()
    graph = gm.graph
    inputs_of = placeholders(gm)
    output = graph.output_node()
    outs = output_values(output)
    for i, j in kept:
        if outs[j] is not inputs_of[i]:
            with graph.inserting_before(output):
                graph.call_function(torch.ops.aten.copy_.default, (inputs_of[i], outs[j]))
    return _drop_donated_outputs(gm, outs, kept)


def _drop_donated_outputs(gm: torch.fx.GraphModule, outs: list[Any], kept: Pairs) -> Pairs:
    """``gm`` without the outputs of ``kept`` (their inputs now hold them), recompiled."""
    dropped = {j for _, j in kept}
    set_outputs(gm, [o for j, o in enumerate(outs) if j not in dropped])
    gm.graph.lint()
    gm.recompile()
    return kept


class StateWrites(torch.nn.Module):
    """Called by an interpreted program just before its first in-place state update: a
    step that fails before then leaves the state as it was (NOTE: [interpreted programs
    update state in place]). ``hook``, when the runtime sets it for a call, runs first:
    the ranks' status exchange of NOTE: [a rank whose program fails alone], which raises
    on every rank, before any write, when a rank's program failed."""

    began = False
    hook: Callable[[], None] | None = None

    def forward(self) -> None:
        if self.hook is not None:
            self.hook()
        self.began = True


class StatusIssue(torch.nn.Module):
    """Called by an interpreted program right after it issues its last collective: where
    the runtime issues the ranks' status round, whose wait ``StateWrites`` (or the end of
    the program) makes, so that its latency overlaps the last collective's (NOTE: [a rank
    whose program fails alone] in ``runtime/rank_failures.py``)."""

    hook: Callable[[], None] | None = None

    def forward(self) -> None:
        if self.hook is not None:
            self.hook()


class StatusRider(torch.nn.Module):
    """The rank's status as one more element of the program's last all-reduce (a sum):
    0 for a rank whose program runs (NOTE: [a rank whose program fails alone])."""

    hook: Callable[[], None] | None = None

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.dtype, self.device = dtype, device

    def forward(self) -> torch.Tensor:
        if self.hook is not None:
            self.hook()
        return torch.zeros(1, dtype=self.dtype, device=self.device)


class StatusCheck(torch.nn.Module):
    """Reads the summed status element after the last all-reduce (``StatusRider``)."""

    hook: Callable[[torch.Tensor], None] | None = None

    def forward(self, summed: torch.Tensor) -> None:
        if self.hook is not None:
            self.hook(summed)


def _rides_on(last: torch.fx.Node | None) -> torch.fx.Node | None:
    """The bucket of ``last`` that the status may ride on (``insert_status``), or None."""
    if last is None or last.target is not ALL_REDUCE or last.args[1] != "sum" or wait_of(last) is None:
        return None
    bucket = last.args[0]
    if not isinstance(bucket, torch.fx.Node) or bucket.target is not torch.ops.aten.cat.default:
        return None
    val = bucket.meta.get("val")
    parts = bucket.args[0]
    if (
        not isinstance(val, torch.Tensor) or val.dim() != 1 or val.dtype not in _RIDES
        or val.device.type != "cpu" or len(bucket.users) != 1 or bucket.args[1:] not in ((), (0,))
        or not isinstance(parts, (list, tuple))
    ):
        return None
    for part in parts:
        meta = part.meta.get("val") if isinstance(part, torch.fx.Node) else None
        if not isinstance(meta, torch.Tensor) or meta.dim() != 1 or meta.dtype != val.dtype:
            return None
    return bucket


STATUS = "status_issue"  # the submodules' names in an interpreted program on real ranks
STATUS_RIDER = "status_rider"
STATUS_CHECK = "status_check"
_RIDES = (torch.float32, torch.float64)  # sums of 0s and 1s exact for any world size


def insert_status(gm: torch.fx.GraphModule) -> tuple[StatusIssue | None, StatusRider | None, StatusCheck | None]:
    """Make ``gm`` carry the ranks' status (NOTE: [a rank whose program fails alone] in
    ``runtime/rank_failures.py``): where its last collective is a sum all-reduce of a
    float32 or float64 bucket on the CPU (a ``cat`` of flat tensors, made for it alone:
    data parallelism's gradient bucket), as one more element of that bucket
    (``StatusRider``, read by ``StatusCheck`` after its wait); else a ``StatusIssue``
    call right after its last collective (after its inputs when it has none), where the
    runtime issues a round of its own. Returns the modules added."""
    graph = gm.graph
    nodes = list(graph.nodes)
    last = next((n for n in reversed(nodes) if is_collective(n)), None)
    bucket = _rides_on(last)
    if last is not None and bucket is not None:
        wait = wait_of(last)
        assert wait is not None
        val = bucket.meta["val"]
        rider, check = StatusRider(val.dtype, val.device), StatusCheck()
        gm.add_submodule(STATUS_RIDER, rider)
        gm.add_submodule(STATUS_CHECK, check)
        with graph.inserting_before(bucket):
            status = graph.call_module(STATUS_RIDER, ())
        bucket.update_arg(0, [*bucket.args[0], status])  # type: ignore[misc]
        del bucket.meta["val"]  # one longer now: a rank that fails evaluates it
        aten = torch.ops.aten
        with graph.inserting_after(wait):
            value = graph.call_function(aten.narrow.default, (wait, 0, 0, val.numel()))
        with graph.inserting_after(value):
            summed = graph.call_function(aten.select.int, (wait, 0, val.numel()))
        with graph.inserting_after(summed):
            graph.call_module(STATUS_CHECK, (summed,))
        wait.replace_all_uses_with(value, delete_user_cb=lambda user: user not in (value, summed))
        gm.recompile()
        return None, rider, check
    if last is None:
        last = next((n for n in reversed(nodes) if n.op == "placeholder"), None)
    module = StatusIssue()
    gm.add_submodule(STATUS, module)
    if last is None:
        with graph.inserting_before(nodes[0]):
            graph.call_module(STATUS, ())
    else:
        with graph.inserting_after(last):
            graph.call_module(STATUS, ())
    gm.recompile()
    return module, None, None


WRITES = "state_writes"  # the submodule's name in a program donate_in_order rewrote
DONATION_COPY = "donation_copy"  # node meta: a copy donate_in_order placed


def donate_in_order(
    gm: torch.fx.GraphModule,
    pairs: Pairs,
    inputs: Sequence[torch.Tensor],
) -> Pairs:
    """Rewrite ``gm``, a program run op by op (the interpreter), to update the donated
    state in place as early as it may (NOTE: [interpreted programs update state in
    place]); returns the pairs kept (``donatable``, less a new value that is a view of an
    input). A ``StateWrites`` submodule named ``WRITES`` is called before the first copy.

    Each new value is copied into its input right after the latest of: the value, the
    last node reading the old one (through views and getitems; no other input shares its
    memory, ``donatable``), and the program's last collective or wait. Nodes after the
    copy that read the new value read the input instead, so the value dies there; the
    value leaves the outputs."""
    graph = gm.graph
    output = graph.output_node()
    outs = output_values(output)
    kept = tuple((i, j) for i, j in donatable(gm, pairs, inputs) if _viewed_input(outs[j]) is None)
    if not kept:
        return ()
    inputs_of = placeholders(gm)
    order: dict[torch.fx.Node, float] = {n: k for k, n in enumerate(graph.nodes)}
    communication = [n for n in graph.nodes if is_collective(n) or is_wait(n)]
    copies = []
    for i, j in kept:
        old, new = inputs_of[i], outs[j]
        readers = [u for v in aliases_of(old) for u in v.users if u is not output]
        after = max([new, *readers, *communication[-1:]], key=order.__getitem__)
        with graph.inserting_after(after):
            copy = graph.call_function(torch.ops.aten.copy_.default, (old, new))
        copy.meta[DONATION_COPY] = True
        copies.append(copy)
        # its position: between ``after`` and the node that followed it (not counted
        # again for every pair: that made this quadratic in the program's size)
        order[copy] = (order[after] + order[copy.next]) / 2
        for user in list(new.users):
            if user is copy or user is output or order.get(user, -1) <= order[after]:
                continue
            if may_return_alias(user):
                continue  # a view of the new value stays one of the value, not the state
            user.replace_input_with(new, copy)
    gm.add_submodule(WRITES, StateWrites())
    with graph.inserting_before(min(copies, key=order.__getitem__)):
        graph.call_module(WRITES, ())
    return _drop_donated_outputs(gm, outs, kept)


# ops that move no arithmetic: Inductor removes them as no-ops (``remove_noop_ops``) where
# their result is not a graph output, so a ``copy_`` of one into an input reads its source
_PLAIN_COPIES = frozenset({
    torch.ops.aten.clone.default, torch.ops.aten.alias.default,
    torch.ops.aten._to_copy.default, torch.ops.aten.copy.default,
})


def not_copies_of_inputs(gm: torch.fx.GraphModule, pairs: Pairs) -> Pairs:
    """The pairs whose new value is not a plain copy of another input (NOTE: [state
    donation]; a hard target update, NOTE: [state written as another state's value]):
    Inductor turns ``copy_(t, clone(w))`` into ``copy_(t, w)``, placed after ``w``'s own
    update, and ``t`` took ``w``'s new value (2 gloo ranks: 2.46e-2 off after one call).
    Left out of the donation, ``t``'s copy is an output of its own."""
    inputs_of = placeholders(gm)
    outs = output_values(gm.graph.output_node())
    kept = []
    for i, j in pairs:
        value = outs[j]
        while isinstance(value, torch.fx.Node) and value.op == "call_function" and (
            value.target in _PLAIN_COPIES or returns_alias(value)
        ):
            value = value.args[1] if value.target is torch.ops.aten.copy.default else value.args[0]
        if not (isinstance(value, torch.fx.Node) and value.op == "placeholder" and value is not inputs_of[i]):
            kept.append((i, j))
    return tuple(kept)


def not_read_by(
    gm: torch.fx.GraphModule, pairs: Pairs, calls_out: Callable[[object], bool]
) -> Pairs:
    """The pairs whose input no node calling out of the compiled code reads, directly or
    through views (``calls_out(target)``; torch 2.11, NOTE: [state donation])."""
    inputs_of = placeholders(gm)
    return tuple((i, j) for i, j in pairs if not _read_by(inputs_of[i], calls_out))


def _read_by(node: torch.fx.Node, calls_out: Callable[[object], bool]) -> bool:
    for user in node.users:
        if user.op == "output":
            continue
        if _is_view_of(user, node):
            if _read_by(user, calls_out):
                return True
        elif user.op != "call_function" or calls_out(user.target):
            return True
    return False


def _is_view_of(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether ``user`` returns an alias of ``node`` (a view, or one piece of a split)."""
    return user.target is operator.getitem or (returns_alias(user) and user.args[0] is node)


def _viewed_input(value: object) -> torch.fx.Node | None:
    """The placeholder ``value`` is, or is a view of (through ops returning an alias)."""
    while isinstance(value, torch.fx.Node) and value.op == "call_function":
        if not returns_alias(value):
            return None
        value = value.args[0]
    return value if isinstance(value, torch.fx.Node) and value.op == "placeholder" else None


class Donating:
    """Call a program compiled after ``donate`` and put each donated input back among its
    outputs, where the new value was (NOTE: [state donation])."""

    def __init__(self, inner: Callable[..., Sequence[torch.Tensor]], pairs: Pairs, outputs: int) -> None:
        self.inner = inner
        self.input_of = {j: i for i, j in pairs}
        self.outputs = outputs

    def __call__(self, *inputs: Any) -> list[torch.Tensor]:
        return self.restore(self.inner(*inputs), inputs)

    def restore(self, outs: Sequence[torch.Tensor], inputs: Sequence[Any]) -> list[torch.Tensor]:
        """The whole output list from the compiled program's outputs and its inputs."""
        rest = iter(outs)
        return [
            inputs[self.input_of[j]] if j in self.input_of else next(rest)
            for j in range(self.outputs)
        ]
