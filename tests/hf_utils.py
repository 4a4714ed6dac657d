"""Randomly initialised Hugging Face T5 models (no download) and their weights in our layout."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import T5Config as HFT5Config
from transformers import T5ForConditionalGeneration

from modelling.hf_mapping import model_config_from_hf, params_from_hf_state_dict
from modelling.t5 import ModelOptions

SMALL = dict(vocab_size=100, d_model=48, d_ff=72, d_kv=8, num_heads=6, num_layers=2,
             relative_attention_num_buckets=8, relative_attention_max_distance=20)


def make_hf(version: str = "1.1", seed: int = 0, **overrides):
    """(hf_model, our ModelConfig, our params) for a random T5 of version '1.1' or '1.0'."""
    kw = dict(SMALL, dropout_rate=0.0)
    if version == "1.1":
        kw.update(feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    else:
        kw.update(feed_forward_proj="relu", tie_word_embeddings=True)
    kw.update(overrides)
    torch.manual_seed(seed)
    hf = T5ForConditionalGeneration(HFT5Config(**kw)).eval()
    m = model_config_from_hf(hf.config.to_dict())
    params = jax.tree.map(jnp.asarray, params_from_hf_state_dict(hf.state_dict(), m))
    return hf, m, params


def options(m, **kw) -> ModelOptions:
    return ModelOptions(eps=m.eps, num_buckets=m.attention.relative_attention_num_buckets,
                        max_distance=m.attention.relative_attention_max_distance,
                        vocab_size=m.embedding.vocab_size, hidden_size=m.hidden_size,
                        tie_word_embeddings=m.tie_word_embeddings, **kw)


def random_batch(vocab: int, b: int = 3, enc_len: int = 11, dec_len: int = 5, seed: int = 0) -> dict:
    """A batch with mixed encoder padding and -100 labels, as numpy int arrays."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, (b, enc_len))
    mask = np.ones((b, enc_len), np.int64)
    for i in range(1, b):
        mask[i, enc_len - 2 * i - 2:] = 0
    ids[mask == 0] = 0
    labels = rng.integers(2, vocab, (b, dec_len))
    labels[0, dec_len - 2:] = -100
    dec = np.concatenate([np.zeros((b, 1), np.int64), np.where(labels == -100, 0, labels)[:, :-1]], axis=1)
    return dict(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, labels=labels)


def hf_outputs(hf, batch: dict):
    """HF loss, logits and per-parameter gradients (our names are mapped by the caller)."""
    hf.zero_grad()
    t = {k: torch.tensor(v) for k, v in batch.items()}
    out = hf(**t)
    out.loss.backward()
    grads = {k: p.grad.detach().numpy().copy() for k, p in hf.named_parameters() if p.grad is not None}
    return out.loss.item(), out.logits.detach().numpy(), grads


def rel_err(a, b) -> float:
    """max |a - b| / max |b| (a scale-aware error that does not blow up near zeros)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
