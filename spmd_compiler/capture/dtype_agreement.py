"""Matrix products and convolutions whose operands' dtypes differ, refused at capture.

NOTE: [operands of one dtype]
Eager's CPU and CUDA kernels of ``mm`` / ``addmm`` / ``bmm`` / ``baddbmm`` / ``mv`` /
``addmv`` / ``dot`` / ``convolution`` refuse operands of different dtypes ("mat1 and mat2
must have the same dtype"), but their fake (meta) kernels, which the capture traces
with, do not check. A float32 batch into a float64 model (a common first-hour slip)
captured, expanded and failed only when the per-rank program ran: in simulation torch's
bare message without the step's line, on real ranks a message suspecting the other rank.
The captured graph is checked here instead, the first call refused before any state is
placed, with eager's words, the op, the module and the line. Autocast inserts its casts
before these ops, so autocast regions pass.
"""

from __future__ import annotations

import torch
import torch.fx

from ..errors import node_error

_aten = torch.ops.aten
# op -> the positions of its tensor operands that must share one dtype (the two factors, or
# a convolution's input and weight: an added bias of another dtype is left to the kernels)
_OPERANDS: dict[object, tuple[int, ...]] = {
    _aten.mm.default: (0, 1),
    _aten.addmm.default: (1, 2),
    _aten.bmm.default: (0, 1),
    _aten.baddbmm.default: (1, 2),
    _aten.mv.default: (0, 1),
    _aten.addmv.default: (1, 2),
    _aten.dot.default: (0, 1),
    _aten.convolution.default: (0, 1),
}


def refuse_mixed_dtype_operands(gm: torch.fx.GraphModule) -> None:
    """Raise on the first op of ``_OPERANDS`` whose tensor operands differ in dtype.

    Raises:
        SPMDCompileError: naming the op, the dtypes, the module and the train-step line.
    """
    for node in gm.graph.nodes:
        positions = _OPERANDS.get(node.target) if node.op == "call_function" else None
        if positions is None:
            continue
        values = [node.args[i].meta.get("val") for i in positions
                  if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)]
        dtypes = [v.dtype for v in values if isinstance(v, torch.Tensor)]
        if len(set(dtypes)) > 1:
            raise node_error(
                f"{node.target} takes operands of different dtypes ({', '.join(str(d) for d in dtypes)}), "
                "which eager refuses too (\"mat1 and mat2 must have the same dtype\").",
                node,
                hint="cast the input to the model's dtype (x.to(model_dtype)), or the model to "
                "the input's, before the step; under autocast the casts are made for you.",
            )
