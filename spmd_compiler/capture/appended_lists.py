"""Lists the step appends to: refused where the step also reads them.

NOTE: [lists the step appends to and reads]
A list (or ``collections.deque``) the step appends traced values to (``history.append(
loss.item())``, ``self.losses.append(...)``) is kept: the runtime appends each call's value
after the call (NOTE: [tensors the step keeps]), and the list is not guarded, as it grows
every call by design. That is sound only while the step never reads it: a compiled step
runs no Python after capture, so a read (``len(history)`` for a warm-up factor, the mean
of a window of past losses to skip a spike, ``history[-1]``, ``for v in window``, ``x in
window``) happened once, at capture, and its answer became a constant of the program.
Until the sixty-third session such a step ran silently on the capture's answer: a warm-up
``min(1, (len(history) + 1) / 3)`` stayed 1/3 every call (losses [0.525, 0.461, 0.458,
0.434] where eager gave [0.525, 0.921, 1.384, 1.305], parameters 0.20 off after 6 calls),
and a spike skip against ``sum(window) / len(window)`` never skipped (eager skipped at the
fourth call: parameters 0.41 off). Guarding the list instead would compile every call (it
grows every call) and still be the wrong tool: the value the step derives changes every
call, so it belongs in a tensor or in the caller. So each place the guards' walk meets such
a list (``Guards.appended``: a global, an attribute of an object or a module, a dict entry
with a str key, a closure variable) is checked in the walked code's bytecode as NOTE: [kept
numbers only written] checks a dict only written (``guards.name_uses``): every instruction
that names it must load it only to call ``append`` or ``extend`` on it at once
(``LOAD_DEREF history / LOAD_METHOD append``, ``LOAD_ATTR losses / LOAD_METHOD append``,
``LOAD_CONST "hist" / BINARY_SUBSCR / LOAD_METHOD append``). Any other use (``len``, an
index, iteration, ``sum``, ``in``, ``+=``, handing it to a function, ``popleft``, binding
it to a local name first) refuses the compile, naming the list and the line of the use,
and leaves the list as found (the capture put its traced values back out). A name shared
with something else the walked code reads (another object's attribute of the same name, a
string constant equal to a dict key) is taken as a read too: refused rather than guessed.
The write-only case (``history.append(loss.item())``, read only outside the step) compiles
once, as before. Not seen, as for every guard: a read by code the walk does not reach, a
read through ``vars`` / ``globals`` / ``__dict__``, a list held under a non-str key or in
another list.
"""

from __future__ import annotations

import dis
import linecache
import types

from ..errors import SourceLocation, SPMDCompileError
from .guards import Guards, name_uses, whole_namespace

# the methods a step may call on a list it appends to, at once, without reading it
_APPENDS = frozenset({"append", "extend"})
_KEY_READS = frozenset({"BINARY_SUBSCR", "PRECALL", "CALL", "CALL_FUNCTION", "CALL_METHOD", "DELETE_SUBSCR"})
_METHOD_LOADS = frozenset({"LOAD_METHOD", "LOAD_ATTR"})


def refuse_appended_lists_read(guards: Guards) -> None:
    """Refuse a step whose walked code reads a list or deque it appends to (see the
    NOTE), naming the list and the line of the read."""
    for name, cell, label, kind in guards.appended:
        read = read_line(guards.codes, name, cell, label)
        if read is None:
            continue
        raise SPMDCompileError(
            f"The train step reads the {kind} it appends to ({label}) at "
            f"{read.filename}:{read.lineno}. A compiled step appends each call's value to it "
            "after the call (NOTE: [tensors the step keeps]) but runs no Python: what the "
            "step read of it (its length, an item, a sum) was read once, when the step was "
            "captured, and would be the same in every call (NOTE: [lists the step appends "
            "to and reads]). Nothing was changed: the list is as the call found it.",
            user_line=read,
            hint="keep the count or the running value in a tensor the step updates in place "
            "(a module buffer made before the first call: self.register_buffer('steps', "
            "torch.zeros((), dtype=torch.long)); self.steps += 1), or compute the decision "
            f"outside the compiled step from the {kind} (warm = min(1, (len(history) + 1) / 3)) "
            "and pass it to the step as an argument; appending to it alone is supported.",
        )


