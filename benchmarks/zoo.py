"""The model zoo: transformers models in small random-init configs, their steps and plans.

Shared by ``tests/models/test_zoo.py`` (parity assertions) and ``python -m
benchmarks.real_models`` (the README's "real models" table). Default attention (sdpa),
default cache setting, default AdamW; dropout probabilities 0 (a compiled step draws
dropout masks from one global draw, NOTE: [random numbers], not from eager's stream).

Needs transformers (``pip install -e .[models]``); it is imported when a model is built.
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import spmd_compiler as sc
from spmd_compiler.parallel_modes import FusedColwiseParallel, make_mode
from spmd_compiler.tools.parity import full_state, relative_difference

VOCAB, LENGTH, BATCH = 64, 16, 8
LR = 1e-3


def _transformers() -> Any:
    import transformers

    return transformers


def gpt2() -> torch.nn.Module:
    """GPT-2: transposed Conv1D layers, lm_head tied to the token embedding."""
    config = _transformers().GPT2Config(
        vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
        bos_token_id=0, eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    return _transformers().GPT2LMHeadModel(config)


def llama() -> torch.nn.Module:
    """Llama: RoPE, grouped-query attention (4 query heads, 2 key/value heads), RMSNorm."""
    config = _transformers().LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )
    return _transformers().LlamaForCausalLM(config)


def bert() -> torch.nn.Module:
    """BERT: an encoder with token-type embeddings, sequence classification head."""
    config = _transformers().BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32, type_vocab_size=2, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return _transformers().BertForSequenceClassification(config)


def vit() -> torch.nn.Module:
    """ViT: patch embedding (a strided convolution), encoder, classification head."""
    config = _transformers().ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return _transformers().ViTForImageClassification(config)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "gpt2": gpt2, "llama": llama, "bert": bert, "vit": vit,
}


def _small_model(model_class: str, config_class: str, **config: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        t = _transformers()
        return getattr(t, model_class)(getattr(t, config_class)(vocab_size=VOCAB, **config))

    build.__doc__ = f"{model_class} in a small random-init config."
    return build


def _classifier(model_class: str, config_class: str, **config: Any) -> Callable[[], torch.nn.Module]:
    build = _small_model(model_class, config_class, **config)
    build.__doc__ = f"{model_class} (3 labels) in a small random-init config."
    return build


_NO_DROPOUT = {"attention_dropout": 0.0}
# More architectures, each with its own attention / position / norm variant, in their
# default configuration (dropout 0), for ``python -m benchmarks.hf_survey``: decoders
# trained as causal LMs, T5 as a sequence-to-sequence model on (ids, ids).
SURVEY_MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "mistral": _small_model("MistralForCausalLM", "MistralConfig", hidden_size=32,
                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64, sliding_window=8),
    "qwen2": _small_model("Qwen2ForCausalLM", "Qwen2Config", hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64),
    "gpt_neox": _small_model("GPTNeoXForCausalLM", "GPTNeoXConfig", hidden_size=32,
                           intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           max_position_embeddings=64, rotary_pct=0.5, hidden_dropout=0.0,
                           **_NO_DROPOUT),
    "opt": _small_model("OPTForCausalLM", "OPTConfig", hidden_size=32, ffn_dim=64,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                      word_embed_proj_dim=32, dropout=0.0, **_NO_DROPOUT),
    "bloom": _small_model("BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=2, n_head=4,
                        hidden_dropout=0.0, **_NO_DROPOUT),
    "phi": _small_model("PhiForCausalLM", "PhiConfig", hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                      resid_pdrop=0.0, embd_pdrop=0.0, **_NO_DROPOUT),
    "gemma": _small_model("GemmaForCausalLM", "GemmaConfig", hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                        head_dim=8, max_position_embeddings=64),
    "gptj": _small_model("GPTJForCausalLM", "GPTJConfig", n_embd=32, n_layer=2, n_head=4,
                       rotary_dim=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0),
    "t5": _small_model("T5ForConditionalGeneration", "T5Config", d_model=32, d_ff=64, d_kv=8,
                     num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0),
    # mixtures of experts. transformers' default experts implementation sorts the
    # token-expert pairs by expert and runs torch's grouped_mm, which has no float64
    # kernel: it is surveyed in float32 (FLOAT32_MODELS, NOTE: [grouped_mm's fake kernel]).
    # In float64 the two run "batched_mm" (every token's chosen experts by gathered
    # weights). The "eager" implementation (a Python loop over the experts the routing
    # hit) is refused (README, Limitations).
    "mixtral_grouped_mm": _small_model("MixtralForCausalLM", "MixtralConfig", hidden_size=32,
                                     intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=64, num_local_experts=4,
                                     num_experts_per_tok=2),
    "mixtral": _small_model("MixtralForCausalLM", "MixtralConfig", hidden_size=32,
                          intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64,
                          num_local_experts=4, num_experts_per_tok=2,
                          experts_implementation="batched_mm"),
    "qwen2_moe": _small_model("Qwen2MoeForCausalLM", "Qwen2MoeConfig", hidden_size=32,
                            intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, max_position_embeddings=64, num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=24,
                            shared_expert_intermediate_size=24,
                            experts_implementation="batched_mm"),
    # Longformer's sliding-window attention: overlapping chunks by as_strided (NOTE:
    # [windows by as_strided]) and `if is_global_attn:` on `.any().item()` (no global
    # tokens in masked LM: the other way is refused when taken, NOTE: [a way no program
    # holds])
    "longformer": _small_model("LongformerForMaskedLM", "LongformerConfig", hidden_size=32,
                             num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             max_position_embeddings=64, attention_window=4,
                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # masked video pretraining: the visible tubelets of each example, x[~mask].reshape(B,
    # -1, C), one count per example (NOTE: [rows of one count])
    "videomae_pt": _small_model("VideoMAEForPreTraining", "VideoMAEConfig", hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                              image_size=16, patch_size=8, num_frames=4, tubelet_size=2,
                              decoder_hidden_size=32, decoder_num_hidden_layers=1,
                              decoder_num_attention_heads=4, decoder_intermediate_size=64,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # more decoders and encoder-decoders probed by hand on 2026-11-26 (twentieth session),
    # each with its own twist: OLMo2's q/k norms over the whole projection, Phi-3's fused
    # qkv / gate-up projections, StarCoder2's LayerNorm and biases, SwitchTransformers'
    # top-1 router (it converts its classifier to its own dtype in forward), LongT5's
    # transient-global attention, BigBird-Pegasus' block-sparse encoder, RWKV's time mix,
    # ModernBERT's alternating local / global attention
    "olmo2": _small_model("Olmo2ForCausalLM", "Olmo2Config", hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=64),
    "phi3": _small_model("Phi3ForCausalLM", "Phi3Config", hidden_size=32, intermediate_size=64,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=64, pad_token_id=0),
    "starcoder2": _small_model("Starcoder2ForCausalLM", "Starcoder2Config", hidden_size=32,
                             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64,
                             residual_dropout=0.0, embedding_dropout=0.0),
    "switch": _small_model("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig",
                         d_model=32, d_ff=64, d_kv=8, num_layers=2, num_decoder_layers=2,
                         num_heads=4, num_experts=4, expert_capacity=8, router_jitter_noise=0.0,
                         dropout_rate=0.0, decoder_start_token_id=0),
    "longt5": _small_model("LongT5ForConditionalGeneration", "LongT5Config", d_model=32, d_ff=64,
                         d_kv=8, num_layers=2, num_heads=4, local_radius=4, dropout_rate=0.0,
                         decoder_start_token_id=0, encoder_attention_type="transient-global",
                         global_block_size=4),
    "bigbird_pegasus": _small_model("BigBirdPegasusForConditionalGeneration", "BigBirdPegasusConfig",
                                  d_model=32, encoder_layers=2, decoder_layers=2,
                                  encoder_attention_heads=4, decoder_attention_heads=4,
                                  encoder_ffn_dim=64, decoder_ffn_dim=64,
                                  max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                  block_size=4, num_random_blocks=1),
    "rwkv": _small_model("RwkvForCausalLM", "RwkvConfig", hidden_size=32, num_hidden_layers=2,
                       attention_hidden_size=32, intermediate_size=64, context_length=LENGTH),
    "modernbert": _small_model("ModernBertForMaskedLM", "ModernBertConfig", hidden_size=32,
                             num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                             max_position_embeddings=64, local_attention=8,
                             global_attn_every_n_layers=2, pad_token_id=0),
    # a vision-language model: CLIP's vision tower into Llama, the image's patch features
    # written at its image tokens (a `torch._check` on their count: NOTE: [value checks])
    "llava": lambda: _llava(),
    # sequence classification as DeBERTa-v3 (the v2 architecture) is fine-tuned: its loss
    # selects the labelled rows with `(labels >= 0).nonzero()` (NOTE: [selections by a
    # mask of the batch])
    "deberta_v2": _classifier("DebertaV2ForSequenceClassification", "DebertaV2Config",
                              hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=64, num_labels=3,
                              hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # BEiT with relative position bias, as its checkpoints have it: transformers memoizes
    # the position index (NOTE: [Python effects at capture])
    "beit": _classifier("BeitForImageClassification", "BeitConfig", image_size=16,
                        patch_size=4, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, num_labels=3,
                        use_relative_position_bias=True, drop_path_rate=0.0,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0),
    # from the thirty-sixth session's hunt over 41 architectures not surveyed before (all
    # but Nystromformer trained as one device): a few kept as regressions. Qwen3's q/k
    # norms per head, Falcon's parallel attention and MLP, StableLM's partial rotary,
    # BART's learned positions and encoder-decoder, DistilBERT classification, and two
    # image classifiers without attention (ResNet's BatchNorm, ConvNeXt's depthwise
    # convolutions and LayerNorm over channels)
    "qwen3": _small_model("Qwen3ForCausalLM", "Qwen3Config", hidden_size=32,
                          intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, max_position_embeddings=64),
    "falcon": _small_model("FalconForCausalLM", "FalconConfig", hidden_size=32,
                           num_hidden_layers=2, num_attention_heads=4, hidden_dropout=0.0,
                           attention_dropout=0.0),
    "stablelm": _small_model("StableLmForCausalLM", "StableLmConfig", hidden_size=32,
                             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2, max_position_embeddings=64,
                             hidden_dropout=0.0, attention_dropout=0.0),
    "bart": _small_model("BartForConditionalGeneration", "BartConfig", d_model=32,
                         encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                         decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                         max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                         activation_dropout=0.0),
    "distilbert": _classifier("DistilBertForSequenceClassification", "DistilBertConfig",
                              dim=32, n_layers=2, n_heads=4, hidden_dim=64,
                              max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                              seq_classif_dropout=0.0, num_labels=3),
    "resnet": _classifier("ResNetForImageClassification", "ResNetConfig", embedding_size=8,
                          hidden_sizes=[16, 32], depths=[1, 1], num_labels=3),
    "convnext": _classifier("ConvNextForImageClassification", "ConvNextConfig", image_size=16,
                            num_stages=2, hidden_sizes=[16, 32], depths=[2, 2], num_labels=3,
                            drop_path_rate=0.0),
}


LLAVA_IMAGE_TOKEN, LLAVA_PATCHES = 2, 16  # a 16x16 image in 4x4 patches


def _llava() -> torch.nn.Module:
    t = _transformers()
    vision = t.CLIPVisionConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=64, image_size=16, patch_size=4)
    text = t.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64)
    return t.LlavaForConditionalGeneration(t.LlavaConfig(
        vision_config=vision.to_dict(), text_config=text.to_dict(),
        image_token_id=LLAVA_IMAGE_TOKEN, vision_feature_layer=-1,
    ))


def _updated(optim, loss):
    """The end of every step here: backward, the optimizer's step, zero_grad."""
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def causal_lm_step(model, optim, input_ids, labels):
    return _updated(optim, model(input_ids=input_ids, labels=labels).loss)


