"""Errors raised to users, and the helpers that locate a graph node in their code.

NOTE: [user-facing errors]
Every error a user can cause names what we know of its origin: the ATen op, the graph
node, the module FQN (``node.meta[MODULE_FQN]``, recorded at capture) and the line of the
user's train step (found in the node's recorded stack trace, or in the Python traceback
when capture itself failed), plus what to do instead. Errors are raised before the
user's model or optimizer is modified: compilation works on fake tensors and only the
runtime's final install step touches real state.
"""

from __future__ import annotations

import logging
import os
import re
import traceback
import types
from dataclasses import dataclass
from typing import cast

import torch.fx

from .ir.node_meta import (
    MODULE_FQN,
    USER_LINE,
)


@dataclass(frozen=True)
class SourceLocation:
    filename: str
    lineno: int
    code: str

    def __str__(self) -> str:
        return f'{self.filename}:{self.lineno}: "{self.code}"'


# NOTE: [names below an argument]: a guard names what it reads below a step argument by
# the argument's label and the path walked on (``argument ctr of the step`` + ``.n``);
# shown as it was built that read "argument ctr of the step.n was 1, now 2" (the
# sixtieth session's probe). A change reads "attribute n of argument ctr of the step";
# an entry of an argument, "argument batch['ids'][0] of the step".
_BELOW_AN_ARGUMENT = re.compile(r"argument (.+?) of the step([.\[][^\s]*)")


def _argument_words(match: re.Match[str]) -> str:
    label, below = match.group(1), match.group(2)
    if below.startswith("."):
        return f"attribute {below[1:]} of argument {label} of the step"
    return f"argument {label}{below} of the step"


def readable_name(what: str) -> str:
    """``what`` with each path below a step argument in words (NOTE: [names below an
    argument])."""
    return _BELOW_AN_ARGUMENT.sub(_argument_words, what) if " of the step" in what else what


def argument_path(what: str) -> str | None:
    """The path a readable name gives below the step's arguments (``ctr.n`` for
    ``attribute n of argument ctr of the step``, ``batch['ids'][0]``), or None."""
    attribute = re.fullmatch(r"attribute (.+) of argument (.+?) of the step", what)
    if attribute:
        return f"{attribute.group(2)}.{attribute.group(1)}"
    argument = re.fullmatch(r"argument (.+) of the step", what)
    return argument.group(1) if argument else None


class Change(str):
    """Why a call cannot run a program compiled before, in the words logged
    (``<what> was <old>, now <new>``), with its parts kept: the compiled step counts the
    new values of each ``what`` to warn about repeated recompiles. ``was`` / ``now`` are
    the values as shown; None for a change told in words alone (``the code the step
    reaches was replaced``)."""

    what: str
    was: str | None
    now: str | None
    # the change is more hooks on a module or optimizer than before: the step
    # registers one every time it runs (said so in the refusal)
    registered: bool = False
    # for an attribute: (the ``__dict__`` holding it, its name), to find the line that
    # writes it (NOTE: [lines of param-group writes])
    place: tuple[object, object] | None = None

    def __new__(cls, what: str, was: str | None = None, now: str | None = None,
                verb: str = "was") -> Change:
        what = readable_name(what)
        text = what if was is None else f"{what} {verb} {was}, now {now}"
        change = super().__new__(cls, text)
        change.what, change.was, change.now = what, was, now
        return change


