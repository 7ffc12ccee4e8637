"""``python -m benchmarks.inductor_parity``: transformers models lowered by Inductor on real ranks.

Simulated ranks always interpret the per-rank program (NOTE: [lowering]), so the zoo
(``benchmarks/real_models.py``, ``tests/models``) and the survey (``benchmarks/hf_survey.py``)
check the interpreter. This checks the kernels: each case compiles a transformers model's
step with ``backend="inductor"`` on 2 gloo ranks (``sc.launch``; each rank passes its half
of the global batch), runs 2 AdamW steps in float64 and compares the losses and every
parameter and optimizer-state tensor with the undecorated step run eagerly on one device
on the global batch. Writes ``benchmarks/results/inductor_parity.{json,md}``.

NOTE: [float32 islands under Inductor]
Several transformers models compute a part in float32 whatever the model's dtype: Llama's
and Mixtral's RMSNorm (``hidden_states.to(torch.float32)``), T5's layer norm (its variance),
Mixtral's router softmax, and the causal-LM loss (``logits.float()``). The interpreter
runs those float32 ops as ATen kernels, as eager does, so a float64 run matches eager
within float64 rounding. Inductor generates its own float32 kernels (vectorized, fused
reductions in another order, its own ``exp`` / ``log``), which round otherwise: the
gradients then differ from eager's by float32 rounding, and 2 AdamW steps carry that into
the state (up to ~4e-7 relative here). The ``t5 (norm in model dtype)`` row runs T5 with
its norm patched to compute in the model's dtype: its difference falls to float64
rounding, which shows where the rest comes from. Models without such an island (BERT,
ViT) are checked against the float64 bound.

Needs transformers (``pip install -e .[models]``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

import spmd_compiler as sc
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import full_state, relative_difference

from .zoo import (
    BATCH,
    STEPS,
    TOL,
    adamw,
    batches,
    causal_lm_step,
    make_model,
    rms_norm_in_model_dtype,
    state_differences,
)

RESULTS = os.path.join(os.path.dirname(__file__), "results")
WORLD, STEP_COUNT = 2, 2
# float32 rounding through 2 AdamW steps (NOTE: [float32 islands under Inductor])
ISLAND_TOL = 1e-6
# the parts each model computes in float32 in a float64 model
ISLANDS = {
    "gpt2": "loss (logits.float())",
    "llama": "RMSNorm, loss",
    "bert": "",
    "vit": "",
    "t5": "layer norm variance",
    "mixtral": "RMSNorm, router softmax, loss",
    "t5 (norm in model dtype)": "",
}
DEFAULT_CASES = (
    "gpt2:ddp,llama:fsdp,bert:ddp,vit:fsdp,t5:ddp,mixtral:fsdp,t5 (norm in model dtype):ddp"
)
NOTES = [
    "loss rel: the worst step's returned loss against eager's; state rel: every parameter "
    "and AdamW state tensor, max|a-b|/max|b|, the worst named (tensors whose reference "
    "never moved beyond 1e-9 in absolute terms, benchmarks/zoo.py: state_differences).",
    f"check: within {TOL:g} for a model computing in float64 throughout, within "
    f"{ISLAND_TOL:g} for one with float32 parts (NOTE: [float32 islands under Inductor] in "
    "benchmarks/inductor_parity.py): Inductor's float32 kernels round otherwise than "
    "ATen's, the interpreter's do not.",
    "lower s: Inductor's lowering of the step's programs on rank 0 (cold cache); compile s: "
    "capture, expansion, passes and lowering.",
]


@contextlib.contextmanager
def _patched(case: str) -> Iterator[None]:
    """T5's layer norm (Llama's RMSNorm form: ``weight``, ``variance_epsilon``) computing
    in the model's dtype, for the case that asks for it."""
    if case != "t5 (norm in model dtype)":
        yield
        return
    from transformers.models.t5 import modeling_t5

    with rms_norm_in_model_dtype(modeling_t5.T5LayerNorm):
        yield


