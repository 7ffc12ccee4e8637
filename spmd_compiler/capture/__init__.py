"""Stage 1, capture: the user's whole train step as one functional ATen graph.

``trace`` runs make_fx over forward, loss, backward and the optimizer step;
``bindings`` finds the modules, optimizers and tensors the step is called with;
``attention`` and ``optimizers`` rewrite what DTensor cannot shard or trace as is;
``python_scalars`` and ``guards`` handle the Python values the step reads.
What leaves this stage: ``ir.signature.CapturedStep``.
"""
