"""Generated token batches for benchmarks and tests (no download, no tokenizer)."""

from __future__ import annotations

import numpy as np


def generated_batch(cfg, seed: int = 0, encoder_length: int | None = None,
                    decoder_length: int | None = None) -> dict:
    """One global batch {key: int32 [gradient_accumulation, dp * micro_batch_size, length]}.

    Encoder prompts have random lengths (right padding, as real prompts); labels end in
    an EOS (1) followed by -100 padding; decoder inputs are the labels shifted right
    behind a pad (0) start token, as in the MNLI pipeline.
    """
    rng = np.random.default_rng(seed)
    ga = max(cfg.gradient_accumulation, 1)
    b = cfg.execution.data_parallel * cfg.execution.micro_batch_size
    L = encoder_length or cfg.model.sequence_length
    D = decoder_length or cfg.model.decoder_sequence_length
    V = cfg.model.embedding.vocab_size
    lengths = rng.integers(max(L // 2, 1), L + 1, (ga, b, 1))
    mask = (np.arange(L)[None, None] < lengths).astype(np.int32)
    ids = np.where(mask > 0, rng.integers(3, V, (ga, b, L)), 0).astype(np.int32)
    ids[np.arange(L)[None, None] == lengths - 1] = 1  # EOS closes each prompt
    tgt_len = rng.integers(1, D + 1, (ga, b, 1))
    labels = rng.integers(3, V, (ga, b, D)).astype(np.int32)
    labels[np.arange(D)[None, None] == tgt_len - 1] = 1
    labels[np.arange(D)[None, None] >= tgt_len] = -100
    dec = np.concatenate([np.zeros((ga, b, 1), np.int32), np.where(labels == -100, 0, labels)[..., :-1]], axis=-1)
    dec_mask = (np.arange(D)[None, None] < tgt_len).astype(np.int32)
    return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec,
            "decoder_attention_mask": dec_mask, "labels": labels}
