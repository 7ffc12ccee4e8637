"""Every rank passes tensor arguments of the same shapes and dtypes, checked every call in
one round that also carries the program's leading all-reduces.

NOTE: [same inputs on all ranks]
The per-rank program is one program for all ranks: a rank whose local batch has another
shape runs (or compiles) another program, and the two then wait in different collectives
until the collective timeout (on gloo, one aborts the process when the sizes differ). So
every call makes one round before its program issues any collective: a sum all-reduce of
a few float64 values carrying a 48-bit digest of the rank's tensor arguments' shapes and
dtypes (``InputAgreement``). A call that compiles makes one more round before it
compiles, marked pending: a rank whose program is cached and a rank that compiles meet
there, and the cached rank sends its round again until the other is ready to run. Only
when the digests disagree do the ranks exchange their descriptions (an all-gather of
bytes) and raise, every rank the same error naming each rank's shapes. Tensor collectives
only (object collectives need numpy). On NCCL the round runs on a CPU (gloo) side group,
so it never waits for the GPU. Every round opens with a header of the same size on every
rank naming the step (NOTE: [every rank in the same step's round]).

The round also carries what the program can reduce before it runs, and the program
computes what needs no collective while the round is in flight (NOTE: [reductions that
ride the input check] in ``leading_reductions.py``).

NOTE: [a rank that fails before its program]
A rank whose call fails after its pending round and before its program's round (its
capture raised: a flag of that rank's own sent the step to a ``raise``) left its peers
waiting in their round, which carries no call number: the peers' next round met the
failed rank's next call's, and a rank whose program was cached ran it on its own batch
of this call and the other rank's of the next, with no error (2 gloo ranks: rank 0
returned the loss of half of batch 3 and half of batch 4, and the ranks stayed a call
apart). So a call that fails on a rank while it still owes its peers this call's round
(``InputAgreement.fail``) sends it marked failed, and every rank whose round meets one
so marked gathers each rank's failure (an all-gather of its first line, on this error
path only) and raises, naming the ranks that failed and how, before its program runs:
the ranks stay in step and the next call runs on both. A round's one more slot is the
only cost. A failure once this rank's program round is settled (its program's own
collectives) is ``NOTE: [fault attribution]``'s.
A call that places state (the first call: ``distribute_tensor`` broadcasts every
replicated parameter from rank 0) issues collectives before its program's round: a rank
whose first capture raised sent its failed round while its peer waited in the first
parameter's broadcast, and both hung until the collective timeout (gloo's 30 minutes
under torchrun; a later call's failure was handled). So such a call makes one more
round before it places anything (``before_install``): it waits, as the program's round
does, until no rank compiles, and meets a failed round there; the program's round is
still owed after it.

NOTE: [constants agree across ranks]
A tensor the step reads from outside its arguments is a constant of the program, the
same on every rank by design (NOTE: [tensors read from outside the arguments]). On real
ranks nothing made it so: a batch passed inside an object the step's arguments do not
open (a plain class instance holding ``x`` and ``y``, NOTE: [batch containers]) was each
rank's local batch read as a replicated constant, so every rank trained on its own
shard alone and the ranks drifted apart (2 gloo ranks, 3 SGD steps: 31% off one device,
no error). So the round's second digest also covers each constant's value: a checksum
of its bytes (a BLAKE2b digest, computed once per program: a constant
cannot change without a guard compiling a new program, its bytes compared every call:
NOTE: [constants changed through shared memory]). When the ranks' constants
differ, every rank raises the same error naming each rank's constants, before any
collective of the program and before anything is updated.

NOTE: [Python values agree across ranks]
A Python value the step reads from outside its arguments (``model.loss_scale``, a
global, a closure's setting) is baked into the program (NOTE: [guards on Python
values]). Set per rank (from a per-rank config), each rank compiled its own program, and
nothing compared them: the programs send the same with the round, so the check for
"different programs" above passed, and 2 gloo ranks with ``loss_scale`` 1.0 and 2.0
trained on the mean of the two scaled losses' gradients with no error (ddp and fsdp:
loss 2.0215 on both ranks, which neither scale gives). So the round's second digest also
covers a digest of the captured step as traced (``captured_step_text``: each node's op
and the Python values it was given, taken once per program): ranks whose Python values
made them trace different steps differ there. A value that differs per rank but leaves
the trace alone (a ``f"[rank {r}]"`` prefix of a log line, an ``is_main`` flag guarding a
print) changes no node and is not refused (a first version digested every value the
guards hold and refused such steps). When the digest differs, the ranks gather the
values their guards hold (``Guards.across_ranks``, on this error path only) and every
rank raises the same error, naming each value that differs and each rank's value, before
any collective of the program and before anything is updated. Environment variables and
devices are left out of that list (launchers set them per rank by design); learning
rates are graph inputs (NOTE: [hyper-parameters without a device sync]), not traced
values.

NOTE: [the traced step as captured]
The digest above must be taken of the same graph on every rank, but the captured graph a
program holds was not: the pipeline rewrites it in place (fully_shard pads a parameter
whose rows do not divide by the world size, ``padding.pad_uneven_state``, adding a
``constant_pad_nd`` per gradient and a ``slice`` per read), so the rank that compiled
held the padded graph, while a rank that received the program through the store or
loaded it from disk holds its own capture, unpadded. Every first job with a cache
directory and an uneven parameter failed on both ranks ("the ranks traced different
train steps", 2 gloo ranks, fsdp with a ``Linear(32, 5)``). So the compiling rank
takes the text before the pipeline runs (``traced_text``, kept on the captured step).
A step entry holds the graph as the program key encoded it, before the pipeline
(``compile_cache.encoded_graph`` keeps that encoding), so a restart that skips the
capture computes the text of the capture too, whichever rank wrote the entry.

NOTE: [generators agree across ranks]
A program's random draws come from each rank's default generator (NOTE: [random numbers]
in ``capture/random_draws.py``: every rank draws the same full tensor and keeps its
slice), which holds only when the ranks' generators are in the same state. Seeded per
rank (``torch.manual_seed(seed + rank)``, as timm's ``random_seed(seed, rank)`` and many
DDP scripts do), each rank drew its own numbers: cleanrl's PPO update, whose
``torch.randperm(B)`` picks the minibatches, on 2 gloo ranks under replicate ran each
rank's own minibatches (losses [0.1331, 0.1235, 0.0874] on rank 0, [0.2857, 0.1166,
0.0785] on rank 1), the "replicated" weights were 0.0275 apart after 3 calls, and
``full_state_dict`` returned rank 0's copy, with no error. So a program that draws
(a random op in its captured graph) also sends, in the round's second digest, a
BLAKE2b digest of the state of each default generator it draws from (the CPU one, and
the device's for draws on CUDA: ``torch.cuda.get_rng_state`` reads the seed and
offset on the host, no GPU sync), taken every call just before the round: no new
collective. Ranks whose generators start alike stay alike (every rank draws the same
global shapes from them), so the check does not fire after the first call. When they
differ, every rank raises the same error before its program runs: nothing is updated
and nothing is drawn. Programs that draw nothing send nothing more and pay nothing.
Under data parallelism (the batch split over every mesh dimension), forward's
element-wise draws (dropout, drop-path, noise on activations) need no agreement: each
rank keeps its slice of a batch-shaped draw, and slices of the ranks' own draws are an
equally good draw; they are left out, so timm's per-rank seeds with dropout still train
(a first version refused them). Left out is a draw the per-rank program only slices: its
every use, through replicated values computed from it alone, is the redistribution's
``slice`` on every mesh dimension (``_sliced_per_rank``, read on the expanded graph,
whose nodes name their captured node in ``ORIGIN``). Until the fifty-eighth session every
forward ``rand`` / ``randn`` / ``normal`` was left out by op name: a 0-d mixup weight, a
``torch.randn(1, D)`` shift or noise on a replicated weight, read whole by every rank,
trained each rank with its own value (losses of no single-device run), and a LayerDrop
coin was refused as Python values that differ instead of as generators. Permutations, index draws (``randint``,
``multinomial``) and any draw in backward or the optimizer (noise on gradients or
parameters, which replicated state would take apart) are checked; under tensor
parallelism every draw is, since the tp ranks of one batch compute one value.

NOTE: [inputs every rank passes whole]
A tensor argument the mode places Replicate on every mesh dimension (a 0-d tensor, or
one ``input_batch_dim`` names None: class weights, a table; NOTE: [inputs by name] in
``parallel_modes/batch_dims.py``) is one value the program reads on every rank as the
same. A rank passing another value would train on it without an error, so the round's
first digest also covers these arguments' values, by the checksum the constants use:
ranks that pass different values get the disagreement error before any collective of the
program. Every argument on the step's first call; on later calls 0-d tensors, and
whole arguments of at most 16 KiB where the mode splits the batch otherwise (a checksum
costs a pass over the bytes: under tensor parallel every argument, the batch too, is
whole by design, so a TP batch is checked on the first call only; that call catches
ranks given their own data shards, as a sampler over every rank would). CPU tensors
only: a CUDA tensor's checksum would wait for the GPU; on CUDA such arguments are
trusted to agree.
The step's Python numbers, flags and strings are such values too: a float argument
feeds the program on every call and an int or a flag is a constant of it, each read as
one value on every rank. Two ranks passing their own scale, 1.0 and 2.0, trained on the
mean of two differently scaled losses with no error; the round's digest covers them.

NOTE: [the same share on every rank]
The other way round, an argument that holds no batch but that the mode splits (nobody
named it None in ``input_batch_dim``) is read on real ranks as one rank's share of a
tensor ``world`` times longer: class weights ``w`` of 3 classes became 6 on 2 ranks, and
``w / w.sum()`` came out halved, loss and gradients half of one device's, with no error
(in simulation, where the user passes the global value, it was right). Nothing in one
call tells such an argument from a batch, but the first call of a step on real ranks
makes one more round (``warn_on_same_shares``): for each split argument, whether every
rank passed the same values, and whether its share's slices along the split dimension
differ from each other. An argument that is the same on every rank but not the same
slice repeated (as a mask of ones or the rows of ``position_ids`` are) is no batch a data
loader would give, so the ranks warn, naming it and the ``input_batch_dim`` entry that
passes it whole. A warning, not an error: a test may give every rank the same batch.
CUDA arguments too: the checksum copies them to the host once per step object.

NOTE: [tp peers pass one batch slice]
An argument the mode splits on some mesh dimensions and passes whole on the others (the
batch under fsdp_tp: S(0) on dp, R on tp) is one slice per dp group, read as the same by
the group's ranks (the tp peers, which split the model, not the batch). Nothing compared
them: 4 gloo ranks on a (2, 2) mesh, each passing its own quarter of the global batch (as
a DistributedSampler over all ranks gives), trained 3 AdamW steps with no error and
ended 1.56 relative off one device. So the first call's round of NOTE: [the same share
on every rank] also carries, for each such argument (``peer_batches``), the checksum
digest of its value in a slot per dp group (a 48-bit digest as three 16-bit parts, each
with its square): a group's ranks passed the same value exactly when its slot's
variance, n * sum(h * h) - sum(h) ** 2 over its n ranks, is 0 (exact in float64 for up
to 2**10 peers), which every rank reads off the same sums, so every rank raises the
error, naming the argument and the ranks of each dp group that differ, before anything
is compiled or updated. On the first call only, as the tensor-parallel batch of NOTE:
[inputs every rank passes whole]: a checksum is a pass over the batch's bytes, and that
call catches a sampler over every rank; later calls cost nothing more.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate

from .. import _torch_private as private
from .._torch_private import pytree
from ..capture.guards import DEVICE_NAME
from ..errors import SPMDCompileError, SPMDRuntimeError, collective_failure, exception_summary
from ..ir.node_meta import ORIGIN, PLACEMENT, Phase, phase
from ..ir.signature import CapturedStep
from ..leading_reductions import MAX_SLOTS, NOTHING_SENT
from .faults import attribution

# One gloo side group per default group, for NCCL jobs (see NOTE above).
_CPU_GROUPS: dict[int, Any] = {}


def describe_inputs(tensor_args: Sequence[torch.Tensor]) -> str:
    """``(4, 8) float32, (4,) int64``: what the digest is taken of."""
    parts = [
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" for t in tensor_args
    ]
    return ", ".join(parts) or "no tensors"


@functools.lru_cache(maxsize=256)
def _parts_of(text: str) -> tuple[int, ...]:
    """The parts a round sends of ``text``'s digest (cached: the same texts come back every
    call)."""
    return tuple(_parts(_digest(text)))


_PENDING = " | deferred update pending: "  # NOTE: [a flush on some ranks only]
_CONSTANTS = " | constants: "  # where a round's description of what it sends names its constants


_VALUES = " | Python values read: "  # after the constants: the digest of the values read
_GENERATORS = " | random-number generators: "  # last: NOTE: [generators agree across ranks]


# draws of independent elements (a dropout mask, noise): on a value split over every rank,
# each rank keeps its slice of a draw, and slices of the ranks' own draws are as good a
# draw (NOTE: [generators agree across ranks])
_ELEMENTWISE_DRAWS = frozenset({
    "bernoulli", "native_dropout", "rand", "randn", "rand_like", "randn_like", "uniform",
    "normal", "exponential", "cauchy", "log_normal", "geometric", "poisson",
})


def _sliced_per_rank(draw: torch.fx.Node, mesh_ndim: int) -> bool:
    """Whether every use of the per-rank program's ``draw`` (and of the replicated values
    computed from it alone) is a slice on every mesh dimension that the program's
    redistribution made: each rank keeps its own part of the draw and no rank reads the
    whole (a 0-d mixup weight, a row of noise added to a batch, noise on a replicated
    weight are read whole). NOTE: [generators agree across ranks]."""
    seen: set[torch.fx.Node] = set()
    todo = [draw]
    while todo:
        node = todo.pop()
        for user in node.users:
            if user in seen:
                continue
            seen.add(user)
            placements = user.meta.get(PLACEMENT)
            if placements is not None:
                if not all(isinstance(p, Replicate) for p in placements):
                    return False  # a sharded value computed from the whole draw
                todo.append(user)  # still replicated: computed from the draw alone
                continue
            slices, at = 0, user
            while at.op == "call_function" and at.target in _SLICES and at.meta.get(PLACEMENT) is None:
                slices += at.target is torch.ops.aten.slice.Tensor
                users = list(at.users)
                if len(users) != 1 or slices >= mesh_ndim:
                    break
                at = users[0]
            if slices < mesh_ndim:
                return False  # read whole (a graph output, a collective) or sliced on fewer dims
    return True


_SLICES = (torch.ops.aten.slice.Tensor, torch.ops.aten.clone.default)


def drawn_devices(
    gm: torch.fx.GraphModule, batch_split_everywhere: bool = False,
    program: torch.fx.GraphModule | None = None, mesh_ndim: int = 1,
) -> tuple[str, ...]:
    """The device types whose default generator the graph's random ops draw from, of the
    draws whose numbers the ranks must agree on (NOTE: [generators agree across ranks]);
    empty when there are none. ``batch_split_everywhere``: the mode splits the batch over
    every mesh dimension (data parallel), where forward's element-wise draws (dropout)
    that the per-rank ``program`` (over ``mesh_ndim`` dimensions) only slices per rank
    need no agreement."""
    devices: set[str] = set()
    expanded: dict[str, list[torch.fx.Node]] = {}
    if program is not None:
        for node in program.graph.nodes:
            if node.op == "call_function" and private.random_op(node.target) and ORIGIN in node.meta:
                expanded.setdefault(node.meta[ORIGIN], []).append(node)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not private.random_op(node.target):
            continue
        per_rank = expanded.get(node.name, [])
        if (
            batch_split_everywhere
            and phase(node) is Phase.FORWARD
            and node.target._opname.rstrip("_") in _ELEMENTWISE_DRAWS  # type: ignore[union-attr]
            and per_rank
            and all(_sliced_per_rank(d, mesh_ndim) for d in per_rank)
        ):
            continue
        val = node.meta.get("val")
        device = val.device if isinstance(val, torch.Tensor) else node.kwargs.get("device")
        devices.add(torch.device(device).type if device is not None else "cpu")
    return tuple(sorted(devices))


def describe_generators(devices: Sequence[str]) -> str:
    """A digest of the state of each default generator in ``devices`` (``drawn_devices``;
    CUDA's of the current device, the rank's): NOTE: [generators agree across ranks]."""
    parts = []
    for kind in devices:
        if kind == "cpu":
            state = torch.get_rng_state()
        elif kind == "cuda":
            state = torch.cuda.get_rng_state()
        else:  # another accelerator's generator: not compared
            continue
        parts.append(f"{kind} {_checksum(state).rpartition(' ')[2]}")
    return ", ".join(parts)


def describe_values_read(values: Sequence[tuple[str, str]]) -> str:
    """The text of the values a program's guards hold (``Guards.across_ranks``): NOTE:
    [Python values agree across ranks]."""
    return "\n".join(f"{name}\t{value}" for name, value in values)


def values_digest(text: str) -> str:
    """What the round's second digest covers of ``captured_step_text``'s text."""
    return _VALUES + hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def captured_step_text(graph: torch.fx.Graph) -> str:
    """The Python values the captured step's live ops were given, as a text the same in
    every process (NOTE: [Python values agree across ranks]): one line per distinct
    ``op(values)``, node arguments written ``%``, sorted. Only the values count: a program
    loaded from the compile cache holds its captured graph in another node order, with a
    dead duplicate dropped (a rank that compiled and one that loaded differed, CI found),
    and a node-only line carries no Python value. A device is written by its type (each
    rank holds its own GPU: ``cuda:1`` on rank 1 made every multi-GPU job differ, the
    second review found)."""

    def literal(value: Any) -> str:
        if isinstance(value, torch.fx.Node):
            return "%"
        if isinstance(value, torch.device):  # each rank's own GPU: its type only
            return repr(value.type)
        if isinstance(value, str) and DEVICE_NAME.fullmatch(value):
            return repr(value.partition(":")[0])
        if isinstance(value, (list, tuple)):
            return "(" + ",".join(literal(v) for v in value) + ")"
        if isinstance(value, dict):
            return "{" + ",".join(f"{k}:{literal(v)}" for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))) + "}"
        if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.layout,
                                                torch.memory_format)):
            return repr(value)
        return type(value).__name__  # an object of one process (its repr may hold an address)

    live: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op == "output" or node.is_impure() or any(user in live for user in node.users):
            live.add(node)
    lines = set()
    for node in graph.nodes:
        if node not in live or node.op != "call_function":
            continue
        values = [v for v in pytree.tree_leaves((node.args, node.kwargs)) if not isinstance(v, torch.fx.Node)]
        if not values:
            continue  # no Python value: nothing a rank could set apart
        target = getattr(node.target, "__name__", type(node.target).__name__)
        lines.add(f"{target} {literal(node.args)} {literal(node.kwargs)}")
    return "\n".join(sorted(lines))


def traced_text(captured: CapturedStep) -> str:
    """``captured_step_text`` of ``captured``'s graph as captured: taken on the first
    call, which the compiling rank makes before the pipeline rewrites the graph in place
    (NOTE: [the traced step as captured]), and kept."""
    if captured.traced_text is None:
        captured.traced_text = captured_step_text(captured.graph_module.graph)
    return captured.traced_text


def describe_constants(outside: Sequence[Any]) -> str:
    """Each program constant's label, shape, dtype and a checksum of its bytes (NOTE:
    [constants agree across ranks]); tensor ops only (no numpy)."""
    return "; ".join(f"{constant.label} {_checksum(constant.tensor)}" for constant in outside)


WHOLE_CHECK_BYTES = 1 << 14  # a whole argument at most this large is checked every call


def checks_whole_values(t: torch.Tensor, first_call: bool, batch_split: bool) -> bool:
    """Whether the round compares the values of ``t``, an argument every rank passes
    whole (NOTE: [inputs every rank passes whole]): on the step's first call always; on
    later calls a 0-d tensor, and one of at most ``WHOLE_CHECK_BYTES`` where the mode
    splits the step's batch otherwise (so this one was named whole). A CUDA tensor never
    (its checksum would wait for the GPU)."""
    if t.device.type != "cpu":
        return False
    if first_call or t.dim() == 0:
        return True
    return batch_split and t.numel() * t.element_size() <= WHOLE_CHECK_BYTES


_WHOLE = " | values of the arguments passed whole: "
_SCALARS = " | Python values: "


def _sections(description: str) -> tuple[str, str, str]:
    """A round's description cut into its shapes, its whole arguments' checksums and its
    Python values."""
    rest, _, scalars = description.partition(_SCALARS)
    shapes, _, whole = rest.partition(_WHOLE)
    return shapes, whole, scalars


_SHAPE = re.compile(r"\(([\d, ]*)\) (\w+)")

# NOTE: [batches padded per rank]: the usual cause of local batches that differ in a
# sequence length alone (one rank's (4, 5), another's (4, 7)) is a collator padding each
# rank's batch to its own longest sequence (transformers' DataCollatorWithPadding), which
# the hint for uneven batches ("split the global batch evenly") did not name.
_PADDED_PER_RANK = (
    "; here the ranks' batches have the same rows and differ in a length, as when a "
    "collator pads each rank to its own longest sequence: pad every rank to one length "
    "(`padding=\"max_length\"` with a fixed max_length, or each batch's longest over "
    "all ranks, found by an all_reduce with MAX before padding); padding to a multiple "
    "(`pad_to_multiple_of=`) alone leaves ranks whose longest fall in different multiples apart"
)


def _only_lengths_differ(shapes: list[str]) -> bool:
    """Whether the ranks' tensor arguments (``_sections``' shapes, ``(4, 5) int64, ...``)
    have the same count, ranks, dtypes and first dimensions, and differ in a later
    dimension: NOTE: [batches padded per rank]."""
    parsed = [[(tuple(int(d) for d in dims.split(",") if d.strip()), dtype) for dims, dtype in _SHAPE.findall(text)]
              for text in shapes]
    if not parsed or len({len(p) for p in parsed}) != 1:
        return False
    differ = False
    for same_argument in zip(*parsed, strict=True):
        if len({(len(dims), dims[:1], dtype) for dims, dtype in same_argument}) != 1:
            return False
        differ = differ or len({dims for dims, _ in same_argument}) > 1
    return differ


def _checksum(t: torch.Tensor) -> str:
    """``(3,) float32 checksum 9f0c...``: a BLAKE2b digest of the bytes of ``t``, read in
    place (hashlib releases the GIL): 0.2 ms for 64 KiB on a loaded 2-core machine, where
    the sum and position-weighted sum of the bytes as int64 tensors it replaced took
    2.2 ms."""
    t = t.detach().cpu().resolve_conj().resolve_neg().contiguous()
    nbytes = t.numel() * t.element_size()
    data = (ctypes.c_char * nbytes).from_address(t.data_ptr()) if nbytes else b""
    digest = hashlib.blake2b(data, digest_size=8).hexdigest()
    return f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} checksum {digest}"


def _digest(description: str) -> int:
    return int.from_bytes(hashlib.blake2b(description.encode(), digest_size=6).digest(), "big")


def _cpu_group() -> Any:
    """The default group when it is gloo, else a gloo group over the same ranks."""
    if dist.get_backend() == "gloo":
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


_RANK_NAMES = re.compile(r"(?:^|_)rank$|^rank_id$|^(?:local_|global_)?process_index$|^shard_(?:id|index)$")
# ranks of a matrix factorization, not of a process (LoRA's ``lora_rank``, ``low_rank``)
_MATRIX_RANKS = re.compile(r"lora|low_rank|adapter|factor|tucker|svd|kron")
# how a guard labels a value (``capture/guards.py``): ``global local_rank (read by step
# (/x/p.py:3))``, ``closure value rank (of ...)``, ``attribute local_rank of argument cfg
# of the step``, ``attribute 'rank' of ...``, ``module 1.<root>.rank``, ``argument rank of the
# step``, ``default of rank (of ...)``
_LABEL_NAME = re.compile(r"^(?:attribute|argument|default of|global|closure value|module)\s+(\S+)")


def _value_name(label: str) -> str:
    """The variable or attribute name a guard's label holds (the last dotted part of its
    path), without the label's words and trailing ``(read by ...)`` / ``(of ...)``."""
    found = _LABEL_NAME.match(label.strip())
    path = found.group(1) if found else label.strip().split(" (", 1)[0]
    parts = [part for part in re.split(r"[.\[\]'\"]+", path) if part]
    return parts[-1] if parts else path


