"""transformers' Wav2Vec2ForCTC under ddp on 2 simulated ranks (NOTE: [CTC loss at capture]).

- Its own loss, labels without padding: as on one device (float64; transformers computes
  the CTC log probabilities in float32, patched here to the model's dtype so that the
  comparison is float64-exact).
- Padded labels (-100), the usual batch: transformers flattens them with
  ``masked_select``, a size the data decides; the selected labels are kept in place
  (NOTE: [selected rows kept in place]) and its own loss trains as on one device. The
  same loss written with the padded labels as 2-D targets does too.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn.functional as F

import spmd_compiler as sc
from benchmarks.zoo import state_differences
from spmd_compiler.parallel_modes import make_mode
from spmd_compiler.tools.parity import full_state, relative_difference

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

TOL = 1e-10
BATCH, SAMPLES, VOCAB, LABELS = 4, 800, 32, 6


def _model() -> torch.nn.Module:
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        conv_dim=(8, 8), conv_stride=(5, 4), conv_kernel=(10, 8), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, vocab_size=VOCAB, pad_token_id=0, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, final_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ForCTC(config).double().train()


def _batches(padded: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(2):
        labels = torch.randint(1, VOCAB, (BATCH, LABELS), generator=gen)
        if padded:
            labels[1, 4:] = -100
            labels[3, 2:] = -100
        out.append((torch.randn(BATCH, SAMPLES, generator=gen, dtype=torch.float64), labels))
    return out


@contextlib.contextmanager
def _ctc_in_model_dtype():  # noqa: ANN202
    """transformers' ForCTCLoss with its log_softmax in the logits' dtype."""
    from transformers.loss import loss_ctc, loss_utils

    original = loss_utils.LOSS_MAPPING["ForCTC"]
    source = open(loss_ctc.__file__).read().replace("dtype=torch.float32", "dtype=logits.dtype")
    namespace: dict = {}
    exec(compile(source, loss_ctc.__file__, "exec"), namespace)  # noqa: S102
    loss_utils.LOSS_MAPPING["ForCTC"] = namespace["ForCTCLoss"]
    try:
        yield
    finally:
        loss_utils.LOSS_MAPPING["ForCTC"] = original


def own_loss_step(model, optim, input_values, labels):  # noqa: ANN001, ANN201
    loss = model(input_values=input_values, labels=labels).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def padded_labels_step(model, optim, input_values, labels):  # noqa: ANN001, ANN201
    """The loss transformers computes, with the padded labels as 2-D targets."""
    logits = model(input_values=input_values).logits
    frames = torch.full((logits.size(0),), logits.size(1), dtype=torch.long)
    log_probs = F.log_softmax(logits, dim=-1).transpose(0, 1)
    keep = (labels >= 0) & (labels != model.config.pad_token_id)
    loss = F.ctc_loss(log_probs, labels.clamp(min=0), frames, keep.sum(-1),
                      blank=model.config.pad_token_id, reduction=model.config.ctc_loss_reduction,
                      zero_infinity=model.config.ctc_zero_infinity)
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss


def _parity(step, batches) -> tuple[list[float], dict[str, float]]:  # noqa: ANN001
    model = _model()
    reference = copy.deepcopy(model)
    optim, reference_optim = (torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (model, reference))
    compiled = sc.compile(make_mode("ddp"))(step)
    losses = []
    with sc.simulate(world_size=2) as sim:
        for batch in batches:
            losses.append(relative_difference(compiled(model, optim, *batch), step(reference, reference_optim, *batch)))
        return losses, state_differences(full_state(model, optim, sim), full_state(reference, reference_optim, None))


def test_its_own_loss_trains_as_one_device() -> None:
    with _ctc_in_model_dtype():
        losses, state = _parity(own_loss_step, _batches(padded=False))
    assert max(losses) < TOL and max(state.values()) < TOL, (losses, max(state.items(), key=lambda kv: kv[1]))


def test_padded_labels_as_2d_targets_train_as_one_device() -> None:
    losses, state = _parity(padded_labels_step, _batches(padded=True))
    assert max(losses) < TOL and max(state.values()) < TOL, (losses, max(state.items(), key=lambda kv: kv[1]))


def test_its_own_loss_on_padded_labels_trains_as_one_device() -> None:
    """transformers flattens the padded labels with ``masked_select``: rows kept in place
    (NOTE: [selected rows kept in place]), moved to the front for the CTC loss."""
    with _ctc_in_model_dtype():
        losses, state = _parity(own_loss_step, _batches(padded=True))
    assert max(losses) < TOL and max(state.values()) < TOL, (losses, max(state.items(), key=lambda kv: kv[1]))
