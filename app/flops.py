"""Model FLOPs of a training step (each family counts its own forward), and peak FLOP/s of known devices."""

from __future__ import annotations

from typing import Optional

from modelling import registry

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
    """Matmul FLOPs (2 per multiply-add) of one sample's forward pass, as the model's family counts them
    (``Family.forward_flops``: T5's encoder and decoder, GPT-J's one causal stack over the encoder length)."""
    return registry.get(m.family).forward_flops(m, encoder_length, decoder_length)


def decode_step_flops(m) -> int:
    """Matmul FLOPs of one row's decoding step (one new token), as the model's family counts them
    (``Family.decode_step_flops``: GPT-J's layers; T5's decoder, whose cross-attention keys and values of the
    encoder's states were made when the prompt joined; and the LM head). The attention's scores over the cache, which
    grow with the position, are not counted beyond the step's own token."""
    return registry.get(m.family).decode_step_flops(m)


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
