"""Model FLOPs of a training step (T5's encoder-decoder, GPT-J's causal stack), and peak FLOP/s of known devices."""

from __future__ import annotations

from typing import Optional

# Dense bf16 peak TFLOP/s (no sparsity), by substring of jax's device_kind.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "L4": 121.0,
    "TPU v5p": 459.0,
    "TPU v5 lite": 197.0,
    "TPU v4": 275.0,
}


def forward_flops_per_sample(m, encoder_length: int, decoder_length: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one sample's forward pass.

    Encoder layer: q/k/v/o projections, scores and context over the encoder length,
    feed-forward. Decoder layer: self-attention as above over the decoder length,
    cross-attention q/o over the decoder length, cross k/v over the encoder length,
    cross scores and context (decoder x encoder), feed-forward. Plus the LM head.
    """
    d, f, hk, V, n = m.hidden_size, m.d_ff, m.attention.heads * m.attention.d_kv, m.embedding.vocab_size, m.layers
    if m.family == "gptj":  # one causal stack over the encoder length: q/k/v/o, scores and context, MLP, head
        Lc = encoder_length
        return n * 2 * (4 * Lc * d * hk + 2 * Lc * Lc * hk + 2 * Lc * d * f) + 2 * Lc * d * V
    ff_mats = 3 if m.feed_forward_proj.startswith("gated-") else 2
    Le, Ld = encoder_length, decoder_length
    enc = 2 * (4 * Le * d * hk + 2 * Le * Le * hk + ff_mats * Le * d * f)
    dec = 2 * (4 * Ld * d * hk + 2 * Ld * Ld * hk  # self-attention
               + 2 * Ld * d * hk + 2 * Le * d * hk + 2 * Ld * Le * hk  # cross-attention
               + ff_mats * Ld * d * f)
    head = 2 * Ld * d * V
    return n * enc + m.decoder_depth * dec + head


def train_flops_per_sample(m, encoder_length: int, decoder_length: int) -> int:
    """Forward + backward (x3 the forward), no recomputation counted (model FLOPs)."""
    return 3 * forward_flops_per_sample(m, encoder_length, decoder_length)


def peak_tflops(device_kind: str, override: Optional[float] = None) -> Optional[float]:
    """Peak TFLOP/s of one device: the override, else the table, else None (unknown)."""
    if override:
        return override
    for key, value in PEAK_TFLOPS.items():
        if key.lower() in device_kind.lower():
            return value
    return None
