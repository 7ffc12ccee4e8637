"""``python -m benchmarks.real_models``: the table's verdicts and merging parallel runs
(no model runs here; tests/models runs the zoo)."""

from __future__ import annotations

import json

from benchmarks.real_models import main, markdown, merge


def _row(model: str, mode: str, dtype: str, loss: float, param: float, **extra) -> dict:
    return {
        "model": model, "mode": mode, "ranks": 4, "dtype": dtype, "steps": 3,
        "loss_rel": loss, "param_rel": param, "param_worst": "param.transformer.h.0.w",
        "param_rel_no_key_bias": param, "param_no_key_bias_worst": "param.model.w",
        "state_rel": param, "state_worst": "param.w", "checked_rel": param,
        "compile_s": 1.0, "step_ms": 2.0, "eager_ms": 3.0, **extra,
    }


def _results(rows: list[dict], wall: float = 10.0) -> dict:
    return {"torch": "2.13", "transformers": "5", "steps": 3, "rows": rows,
            "failures": [], "notes": ["a note"], "wall_seconds": wall}


def test_verdicts_per_dtype():
    table = markdown(_results([
        _row("gpt2", "ddp", "float64", 1e-7, 1e-12),
        _row("gpt2", "fsdp", "float64", 1e-7, 1e-9),
        _row("llama", "ddp", "float32", 1e-7, 2e-6),
        _row("llama", "fsdp", "float32", 1e-7, 2e-5, sgd_param_rel_no_key_bias=3e-8),
        _row("bert", "ddp", "float32", 1e-7, 2e-5, sgd_param_rel=4e-7),
    ]))
    lines = [line for line in table.splitlines() if line.startswith(("| gpt2", "| llama", "| bert"))]
    assert "1.0e-12 met" in lines[0]
    assert "**missed**" in lines[1]
    assert "| met |" in lines[2]
    assert "**above 1e-5**; SGD 3.0e-08" in lines[3]
    assert "**above 1e-5**; SGD <= 4.0e-07" in lines[4]  # the worst of all parameters
    assert "(h.0.w)" in lines[0]  # FQN prefixes shortened


def test_merge_orders_rows_and_writes(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_results([_row("llama", "ddp", "float32", 0, 0)], wall=5)))
    b.write_text(json.dumps(_results([_row("gpt2", "ddp", "float64", 0, 0),
                                      _row("gpt2", "ddp", "float32", 0, 0),
                                      _row("llama", "ddp", "float32", 0, 1.0)], wall=7)))
    merged = merge([str(a), str(b)])
    assert merged["rows"][-1]["param_rel"] == 1.0  # the later file's row of a case
    assert [(r["model"], r["dtype"]) for r in merged["rows"]] == [
        ("gpt2", "float64"), ("gpt2", "float32"), ("llama", "float32"),
    ]
    assert merged["wall_seconds"] == 7 and merged["parallel_runs"] == 2
    assert main(["--merge", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "real_models.md").read_text()
    assert "joined from 2 runs" in text and text.count("| gpt2 |") == 2