class SPMDCompileError(RuntimeError):
    """A train step that cannot be compiled (or run) as asked; the model is untouched."""

    def __init__(
        self,
        message: str,
        *,
        op: str | None = None,
        node: str | None = None,
        module_fqn: str | None = None,
        user_line: SourceLocation | str | None = None,
        hint: str | None = None,
        failed_at: SourceLocation | None = None,
        made_at: SourceLocation | None = None,
        library_note: bool = True,
    ) -> None:
        """``failed_at``: the innermost line of model code where the failure started,
        where it is not ``user_line`` (the note on a line of an installed package);
        ``made_at``: the model's line that made a node's op, where it is another line
        than ``user_line`` (a view in a module's forward, reached from the step's
        ``loss = model(x)...``), shown; ``library_note``: False where the hint already
        says what a line in an installed package means (no change of the step reaches it)."""
        self.message, self.op, self.node, self.module_fqn = message, op, node, module_fqn
        self.user_line, self.hint, self.failed_at = user_line, hint, failed_at
        self.made_at, self.library_note = made_at, library_note
        parts = [message]
        if op:
            parts.append(f"  op:          {op}")
        if node:
            parts.append(f"  graph node:  {node}")
        if module_fqn is not None:
            parts.append(f"  module:      {module_fqn or '<root module>'}")
        if user_line:
            parts.append(f"  train step:  {user_line}")
        if made_at is not None:
            parts.append(f"  op made at:  {made_at}")
        if hint:
            parts.append(f"  what to do:  {hint}")
        package = installed_package_of(failed_at or made_at or user_line)
        if package is not None and library_note:
            parts.append(
                f"  note:        the line is in the installed package {package!r}, not in the "
                f"step's own code: make the change through what leads there (the package's "
                f"configuration, or the arguments the step passes it)"
            )
        super().__init__("\n".join(parts))

    def in_module(self, module_fqn: str) -> SPMDCompileError:
        """The same error naming ``module_fqn``, where it named no module."""
        if self.module_fqn is not None:
            return self
        return SPMDCompileError(
            self.message, op=self.op, node=self.node, module_fqn=module_fqn,
            user_line=self.user_line, hint=self.hint, failed_at=self.failed_at, made_at=self.made_at,
            library_note=self.library_note,
        )


    def with_hint(self, hint: str) -> SPMDCompileError:
        """The same error with ``hint`` as what to do."""
        return SPMDCompileError(
            self.message, op=self.op, node=self.node, module_fqn=self.module_fqn,
            user_line=self.user_line, hint=hint, failed_at=self.failed_at, made_at=self.made_at,
            library_note=self.library_note,
        )


# the folders installed packages lie in, as a part of a file's path
LIBRARY_DIRS = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def in_installed_package(path: str) -> bool:
    """Whether ``path`` is a file of an installed package (not the user's own code)."""
    return any(marker in path for marker in LIBRARY_DIRS)


def installed_package_of(where: SourceLocation | str | None) -> str | None:
    """The top-level name of the installed package (``transformers``) whose file holds
    ``where``, or None for a line of the user's own code. An error's hint is written for
    code the user can change; at a line of a library it applies to what reaches it."""
    if not isinstance(where, SourceLocation):
        return None
    path = os.path.abspath(where.filename)
    for marker in LIBRARY_DIRS:
        if marker in path:
            top = path.split(marker, 1)[1].split(os.sep, 1)[0]
            return top.removesuffix(".py") or None
    return None


class SPMDRuntimeError(RuntimeError):
    """A compiled step failed while running (e.g. a peer rank died); state is intact."""


def collective_failure(message: str) -> SPMDRuntimeError:
    """The error of a collective of the compiled step that failed on this rank (a peer
    failed, left or was slower than the timeout; ``message`` names the rank that failed
    first), marked ``collective`` so that what catches it adds no cause of its own."""
    error = SPMDRuntimeError(message)
    error.collective = True  # type: ignore[attr-defined]
    return error


def exception_summary(exc: BaseException) -> str:
    """``TypeName: first line of the message``, without a closing period (callers end
    their sentence after it)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0].rstrip('.') if text else ''}"


def step_frame_from_traceback(
    tb: types.TracebackType | None, step_code: types.CodeType
) -> SourceLocation | None:
    """The innermost frame of the user's train step in a Python traceback."""
    found = None
    for frame_summary, code in zip(
        traceback.extract_tb(tb), _codes_of(tb), strict=False
    ):
        if code is step_code:
            found = SourceLocation(
                frame_summary.filename, frame_summary.lineno or 0, frame_summary.line or ""
            )
    return found


