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
    "init_from_env": ".runtime.launch",
    "launch": ".runtime.launch",
    "Simulation": ".runtime.simulate",
    "active_simulation": ".runtime.simulate",
    "simulate": ".runtime.simulate",
    "shard_onto_parent": ".expand.parent_mesh",
}
# public name -> a module users reach as an attribute (``sc.checkpoint.save(...)``)
_MODULES = {
    "checkpoint": ".checkpoint",  # the public names of .runtime.checkpoint
    "parity": ".tools.parity",
}

if TYPE_CHECKING:
    from . import checkpoint
    from .api import CompiledTrainStep, compile
    from .errors import SPMDCompileError, SPMDRuntimeError
    from .expand.parent_mesh import shard_onto_parent
    from .runtime.launch import init_from_env, launch
    from .runtime.simulate import Simulation, active_simulation, simulate
    from .tools import parity


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value: Any = importlib.import_module(_MODULES[name], __name__)
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    else:
        raise AttributeError(f"module 'spmd_compiler' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS, *_MODULES])


__all__ = [
    "CompiledTrainStep",
    "SPMDCompileError",
    "SPMDRuntimeError",
    "Simulation",
    "__version__",
    "active_simulation",
    "checkpoint",
    "compile",
    "init_from_env",
    "launch",
    "parity",
    "shard_onto_parent",
    "simulate",
]
