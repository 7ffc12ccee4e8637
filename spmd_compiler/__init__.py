"""spmd_compiler: compile a whole PyTorch train step into one SPMD program.

    import spmd_compiler as sc
    from spmd_compiler.parallel_modes import DTensorExpandMode

    @sc.compile(parallel_mode=DTensorExpandMode())
    def train_step(model, optim, batch, target): ...

See DESIGN.md for the pipeline: capture -> plan -> expand -> passes -> run.
"""

from .api import CompiledTrainStep, compile
from .errors import SPMDCompileError, SPMDRuntimeError
from .launch import init_from_env, launch
from .simulate import Simulation, active_simulation, simulate

__all__ = [
    "CompiledTrainStep",
    "SPMDCompileError",
    "SPMDRuntimeError",
    "Simulation",
    "active_simulation",
    "compile",
    "init_from_env",
    "launch",
    "simulate",
]
