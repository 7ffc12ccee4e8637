"""Benchmarks: compiled steps beside torch's eager DDP / FSDP2 / tensor parallel.

``python -m benchmarks.run --suite cpu`` writes ``benchmarks/results/``. See docs/design.md
("Performance"): ratios are measured side by side in one run, never in timed tests.
"""