def _kind(case: str) -> str:
    return case.split(" ")[0]


def _worker(rank: int, world: int, case: str, mode: str) -> dict[str, Any]:
    kind = _kind(case)
    torch.manual_seed(0)
    model = make_model(kind)()
    optim = adamw(model)
    step = sc.compile(parallel_mode=make_mode(mode), backend="inductor")(
        STEPS.get(kind, causal_lm_step)
    )
    share = BATCH // world
    losses = []
    with _patched(case):
        for batch in batches(kind, STEP_COUNT):
            local = [t[rank * share:(rank + 1) * share] for t in batch]
            losses.append(step(model, optim, *local).detach().clone())
    lowered = step.last_program.executable.step
    return {
        "losses": losses, "state": full_state(model, optim, None),
        "lowered": lowered._compiled is not None,
        "compile_s": step.timings.compile_seconds, "lower_s": step.timings.lower_seconds,
    }


def _eager(case: str) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    kind = _kind(case)
    torch.manual_seed(0)
    model = make_model(kind)()
    optim = adamw(model)
    step = STEPS.get(kind, causal_lm_step)
    with _patched(case):
        losses = [step(model, optim, *batch).detach() for batch in batches(kind, STEP_COUNT)]
    return losses, full_state(model, optim, None)


def run(case: str, mode: str) -> dict[str, Any]:
    start = time.perf_counter()
    results = sc.launch(_worker, WORLD, args=(case, mode), timeout_s=1800)
    losses, state = _eager(case)
    ranks = [
        max(relative_difference(a, b) for a, b in zip(r["losses"], losses, strict=True))
        for r in results
    ]
    worst = max(state_differences(results[0]["state"], state).items(), key=lambda kv: kv[1])
    return {
        "model": case, "mode": mode, "islands": ISLANDS.get(case, "?"),
        "lowered": all(r["lowered"] for r in results), "loss_rel": max(ranks),
        "state_rel": worst[1], "state_worst": worst[0],
        "compile_s": results[0]["compile_s"], "lower_s": results[0]["lower_s"],
        "seconds": time.perf_counter() - start,
    }


def verdict(row: dict[str, Any]) -> str:
    if not row["lowered"]:
        return "**not lowered**"
    bound = ISLAND_TOL if row["islands"] else TOL
    ok = row["state_rel"] <= bound and row["loss_rel"] <= bound
    return f"{'met' if ok else '**missed**'} (<= {bound:g})"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"Inductor on real ranks, torch {results['torch']}, transformers "
        f"{results['transformers']}, {WORLD} gloo ranks, float64, {STEP_COUNT} AdamW steps, "
        f"wall {results['wall_seconds']:.0f} s (`python -m benchmarks.inductor_parity`).",
        "",
        "| model | mode | float32 parts | loss rel | state rel (worst tensor) | check | "
        "compile s (lower s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['islands'] or 'none'} | {r['loss_rel']:.1e} | "
            f"{r['state_rel']:.1e} ({r['state_worst']}) | {verdict(r)} | "
            f"{r['compile_s']:.1f} ({r['lower_s']:.1f}) |"
        )
    return "\n".join(lines + [""] + [f"- {n}" for n in results["notes"]]) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cases", default=DEFAULT_CASES, help="comma-separated model:mode pairs (ddp, fsdp)"
    )
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    import transformers

    start = time.perf_counter()
    rows = []
    for item in args.cases.split(","):
        case, mode = item.rsplit(":", 1)
        rows.append(run(case, mode))
        print(f"[bench] {case} {mode}: state {rows[-1]['state_rel']:.1e}, "
              f"{verdict(rows[-1])}", flush=True)
    results = {
        "rows": rows, "torch": torch.__version__, "transformers": transformers.__version__,
        "notes": NOTES, "wall_seconds": time.perf_counter() - start,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "inductor_parity.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(args.out, "inductor_parity.md"), "w") as f:
        f.write(markdown(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
