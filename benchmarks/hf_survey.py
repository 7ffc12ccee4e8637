"""``python -m benchmarks.hf_survey``: more transformers architectures under data parallelism.

The zoo (``benchmarks/zoo.py`` MODELS, ``tests/models``) checks four architectures in
every mode; this survey widens the net: Mistral (sliding window), Qwen2, GPT-NeoX
(partial rotary), OPT, BLOOM (ALiBi), Phi, Gemma, GPT-J, T5 (encoder-decoder, relative
position bias), two mixtures of experts, DeBERTa-v2 (sequence classification,
disentangled attention), BEiT (relative position bias), and since the twentieth session
OLMo2, Phi-3, StarCoder2, SwitchTransformers, LongT5, BigBird-Pegasus, RWKV, ModernBERT and
Llava (a vision-language model), each in its default
configuration (dropout 0), under ddp and fsdp on 2 simulated ranks, float64, 2 AdamW steps, against the undecorated step on one device on
the global batch. Writes ``benchmarks/results/hf_survey.{json,md}``.

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

from .zoo import (
    FLOAT32_TOL,
    SURVEY_MODELS,
    TOL,
    ZooCase,
    run_case,
    survey_differences,
    survey_dtype,
    survey_tolerance,
)

RESULTS = os.path.join(os.path.dirname(__file__), "results")
MODES = ("ddp", "fsdp")
WORLD = 2
# transformers computes the causal LM loss from logits.float(): a loss is float32-exact
LOSS_TOL = 1e-6
NOTES = [
    "check: the worst state tensor (parameters and AdamW state) relative to the eager "
    f"run, within {TOL:g}; tensors whose reference never moved beyond 1e-9 (OPT's "
    "zero-initialized key biases, whose gradient is zero in exact arithmetic) are compared "
    "in absolute terms (benchmarks/zoo.py: state_differences). loss: within "
    f"{LOSS_TOL:g} relative (transformers computes the loss from logits.float()).",
    "longformer: its key biases' gradient is rounding noise (zero in exact arithmetic), "
    "which AdamW turns into moves of order lr, differently in the two runs; its row "
    "checks the parameters without key biases (benchmarks/zoo.py: NOISY_KEY_BIAS_MODELS).",
    "mixtral_grouped_mm is Mixtral in its default configuration: its experts run torch's "
    "grouped_mm, which no kernel runs in float64, so this row is float32, within "
    f"{FLOAT32_TOL:g} (float32 rounding of gradient sums, through AdamW).",
    "Gemma computes its RMSNorm in float32 even in a float64 model (`x.float()`), so its "
    "float64 run is float32-exact only: the norm weights' gradients are sums over the "
    "batch, added in another order on 2 ranks. The last row runs it with the norm "
    "computing in the model's dtype (patched for the run): within the bound.",
]


def _gemma_norm_in_model_dtype(self: Any, x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


@contextlib.contextmanager
def gemma_norm_in_model_dtype() -> Iterator[None]:
    """transformers' GemmaRMSNorm computing in the model's dtype while the block runs."""
    from transformers.models.gemma import modeling_gemma

    original = modeling_gemma.GemmaRMSNorm.forward
    modeling_gemma.GemmaRMSNorm.forward = _gemma_norm_in_model_dtype
    try:
        yield
    finally:
        modeling_gemma.GemmaRMSNorm.forward = original


def _row(kind: str, mode: str, norm_in_model_dtype: bool = False) -> dict[str, Any]:
    start = time.perf_counter()
    patch = gemma_norm_in_model_dtype() if norm_in_model_dtype else contextlib.nullcontext()
    if norm_in_model_dtype:
        kind = "gemma"
    try:
        with patch:
            run = run_case(ZooCase(kind, mode, WORLD), survey_dtype(kind), steps=2)
    except sc.SPMDCompileError as exc:
        return {"model": kind, "mode": mode, "refused": str(exc).splitlines()[0],
                "seconds": time.perf_counter() - start}
    worst = max(survey_differences(kind, run).items(), key=lambda kv: kv[1])
    return {
        "model": kind + (" (RMSNorm in model dtype)" if norm_in_model_dtype else ""),
        "mode": mode, "loss_rel": max(run.loss_differences),
        "state_rel": worst[1], "state_worst": worst[0], "tolerance": survey_tolerance(kind),
        "compile_s": run.compile_seconds, "seconds": time.perf_counter() - start,
    }


def _verdict(row: dict[str, Any]) -> str:
    if "refused" in row:
        return f"refused: {row['refused'][:90]}"
    ok = row["state_rel"] < row.get("tolerance", TOL) and row["loss_rel"] < LOSS_TOL
    return "met" if ok else "**missed**"


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"transformers survey, torch {results['torch']}, transformers "
        f"{results['transformers']}, {WORLD} simulated ranks, float64 (float32 where noted), 2 AdamW steps, wall "
        f"{results['wall_seconds']:.0f} s (`python -m benchmarks.hf_survey`).",
        "",
        "| model | mode | loss rel | state rel (worst tensor) | check | compile s |",
        "|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        if "refused" in r:
            lines.append(f"| {r['model']} | {r['mode']} | | | {_verdict(r)} | |")
            continue
        lines.append(
            f"| {r['model']} | {r['mode']} | {r['loss_rel']:.1e} | {r['state_rel']:.1e} "
            f"({r['state_worst']}) | {_verdict(r)} | {r['compile_s']:.1f} |"
        )
    return "\n".join(lines + [""] + [f"- {n}" for n in results["notes"]]) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(SURVEY_MODELS))
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    import transformers

    start = time.perf_counter()
    rows = []
    for kind in args.models.split(","):
        for mode in args.modes.split(","):
            rows.append(_row(kind, mode))
            print(markdown({"rows": rows[-1:], "torch": torch.__version__,
                            "transformers": transformers.__version__, "notes": [],
                            "wall_seconds": time.perf_counter() - start}).splitlines()[-2],
                  flush=True)
    if "gemma" in args.models.split(","):  # the float32 norm explains Gemma's difference
        rows.append(_row("gemma", "ddp", norm_in_model_dtype=True))
    results = {
        "rows": rows, "torch": torch.__version__, "transformers": transformers.__version__,
        "notes": NOTES, "wall_seconds": time.perf_counter() - start,
    }
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "hf_survey.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(RESULTS, "hf_survey.md"), "w") as f:
        f.write(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
