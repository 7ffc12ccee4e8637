"""The demo command: parity report, JSON fields, exit code."""

from __future__ import annotations

import json

from spmd_compiler.__main__ import main

FIELDS = {
    "mode", "world_size", "backend", "steps", "losses", "reference_losses",
    "max_param_rel_diff", "collectives", "comm_bytes_per_step", "compile_seconds",
    "step_seconds",
}


def test_demo_world_4_writes_json_and_passes(tmp_path, capsys):
    path = tmp_path / "r.json"
    code = main(["demo", "--steps", "3", "--json", str(path)])
    assert code == 0
    report = json.loads(path.read_text())
    assert FIELDS <= set(report)
    assert report["mode"] == "dtensor_expand" and report["world_size"] == 4
    assert len(report["losses"]) == len(report["reference_losses"]) == 3
    assert report["max_param_rel_diff"] < 1e-5
    # the default pipeline buckets the 35 gradients and the loss's partial sum under the
    # 25 MiB cap: one bucket, plus the loss's total weight (needed before backward);
    # bytes are exactly one all-reduce of the grads and the two loss scalars
    assert report["collectives"] == {"all_reduce": 2}
    assert report["comm_bytes_per_step"] == 440_832 + 2 * 4
    assert report["collectives_before_passes"] == {"all_reduce": 37}
    assert report["comm_bytes_per_step"] > 0
    assert report["losses"][-1] < report["losses"][0]
    out = capsys.readouterr().out
    assert "parity OK" in out
    # a line per step as it runs, before the final table (issue 13)
    assert out.index("step 1/3: loss") < out.index("step 3/3: loss") < out.index("parity OK")
    assert "(includes compile)" in out.splitlines()[0]


def test_demo_exit_code_reports_parity_failure(monkeypatch, tmp_path):
    import spmd_compiler.tools.demo.run as run

    original = run.run_reference

    def skewed(config):
        losses, state = original(config)
        state = {k: v + 1.0 for k, v in state.items()}
        return losses, state

    monkeypatch.setattr(run, "run_reference", skewed)
    assert main(["demo", "--steps", "2", "--world-size", "2"]) == 1
