"""Stage 2, expansion: the captured graph re-traced on DTensors into the per-rank program.

``retrace`` drives it (``expand``, ``DistributedProgram``); ``local_rules`` computes ops
on local tensors where DTensor's propagation would move more than a rank needs;
``redistribute`` and ``parent_mesh`` carry our fixes to DTensor's redistribution.
"""