def read_line(codes: list[types.CodeType], name: str, cell: bool, label: str) -> SourceLocation | None:
    """The line of the first read (``_first_read``) of what the walk met at ``name`` (a
    closure variable with ``cell``; a dict entry where ``label``, the guard's name of
    it, ends in that key) by ``codes``, or None where no walked code reads it."""
    found = _first_read(codes, name, cell, key=f"[{name!r}]" in label)
    if found is None:
        return None
    code, ins = found
    line = _line_of(code, ins)
    return SourceLocation(code.co_filename, line, linecache.getline(code.co_filename, line).strip())


def _first_read(
    codes: list[types.CodeType], name: str, cell: bool, key: bool = False
) -> tuple[types.CodeType, dis.Instruction] | None:
    """The first instruction of ``codes`` that names the list ``name`` other than to
    call ``append`` / ``extend`` on it at once (see the NOTE), with its code. With
    ``key`` (the list is a dict's entry): only the constant ``name`` subscripting a
    value or passed to a call (``d.get("loss")``) reads it, not an attribute or method
    of that name (``model(x).loss``, ``opt.step()``) nor a key of a dict literal
    (``return {"loss": ...}``): a review found those refused as reads of
    ``history["loss"]``."""
    for code, instructions, i in name_uses(codes, name, cell):
        ins = instructions[i]
        if whole_namespace(ins):
            continue  # not seen (see the NOTE)
        if key and (ins.opname != "LOAD_CONST" or i + 1 >= len(instructions)
                    or instructions[i + 1].opname not in _KEY_READS):
            continue
        if not _appended_at_once(instructions, i):
            return code, ins
    return None


def _appended_at_once(instructions: list[dis.Instruction], i: int) -> bool:
    """Whether the value instruction ``i`` loads (a name, an attribute, a dict key) is
    loaded only to call ``append`` / ``extend`` on it at once."""
    ins = instructions[i]
    after = i + 1
    if ins.opname == "LOAD_CONST":  # a dict key: d["hist"].append(...)
        after = i + 2 if i + 1 < len(instructions) and instructions[i + 1].opname == "BINARY_SUBSCR" else -1
    loads = ins.opname in ("LOAD_CONST", "LOAD_GLOBAL", "LOAD_NAME", "LOAD_ATTR", "LOAD_METHOD", "LOAD_DEREF",
                           "LOAD_CLASSDEREF")
    following = instructions[after] if loads and 0 <= after < len(instructions) else None
    return following is not None and following.opname in _METHOD_LOADS and following.argval in _APPENDS


def append_line(codes: list[types.CodeType], name: str) -> SourceLocation | None:
    """The one line of ``codes`` (and the code nested in them) that appends to what
    ``name`` names (``self.outputs.append(...)``, ``d["outs"].append(...)``), or None
    where there is none or more than one (for messages: the bytecode says which lines
    append to a name, not which object the name was at run time)."""
    lines = {
        (code.co_filename, _line_of(code, instructions[i]))
        for code, instructions, i in name_uses(codes, name)
        if not whole_namespace(instructions[i]) and _appended_at_once(instructions, i)
    }
    if len(lines) != 1:
        return None
    filename, line = lines.pop()
    return SourceLocation(filename, line, linecache.getline(filename, line).strip())


def _line_of(code: types.CodeType, ins: dis.Instruction) -> int:
    positions = getattr(ins, "positions", None)  # Python 3.11 and later
    if positions is not None and positions.lineno is not None:
        return int(positions.lineno)
    line = code.co_firstlineno
    for other in dis.get_instructions(code):  # Python 3.10: the last line started before it
        if other.starts_line is not None:
            line = other.starts_line
        if other.offset == ins.offset:
            break
    return line


__all__ = ["read_line", "refuse_appended_lists_read"]