def values_differ_hint(differ: Sequence[str], everyone: Sequence[dict[str, str]]) -> str:
    """What to do where the ranks read the Python values ``differ`` differently
    (``everyone``: each rank's values as shown). A value named like the rank itself
    (``rank``, ``*_rank``, ``local_rank``, ``rank_id``, ``process_index``, ``shard_id``; not
    a matrix rank such as ``lora_rank``) that is an integer on every rank is told apart:
    open_clip's ``ClipLoss(rank=dist.get_rank(), world_size=...)``. The step is computed
    as one device, so it is rank 0 of a world of one (NOTE: [torch.distributed inside the
    step]); "a local count goes in a tensor argument" misled there (sixty-second
    session). The name is read off the guard's label (``global local_rank (read by
    ...)``): the last dotted piece of the whole label was matched before, which no real
    label's name is, and values 0 and 1 alone counted as a rank, which any per-rank count
    (``n_skipped``) also reads on 2 ranks (review of a2c1a1b)."""
    def rank_like(label: str) -> bool:
        name = _value_name(label).lower()
        if not _RANK_NAMES.search(name) or _MATRIX_RANKS.search(name):
            return False
        return all(re.fullmatch(r"-?\d+", values.get(label, "")) for values in everyone)

    ranks = [name for name in differ if rank_like(name)]
    common = ("set these the same on every rank (from one config, not a per-rank one); "
              "a value that is each rank's own (a local count) goes in a tensor argument "
              "split like the batch.")
    if not ranks:
        return common
    return (
        f"{', '.join(ranks)} {'looks' if len(ranks) == 1 else 'look'} like each rank's "
        "rank: inside a compiled step the code computes as one device on the global "
        "batch, rank 0 of a world of one (the mode inserts the collectives). Build the "
        "object with rank=0 and world_size=1 (a loss that gathers features over the ranks: "
        "open_clip's ClipLoss(rank=0, world_size=1)), or read dist.get_rank() / "
        "dist.get_world_size() inside the step, where they answer 0 and 1."
        + ("" if len(ranks) == len(differ) else " For the others: " + common)
    )