def innermost_model_frame(tb: types.TracebackType | None) -> SourceLocation | None:
    """The innermost frame of a traceback outside torch and this package: the line of
    the model (or the train step) where the failure started, e.g. a ``torch.where(mask)``
    in a module's forward."""
    return _innermost_outside_torch(traceback.extract_tb(tb))


def innermost_model_traceback(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The entry of ``innermost_model_frame``'s frame in ``tb`` (its frame and the
    instruction it was at), or None."""
    found = None
    while tb is not None:
        if _outside_torch(tb.tb_frame.f_code.co_filename):
            found = tb
        tb = tb.tb_next
    return found


def innermost_model_frame_of_stack(skip_stdlib: bool = False) -> SourceLocation | None:
    """``innermost_model_frame`` of the running code (the caller's stack); with
    ``skip_stdlib``, Python's own library is passed over too (``logging`` formatting a
    message for the user's ``log.info(...)`` line)."""
    frames = traceback.extract_stack()
    if skip_stdlib:
        import sysconfig

        stdlib = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
        frames = traceback.StackSummary.from_list(
            [f for f in frames if not os.path.abspath(f.filename).startswith(stdlib)]
        )
    return _innermost_outside_torch(frames)


def torch_function_called_by_model() -> str | None:
    """The name of the torch function that the innermost model frame of the running code
    called, where the running code is inside it (``vector_to_parameters``, whose
    ``param.data = ...`` the step did not write itself); None where the model's frame
    is not calling into torch's Python code."""
    frames = traceback.extract_stack()
    user = max((i for i, f in enumerate(frames) if _outside_torch(f.filename)), default=None)
    if user is None or user + 1 >= len(frames):
        return None
    inner = frames[user + 1]
    torch_dir = os.path.dirname(os.path.abspath(cast(str, torch.__file__))) + os.sep
    return inner.name if os.path.abspath(inner.filename).startswith(torch_dir) else None


_WARNED_LINES: set[tuple[object, ...]] = set()


def warn_once_per_line(key: tuple[object, ...], message: str) -> None:
    """Log ``message`` with ``{line}`` replaced by the line of the user's code running now
    (the innermost frame outside torch and this package), once per ``key`` and line: a
    capture warning about a line of the step, said once however often it is traced."""
    where = innermost_model_frame_of_stack()
    line = str(where) if where is not None else "the train step"
    if (*key, line) not in _WARNED_LINES:
        _WARNED_LINES.add((*key, line))
        logging.getLogger("spmd_compiler").warning("%s", message.replace("{line}", line))


def _innermost_outside_torch(frames: traceback.StackSummary) -> SourceLocation | None:
    found = None
    for frame_summary in frames:
        if _outside_torch(frame_summary.filename):
            found = SourceLocation(frame_summary.filename, frame_summary.lineno or 0, frame_summary.line or "")
    return found


def _outside_torch(filename: str) -> bool:
    """A file of the user's model or a library it uses: not torch's, not this package's."""
    here = os.path.dirname(os.path.abspath(__file__))  # this package
    skip = (os.path.dirname(os.path.abspath(cast(str, torch.__file__))) + os.sep, here + os.sep)
    path = os.path.abspath(filename)
    return not path.startswith(skip) and not path.startswith("<")


def innermost_model_frame_of_stack_trace(stack_trace: str | None) -> SourceLocation | None:
    """``innermost_model_frame`` of a node's recorded ``stack_trace``: the line of the
    model, or of a library module it calls (transformers' ``modeling_*.py``), that made
    the node's op."""
    found = None
    for filename, lineno, _, code in stack_trace_frames(stack_trace):
        if _outside_torch(filename):
            found = SourceLocation(filename, lineno, code)
    return found


def _codes_of(tb: types.TracebackType | None):
    while tb is not None:
        yield tb.tb_frame.f_code
        tb = tb.tb_next


def step_line_from_stack_trace(
    stack_trace: str | None, step_code: types.CodeType
) -> SourceLocation | None:
    """Parse a node's recorded ``stack_trace`` for the line inside the train step."""
    found = None
    for filename, lineno, func, code in stack_trace_frames(stack_trace):
        if filename == step_code.co_filename and func == step_code.co_name:
            found = SourceLocation(filename, lineno, code)
    return found


def stack_trace_frames(stack_trace: str | None) -> list[tuple[str, int, str, str]]:
    """(file, line, function, code) of each frame of a node's recorded ``stack_trace``,
    outermost first."""
    lines = (stack_trace or "").splitlines()
    frames = []
    for i, line in enumerate(lines):
        text = line.strip()
        if not text.startswith("File "):
            continue
        try:
            filename = text.split('"')[1]
            lineno = int(text.split("line ")[1].split(",")[0])
            func = text.split(", in ")[1].strip()
        except (IndexError, ValueError):
            continue
        frames.append((filename, lineno, func, lines[i + 1].strip() if i + 1 < len(lines) else ""))
    return frames


def node_op(node: torch.fx.Node) -> str:
    """How errors name ``node``'s op: its target for a call, else its kind."""
    return str(node.target) if node.op == "call_function" else node.op


def node_error(
    message: str, node: torch.fx.Node, *, hint: str | None = None, made_at: SourceLocation | None = None
) -> SPMDCompileError:
    """An error about ``node`` that carries its op, FQN and train-step line, and the
    model line that made the op where that is another line (nanoGPT's ``qkv(x).view(...)``
    in ``forward`` was named by the step's loss line alone; sixty-second session):
    ``made_at`` where the caller knows it, else the innermost model frame of the node's
    recorded stack trace."""
    line = node.meta.get(USER_LINE)
    made = made_at or innermost_model_frame_of_stack_trace(node.meta.get("stack_trace"))
    if made is not None and line and (made.filename, made.lineno) == (
        getattr(line, "filename", None), getattr(line, "lineno", None)
    ):
        made = None
    return SPMDCompileError(
        message,
        op=node_op(node),
        node=node.name,
        module_fqn=node.meta.get(MODULE_FQN),
        user_line=line,
        hint=hint,
        made_at=made,
    )


def mesh_of_another_size(mode: str, mesh_size: int, world: int, shape: tuple[int, ...] | None = None) -> SPMDCompileError:
    """A mode's mesh that does not span the process group's ranks: smaller (the other
    ranks would have no part of the step) or bigger (``mesh_shape=(2, 2)`` at 2 ranks,
    which torch's ``init_device_mesh`` refused with its own "Mesh should not be bigger
    than default world size"). One message for both, raised before any state is placed."""
    if mesh_size > world or shape is not None:
        asked = f" (mesh_shape={shape})" if shape is not None else ""
        bigger = mesh_size > world
        return SPMDCompileError(
            f"{mode} uses a mesh of {mesh_size} ranks{asked} but the process group has {world}: "
            + ("the mesh asks for ranks that do not exist." if bigger else
               "the other ranks would have no part of the step."),
            hint=f"make the mesh's shape multiply to {world} (e.g. mesh_shape=(1, {world}) for tensor "
            f"parallel alone, ({world}, 1) for data parallel alone)"
            + (f", or run on {mesh_size} ranks (simulate(world_size={mesh_size}), torchrun "
               f"--nproc-per-node {mesh_size})." if bigger else "."),
        )
    return SPMDCompileError(
        f"{mode} uses a mesh of {mesh_size} ranks but the process group has {world}: the other "
        "ranks would have no part of the step (a sub-mesh such as mesh['tp'] of a 2-D mesh spans "
        "part of the ranks).",
        hint="build the mesh over all ranks (init_device_mesh); for tensor parallel "
        "inside data parallel use the fsdp_tp mode on the 2-D mesh "
        "(make_mode('fsdp_tp', mesh_shape=(dp, tp), plan=...)).",
    )
