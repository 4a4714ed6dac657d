"""Model FLOPs (app/flops.py): a training step's count equals a hand count; a decoding step counts each weight that
multiplies its token once (against an HF model of the same shape); the peak FLOP/s of known devices."""

import pytest

from app.flops import decode_step_flops, forward_flops_per_sample, peak_tflops, train_flops_per_sample
from config.schema import ModelConfig


def test_flop_count_equals_hand_count():
    m = ModelConfig(layers=1, hidden_size=4, d_ff=8)
    m.attention.heads, m.attention.d_kv, m.embedding.vocab_size = 2, 2, 10  # h * kv = 4
    Le, Ld = 3, 2
    # encoder layer: q,k,v,o 4*3*4*4=192; scores+context 2*3*3*4=72; gated FF 3*3*4*8=288
    enc = 2 * (192 + 72 + 288)
    # decoder layer: self q,k,v,o 4*2*4*4=128; self scores+context 2*2*2*4=32; cross q,o 2*2*4*4=64;
    # cross k,v over the encoder 2*3*4*4=96; cross scores+context 2*2*3*4=48; gated FF 3*2*4*8=192
    dec = 2 * (128 + 32 + 64 + 96 + 48 + 192)
    head = 2 * 2 * 4 * 10
    assert forward_flops_per_sample(m, Le, Ld) == enc + dec + head == 2384
    assert train_flops_per_sample(m, Le, Ld) == 3 * 2384


def _weights(module, skip=()) -> int:
    return sum(p.numel() for name, p in module.named_parameters() if p.dim() == 2 and not any(k in name for k in skip))


@pytest.mark.parametrize("version,overrides", [("1.1", {}), ("1.0", {"num_decoder_layers": 3}), ("umt5", {}),
                                               ("1.1", {"num_decoder_layers": 1})])
def test_a_decoding_step_counts_each_weight_that_multiplies_its_token_once(version, overrides):
    """decode_step_flops: 2 FLOPs per weight that multiplies a new token (an HF model of the same shape's: GPT-J's
    layers and head; T5's decoder, as deep as it is, and head, not its encoder nor the cross-attention's keys and
    values of the encoder's states, nor the tables: embeddings, relative positions; gated feed-forwards or not), and
    the token's own self-attention scores and context (4 x heads x d_kv a decoder layer)."""
    from tests.hf_utils import gptj_config, gptj_hf, make_hf

    hf, m, _ = make_hf(version, **overrides)
    assert m.decoder_depth == overrides.get("num_decoder_layers", m.layers)
    hk = m.attention.heads * m.attention.d_kv
    count = _weights(hf.decoder, skip=("embed_tokens", "EncDecAttention.k.", "EncDecAttention.v.",
                                       "relative_attention_bias"))
    assert decode_step_flops(m) == 2 * (count + hf.lm_head.weight.numel()) + 4 * hk * m.decoder_depth
    hf = gptj_hf()
    m = gptj_config(hf).model
    hk = m.attention.heads * m.attention.d_kv
    count = _weights(hf.transformer.h) + hf.lm_head.weight.numel()
    assert decode_step_flops(m) == 2 * count + 4 * hk * m.layers


def test_peak_table():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("cpu") is None and peak_tflops("cpu", 1.5) == 1.5