class InputAgreement:
    """The ranks' agreement on one call's inputs: every call on real ranks makes one round
    (a sum all-reduce of ``ROUND`` float64 values) before its program runs, and a call
    that compiles makes one more before it compiles. See NOTE: [same inputs on all ranks].

    A round carries: whether this rank still compiles before it runs (``pending``), the
    step's identity (NOTE: [every rank in the same step's round]), the digest of its
    inputs' shapes and dtypes, the digest of what its program sends along,
    and the program's values (NOTE: [reductions that ride the input check]). A 48-bit
    digest goes as three 16-bit parts, each sent with its square: the ranks sent the same
    part exactly when sum(h) == world * h and sum(h * h) == world * h * h hold on a rank
    (then the parts' variance is 0), which every rank reads off the same sums, so every
    rank decides the same way (float64 sums are exact below 2**53: 2**21 ranks).
    """

    def __init__(
        self, tensor_args: Sequence[torch.Tensor], whole: Sequence[tuple[str, torch.Tensor]] = (),
        scalars: Sequence[tuple[str, Any]] = (), step: str = "",
    ) -> None:
        """``whole``: the CPU tensor arguments every rank passes whole (Replicate), by
        label, whose values must agree too (NOTE: [inputs every rank passes whole]);
        ``scalars``: the step's Python number, bool and string arguments, by name, which
        must agree as well; ``step``: the compiled step's ``step_label``, whose identity
        the round's header carries (NOTE: [every rank in the same step's round])."""
        self.step = step
        self.step_parts = _step_parts(step, "call")
        self.scalars = list(scalars)
        self.description = describe_inputs(tensor_args)
        if whole:
            self.description += _WHOLE + "; ".join(f"{label} {_checksum(t)}" for label, t in whole)
        if scalars:
            self.description += _SCALARS + ", ".join(f"{name}={value!r}" for name, value in scalars)
        self.world = dist.get_world_size()
        self.group = _cpu_group()
        # the program's constants (``describe_constants``), set before it runs: NOTE:
        # [constants agree across ranks]
        self.constants = ""
        # the program's values read (``describe_values_read``), whose digest ends
        # ``constants``: NOTE: [Python values agree across ranks]
        self.values_read = ""
        # the digest of the generators the program draws from (``describe_generators``),
        # set each call before it runs: NOTE: [generators agree across ranks]
        self.generators = ""
        # whether this rank still owes its peers this call's round, and the round it has
        # in flight: NOTE: [a rank that fails before its program]
        self.owed = True
        self._flying: Round | None = None
        # whether the program runs on a deferred update of the last call (None: the
        # program defers nothing): NOTE: [a flush on some ranks only]
        self.pending_update: bool | None = None

    def step_call(self) -> str:
        """What this rank's round is, for the error of NOTE: [every rank in the same
        step's round]."""
        return self.step or "a compiled step"

    def before_compile(self) -> None:
        """The round of a rank about to compile: raise if the inputs disagree."""
        self.start(NOTHING_SENT, [], pending=True).finish()

    def before_install(self) -> None:
        """The round of a rank about to place state, whose broadcasts are collectives of
        their own: wait until no rank compiles, raise if a rank failed or the inputs
        disagree (NOTE: [a rank that fails before its program]). The program's round is
        still owed after it."""
        self.start(NOTHING_SENT, []).finish()
        self.owed = True

    def before_run(self, sends: str, values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The round of a rank about to run its program, which sends ``values`` (described
        by ``sends``); returns their sums over the ranks, each in its own dtype and shape."""
        return self.start(sends, values).finish()

    def fail(self, exc: BaseException) -> None:
        """This rank's call raised ``exc``: when it still owes its peers the call's round,
        send it marked failed, so that their call fails too, naming this rank, instead of
        meeting this rank's next call (NOTE: [a rank that fails before its program]).
        The caller raises ``exc`` afterwards."""
        if not self.owed or getattr(exc, "collective", False):  # a broken group: no round
            return
        flying, self._flying = self._flying, None
        try:
            if flying is not None:  # a round in flight (the program's early part raised)
                _collective(flying.work.wait, self.step)
                if self._read(flying) is not None:
                    return  # the peers run their programs: their collectives fail, named
            if not self.owed:
                return
            self.owed = False
            row = _header(self.step_parts, failed=True)
            buf = torch.tensor(row + [0.0] * (ROUND - len(row)), dtype=torch.float64)
            _collective(lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group), self.step)
            if not _header_agrees(buf.tolist(), self.step_parts, self.world):  # a peer in another step
                _raise_other_steps(self.step_call(), self.group, self.world)
            _all_descriptions(_failure_line(exc), self.group, self.world)
        except (SPMDCompileError, SPMDRuntimeError):
            pass  # the peers' errors (they failed too, or disagree): this rank raises its own

    def start_status(self, failure: str = "") -> StatusRound:
        """Issue the round of a call's end (``StatusRound.finish`` waits for it), made once
        the program has issued its last collective, waited for before it writes any state:
        ``failure`` is this rank's program's failure ("" when it ran). When any rank's
        failed, every rank raises ``RanksFailed`` naming them (NOTE: [a rank whose program
        fails alone] in ``rank_failures.py``)."""
        parts = _step_parts(self.step, "status")
        row = _header(parts, failed=bool(failure))
        buf = torch.tensor(row + [0.0] * (ROUND - len(row)), dtype=torch.float64)
        work = self._status_collective(
            lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        )
        return StatusRound(self, buf, work, parts, failure)

    def raise_failed(self, failure: str) -> None:
        """A rank's program failed (its status said so): gather each rank's failure
        (``failure``: this rank's, "" when its program ran) and raise ``RanksFailed``."""
        everyone = _all_descriptions(failure, self.group, self.world)
        raise RanksFailed([(rank, text) for rank, text in enumerate(everyone) if text])

    def exchange_status(self, failure: str = "") -> None:
        """``start_status``, then wait for it."""
        self.start_status(failure).finish()

    def _status_collective(self, call: Any) -> Any:
        try:
            return call()
        except Exception as exc:
            rank = dist.get_rank()
            raise collective_failure(
                f"The compiled step {self.step_call()} failed on rank {rank} while exchanging "
                "its status with the other ranks (the round every call makes after its "
                f"program's last collective, before any update): {exception_summary(exc)}. "
                f"{attribution(rank)} The model and optimizer hold the state of the last "
                "completed step."
            ) from exc

    def start(self, sends: str, values: Sequence[torch.Tensor], pending: bool = False) -> Round:
        """Issue this rank's round; ``Round.finish`` waits for it. The program may compute
        in between, as long as it issues no collective (NOTE: [reductions that ride the
        input check])."""
        resend = sends  # what a round sent again starts from: each part is added once
        if self.pending_update is not None and not pending:
            sends = f"{sends}{_PENDING}{self.pending_update}"
        if self.constants and not pending:
            sends = f"{sends}{_CONSTANTS}{self.constants}"
        if self.generators and not pending:  # last, and new every call: not cached
            sends = f"{sends}{_GENERATORS}{self.generators}"
        payload = [float(x) for v in values for x in v.detach().reshape(-1).tolist()]
        if len(payload) > MAX_SLOTS:
            raise ValueError(f"{len(payload)} values do not fit a round of {MAX_SLOTS}")
        sent = _parts(_digest(sends)) if self.generators and not pending else _parts_of(sends)
        parts = [*_parts_of(self.description), *sent]
        row = _header(self.step_parts, pending=pending) + _with_squares(parts)
        row += payload + [0.0] * (MAX_SLOTS - len(payload))
        buf = torch.tensor(row, dtype=torch.float64)
        work = _collective(
            lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True),
            self.step,
        )
        self._flying = Round(self, buf, work, pending, sends, list(values), parts, resend)
        return self._flying

    def _read(self, r: Round) -> list[torch.Tensor] | None:
        """The sums of a finished round, or None when a rank compiles first."""
        self._flying = None
        sums = r.buf.tolist()
        if not _header_agrees(sums, self.step_parts, self.world):
            self.owed = False  # NOTE: [every rank in the same step's round]
            _raise_other_steps(self.step_call(), self.group, self.world)
        if sums[1] > 0:  # NOTE: [a rank that fails before its program]
            self.owed = False
            self._raise_peer_failure()
        agree = _parts_agree(sums, _HEADER, r.parts, self.world)
        if not all(agree[:_PARTS]):
            self.owed = False
            self._raise_disagreement()
        if r.pending or sums[0] > 0:
            return None  # a rank compiles first: its next round is the one to read
        self.owed = False  # every rank's program runs now
        if not all(agree[_PARTS:]):
            everyone = _all_descriptions(r.sends, self.group, self.world)  # one gather for both
            self._raise_if_generators_differ(everyone)
            everyone = [text.partition(_GENERATORS)[0] for text in everyone]
            self._raise_if_pending_differs(everyone)
            self._raise_if_constants_differ(everyone)
            raise SPMDRuntimeError(
                "The ranks run different programs for the same input shapes (the values "
                f"their programs send with the input check differ; this rank's: {r.sends}), "
                "so their collectives would not match. Nothing was updated: the model and "
                "optimizer keep the state of the last completed step. Make every rank "
                "read the same Python values in the train step."
            )
        out, offset = [], _HEADER + 2 * len(r.parts)
        for v in r.values:
            part = r.buf[offset : offset + v.numel()]
            out.append(part.to(v.dtype).reshape(v.shape).to(v.device))
            offset += v.numel()
        return out

    def _raise_peer_failure(self) -> None:
        """Another rank's call failed before its program ran (its round came marked
        failed): name each rank that failed and how (NOTE: [a rank that fails before its
        program])."""
        everyone = _all_descriptions("", self.group, self.world)
        failed = [(rank, text) for rank, text in enumerate(everyone) if text]
        lines = "\n".join(f"    rank {rank}: {text}" for rank, text in failed)
        ranks = ", ".join(str(rank) for rank, _ in failed)
        raise SPMDRuntimeError(
            f"The compiled step failed on rank{'s' if len(failed) > 1 else ''} {ranks} "
            "before its program ran (while capturing or preparing the step), so this "
            f"rank (rank {dist.get_rank()}) did not run its program either: its "
            "collectives would have met that rank's next call. Nothing was updated: the "
            "model and optimizer keep the state of the last completed step, and the ranks "
            f"stay in step for the next call. Per rank:\n{lines}"
        )

    # NOTE: [a flush on some ranks only]
    # A step with cross_iteration_overlap runs its ``steady`` program on the update the
    # last call deferred, or its ``first`` program when that update was applied. A
    # ``step.flush()`` on some ranks only (under ``if rank == 0:``, next to a save) made the
    # ranks run different programs, reported as "make every rank read the same Python
    # values", which pointed away from the cause. Each round says whether the rank's
    # program runs on a pending update, and a disagreement on that is named.
    @staticmethod
    def _raise_if_pending_differs(everyone: list[str]) -> None:
        """NOTE: [a flush on some ranks only]: name the ranks whose deferred update was
        applied; ``everyone``: each rank's description of what its program sends."""
        flags = [text.partition(_PENDING)[2].partition(" | ")[0] for text in everyone]
        if len(set(flags)) < 2 or "" in flags:
            return
        flushed = [rank for rank, flag in enumerate(flags) if flag != "True"]
        raise SPMDRuntimeError(
            "The ranks disagree on the update the last call of this step deferred "
            "(cross_iteration_overlap): it was already applied on rank(s) "
            f"{', '.join(map(str, flushed))} (a step.flush(), a checkpoint, another compiled "
            "step, or a recompile for a value that changed there only, ran on those ranks) and is pending on the others, so the ranks would run "
            "different programs. Nothing was updated by this call. Call step.flush() "
            "(and checkpoint saves, which flush) on every rank, not under `if rank == 0:`."
        )

    @staticmethod
    def _raise_if_generators_differ(everyone: list[str]) -> None:
        """NOTE: [generators agree across ranks]: raise when the ranks' generator states
        are all that differs in what their programs send (every rank reads the same
        sums, so all of them come here); ``everyone``: each rank's description."""
        parts = [text.partition(_GENERATORS) for text in everyone]
        if len({rest for rest, _, _ in parts}) > 1 or len({state for _, _, state in parts}) < 2:
            return  # the programs differ otherwise (the other errors), or the states agree
        lines = "\n".join(f"    rank {rank}: {state}" for rank, (_, _, state) in enumerate(parts))
        raise SPMDCompileError(
            "The ranks' default random-number generators differ (seeded per rank? as "
            "torch.manual_seed(seed + rank) or timm's random_seed(seed, rank) do; or a rank "
            "drew random numbers the others did not between calls: sampling a generation "
            "for a log under `if rank == 0:`, a data loader shuffling on some ranks), and the "
            "train step draws random numbers (torch.randperm, torch.rand, dropout, "
            "sampling). The compiled program draws every random tensor whole on each rank "
            "from its default generator and reads it as one value (NOTE: [random "
            "numbers]); with each rank's own numbers the replicated weights would drift "
            "apart without an error. Nothing was updated and nothing was drawn. Generator "
            f"state digests per rank:\n{lines}",
            hint="seed every rank alike: torch.manual_seed(seed) (the same seed on every "
            "rank) before compiling and before each call that reseeds; per-rank "
            "randomness such as dropout masks is handled by the compiler, each rank "
            "keeping its own slice of one global draw. A per-rank stream for your own "
            "code outside the step (data augmentation, a rank-0 sample, a sampler) goes "
            "in its own torch.Generator.",
        )

    def _raise_if_constants_differ(self, everyone: list[str]) -> None:
        """NOTE: [constants agree across ranks]: name each rank's constants when they
        are what differs (every rank reads the same sums, so all of them come here);
        ``everyone``: each rank's description of what its program sends."""
        parts = [text.partition(_CONSTANTS) for text in everyone]
        programs = {program for program, _, _ in parts}
        if len(programs) > 1:
            return  # the programs differ: the caller's error
        tensors = [constants.partition(_VALUES) for _, _, constants in parts]
        if len({digest for _, _, digest in tensors}) > 1:
            self._raise_values_differ()
        lines = "\n".join(
            f"    rank {rank}: {constants or 'none'}" for rank, (constants, _, _) in enumerate(tensors)
        )
        raise SPMDCompileError(
            "The ranks hold different values in tensors the train step reads from outside "
            "its arguments. The program reads such a tensor as a constant, the same on "
            "every rank (NOTE: [tensors read from outside the arguments]); run on each "
            "rank's own value, the ranks would compute different things and drift apart. "
            f"Nothing was updated. Constants per rank:\n{lines}",
            hint="a batch inside an object that is not a tensor, list, tuple, dict, "
            "dataclass, UserDict or SimpleNamespace (or in a subclass of dict, list or "
            "tuple with attributes set on the object: NOTE: [subclasses of dict, list and "
            "tuple]) is read this way: pass the batch's "
            "tensors as arguments, or make its class a @dataclass (NOTE: [batch "
            "containers]); a per-rank tensor the model holds belongs in a buffer.",
        )

    def _raise_if_strings_differ(self) -> None:
        """NOTE: [strings that differ per sample]: raise the metadata error when every
        Python argument the ranks pass differently is a string (each rank's values
        gathered, on this error path only)."""
        mine = "\n".join(f"{name}\t{type(value).__name__}\t{value!r}" for name, value in self.scalars)
        everyone = [
            {name: (kind, value) for name, kind, value in (line.split("\t", 2) for line in text.splitlines())}
            for text in _all_descriptions(mine, self.group, self.world)
        ]
        names = list(dict.fromkeys(name for values in everyone for name in values))
        differ = [name for name in names if len({values.get(name) for values in everyone}) > 1]
        if not differ or any(values.get(name, ("", ""))[0] != "str" for name in differ for values in everyone):
            return
        if not all(per_sample_path(name) for name in differ):
            return
        lines = _per_value_lines(differ, [{k: v[1] for k, v in values.items()} for values in everyone])
        raise SPMDCompileError(
            "The ranks pass different strings to the train step. A string argument is "
            "read as one value on every rank (the program is compiled for it), so the "
            "ranks cannot run one program on these. Nothing was updated. Per value:\n"
            f"{lines}",
            hint=metadata_advice(differ, "every rank"),
        )

    def _raise_values_differ(self) -> None:
        """NOTE: [Python values agree across ranks]: name each Python value the ranks'
        programs read differently, with each rank's value."""
        everyone = [
            dict(line.split("\t", 1) for line in text.splitlines() if "\t" in line)
            for text in _all_descriptions(self.values_read, self.group, self.world)
        ]
        names = list(dict.fromkeys(name for values in everyone for name in values))
        differ = [name for name in names if len({values.get(name, "not read") for values in everyone}) > 1]
        if not differ:  # a value no guard holds (or not as a plain value) made the difference
            raise SPMDCompileError(
                "The ranks traced different train steps for the same input shapes: the "
                "Python values their steps read differ (constants baked into the program "
                "differ between ranks), though no value the compiler guards does. Run with "
                "each rank's own program, the ranks would train on a mix of their settings. "
                "Nothing was updated.",
                hint="set every value the step reads the same on every rank (from one "
                "config, not a per-rank one); a value that is each rank's own goes in a "
                "tensor argument split like the batch.",
            )
        lines = _per_value_lines(differ, everyone)
        raise SPMDCompileError(
            "The ranks read different Python values in the train step. The program bakes "
            "each Python value it reads in as one value on every rank (NOTE: [guards on "
            "Python values]); run with each rank's own value, the ranks would train on a "
            "mix of their settings (their gradients are averaged), which no single value "
            f"gives. Nothing was updated. Per value:\n{lines}",
            hint=values_differ_hint(differ, everyone),
        )

    def _raise_disagreement(self) -> None:
        everyone = _all_descriptions(self.description, self.group, self.world)
        lines = "\n".join(f"    rank {rank}: {text}" for rank, text in enumerate(everyone))
        sections = [_sections(text) for text in everyone]
        if len({shapes for shapes, _, _ in sections}) == 1 and len({whole for _, whole, _ in sections}) == 1:
            self._raise_if_strings_differ()
            raise SPMDCompileError(
                "The ranks pass different Python values to the train step (numbers, flags "
                "or strings, which the program reads as one value on every rank), so they "
                "would train on different settings. Nothing was updated. Per rank:\n"
                + "\n".join(f"    rank {rank}: {scalars}" for rank, (_, _, scalars) in enumerate(sections)),
                hint="pass the same values on every rank; a value that is each rank's own "
                "(a local count) goes in a tensor argument split like the batch.",
            )
        if len({shapes for shapes, _, _ in sections}) == 1:
            raise SPMDCompileError(
                "The ranks pass different values for a tensor argument that every rank "
                "passes whole (the mode does not split it: a 0-d tensor, one "
                "input_batch_dim names None, or any argument under tensor parallel, whose "
                "ranks all take the same batch), so each rank would train on its own value. "
                f"Nothing was updated. Tensor arguments per rank:\n{lines}",
                hint="pass the same value on every rank, or give the argument's batch "
                "dimension in input_batch_dim if each rank passes its own share.",
            )
        raise SPMDCompileError(
            "The ranks pass tensor arguments of different shapes or dtypes to the train step, "
            "so they would run different programs (and wait for each other until the "
            f"collective timeout). Tensor arguments per rank:\n{lines}",
            hint="give every rank a local batch of the same shape (split the global batch "
            "evenly; drop or pad the last partial batch)"
            + (_PADDED_PER_RANK if _only_lengths_differ([shapes for shapes, _, _ in sections]) else "")
            + ".",
        )


class StatusRound:
    """One rank's status round in flight (``InputAgreement.start_status``)."""

    def __init__(
        self, agreement: InputAgreement, buf: torch.Tensor, work: Any, parts: tuple[int, ...],
        failure: str,
    ) -> None:
        self.agreement, self.buf, self.work, self.parts, self.failure = agreement, buf, work, parts, failure

    def finish(self) -> None:
        """Wait for the round; raise ``RanksFailed`` when a rank's program failed."""
        agreement = self.agreement
        agreement._status_collective(self.work.wait)
        sums = self.buf.tolist()
        if not _header_agrees(sums, self.parts, agreement.world):
            _raise_other_steps(f"{agreement.step_call()}, at the end of a call", agreement.group, agreement.world)
        if sums[1] > 0:
            agreement.raise_failed(self.failure)


class RanksFailed(SPMDRuntimeError):
    """The status round found ranks whose program failed: ``failed`` holds each one's rank
    and failure; the runner words the error (NOTE: [a rank whose program fails alone])."""

    def __init__(self, failed: list[tuple[int, str]]) -> None:
        super().__init__("; ".join(f"rank {rank}: {text}" for rank, text in failed))
        self.failed = failed


class Round:
    """One rank's round in flight (``InputAgreement.start``)."""

    def __init__(
        self, agreement: InputAgreement, buf: torch.Tensor, work: Any, pending: bool,
        sends: str, values: list[torch.Tensor], parts: list[int], resend: str = "",
    ) -> None:
        """``sends``: what the round's second digest was taken of; ``resend``: what
        ``start`` was given, which a round sent again starts from."""
        self.agreement, self.buf, self.work = agreement, buf, work
        self.pending, self.sends, self.values, self.parts = pending, sends, values, parts
        self.resend = resend or sends

    def finish(self) -> list[torch.Tensor]:
        """Wait for the round; raise if the ranks disagree; return the sums of the values
        sent. While another rank compiles first (its round said ``pending``), this rank
        sends its round again until that rank's next one."""
        current = self
        while True:
            _collective(current.work.wait, self.agreement.step)
            sums = self.agreement._read(current)
            if sums is not None or current.pending:
                return sums or []
            current = self.agreement.start(self.resend, self.values)


_PARTS, _PART_BITS = 3, 16  # a 48-bit digest in parts whose squares sum exactly
# NOTE: [every rank in the same step's round]: pending, failed, the step's identity
# (parts, squares), the length of what follows (and its square)
_HEADER = 2 + 2 * _PARTS + 2
ROUND = _HEADER + 2 * 2 * _PARTS + MAX_SLOTS  # the header, two digests (parts, squares), the values


# NOTE: [every rank in the same step's round]
# Every collective of a round is one message of the same size on every rank only when
# every rank is in the same kind of round of the same step. A compiled step called on some
# ranks only (the DDP habit ``if rank == 0: val = evaluate(model, VX, VY)`` with a compiled
# eval step), or ranks calling different compiled steps (``step = with_metrics if rank
# == 0 else plain``), put one rank's round against another's of another size (the first
# call's share comparison, 96 values, against a call's round): gloo aborted the process
# (SIGABRT, "op.preamble.length <= op.nbytes. 192 vs 40 ... Is there a distributed
# collective mismatch"), with no Python error, and torchrun killed the job. Where both
# ranks had compiled both steps the rounds met, and the error blamed the Python values
# the steps read. So the first exchange of every round is the same ``ROUND`` values on
# every rank, and starts with a header: the step's identity (a digest of its name and
# ``file:line``, and of the round's kind: a call's input check or the first call's share
# comparison) and the length of the payload that follows a header (the share
# comparison's; a call's round carries its payload in the same message). Ranks whose
# headers differ gather each rank's step (an all-gather of its label, on this error path
# only) and every rank raises the same error naming them, before any program runs:
# nothing is updated, and the rank that called another step gets the error too. A rank
# that never enters the step (rank 0 evaluates, rank 1 has finished) leaves the others
# in the round until the collective timeout, whose error names the step and the cause.
# The header costs 8 more float64 values in the round a call makes anyway.
def _per_value_lines(differ: Sequence[str], everyone: Sequence[dict[str, str]]) -> str:
    """The lines of an error naming, for each of the first 8 values that ``differ``,
    each rank's value (``everyone``: each rank's values by name; one a rank did not
    read: "not read")."""
    lines = "\n".join(
        f"    {name}: " + ", ".join(f"rank {rank}: {values.get(name, 'not read')}" for rank, values in enumerate(everyone))
        for name in differ[:8]
    )
    return lines + (f"\n    ... and {len(differ) - 8} more" if len(differ) > 8 else "")


def step_label(name: str, where: str) -> str:
    """``train (train.py:12)``: how a round names its step."""
    return f"{name} ({where})"


def _step_parts(label: str, kind: str) -> tuple[int, ...]:
    """The digest parts of a step's identity in a round of ``kind``: its name and the
    file name (without the directory, which may differ between machines) and line."""
    name, _, where = label.partition(" (")
    return _parts_of(f"{name} {where.rpartition('/')[2]} {kind}")


def _header(step_parts: Sequence[int], pending: bool = False, failed: bool = False, length: int = 0) -> list[float]:
    """The first ``_HEADER`` values of a round (NOTE: [every rank in the same step's round])."""
    # failed: NOTE: [a rank that fails before its program]
    return [float(pending), float(failed), *_with_squares(step_parts), *_with_squares([length])]


def _header_agrees(sums: Sequence[float], step_parts: Sequence[int], world: int) -> bool:
    """Whether every rank's round carried this rank's step identity."""
    return all(_parts_agree(sums, 2, step_parts, world))


def _with_squares(parts: Sequence[int]) -> list[float]:
    """Each digest part followed by its square, as a round sends it (see
    ``InputAgreement``)."""
    return [v for h in parts for v in (float(h), float(h * h))]


def _parts_agree(sums: Sequence[float], offset: int, parts: Sequence[int], world: int) -> list[bool]:
    """For each of ``parts`` (sent with its square from ``offset``), whether every rank
    sent this rank's value: sum(h) == world * h and sum(h * h) == world * h * h."""
    return [
        sums[offset + 2 * k] == world * h and sums[offset + 1 + 2 * k] == world * h * h
        for k, h in enumerate(parts)
    ]


def _raise_other_steps(this: str, group: Any, world: int) -> None:
    """NOTE: [every rank in the same step's round]: every rank raises, naming each rank's
    step; ``this``: this rank's step and round. Where a rank was in a checkpoint call,
    the error is the checkpoint's (NOTE: [a checkpoint on some ranks only])."""
    everyone = _all_descriptions(this, group, world)
    lines = "\n".join(f"    rank {rank}: {text}" for rank, text in enumerate(everyone))
    if any(text.startswith(CHECKPOINT_PREFIX) for text in everyone):
        _raise_checkpoint_on_some_ranks(everyone, lines)
    raise SPMDRuntimeError(
        "The ranks called different compiled steps, or the same one at a different point "
        "(a compiled step called on some ranks only, as `if rank == 0: evaluate(...)` "
        "does, or one rank calling another step): every rank must call the same compiled "
        "steps in the same order, since their programs meet in collectives. Nothing was "
        f"updated by this call. Per rank:\n{lines}\n"
        "  what to do:  call a compiled step on every rank (a compiled evaluation on every "
        "rank, each on its share of the eval batch), or run what one rank does alone "
        "uncompiled (the model called eagerly under torch.no_grad() on rank 0); pick a "
        "step variant (one that logs more) from a value every rank shares, not the rank."
    )


# NOTE: [a checkpoint on some ranks only]
# ``sc.checkpoint.full_state_dict`` gathers every rank's shards, and ``save`` / ``load``
# write and read each rank's own through DCP's collectives: every rank must call them.
# The plain-DDP habit ``if rank == 0: state = sc.checkpoint.full_state_dict(model, opt)``
# left rank 0 in the gathers' collectives while rank 1 went on: its next compiled call's
# round met rank 0's all-gather, and the job waited until the collective timeout (2 gloo
# ranks, fully_shard: 120 s, sc.launch's timeout_s; under torchrun gloo's 30 minutes) or
# gloo aborted on the sizes. So on real ranks each of them first makes one round of the
# ``ROUND`` values every compiled call's round sends (``checkpoint_round``), its header
# naming the function (not the line: ranks may call it from the two branches of an
# ``if``). Met by another rank's compiled call (the rank that skipped the save went on
# training) or by another checkpoint function, the headers differ and every rank raises
# the same error within the round, naming each rank's call and what to do; nothing was
# gathered, written or updated. A rank that skipped it for a collective of its own
# (``dist.barrier()``) or finished cannot be met by a round of ours: the caller then
# waits, and after ``CHECKPOINT_WAIT_WARNING_S`` it warns, naming the likely cause,
# until the collective timeout (waiting is not refused: a rank may be late for a good
# reason, as rank 0 evaluating alone before every rank saves). The round costs one
# all-reduce of ``ROUND`` float64 values per call.
CHECKPOINT_PREFIX = "sc.checkpoint."
CHECKPOINT_WAIT_WARNING_S = 10.0

_CHECKPOINT_ADVICE = (
    "  what to do:  call it on every rank, and write the file on rank 0 only: `state = "
    "sc.checkpoint.full_state_dict(model, optim)` on every rank (it returns {} on the "
    "others), then `if rank == 0: torch.save(state, path)`; sc.checkpoint.save(path, "
    "model, optim) and sc.checkpoint.load(path, model, optim) on every rank too (each rank "
    "writes and reads its own shards)."
)


def checkpoint_round(function: str) -> None:
    """NOTE: [a checkpoint on some ranks only]: the round every rank makes on entering
    the checkpoint ``function`` (``"full_state_dict"``) on real ranks, before it gathers,
    writes or reads anything; raises when another rank is in a compiled call or another
    checkpoint function, and warns when the peers have not come after
    ``CHECKPOINT_WAIT_WARNING_S``."""
    import datetime

    from ..errors import innermost_model_frame_of_stack

    world = dist.get_world_size()
    if world == 1:
        return
    name = CHECKPOINT_PREFIX + function
    where = innermost_model_frame_of_stack()
    this = f"{name} ({where.filename.rpartition('/')[2]}:{where.lineno})" if where else name
    step_parts = _parts_of(f"{name} checkpoint")
    head = _header(step_parts)
    buf = torch.tensor(head + [0.0] * (ROUND - len(head)), dtype=torch.float64)
    group = _cpu_group()
    try:
        work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group, async_op=True)
        try:
            work.wait(datetime.timedelta(seconds=CHECKPOINT_WAIT_WARNING_S))
        except RuntimeError:
            if work.is_completed():
                raise  # the collective failed: not the wait
            warnings.warn(
                f"Rank {dist.get_rank()} has waited {CHECKPOINT_WAIT_WARNING_S:.0f} s in {this} "
                "for the other ranks. It is a collective: every rank must call it. If the "
                "other ranks skipped it (the DDP habit of saving under `if rank == 0:`), this "
                "waits until the collective timeout (NOTE: [a checkpoint on some ranks "
                f"only]).\n{_CHECKPOINT_ADVICE}",
                stacklevel=3,
            )
            work.wait()
    except Exception as exc:
        if isinstance(exc, (SPMDCompileError, SPMDRuntimeError)):
            raise
        rank = dist.get_rank()
        raise collective_failure(
            f"{this} failed on rank {rank} while waiting for the other ranks to call it "
            f"too: {exception_summary(exc)}. {attribution(rank)} It is a collective: if the "
            "other ranks never called it (under `if rank == 0:`), they could not meet "
            f"it (NOTE: [a checkpoint on some ranks only]).\n{_CHECKPOINT_ADVICE}"
        ) from exc
    if not _header_agrees(buf.tolist(), step_parts, world):
        _raise_other_steps(this, group, world)


