"""Which dimension of each tensor argument holds the batch, for the data-parallel modes.

NOTE: [inputs by name]
A data-parallel mode splits every tensor argument of the step along one dimension: each
rank passes its own share on real ranks, and a simulated rank is cut its share of the
global batch. One dimension for every argument was the only choice, so a step could not
take an RNN's hidden state (batch in dimension 1 of ``(layers, batch, hidden)``) beside
a batch-first input, nor a tensor that is no batch at all (class weights, a lookup
table): every rank passes the same whole tensor. Such an argument was read as one
rank's share of a tensor ``world`` times longer: on real ranks ``w.sum()`` of class
weights came out ``world`` times too large, while in simulation, where the user passes
the global value, it was right.

``input_batch_dim`` takes either one dimension for every tensor argument, or a mapping
from argument names to a dimension, or to None for an argument that holds no batch
(Replicate: every rank passes, and computes with, the same whole tensor; on real ranks
every call checks that the ranks' values agree, NOTE: [same inputs on all ranks]).
Arguments the mapping does not name keep dimension 0. A name is the step's parameter
name, then keys and attributes inside it as the step's code reads them (``h``,
``batch['class_weights']``, ``state.h``, ``args[2]`` for one caught by ``*args``:
``capture.bindings.argument_paths``); a name covers everything inside it, and the
longest name that covers an argument wins. A name that names no argument of the call
is refused at compile time (NOTE: [names that name nothing]). 0-d tensor arguments are
always Replicate.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import re
import types
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard

from spmd_compiler.capture.bindings import (
    StepBindings,
    argument_names,
    argument_paths,
    tensor_argument_names,
)
from spmd_compiler.capture.code_names import step_code, step_where
from spmd_compiler.errors import SPMDCompileError
from spmd_compiler.expand.iterated_batches import check_iterated_batches, check_stacked_samples
from spmd_compiler.expand.listed_samples import check_listed_samples
from spmd_compiler.expand.retrace import DistributedProgram, Placements
from spmd_compiler.ir.signature import CapturedStep, Kind, StateRef, TensorMeta
from spmd_compiler.runtime.simulate import active_simulation

BatchDims = int | Mapping[str, int | None]


def checked_batch_dims(batch_dims: BatchDims) -> int | dict[str, int | None]:
    """``batch_dims`` as a mode keeps it; raises TypeError on anything else."""
    if isinstance(batch_dims, bool) or not isinstance(batch_dims, (int, Mapping)):
        raise TypeError(
            f"input_batch_dim must be an int or a dict from argument names to an int or "
            f"None, got {batch_dims!r}"
        )
    if isinstance(batch_dims, int):
        return batch_dims
    out: dict[str, int | None] = {}
    for name, dim in batch_dims.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"input_batch_dim's keys are argument names, got {name!r}")
        if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
            raise TypeError(f"input_batch_dim[{name!r}] must be an int or None, got {dim!r}")
        spelled = _spelled(name)
        if spelled in out:
            raise ValueError(f"input_batch_dim names {spelled!r} twice (as {name!r} too)")
        out[spelled] = dim
    return out


# NOTE: [names that name nothing]
# A name of ``input_batch_dim`` that covers no argument path was dropped without a word,
# and the argument it meant kept dimension 0: only its first part was checked against
# the step's parameters, and nothing at all under ``**kwargs``. ``{'batch.tok': 1,
# 'batch.y': 1}`` for a dict batch (its keys are ``batch['tok']``), or a misspelt key,
# trained a time-major attention model off one device on 2 gloo ranks, a parameter
# 0.108 relative off after 3 steps (fifty-sixth session); a NamedTuple's ``batch[0]``
# (its fields are ``batch.x``), ``batch[-1]``, ``batch["tok"]`` and ``inputs['x']`` for
# ``**inputs`` (whose arguments are ``x``) were dropped the same way. Now a name is spelled as the argument paths are
# (``_spelled``: ``batch["tok"]`` is ``batch['tok']``), and at compile time every name
# must cover a path of the call's arguments (a None value's too: ``batch['mask']`` passed
# as None); refused otherwise, with the tensor arguments' paths and the path meant where
# one reading of the name finds it (``_meant``). Those readings are not accepted: an
# index or a ``**inputs`` prefix names another path as the call's structure goes, and
# the placement of an argument is decided from its path alone (on real ranks before the
# mode is prepared). A bare parameter name the call does not pass (``h=None`` left out)
# is accepted: it names the argument of the calls that pass it. So is a key of a dict the
# call passes without it where the name covered an argument of an earlier call of the
# step (``batch['attention_mask']`` a collator drops from some batches: refused on
# those calls by the first version of this check); left out of a step's first call, it
# cannot be told from a typo and is refused.
_TOP = re.compile(r"\s*([A-Za-z_]\w*)")
_PART = re.compile(r"\s*(?:\.\s*([A-Za-z_]\w*)|\[([^\[\]]*)\])")
Part = tuple[str, "str | int"]


def _parsed(name: str) -> tuple[str, list[Part]] | None:
    """``name`` as its parameter and the attributes (``("attr", "mask")``) and keys
    (``("key", "mask")``, ``("key", 0)``) inside it; None where it is not spelled so."""
    match = _TOP.match(name)
    if match is None:
        return None
    top, pos, parts = match.group(1), match.end(), []
    while pos < len(name.rstrip()):
        match = _PART.match(name, pos)
        if match is None:
            return None
        if match.group(1) is not None:
            parts.append(("attr", match.group(1)))
        else:
            try:
                key = ast.literal_eval(match.group(2).strip())
            except (ValueError, SyntaxError):
                return None
            if isinstance(key, bool) or not isinstance(key, (str, int)):
                return None
            parts.append(("key", key))
        pos = match.end()
    return top, parts


def _render(top: str, parts: list[Part]) -> str:
    # as pytree's keystr writes a path: GetAttrKey ".x", MappingKey / SequenceKey "[k!r]"
    return top + "".join(f".{v}" if kind == "attr" else f"[{v!r}]" for kind, v in parts)


def _spelled(name: str) -> str:
    """``name`` spelled as argument paths are: quotes and spaces as pytree writes them."""
    parsed = _parsed(name)
    return name if parsed is None else _render(*parsed)


def _covers(name: str, path: str) -> bool:
    return path == name or path.startswith((name + "[", name + "."))


def batch_dim_of(batch_dims: int | dict[str, int | None], ref: StateRef, meta: TensorMeta) -> int | None:
    """The dimension of tensor argument ``ref`` that holds the batch, normalized to
    ``0 <= dim < ndim``; None where it holds none (0-d, or named None).

    Raises:
        SPMDCompileError: the argument has no such dimension.
    """
    if not meta.shape:
        return None
    if isinstance(batch_dims, int):
        dim: int | None = batch_dims
        how = f"input_batch_dim={batch_dims}"
    else:
        names = [n for n in batch_dims if _covers(n, ref.name)]
        chosen = max(names, key=len) if names else None
        dim = batch_dims[chosen] if chosen is not None else 0
        how = f"input_batch_dim[{chosen!r}]={dim}" if chosen is not None else "the default batch dimension 0"
    if dim is None:
        return None
    if not -len(meta.shape) <= dim < len(meta.shape):
        raise SPMDCompileError(
            f"{ref} of shape {meta.shape} has no batch dimension {dim} ({how}).",
            hint="name the dimension that holds this argument's batch, or None when it holds "
            f"none: input_batch_dim={{{(ref.name or 'name')!r}: 1}} or {{{(ref.name or 'name')!r}: None}}.",
        )
    return dim % len(meta.shape)


def check_batch_iterations(
    program: DistributedProgram, batch_dims: int | dict[str, int | None], given: bool
) -> None:
    """NOTE: [a batch dimension iterated over] in ``expand/iterated_batches.py``: an
    argument whose split dimension the step iterates over must have its batch dimension
    named (``given``: whether the mode was given ``input_batch_dim`` at all)."""

    def named(argument: str) -> bool:
        if isinstance(batch_dims, int):
            return given
        return any(_covers(name, argument) for name in batch_dims)

    check_program_iterations(program, named)
    if not isinstance(batch_dims, int):
        check_arguments_laid_out_alike(program, named)


def check_list_arguments(
    captured: CapturedStep, mesh: DeviceMesh, placements: list[Placements], batch_dims: int | dict[str, int | None]
) -> None:
    """NOTE: [a list of samples split as batch tensors] in ``expand/listed_samples.py``:
    a list argument whose items are samples must be passed batched, or named. Only a
    name of the mapping covers it: an int ``input_batch_dim`` says where the batch of
    each tensor lies, not that a list's items are batch tensors."""
    names = {} if isinstance(batch_dims, int) else batch_dims
    check_listed_samples(
        captured, mesh, placements, lambda path: any(_covers(name, path) for name in names),
        active_simulation() is not None,
    )


