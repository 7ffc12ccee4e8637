"""``python -m benchmarks.inductor_parity``: its verdicts and table (no model runs here;
the benchmark itself launches gloo ranks)."""

from __future__ import annotations

from benchmarks.inductor_parity import ISLAND_TOL, ISLANDS, markdown, verdict


def _row(model: str, state: float, loss: float = 0.0, lowered: bool = True) -> dict:
    return {
        "model": model, "mode": "ddp", "islands": ISLANDS[model], "lowered": lowered,
        "loss_rel": loss, "state_rel": state, "state_worst": "param.w",
        "compile_s": 10.0, "lower_s": 4.0,
    }


def test_float64_bound_unless_the_model_has_float32_parts() -> None:
    assert verdict(_row("bert", 1e-14)).startswith("met")
    assert verdict(_row("bert", 4e-7)).startswith("**missed**")  # no island: float64 bound
    assert verdict(_row("t5", 4e-7)).startswith("met")  # its norm's variance is float32
    assert verdict(_row("t5", 10 * ISLAND_TOL)).startswith("**missed**")
    assert verdict(_row("t5 (norm in model dtype)", 4e-7)).startswith("**missed**")
    assert verdict(_row("gpt2", 1e-8, loss=1e-3)).startswith("**missed**")  # the loss too


def test_a_step_that_was_not_lowered_fails() -> None:
    assert verdict(_row("bert", 0.0, lowered=False)) == "**not lowered**"


def test_table_names_the_float32_parts() -> None:
    table = markdown({"rows": [_row("llama", 2e-7), _row("vit", 1e-14)], "torch": "2.13",
                      "transformers": "5", "notes": ["a note"], "wall_seconds": 3.0})
    llama, vit = (line for line in table.splitlines() if line.startswith(("| llama", "| vit")))
    assert "| RMSNorm, loss |" in llama and "met (<= 1e-06)" in llama
    assert "| none |" in vit and "met (<= 1e-10)" in vit
    assert "10.0 (4.0)" in llama and "- a note" in table
