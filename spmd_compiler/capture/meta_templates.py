"""Modules on the meta device that a step reads by name only as stateless templates.

NOTE: [meta templates read by name]
torch's model-ensembling recipe keeps a module on the meta device (``base =
member().to("meta")``) as a template for ``torch.func.functional_call(base, params,
(x,))``, every parameter and buffer supplied by the call (the members' weights stacked
in a module the step is given, ``vmap`` over them). The step reads ``base`` by name, so
NOTE: [modules read by name beside the given ones] took it as state, and NOTE: [state on
the meta device] refused it ("parameter 1.0.weight is on the meta device ... to_empty"),
naming an internal prefix, where eager trains. A module read by name whose every
parameter and buffer is on the meta device holds no values a program could compute with,
so beside a module the step is given it is not the step's state (a step given no module
reads its model by name, and a meta one there is a model left unmaterialized: still
refused, as one given is). The trace then reads it through ``functional_call`` with
every tensor replaced, which computes what eager does (the prober's 4-member ensemble, 2
simulated ranks, float64: losses within 8.9e-16 of eager, parameters within 6.2e-17, as
with a real-valued template). Any op on one of its own meta tensors (``base(x)``, a
``functional_call`` missing a parameter, ``base.weight.sum()``) is refused while the
step is traced, naming the module and the tensor (``OutsideWrites`` in
``capture/outside_tensors.py``): torch's own error there is "found at least two devices,
cpu and meta", or, for an op on meta tensors alone, a meta result no program can hold.
Reading a shape (``base.weight.shape``) is no op and stays allowed, as in eager.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..errors import SPMDCompileError, innermost_model_frame_of_stack


def is_meta_template(module: torch.nn.Module) -> bool:
    """Whether ``module`` holds state and all of it is on the meta device."""
    tensors = [*module.parameters(), *module.buffers()]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


def template_tensors(templates: Iterable[tuple[torch.nn.Module, str]]) -> dict[int, str]:
    """id(tensor) -> "parameter 0.weight of <where>" for every tensor of ``templates``
    (each a module and where the step reads it, as ``modules_read_by_name`` gives)."""
    named: dict[int, str] = {}
    for module, where in templates:
        for kind, entries in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
            for name, t in entries:
                named.setdefault(id(t), f"{kind} {name} of the meta-device module {where}")
    return named


def template_read(label: str) -> SPMDCompileError:
    """The refusal of an op on a meta template's own tensor (see the NOTE)."""
    return SPMDCompileError(
        f"The train step computes with {label}. A module on the meta device that the step "
        "reads by name is taken as a stateless template for torch.func.functional_call, "
        "every parameter and buffer supplied by the call; its own tensors have no values "
        "(NOTE: [meta templates read by name]).",
        user_line=innermost_model_frame_of_stack(),
        hint="supply every parameter and buffer in the functional_call "
        "(functional_call(base, {**params, **buffers}, (x,))), or, if the step trains the "
        "module itself, materialize it before the first call (model.to_empty(device=...) "
        "and initialize it) and pass it to the step.",
    )


__all__ = ["is_meta_template", "template_read", "template_tensors"]