def _split_inputs(program: DistributedProgram) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Each split step argument's split dimension (on the first mesh dimension) and
    global shape."""
    return {
        ref.name: (p.dim, tuple(meta.shape))
        for (ref, meta), placements in zip(program.captured.inputs, program.input_placements, strict=True)
        if ref.kind is Kind.INPUT and ref.name
        for p in placements[:1] if isinstance(p, Shard)
    }


def check_arguments_laid_out_alike(program: DistributedProgram, named: Callable[[str], bool]) -> None:
    """NOTE: [arguments laid out alike]
    ``input_batch_dim={'x': 1}`` names a time-major ``(T, B, F)`` input; its ``(T, B)``
    labels left unnamed keep dimension 0, time. In simulation the caller passes global
    values and the split is right either way; on real ranks each rank's ``(T, B / world)``
    labels are read as its part of a sequence ``world`` times longer, and the step trains
    wrong without a sign (an encoder tagger 3.5e-2 relative off one device after 3 steps
    on 2 gloo ranks, fifty-fifth session). Such an argument gives itself away by its
    layout: its leading dimensions, as the caller passes them, equal the named
    argument's up to and including its batch dimension. Refused on real ranks (a
    ``(B, B)`` argument batch-first beside a ``(B, B, F)`` time-major one looks the same:
    naming it, ``{'y': 0}``, says so), warned in simulation, where it trains right.

    Raises:
        SPMDCompileError: on real ranks, for an unnamed argument laid out like a named one.
    """
    world = program.mesh.size(0)
    if world < 2:
        return
    split = _split_inputs(program)
    simulated = active_simulation() is not None

    def passed(dim: int, shape: tuple[int, ...]) -> tuple[int, ...]:
        # what the caller passes: the global value in simulation, a share on real ranks
        return shape if simulated else shape[:dim] + (shape[dim] // world,) + shape[dim + 1:]

    for name, (dim, shape) in split.items():
        if dim == 0 or not named(name):
            continue
        lead = passed(dim, shape)[: dim + 1]
        alike = [
            other for other, (d, s) in split.items()
            if d == 0 and not named(other) and len(s) > dim and passed(d, s)[: dim + 1] == lead
        ]
        if not alike:
            continue
        listed = ", ".join(repr(a) for a in alike)
        error = SPMDCompileError(
            f"The step argument(s) {listed} {'is' if len(alike) == 1 else 'are'} laid out like "
            f"{name!r}, whose batch input_batch_dim names as dimension {dim} (leading "
            f"dimensions {lead} as passed), but {'keeps' if len(alike) == 1 else 'keep'} the "
            "default batch dimension 0: on real "
            f"ranks each rank's share would be read as its part of a dimension 0 {world} "
            "times longer, and the step would train wrong.",
            hint="name them: input_batch_dim={"
            + ", ".join([f"{name!r}: {dim}"] + [f"{a!r}: {dim}" for a in alike])
            + "}, or {" + ", ".join(f"{a!r}: 0" for a in alike) + "} if dimension 0 is their batch.",
        )
        if not simulated:
            raise error
        warnings.warn(f"{error} (refused on real ranks; simulated ranks are passed the global value, "
                      "which is split right either way)", stacklevel=2)
        return


def check_program_iterations(
    program: DistributedProgram, named: Callable[[str], bool], hint: str | None = None
) -> None:
    """``check_iterated_batches`` for ``program``, whose split arguments are read off its
    input placements (their first mesh dimension's shard); ``named``: whether the mode
    names an argument's batch dimension; ``hint``: for a mode without ``input_batch_dim``.
    Also the items of a list argument stacked as samples (NOTE: [samples of a list
    stacked])."""
    check_stacked_samples(program.stacked_samples, named)
    check_iterated_batches(
        program.iterated_batches, named, _split_inputs(program), simulated=active_simulation() is not None, hint=hint
    )


def check_batch_dim_names(batch_dims: int | dict[str, int | None], bindings: StepBindings, mode: object) -> None:
    """Refuse a name of ``input_batch_dim`` that names no argument of the call (NOTE:
    [names that name nothing]); run before anything is placed. ``mode``: the mode whose
    names these are; what covered an argument of its earlier calls is its own record
    (``_COVERED``)."""
    if isinstance(batch_dims, int) or bindings.step is None:
        return
    step = bindings.step
    parameters, any_keyword = argument_names(step)
    var_keyword = _var_keyword(step)
    paths = argument_paths(step, bindings.args_spec, nones=True)
    covered = _COVERED.setdefault(mode, {}).setdefault(step_code(step), set())
    for name in batch_dims:
        if any(_covers(name, path) for path in paths):
            covered.add(name)
            continue
        parsed = _parsed(name)
        top = parsed[0] if parsed is not None else name.split("[", 1)[0].split(".", 1)[0]
        passed = any(_covers(top, path) for path in paths)
        if name == top and top in parameters and top != var_keyword and not passed:
            continue  # a parameter this call leaves out: names it in the calls that pass it
        if name in covered and parsed is not None and _key_of_a_passed_dict(parsed, paths):
            continue  # a key an earlier call passed and this call's dict leaves out
        tensors = tensor_argument_names(step, bindings)
        shown = ", ".join(tensors[:_SHOWN_PATHS]) + (
            f" and {len(tensors) - _SHOWN_PATHS} more" if len(tensors) > _SHOWN_PATHS else ""
        )
        if top == var_keyword:
            why = (f"{top!r} is the step's **{top}, whose arguments are named by their own "
                   "names")
        elif top not in parameters and not any_keyword:
            why = f"the train step has no parameter {top!r}; its parameters: {', '.join(parameters)}"
        elif not passed:
            why = f"this call passes no argument {top!r}"
        else:
            why = f"no argument path of this call is {name!r} or lies inside it"
        meant = _meant(parsed, paths, var_keyword) if parsed is not None else None
        if meant is None:
            close = difflib.get_close_matches(name, _prefixes(tensors), n=1, cutoff=0.6)
            meant = close[0] if close else None
        if name == var_keyword:
            caught = [t for t in tensors if (_parsed(t) or (t, []))[0] not in parameters]
            hint = ("name each argument it catches: input_batch_dim={"
                    + ", ".join(f"{t!r}: {batch_dims[name]}" for t in caught) + "}.")
        elif meant is not None:
            hint = f"did you mean {meant!r}? input_batch_dim={{{meant!r}: {batch_dims[name]}}}."
        else:
            hint = ("name a tensor argument as the step reads it: a key as batch['mask'], a field "
                    "of a dataclass, namedtuple or namespace as batch.mask, an item as batch[1].")
        raise SPMDCompileError(
            f"input_batch_dim names {name!r}, but {why}: the name covers no argument of the "
            f"call, and the argument it meant would keep the default batch dimension 0. The "
            f"tensor arguments, as input_batch_dim names them: {shown or 'none'}.",
            user_line=step_where(step),
            hint=hint,
        )


_SHOWN_PATHS = 12

# per mode and step, the names of input_batch_dim that covered an argument of an earlier
# call (NOTE: [names that name nothing]). Kept by the mode's identity, not in it: the
# compile cache keys a program by the mode's attributes, which a record of calls would
# change; and not per step and names alone, which two modes given the same names shared
_COVERED: weakref.WeakKeyDictionary[object, dict[types.CodeType, set[str]]] = weakref.WeakKeyDictionary()


def _key_of_a_passed_dict(parsed: tuple[str, list[Part]], paths: list[str]) -> bool:
    """Whether ``parsed`` is a string key of a dict this call passes (and leaves the key
    out): ``batch['attention_mask']`` where a collator drops the mask from some batches.
    Accepted where the name covered an argument of an earlier call, as a parameter left
    out is; on a first call it cannot be told from a typo (``batch['tokens']`` for
    ``batch['tok']``), and is refused."""
    top, parts = parsed
    if not parts or parts[-1][0] != "key" or not isinstance(parts[-1][1], str):
        return False
    parent = _render(top, parts[:-1])
    for path in paths:
        if path.startswith(parent + "["):
            sub = _parsed("x" + path[len(parent):])
            if sub is not None and sub[1] and sub[1][0][0] == "key" and isinstance(sub[1][0][1], str):
                return True
    return False


def _var_keyword(step: Callable[..., object]) -> str | None:
    """The name of the step's ``**kwargs`` parameter, if it has one."""
    try:
        parameters = inspect.signature(step).parameters.values()
    except (TypeError, ValueError):
        return None
    return next((p.name for p in parameters if p.kind is p.VAR_KEYWORD), None)


def _prefixes(paths: list[str]) -> list[str]:
    """Every path and each container above it (``batch``, ``batch['ids']``)."""
    out: dict[str, None] = {}
    for path in paths:
        parsed = _parsed(path)
        if parsed is None:
            out[path] = None
            continue
        top, parts = parsed
        for k in range(len(parts) + 1):
            out[_render(top, parts[:k])] = None
    return list(out)


def _meant(parsed: tuple[str, list[Part]], paths: list[str], var_keyword: str | None) -> str | None:
    """The path a name that covers none means, where one reading finds it: a key for an
    attribute or the other way round (``batch.tok`` of a dict), an item by its position
    (a NamedTuple's ``batch[0]``, ``batch[-1]``), an argument of ``**inputs`` under its
    own name (``inputs['x']``); None where none does."""
    top, parts = parsed
    if top == var_keyword and parts and isinstance(parts[0][1], str):
        top, parts = parts[0][1], parts[1:]
    known = [q for q in map(_parsed, paths) if q is not None]
    found: list[Part] = []
    for kind, value in parts:
        below = [ps for t, ps in known if t == top and ps[: len(found)] == found and len(ps) > len(found)]
        children = list(dict.fromkeys(ps[len(found)] for ps in below))
        if (kind, value) in children:
            found.append((kind, value))
            continue
        if isinstance(value, str):
            other = ("key" if kind == "attr" else "attr", value)
            if other not in children:
                return None
            found.append(other)
            continue
        items = [v for k, v in children if k == "key" and isinstance(v, int)]
        if items and len(items) == len(children):  # a sequence: its items by index
            index = value + max(items) + 1 if value < 0 else value
            if ("key", index) not in children:
                return None
            found.append(("key", index))
        elif children and all(k == "attr" for k, _ in children) and -len(children) <= value < len(children):
            found.append(children[value])  # a NamedTuple's fields, in order
        else:
            return None
    meant = _render(top, found)
    return meant if any(_covers(meant, path) for path in paths) else None


# NOTE: [capture failures of split arguments]
# On real ranks each rank passes its share of every split argument, and the step is
# captured at the global shapes the mode builds from them: the share's batch dimension
# times the ranks. Where that dimension is not the argument's batch (a time-major
# ``(S, B, E)`` sequence into ``nn.TransformerEncoder(batch_first=False)``, nothing
# named), the captured arguments disagree although each rank's own tensors agree, and
# torch's error quotes the global sizes ("Expected key_padded_mask.shape[0] to be 4,
# but got 8", "Expected input batch_size (4) to match target batch_size (8)" on 2 gloo
# ranks, 2026-12-05), with no word of input_batch_dim. A capture failure on real ranks
# whose message names the global size of a split dimension says which dimension of
# which argument was read as the batch, and how to name another; as an "if": the
# mismatch may be the step's own. A Python int argument is not scaled so: PyG's
# ``size=data.num_graphs`` (this rank's 4 graphs) beside split labels captured as 8 gave
# the same "Expected input batch_size (4) to match target batch_size (8)" on 2 gloo
# ranks, and the hint above pointed at input_batch_dim (sixty-fourth session). Where
# the message also quotes the value of an int argument of the call, the hint says that
# such an argument is read as one global value on every rank while split tensors are
# the global batch, and suggests a size taken from a split tensor (``y.shape[0]``;
# NOTE: [counts passed as Python ints] in ``local_indices.py``).


def split_arguments_hint(
    splits: list[tuple[str, tuple[int, ...], tuple[int, ...], int]], message: str,
    state: Sequence[tuple[str, tuple[int, ...]]] = (),
) -> str | None:
    """What to do where a capture failure on real ranks may come from a split argument
    whose batch is not where the mode read it (NOTE: [capture failures of split
    arguments]); ``splits``: ``(name, this rank's shape, captured shape, dimension)`` of
    each argument split along ``dimension``; ``state``: ``(what, shape)`` of the modules'
    tensors (``"module buffer 'h'"``), one of which the message may quote (NOTE:
    [batch-sized module state]). None where ``message`` quotes no captured size of a
    split dimension."""
    numbers = _quoted_numbers(message)
    if not any(whole[dim] in numbers for _, _, whole, dim in splits):
        return None
    shown = [
        f"{name!r} along dimension {dim} (this rank's {tuple(local)} as {tuple(whole)})"
        for name, local, whole, dim in splits[:_SHOWN_SPLITS]
    ]
    if len(splits) > _SHOWN_SPLITS:
        shown.append(f"and {len(splits) - _SHOWN_SPLITS} more")
    captured = (
        "the step was captured at the global shapes the mode builds from each rank's share, "
        f"taking these dimensions as the batch: {', '.join(shown)}."
    )
    runs = _quoted_runs(message)
    if not any(tuple(whole) in runs for _, _, whole, _ in splits if len(whole) > 1):
        held = _module_state_quoted(splits, state, runs)
        if held is not None:
            return held + " (" + captured[0].upper() + captured[1:-1] + ".)"
    first, batch = _named_in(splits, message)
    example = "{'<argument>': <dimension>}" if first is None else f"{{{first!r}: {batch}}}"
    return (
        f"if the sizes that disagree are those of arguments split over the ranks: {captured} "
        "If an argument's batch lies in another dimension (a time-major (S, B, E) sequence: "
        f"dimension 1), name it with the mode's input_batch_dim (input_batch_dim={example}), "
        "or None for one every rank passes whole."
    )


# NOTE: [batch-sized module state]
# A stateful GRU language model keeps its hidden state in a buffer sized for the rank's
# own share (``register_buffer("h", zeros(1, B / world, H))``, the DDP habit). Module
# state is not split: every rank holds it whole, while the step is captured at the
# global batch, and torch refused "Expected hidden size (1, 8, 6), got [1, 4, 6]" on 2
# gloo ranks. The hint of NOTE: [capture failures of split arguments] fell back to "the
# first argument, dimension 1" (input_batch_dim={'x': 1}) where the quoted size was no
# argument's; following it, the batch-first x was split along time, and the model
# trained wrong with no warning (losses 2.5453 / 2.4390 / 2.4200 against eager's
# 2.5536 / 2.4317 / 2.4284; sixty-fourth session; NOTE: [a named batch dimension read as
# time] now refuses that). Where the message quotes the whole shape of a module's
# parameter, buffer or tensor attribute, one of whose dimensions is the size a split
# argument's batch has as each rank passes it, and no argument's captured shape, the
# hint names that tensor and says that batch-sized module state must be sized for the
# global batch (the same on every rank), or passed to the step as an argument and
# named with input_batch_dim. Where nothing shows which argument's batch lies
# elsewhere, the example names none.
def _quoted_runs(message: str) -> list[tuple[int, ...]]:
    """The bracketed runs of sizes ``message`` quotes (``(2, 8, 8)``, ``[2, 4, 8]``)."""
    return [tuple(int(n) for n in re.findall(r"\d+", m)) for m in re.findall(r"[(\[][\d,\s]+[)\]]", message)]


def _module_state_quoted(
    splits: list[tuple[str, tuple[int, ...], tuple[int, ...], int]],
    state: Sequence[tuple[str, tuple[int, ...]]], runs: list[tuple[int, ...]],
) -> str | None:
    """The hint of NOTE: [batch-sized module state], where ``runs`` hold the shape of a
    module tensor of ``state`` sized by a rank's share; None where none."""
    globally = {local[dim]: whole[dim] for _, local, whole, dim in splits if local[dim] != whole[dim]}
    for what, shape in state:
        if len(shape) < 2 or tuple(shape) not in runs or not any(n in globally for n in shape):
            continue
        size = tuple(globally.get(n, n) for n in shape)
        return (
            f"the size {list(shape)} is that of the {what} {tuple(shape)}, not of an "
            "argument: module state is not split, every rank holds it whole, while the step "
            "is captured at the global batch (this rank's share times the ranks). Batch-sized "
            f"module state (a recurrent hidden state kept on the model) must be sized for the "
            f"global batch, the same on every rank (here {size}), or passed to the step as an "
            "argument and named with the mode's input_batch_dim (a hidden state "
            "(num_layers, B, H): input_batch_dim={'h': 1}); naming another dimension of an "
            "argument does not fix it."
        )
    return None


_SHOWN_SPLITS = 6


def _quoted_numbers(message: str) -> set[int]:
    """The whole numbers ``message`` quotes as sizes (not ``8.0``, ``x8``, ``layer4``)."""
    return {int(n) for n in re.findall(r"(?<![\w.])\d+(?!\w|\.\d)", message)}


def int_arguments_hint(
    splits: list[tuple[str, tuple[int, ...], tuple[int, ...], int]], ints: list[tuple[str, int]],
    message: str,
) -> str | None:
    """What to add to ``split_arguments_hint`` where ``message`` quotes the value of an int
    argument of the call (``ints``: path, value) beside a captured split size (NOTE:
    [capture failures of split arguments]); None where it quotes none."""
    numbers = _quoted_numbers(message)
    quoted = [(path, n) for path, n in ints if n in numbers]
    quoted_splits = [(name, dim) for name, _, whole, dim in splits if whole[dim] in numbers]
    if not quoted or not quoted_splits:
        return None
    path, value = quoted[0]
    name, dim = quoted_splits[0]
    return (
        f"If a size comes from the int argument {path!r} ({value}): a Python int argument is "
        "read as one global value, the same on every rank, while each split tensor argument "
        "is captured as the global batch (this rank's share times the ranks). A count of this "
        f"rank's items (PyG's data.num_graphs) disagrees with it: take the size from a split "
        f"tensor instead ({name}.shape[{dim}]), which the capture sees as the global one."
    )


def _named_in(
    splits: list[tuple[str, tuple[int, ...], tuple[int, ...], int]], message: str
) -> tuple[str | None, int]:
    """The split argument the example of ``split_arguments_hint`` names, and the batch
    dimension it suggests: the argument whose whole captured shape (of two dimensions or
    more) the message quotes (``got [4, 4, 8]``: a GRU's unnamed ``h0``, not the
    batch-first ``x`` before it); else the one whose split dimension, as this rank
    passed it, has a size no other split argument's has, while another of its
    dimensions has such a size (feature-major ids ``(F, B, L)`` beside a ``(B, D)``
    dense input: ``ids`` along dimension 1, not the first argument, 2 gloo ranks,
    sixty-first session); else none (NOTE: [batch-sized module state])."""
    runs = _quoted_runs(message)
    for name, _, whole, _ in splits:
        if len(whole) > 1 and tuple(whole) in runs:  # "(8)" may be any size
            return name, _other_batch_dim(splits, name)
    for name, local, _, dim in splits:
        batches = {other[d] for n, other, _, d in splits if n != name}
        if local[dim] not in batches and any(local[d] in batches for d in range(len(local)) if d != dim):
            return name, _other_batch_dim(splits, name)
    return None, 1


def _other_batch_dim(splits: list[tuple[str, tuple[int, ...], tuple[int, ...], int]], name: str) -> int:
    """The first dimension of ``name``'s share, other than its split one, whose size is
    another split argument's batch size as passed; 1 where none is."""
    local, dim = next((local, dim) for n, local, _, dim in splits if n == name)
    batches = {other[d] for n, other, _, d in splits if n != name}
    return next((d for d in range(len(local)) if d != dim and local[d] in batches), 1)
