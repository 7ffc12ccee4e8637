"""Stage 4, running: state ownership, the per-rank program on real or simulated ranks.

``runner`` installs the sharded state and runs an executable; ``cross_iteration`` cuts a
program with deferred reductions into first / steady / finish; ``simulate`` and ``launch``
give simulated ranks or real process groups; ``same_inputs`` and ``faults`` check ranks
agree and name the one that failed; ``checkpoint`` saves and resumes with DCP.
"""