def bert_step(model, optim, input_ids, token_type_ids, labels):
    return _updated(optim, model(input_ids=input_ids, token_type_ids=token_type_ids, labels=labels).loss)


def vit_step(model, optim, pixel_values, labels):
    return _updated(optim, model(pixel_values=pixel_values, labels=labels).loss)


def image_text_step(model, optim, input_ids, pixel_values, labels):
    return _updated(optim, model(input_ids=input_ids, pixel_values=pixel_values, labels=labels).loss)


def masked_video_step(model, optim, pixel_values, bool_masked_pos):
    return _updated(optim, model(pixel_values=pixel_values, bool_masked_pos=bool_masked_pos).loss)


STEPS = {
    "gpt2": causal_lm_step, "llama": causal_lm_step, "bert": bert_step, "vit": vit_step,
    "beit": vit_step, "videomae_pt": masked_video_step, "llava": image_text_step,
    "resnet": vit_step, "convnext": vit_step,
}
VIDEO_TOKENS, VIDEO_MASKED = 8, 6  # tubelets per clip of videomae_pt, masked per example
# models whose batches are (ids, class labels); their step is causal_lm_step's
CLASSIFIERS = {"deberta_v2", "distilbert"}
# models whose kernels do not run float64 (torch's grouped_mm): surveyed in float32, where
# the compiled and the eager run differ by float32 rounding (gradient sums in another
# order, amplified by AdamW's normalization), within FLOAT32_TOL
FLOAT32_MODELS = {"mixtral_grouped_mm"}
FLOAT32_TOL = 1e-4