def _raise_checkpoint_on_some_ranks(everyone: Sequence[str], lines: str) -> None:
    """NOTE: [a checkpoint on some ranks only]: every rank raises, naming each rank's
    call; ``everyone``: each rank's checkpoint function or compiled step."""
    called = [rank for rank, text in enumerate(everyone) if text.startswith(CHECKPOINT_PREFIX)]
    functions = sorted({everyone[rank].partition(" (")[0] for rank in called})
    which = " and ".join(functions)
    ranks = ", ".join(map(str, called))
    raise SPMDRuntimeError(
        f"{which} was called on rank{'s' if len(called) > 1 else ''} {ranks} while the other "
        "ranks were elsewhere (per rank below): it is a collective, and every rank must "
        "call it, the same function at the same point (its state is gathered from, or "
        "written and read by, the shards of every rank), not under `if rank == 0:` as "
        "plain DDP saves. Nothing was gathered, written or read, and no compiled step "
        "ran: the model and optimizer keep the state of the last completed step. Per "
        f"rank:\n{lines}\n{_CHECKPOINT_ADVICE}"
    )


# NOTE: [strings that differ per sample]
# A dataset whose items hold a file name or an id string ({"x": ..., "y": ..., "name":
# "sample_12.png"}) gives, through the default collate, a batch holding a list of strings
# the step never reads. Each string is a Python argument, baked into the program: in
# simulation every call compiled again (20 compiles in 20 calls), on real ranks each
# rank's own names were refused as "different settings", whose advice (a tensor
# argument) did not fit. Whether the step reads a string cannot be told in general, so
# nothing is guessed: the recompile warning (by the third call) and the ranks' refusal
# say that such strings look like per-sample metadata and to pass the step only what it
# reads.
def per_sample_path(path: str) -> bool:
    """Whether argument ``path`` is an element of a sequence (``batch['name'][0]``: a
    collated list of strings), not one string argument (a ``phase`` the step branches
    on, a program per value: no metadata; the second review)."""
    return re.search(r"\[\d+\]$", path) is not None


