"""transformers models' own tensor-parallel plans (NOTE: [transformers' plan names]).

``TensorParallel(model.tp_plan)``: the style names a transformers model carries are read
as torch's styles, so a Llama-family model trains under tp and fsdp_tp with no plan
written by hand, exactly as on one device (float64; RMSNorm computing in the model's
dtype, as the zoo's Llama tp cases do). Names without a torch counterpart are refused.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from benchmarks import zoo
from benchmarks.zoo import ZooCase, make_model, rms_norm_in_model_dtype, run_case
from parallel_modes.tensor_parallel import TensorParallel, plan_styles

transformers = pytest.importorskip("transformers")

TOL = 1e-12


def test_plan_names_are_read_as_torch_styles() -> None:
    styles = plan_styles({
        "a": "colwise", "b": "rowwise", "c": "colwise_gather_output", "d": "embedding_rowwise",
        "e": "replicated_with_grad_allreduce", "f": "rowwise_split_input", "g": RowwiseParallel(),
    })
    assert isinstance(styles["a"], ColwiseParallel) and styles["a"].output_layouts == (Shard(-1),)
    assert isinstance(styles["b"], RowwiseParallel) and styles["b"].output_layouts == (Replicate(),)
    assert isinstance(styles["c"], ColwiseParallel) and styles["c"].output_layouts == (Replicate(),)
    assert isinstance(styles["d"], RowwiseParallel) and styles["d"].input_layouts == (Replicate(),)
    assert styles["e"] == "replicate"
    assert isinstance(styles["f"], RowwiseParallel) and styles["f"].input_layouts == (Replicate(),)
    assert isinstance(styles["g"], RowwiseParallel)


def test_plan_names_without_a_counterpart_are_refused() -> None:
    """A mixture of experts' plan names its packed and expert styles: refused by name."""
    plan = {"model.layers.*.mlp.experts.gate_up_proj": "packed_colwise",
            "model.layers.*.mlp.experts": "moe_tp_experts", "model.layers.*.self_attn.q_proj": "colwise"}
    with pytest.raises(ValueError, match="packed_colwise") as info:
        TensorParallel(plan)
    assert "moe_tp_experts" in str(info.value) and "stay replicated" in str(info.value)


def _qwen3() -> torch.nn.Module:
    t = transformers
    return t.Qwen3ForCausalLM(t.Qwen3Config(
        vocab_size=zoo.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64))


@pytest.mark.parametrize(("kind", "mode"), [
    ("llama", "tp"),
    pytest.param("llama", "fsdp_tp", marks=pytest.mark.slow),
    ("qwen3", "tp"),  # q_norm / k_norm: "replicated_with_grad_allreduce"
])
def test_a_models_own_plan_trains_as_one_device(monkeypatch, kind: str, mode: str) -> None:
    if kind == "qwen3":
        monkeypatch.setitem(zoo.SURVEY_MODELS, "qwen3", _qwen3)
    plan = make_model(kind)().tp_plan
    assert plan and all(isinstance(style, str) for style in plan.values())
    monkeypatch.setitem(zoo.PLANS, kind, plan)
    if kind == "qwen3":
        from transformers.models.qwen3 import modeling_qwen3

        patch = rms_norm_in_model_dtype(modeling_qwen3.Qwen3RMSNorm)
    else:
        patch = rms_norm_in_model_dtype()
    with patch:
        run = run_case(ZooCase(kind, mode, 2 if mode == "tp" else 4), norm_in_model_dtype=False)
    assert max(run.loss_differences) < TOL, run.loss_differences
    assert run.worst(1)[0][1] < TOL, run.worst(3)


def test_a_models_own_plan_shards_its_weights() -> None:
    """The plan's names decide the placements: vocabulary-sharded embedding
    ("embedding_rowwise"), column-split q and lm_head, row-split o_proj."""
    torch.manual_seed(0)
    model = make_model("llama")()
    optim = zoo.adamw(model)
    import spmd_compiler as sc

    compiled = sc.compile(TensorParallel(model.tp_plan))(zoo.causal_lm_step)
    with sc.simulate(world_size=2), rms_norm_in_model_dtype():
        compiled(model, optim, *zoo.batches("llama", 1)[0])
    layer = model.model.layers[0]
    assert model.model.embed_tokens.weight.placements == (Shard(0),)
    assert model.lm_head.weight.placements == (Shard(0),)
    assert layer.self_attn.q_proj.weight.placements == (Shard(0),)
    assert layer.self_attn.o_proj.weight.placements == (Shard(1),)
    assert layer.input_layernorm.weight.placements == (Replicate(),)