# models whose key biases move by AdamW on rounding noise alone (their gradient is zero in
# exact arithmetic: a softmax ignores a per-query constant) by steps of order lr, so
# their relative difference is noise through Adam's normalization: surveyed on the
# parameters without key biases (GPT-2 / BERT / ViT in real_models.py likewise)
NOISY_KEY_BIAS_MODELS = {"longformer"}


def survey_differences(kind: str, run: ZooRun) -> dict[str, float]:
    """What the survey checks of ``run``: every state tensor, or for
    NOISY_KEY_BIAS_MODELS the parameters without their key biases."""
    if kind in NOISY_KEY_BIAS_MODELS:
        return run.no_key_bias_differences
    return run.state_differences


def survey_dtype(kind: str) -> torch.dtype:
    return torch.float32 if kind in FLOAT32_MODELS else torch.float64


def survey_tolerance(kind: str) -> float:
    return FLOAT32_TOL if kind in FLOAT32_MODELS else TOL


def batches(kind: str, steps: int = 2, dtype: torch.dtype = torch.float64) -> list[tuple]:
    """Fixed global batches from their own generator (pixels in ``dtype``)."""
    gen = torch.Generator().manual_seed(1)
    out: list[tuple[torch.Tensor, ...]] = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (BATCH, LENGTH), generator=gen)
        labels = torch.randint(0, 3, (BATCH,), generator=gen)
        if kind == "bert":
            out.append((ids, torch.randint(0, 2, (BATCH, LENGTH), generator=gen), labels))
        elif kind in CLASSIFIERS:
            out.append((ids, labels))
        elif kind == "videomae_pt":
            clips = torch.randn(BATCH, 4, 3, 16, 16, generator=gen, dtype=torch.float64)
            masked = torch.stack([torch.randperm(VIDEO_TOKENS, generator=gen) < VIDEO_MASKED
                                  for _ in range(BATCH)])
            out.append((clips.to(dtype), masked))
        elif kind == "llava":  # the image's tokens first, then text
            text = torch.randint(3, VOCAB, (BATCH, LENGTH), generator=gen)
            ids = torch.cat([torch.full((BATCH, LLAVA_PATCHES), LLAVA_IMAGE_TOKEN), text], 1)
            pixels = torch.randn(BATCH, 3, 16, 16, generator=gen, dtype=torch.float64)
            out.append((ids, pixels.to(dtype), ids.clone()))
        elif STEPS.get(kind) is vit_step:
            pixels = torch.randn(BATCH, 3, 16, 16, generator=gen, dtype=torch.float64)
            out.append((pixels.to(dtype), labels))
        else:
            out.append((ids, ids.clone()))
    return out


