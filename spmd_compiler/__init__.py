"""spmd_compiler: compile a whole PyTorch train step into one SPMD program.

    import spmd_compiler as sc
    from spmd_compiler.parallel_modes import DTensorExpandMode

    @sc.compile(parallel_mode=DTensorExpandMode())
    def train_step(model, optim, batch, target): ...

See docs/design.md for the pipeline: capture -> plan -> expand -> passes -> run.

The public names load torch on first use (PEP 562 ``__getattr__``), so ``import
spmd_compiler`` alone, ``__version__`` and ``python -m spmd_compiler --help`` are fast.
"""

from __future__ import annotations

import importlib
import sys
import types
from importlib import metadata as _metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = _metadata.version("spmd_compiler")
except _metadata.PackageNotFoundError:  # run from a source tree that is not installed
    __version__ = "0+unknown"

# public name -> the module that defines it
_EXPORTS = {
    "CompiledTrainStep": ".api",
    "compile": ".api",
    "SPMDCompileError": ".errors",
    "SPMDRuntimeError": ".errors",
    "init_from_env": ".launch",
    "launch": ".launch",
    "Simulation": ".simulate",
    "active_simulation": ".simulate",
    "simulate": ".simulate",
}

if TYPE_CHECKING:
    from .api import CompiledTrainStep, compile
    from .errors import SPMDCompileError, SPMDRuntimeError
    from .launch import init_from_env, launch
    from .simulate import Simulation, active_simulation, simulate


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spmd_compiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps ``spmd_compiler.simulate`` / ``.launch`` the functions: importing the
    submodule of the same name sets the package attribute to the module, which the eager
    ``from .simulate import simulate`` used to overwrite again."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == f".{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "CompiledTrainStep",
    "SPMDCompileError",
    "SPMDRuntimeError",
    "Simulation",
    "__version__",
    "active_simulation",
    "compile",
    "init_from_env",
    "launch",
    "simulate",
]