def metadata_advice(paths: Sequence[str], where: str) -> str:
    """What to do about the string arguments at ``paths`` (``batch['name'][0]``) that
    differ across ``where`` ("every rank", "every call"): NOTE: [strings that differ
    per sample]."""
    containers = list(dict.fromkeys(re.sub(r"(\[\d+\])+$", "", path) for path in paths))
    pops = []
    for container in containers[:3]:
        keyed = re.fullmatch(r"(\w+)\[('[^']*'|\"[^\"]*\")\]", container)
        if keyed:
            pops.append(f"`{keyed.group(1)}.pop({keyed.group(2)})`")
    drop = " or ".join(pops) + " before the call, or " if pops else ""
    return (
        f"{', '.join(containers[:3])} look{'s' if len(containers) == 1 else ''} like per-sample "
        "metadata (file names, ids: a data loader's default collate makes a list of "
        "strings of them): pass the step only what it reads: "
        f"{drop}a batch without them (a collate_fn that leaves them out; Hugging Face "
        "datasets: remove_unused_columns / batch.remove_columns). A string the step "
        f"does read is compiled into the program and must be the same on {where}."
    )


def _failure_line(exc: BaseException) -> str:
    """What a rank that failed before its program tells its peers: the first line of its
    error, and where in the train step, when known."""
    text = exception_summary(exc)
    where = getattr(exc, "user_line", None)
    return f"{text} (at {where})" if where and str(where) not in text else text