def make_model(kind: str, dtype: torch.dtype = torch.float64) -> Callable[[], torch.nn.Module]:
    def make() -> torch.nn.Module:
        model = {**MODELS, **SURVEY_MODELS}[kind]().to(dtype)
        model.train()
        return model

    return make


def adamw(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=LR)


# Tensor-parallel plans written for the decoders (heads split across the tp ranks).
LLAMA_TP_PLAN = {
    "model.layers.*.self_attn.q_proj": ColwiseParallel(),
    "model.layers.*.self_attn.k_proj": ColwiseParallel(),
    "model.layers.*.self_attn.v_proj": ColwiseParallel(),
    "model.layers.*.self_attn.o_proj": RowwiseParallel(),
    "model.layers.*.mlp.gate_proj": ColwiseParallel(),
    "model.layers.*.mlp.up_proj": ColwiseParallel(),
    "model.layers.*.mlp.down_proj": RowwiseParallel(),
}
GPT2_TP_PLAN = {
    "transformer.h.*.attn.c_attn": FusedColwiseParallel(chunks=3),
    "transformer.h.*.attn.c_proj": RowwiseParallel(),
    "transformer.h.*.mlp.c_fc": ColwiseParallel(),
    "transformer.h.*.mlp.c_proj": RowwiseParallel(),
}
PLANS = {"gpt2": GPT2_TP_PLAN, "llama": LLAMA_TP_PLAN}


