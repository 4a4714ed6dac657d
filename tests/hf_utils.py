"""Randomly initialised Hugging Face models of the T5 family (no download) and their weights in our layout.

Untied variants are untied for real: transformers >= 5 ties every T5-family head to the embedding whatever the
config says, while the real Flan-T5, mT5, UMT5 and UL2 checkpoints carry their own ``lm_head``. ``make_hf`` gives
those fixtures a head of their own, with values unlike the embedding's, so a head that read ``shared`` instead of
``lm_head`` fails every parity test.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers import MT5Config, MT5ForConditionalGeneration, UMT5Config, UMT5ForConditionalGeneration
from transformers import T5Config as HFT5Config
from transformers import T5ForConditionalGeneration

from modelling.hf_mapping import model_config_from_hf, params_from_hf_state_dict
from modelling.t5 import ModelOptions

SMALL = dict(vocab_size=100, d_model=48, d_ff=72, d_kv=8, num_heads=6, num_layers=2,
             relative_attention_num_buckets=8, relative_attention_max_distance=20)


# variant -> (HF config class, model class, config fields): the layouts of the family's real checkpoints
VARIANTS = {
    "1.1": (HFT5Config, T5ForConditionalGeneration, dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "1.0": (HFT5Config, T5ForConditionalGeneration, dict(feed_forward_proj="relu", tie_word_embeddings=True)),
    "ul2": (HFT5Config, T5ForConditionalGeneration, dict(feed_forward_proj="gated-silu", tie_word_embeddings=False)),
    "mt5": (MT5Config, MT5ForConditionalGeneration, dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "umt5": (UMT5Config, UMT5ForConditionalGeneration, dict(feed_forward_proj="gated-gelu",
                                                           tie_word_embeddings=False)),
}


def untie(hf) -> None:
    """Gives an HF model its own LM head, unlike its embedding (transformers >= 5 ties them on construction)."""
    with torch.no_grad():
        hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.shared.weight) * hf.config.d_model ** -0.5)
    hf.config.tie_word_embeddings = False  # UMT5 reads it at run time (its output rescale)


def from_pretrained(model_cls, path):
    """model_cls.from_pretrained(path), with the checkpoint's own head where it has one (transformers >= 5 ties
    the head to the embedding on load, whatever config.json says)."""
    import os

    from safetensors.torch import load_file

    model = model_cls.from_pretrained(path).eval()
    sd = load_file(os.path.join(path, "model.safetensors"))
    if "lm_head.weight" in sd and not torch.equal(sd["lm_head.weight"], sd["shared.weight"]):
        untie(model)
        with torch.no_grad():
            model.lm_head.weight.copy_(sd["lm_head.weight"])
    return model


def make_hf(version: str = "1.1", seed: int = 0, **overrides):
    """(hf_model, our ModelConfig, our params) for a random model of a VARIANTS layout."""
    config_cls, model_cls, fields = VARIANTS[version]
    kw = dict(SMALL, dropout_rate=0.0, **fields)
    kw.update(overrides)
    tied = kw["tie_word_embeddings"]
    torch.manual_seed(seed)
    hf = model_cls(config_cls(**kw)).eval()
    if not tied:
        untie(hf)
        assert hf.lm_head.weight is not hf.shared.weight
    # our config from what a real checkpoint's config.json says (transformers >= 5 rewrites tie_word_embeddings)
    m = model_config_from_hf({**hf.config.to_dict(), "tie_word_embeddings": tied})
    params = jax.tree.map(jnp.asarray, params_from_hf_state_dict(hf.state_dict(), m))
    return hf, m, params


def options(m, **kw) -> ModelOptions:
    return ModelOptions(family=m.family, feed_forward_proj=m.feed_forward_proj, eps=m.eps,
                        relative_attention_num_buckets=m.attention.relative_attention_num_buckets,
                        relative_attention_max_distance=m.attention.relative_attention_max_distance,
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