_SHARE_SLOTS = 32  # split arguments the first call's round looks at (the first ones)


class PeerBatch(NamedTuple):
    """An argument split on some mesh dimensions and whole on the others, which the ranks
    of one group (one dp group's tp peers) must pass alike: NOTE: [tp peers pass one
    batch slice]."""

    label: str
    tensor: torch.Tensor
    group: int  # this rank's group: its index in ``members``
    members: tuple[tuple[int, ...], ...]  # each group's ranks
    split_on: str  # the mesh dimensions that split it (``dp``)
    whole_on: str  # those it is whole on (``tp``)


def peer_batches(
    names: Sequence[str], tensor_args: Sequence[torch.Tensor],
    placements: Sequence[Sequence[Any]], mesh: DeviceMesh,
) -> list[PeerBatch]:
    """The tensor arguments whose placements split them on some dimensions of ``mesh``
    and leave them Replicate on others (NOTE: [tp peers pass one batch slice]); an
    argument Replicate everywhere is the round's (NOTE: [inputs every rank passes
    whole]), one split everywhere has no peers."""
    out = []
    dim_names = mesh.mesh_dim_names or tuple(f"mesh dimension {d}" for d in range(mesh.ndim))
    rank = dist.get_rank()
    for k, (name, t, pl) in enumerate(zip(names, tensor_args, placements, strict=True)):
        whole = [d for d, p in enumerate(pl) if isinstance(p, Replicate)]
        split = [d for d in range(len(pl)) if d not in whole]
        if not whole or not split:  # decided by placements alone: every rank sends as many slots
            continue
        groups = mesh.mesh.permute(*split, *whole).reshape(-1, math.prod(mesh.size(d) for d in whole))
        members = tuple(tuple(int(r) for r in row) for row in groups.tolist())
        group = next(g for g, ranks in enumerate(members) if rank in ranks)
        out.append(PeerBatch(
            f"{name} (input[{k}])", t, group, members,
            ", ".join(dim_names[d] for d in split), ", ".join(dim_names[d] for d in whole),
        ))
    return out