@dataclass(frozen=True)
class ZooCase:
    """One model in one mode on ``world`` simulated ranks."""

    kind: str
    mode: str
    world: int

    @property
    def name(self) -> str:
        mesh = "2x2" if self.mode == "fsdp_tp" else str(self.world)
        return f"{self.kind}-{self.mode}-{mesh}"

    def parallel_mode(self) -> Any:
        if self.mode == "tp":
            return make_mode("tp", plan=PLANS[self.kind])
        if self.mode == "fsdp_tp":
            return make_mode("fsdp_tp", plan=PLANS[self.kind], mesh_shape=(2, 2))
        return make_mode(self.mode)


DATA_PARALLEL_WORLD, TP_WORLD = 4, 2
ZOO_CASES = [
    ZooCase(kind, mode, DATA_PARALLEL_WORLD)
    for kind in MODELS for mode in ("dtensor_expand", "ddp", "fsdp")
] + [ZooCase("gpt2", "tp", TP_WORLD), ZooCase("llama", "tp", TP_WORLD),
     ZooCase("llama", "fsdp_tp", 4)]


# transformers' LlamaRMSNorm computes in float32 even in a float64 model
# (``hidden_states.to(torch.float32)``), so a float64 Llama has float32 steps inside.
# Under TP those see operands that differ in the last float64 bits (the row-wise
# projections' partial sums are added in another order), and float32 rounding turns that
# into differences of ~1e-8 in the gradients: measured 4.2e-7 relative (tp) and 5.7e-8
# (fsdp_tp) after 2 AdamW steps, 5.8e-9 with SGD. With the norm computing in the
# model's dtype the same runs agree within 2e-16 (SGD) and 5e-14 (AdamW).
def _norm_in_model_dtype(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


@contextlib.contextmanager
def rms_norm_in_model_dtype(norm_class: type | None = None) -> Iterator[None]:
    """An RMSNorm class of Llama's form (``weight``, ``variance_epsilon``; Llama's by
    default, Qwen3's, Mistral's, ...) computing in the model's dtype while the block runs."""
    if norm_class is None:
        from transformers.models.llama import modeling_llama

        norm_class = modeling_llama.LlamaRMSNorm
    original = norm_class.forward
    norm_class.forward = _norm_in_model_dtype
    try:
        yield
    finally:
        norm_class.forward = original


# A key bias has a zero gradient in exact arithmetic (softmax ignores a per-query
# constant); Adam turns its rounding noise into updates (about 1e-13 in float64). Such
# tensors (reference magnitude below NEVER_MOVED) are compared in absolute terms, scaled
# so that ABS_TOL maps onto the relative tolerance: their relative difference is noise
# over noise.
NEVER_MOVED = 1e-9
ABS_TOL = 1e-10
TOL = 1e-10


def state_differences(actual: dict, expected: dict) -> dict[str, float]:
    """Relative difference per state tensor (absolute, scaled, for NEVER_MOVED ones)."""
    out = {}
    for key, want in expected.items():
        got = actual[key].reshape(want.shape).double()
        want = want.double()
        diff = (got - want).abs().max().item() if want.numel() else 0.0
        scale = want.abs().max().item() if want.numel() else 0.0
        out[key] = diff / ABS_TOL * TOL if scale < NEVER_MOVED else diff / scale
    return out


# Key biases by parameter name: whole tensors, and GPT-2's fused q/k/v bias whose middle
# third is the key bias.
KEY_BIASES = ("attention.self.key.bias", "attention.k_proj.bias")
FUSED_QKV_BIAS = "attn.c_attn.bias"


def without_key_bias(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor`` (a parameter) with its key-bias part removed; None if nothing is left."""
    if name.endswith(KEY_BIASES):
        return None
    if name.endswith(FUSED_QKV_BIAS):
        q, _, v = tensor.chunk(3, dim=-1)
        return torch.cat([q, v], dim=-1)
    return tensor


def param_differences_without_key_biases(actual: dict, expected: dict) -> dict[str, float]:
    """Relative difference per parameter, key biases (or key thirds) left out."""
    out = {}
    for key, want in expected.items():
        if not key.startswith("param."):
            continue
        want = without_key_bias(key, want)
        if want is not None:
            got = without_key_bias(key, actual[key].reshape(expected[key].shape))
            out[key] = relative_difference(got, want)
    return out


@dataclass
class ZooRun:
    """What one compiled-vs-eager run of a zoo case measured."""

    case: ZooCase
    dtype: str
    steps: int
    loss_differences: list[float] = field(default_factory=list)
    state_differences: dict[str, float] = field(default_factory=dict)
    raw_differences: dict[str, float] = field(default_factory=dict)
    no_key_bias_differences: dict[str, float] = field(default_factory=dict)
    optimizer: str = "AdamW"
    compile_seconds: float = 0.0
    step_seconds: list[float] = field(default_factory=list)
    eager_step_seconds: list[float] = field(default_factory=list)
    tied: bool | None = None

    def worst(self, n: int = 3) -> list[tuple[str, float]]:
        return sorted(self.raw_differences.items(), key=lambda kv: -kv[1])[:n]


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR)


OPTIMIZERS = {"AdamW": adamw, "SGD": sgd}


def run_case(
    case: ZooCase, dtype: torch.dtype = torch.float64, steps: int = 2,
    norm_in_model_dtype: bool | None = None, optimizer: str = "AdamW",
) -> ZooRun:
    """Compile the case's step on simulated ranks, run it beside the eager step on one
    device (global batch), and measure loss / state differences and times.

    ``norm_in_model_dtype`` (default: Llama under tp / fsdp_tp) patches transformers'
    float32 RMSNorm to compute in the model's dtype (see ``_norm_in_model_dtype``).
    """
    if norm_in_model_dtype is None:
        norm_in_model_dtype = case.kind == "llama" and case.mode in ("tp", "fsdp_tp")
    patch = rms_norm_in_model_dtype() if norm_in_model_dtype else contextlib.nullcontext()
    with patch:
        return _run(case, dtype, steps, optimizer)


def _run(case: ZooCase, dtype: torch.dtype, steps: int, optimizer: str) -> ZooRun:
    torch.manual_seed(0)
    model = make_model(case.kind, dtype)()
    reference = copy.deepcopy(model)
    make_optimizer = OPTIMIZERS[optimizer]
    optim, reference_optim = make_optimizer(model), make_optimizer(reference)
    step = STEPS.get(case.kind, causal_lm_step)
    compiled = sc.compile(case.parallel_mode())(step)
    run = ZooRun(case, str(dtype).replace("torch.", ""), steps, optimizer=optimizer)
    with sc.simulate(world_size=case.world) as sim:
        for batch in batches(case.kind, steps, dtype):
            loss = compiled(model, optim, *batch)
            start = time.perf_counter()
            expected = step(reference, reference_optim, *batch)
            run.eager_step_seconds.append(time.perf_counter() - start)
            run.loss_differences.append(relative_difference(loss, expected))
        actual = full_state(model, optim, sim)
        want = full_state(reference, reference_optim, None)
        run.state_differences = state_differences(actual, want)
        run.raw_differences = {
            key: relative_difference(actual[key].reshape(w.shape), w) for key, w in want.items()
        }
        run.no_key_bias_differences = param_differences_without_key_biases(actual, want)
    run.compile_seconds = compiled.timings.compile_seconds
    run.step_seconds = list(compiled.timings.step_seconds)
    if case.kind == "gpt2":
        run.tied = model.lm_head.weight is model.transformer.wte.weight
    return run
