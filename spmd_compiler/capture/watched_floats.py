"""Float arguments watched for reads of their value, in the trace that checks a float
the program does not read (NOTE: [float arguments the program does not read] in
``trace.py``).

A ``Watched`` float is a ``float`` subclass: ``isinstance(w, float)`` holds, as in
eager (a tensor stand-in fails it), and every use of its value in Python (a comparison,
arithmetic, ``float()``, ``round``, a format string, hashing) or in a torch call (a Scalar
argument, ``loss * w``: ``WatchedReads`` sees it among the arguments) is recorded. A
C function that reads the double itself (``math.exp(w)``) is not seen here; the trace
with a tensor stand-in sees that one (``__float__`` of a tensor).
"""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

from .._torch_private import pytree

_READS = (
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__hash__", "__bool__",
    "__float__", "__int__", "__round__", "__trunc__", "__floor__", "__ceil__",
    "__repr__", "__str__", "__format__", "__abs__", "__neg__", "__pos__", "__add__",
    "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__divmod__", "__rdivmod__",
    "__pow__", "__rpow__", "is_integer", "as_integer_ratio", "hex", "conjugate",
)


class WatchedReads(TorchFunctionMode):
    """Records the reads of its ``Watched`` floats; active while the step runs, it
    also records a torch call given one."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def watch(self, value: float) -> float:
        return Watched(value, self)

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if any(isinstance(leaf, Watched) for leaf in pytree.tree_leaves((args, kwargs))):
            self.reads.append(getattr(func, "__name__", str(func)))
        return func(*args, **kwargs)


class Watched(float):
    """A float whose every read is recorded in its ``WatchedReads``."""

    _watcher: WatchedReads

    def __new__(cls, value: float, watcher: WatchedReads) -> Watched:
        self = super().__new__(cls, value)
        self._watcher = watcher
        return self


def _recorded(name: str) -> Any:
    plain = getattr(float, name)

    def method(self: Watched, *args: Any) -> Any:
        self._watcher.reads.append(name)
        return plain(float.__float__(self), *args)

    method.__name__ = name
    return method


for _name in _READS:
    setattr(Watched, _name, _recorded(_name))