def warn_on_same_shares(
    split: Sequence[tuple[str, torch.Tensor, int]], peers: Sequence[PeerBatch] = (), step: str = "",
) -> None:
    """The first call's round of NOTE: [the same share on every rank]: warn for each
    ``(label, tensor, split dimension)`` whose values every rank passed alike. The round
    also carries ``peers`` (``peer_batches``): raise when the ranks of one group passed
    different values (NOTE: [tp peers pass one batch slice]). ``step``: the step's
    ``step_label``, which the round's header carries (NOTE: [every rank in the same
    step's round])."""
    split = [item for item in split if item[1].numel() > 1][:_SHARE_SLOTS]
    peers = list(peers)[:_SHARE_SLOTS]
    world = dist.get_world_size()
    row = [0.0] * (3 * _SHARE_SLOTS)
    for k, (_, t, dim) in enumerate(split):
        h = _digest(_checksum(t)) & ((1 << 20) - 1)
        row[3 * k : 3 * k + 3] = [float(h), float(h * h), float(_slices_differ(t, dim))]
    for peer in peers:  # a slot per group, this rank's filled
        slots = [0.0] * (2 * _PARTS * len(peer.members))
        parts = _parts(_digest(_checksum(peer.tensor)))
        slots[2 * _PARTS * peer.group : 2 * _PARTS * (peer.group + 1)] = [
            float(x) for h in parts for x in (h, h * h)
        ]
        row += slots
    # the header first, as every round's (NOTE: [every rank in the same step's round])
    step_parts = _step_parts(step, "first call")
    head = _header(step_parts, length=len(row))
    header = torch.tensor(head + [0.0] * (ROUND - len(head)), dtype=torch.float64)
    _collective(lambda: dist.all_reduce(header, op=dist.ReduceOp.SUM, group=_cpu_group()), step)
    sums = header.tolist()
    if not _header_agrees(sums, step_parts, world):
        _raise_other_steps(f"{step or 'a compiled step'}, its first call", _cpu_group(), world)
    if sums[_HEADER - 2 : _HEADER] != [world * len(row), world * len(row) ** 2]:
        return  # the ranks' arguments differ in number: the call's round refuses them
    buf = torch.tensor(row, dtype=torch.float64)
    _collective(lambda: dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=_cpu_group()), step)
    sums = buf.tolist()
    _raise_if_peers_differ(peers, sums[3 * _SHARE_SLOTS :])
    for k, (label, t, dim) in enumerate(split):
        part, square, differ = row[3 * k : 3 * k + 3]
        alike = sums[3 * k] == world * part and sums[3 * k + 1] == world * square
        if alike and differ and sums[3 * k + 2] == world * differ:
            name = label.split(" (input[")[0]
            warnings.warn(
                f"Every rank passed the same values for {label} {tuple(t.shape)}, which the "
                f"parallel mode splits along dimension {dim} as each rank's share of the "
                "batch: the program reads it as a tensor "
                f"{world} times longer. If it holds no batch (class weights, a table), pass "
                f"it whole: input_batch_dim={{{name!r}: None}}; if it is batch data whose "
                "shares are alike by design (each rank sampling the same class grid), the "
                "split is right and this warning can be ignored (NOTE: [the same share on "
                "every rank]).",
                stacklevel=4,
            )


