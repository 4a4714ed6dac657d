"""Decoding searches over any family, under tensor parallelism: each is one compiled ``lax.while_loop``.

A search knows no model: the family (modelling/family.py) supplies ``decode_start`` (read the
prompts: T5's encoder, a causal LM's prefill; -> the first new token's logits and a KV cache) and
``decode_step`` (one new token -> the next one's logits and the cache), as t5x's decoding takes a
``tokens_to_logits`` callback. Every leaf of a cache has the batch as its leading axis.

Logits are vocab-sharded ([b, Vl] per device, Vl = padded vocab / tp); the searches pick tokens
without gathering them (``greedy_token``). Finished sequences are padded with ``pad_id`` after their
EOS (kept), as Hugging Face ``generate`` pads them, and the loop stops once every sequence has ended.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from modelling.tp import tp_index


def greedy_token(logits: jax.Array, tp_axis: Optional[str]) -> jax.Array:
    """Argmax over vocab-sharded logits. logits [b, Vl] -> int32 [b] global ids.

    Each device takes its local max and index; the maxima are gathered over tp (a
    [tp, b] exchange, not the logits) and the first device holding the largest wins,
    which reproduces argmax's lowest-index tie-break.
    """
    local_idx = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    local_max = jnp.max(logits, axis=-1)
    if tp_axis is None:
        return local_idx
    offset = tp_index(tp_axis) * logits.shape[-1]
    maxes = lax.all_gather(local_max, tp_axis)  # [tp, b]
    idxs = lax.all_gather(local_idx + offset, tp_axis)
    best = jnp.argmax(maxes, axis=0)
    return jnp.take_along_axis(idxs, best[None], axis=0)[0]


def layer_rows(layers: dict) -> list:
    """Stacked [layers, ...] weights -> one tree per layer, sliced once outside the decode loop.

    The decode step is memory-bound (a few rows against every weight); slicing a layer out of
    the stack inside the loop made XLA:CPU copy each layer's weights at every token.
    """
    n = jax.tree_util.tree_leaves(layers)[0].shape[0]
    return [jax.tree.map(lambda w: w[i], layers) for i in range(n)]


def heads_major(x: jax.Array) -> jax.Array:
    """[b, l, h, kv] -> [b, h, l, kv]."""
    return jnp.transpose(x, (0, 2, 1, 3))


def attend_cached(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array, scale: float = 1.0) -> jax.Array:
    """Attention of one query position against a heads-major cache.

    q [b, 1, h, kv], k/v [b, h, K, kv], bias broadcastable to [b, h, 1, K] -> [b, 1, h, kv].
    Caches are kept heads-major so both products are plain batched matmuls: with the
    [b, K, h, kv] layout XLA:CPU transposed the whole cache at every token (5x slower
    cross-attention at the Flan-T5-small shape).
    """
    scores = jnp.einsum("bhqd,bhkd->bhqk", heads_major(q), k, preferred_element_type=jnp.float32) * scale + bias
    probs = jax.nn.softmax(scores, axis=-1)
    return heads_major(jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v))


def greedy(family, params: dict, input_ids: jax.Array, attention_mask: jax.Array, opts, max_new_tokens: int,
           tp_axis: Optional[str] = None, eos_id: int = 1, pad_id: int = 0) -> jax.Array:
    """Greedy decoding with the KV cache. ids/mask [b, k] (left-padded for a family that says so) -> int32 tokens
    [b, max_new_tokens]: each sequence stops at ``eos_id`` (kept) and is padded with ``pad_id`` after it."""
    dp = family.decoding_params(params, opts)
    logits, cache = family.decode_start(dp, input_ids, attention_mask, opts, max_new_tokens, tp_axis)
    b = input_ids.shape[0]
    first = greedy_token(logits, tp_axis)
    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32).at[:, 0].set(first)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, out, cache, done = carry
        logits, cache = family.decode_step(dp, token, i - 1, cache, opts, tp_axis)
        nxt = jnp.where(done, pad_id, greedy_token(logits, tp_axis))
        out = lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1)
        return i + 1, nxt, out, cache, done | (nxt == eos_id)

    init = (jnp.int32(1), first, out, cache, first == eos_id)
    return lax.while_loop(cond, body, init)[2]


def greedy_uncached(family, params: dict, input_ids, attention_mask, opts, max_new_tokens: int,
                    tp_axis: Optional[str] = None, eos_id: int = 1, pad_id: int = 0) -> jax.Array:
    """The reference greedy decoding: the whole model run again for every new token (the original's way)."""
    p = family.compute_params(params, opts)
    b = input_ids.shape[0]
    tokens = jnp.zeros((b, 0), jnp.int32)
    done = jnp.zeros((b,), bool)
    for _ in range(max_new_tokens):
        logits = family.decode_uncached(p, input_ids, attention_mask, tokens, opts, tp_axis)
        nxt = jnp.where(done, pad_id, greedy_token(logits, tp_axis))
        done = done | (nxt == eos_id)
        tokens = jnp.concatenate([tokens, nxt[:, None]], axis=1)
    return tokens