def _raise_if_peers_differ(peers: Sequence[PeerBatch], sums: Sequence[float]) -> None:
    """NOTE: [tp peers pass one batch slice]: raise, on every rank alike, when the ranks
    of a group passed different values for one of ``peers``; ``sums`` are the round's
    slots for them."""
    wrong, offset = [], 0
    for peer in peers:
        differ = []
        for g, ranks in enumerate(peer.members):
            n = len(ranks)
            cell = sums[offset + 2 * _PARTS * g : offset + 2 * _PARTS * (g + 1)]
            if any(n * cell[2 * j + 1] != cell[2 * j] ** 2 for j in range(_PARTS)):
                differ.append(g)
        offset += 2 * _PARTS * len(peer.members)
        if differ:
            wrong.append((peer, differ))
    if not wrong:
        return
    peer = wrong[0][0]
    groups = len(peer.members)
    lines = "\n".join(
        f"    {p.label} {tuple(p.tensor.shape)}: {p.split_on} group {g} (ranks "
        f"{', '.join(map(str, p.members[g]))}) passed different values"
        for p, differ in wrong for g in differ
    )
    raise SPMDCompileError(
        f"The ranks of one {peer.split_on} group (the {peer.whole_on} peers) pass "
        f"different values for {peer.label}, a tensor argument the mode splits only over "
        f"{peer.split_on}: the group's ranks must pass the same batch slice, which the "
        f"program reads as one (its {peer.whole_on} ranks split the model, not the batch), "
        "so each rank would train on its own slice as if it were the group's, without an "
        f"error. Nothing was updated. Per argument:\n{lines}",
        hint=f"give the ranks of one {peer.split_on} group the same slice of the global "
        f"batch: sample over the {peer.split_on} dimension, not over all "
        f"{dist.get_world_size()} ranks: DistributedSampler(dataset, num_replicas={groups}, "
        f"rank={peer.split_on}_index), the {peer.split_on} size and the rank's coordinate on "
        f"{peer.split_on} (mesh.get_coordinate(); {peer.group} on this rank).",
    )


def _slices_differ(t: torch.Tensor, dim: int) -> bool:
    """Whether the slices of ``t`` along ``dim`` are not all equal."""
    t = t.detach()
    return bool(t.size(dim) > 1 and not torch.equal(t.narrow(dim, 0, 1).expand_as(t), t))


def _parts(digest: int) -> list[int]:
    mask = (1 << _PART_BITS) - 1
    return [(digest >> (_PART_BITS * k)) & mask for k in range(_PARTS)]


def _all_descriptions(description: str, group: Any, world: int) -> list[str]:
    mine = torch.tensor(list(description.encode()), dtype=torch.uint8)
    length = torch.tensor([mine.numel()], dtype=torch.int64)
    _collective(lambda: dist.all_reduce(length, op=dist.ReduceOp.MAX, group=group))
    padded = torch.zeros(int(length), dtype=torch.uint8)
    padded[: mine.numel()] = mine
    gathered = [torch.empty_like(padded) for _ in range(world)]
    _collective(lambda: dist.all_gather(gathered, padded, group=group))
    return [bytes(t.tolist()).rstrip(b"\0").decode() for t in gathered]


def _collective(call: Any, step: str = "") -> Any:
    """Run a round's collective; its failure (a peer left, or the timeout) names the
    round, the step and, where the peers never came, the likely cause."""
    try:
        return call()
    except Exception as exc:
        rank = dist.get_rank()
        raise collective_failure(
            f"The compiled step {step + ' ' if step else ''}failed on rank {rank} while "
            "comparing its inputs with the other ranks (the round every call makes before "
            f"its program runs): {exception_summary(exc)}. "
            f"{attribution(rank)} The model and optimizer hold the state of the last "
            "completed step. If the other ranks never called this step (a compiled step "
            "under `if rank == 0:`, as an evaluation), call it on every rank or run that "
            "part uncompiled (NOTE: [every rank in the same step's round])."
        ) from exc
