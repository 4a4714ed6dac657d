"""Greedy decoding with a key/value cache, under tensor parallelism.

The encoder runs once per batch; cross-attention keys/values are computed once;
the self-attention cache [layers, b, max_len, h, kv] is written in place at each
step (one cache per layer, the layers unrolled). The whole loop is one compiled ``lax.while_loop`` that stops early once
every sequence has produced EOS. Finished sequences are padded with ``pad_id``
(as Hugging Face ``generate`` does).

Shapes are per device: ``h`` = heads / tp and ``Vl`` = padded vocab / tp.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from modelling import layers as L
from modelling import t5
from modelling.tp import tp_index

F32 = jnp.float32


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


def _heads_major(x: jax.Array) -> jax.Array:
    """[b, l, h, kv] -> [b, h, l, kv]."""
    return jnp.transpose(x, (0, 2, 1, 3))


def cross_kv(rows: list, enc_out: jax.Array) -> list:
    """Cross-attention keys/values of every decoder layer, computed once: [(k, v)] each [b, h, k, kv]."""
    return [tuple(_heads_major(t) for t in L.project_kv(p, enc_out, "c")) for p in rows]


def attend_cached(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array) -> jax.Array:
    """attend() for one query position against a heads-major cache.

    q [b, 1, h, kv], k/v [b, h, K, kv], bias broadcastable to [b, h, 1, K] -> [b, 1, h, kv].
    Caches are kept heads-major so both products are plain batched matmuls: with the
    [b, K, h, kv] layout XLA:CPU transposed the whole cache at every token (5x slower
    cross-attention at the Flan-T5-small shape).
    """
    scores = jnp.einsum("bhqd,bhkd->bhqk", _heads_major(q), k, preferred_element_type=F32) + bias
    probs = jax.nn.softmax(scores, axis=-1)
    return _heads_major(jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v))


def _decoder_step(params, rows, token, pos, caches, cross, cross_bias, opts, tp_axis):
    """One decoder position with the cache. token int [b] -> (logits [b, Vl], caches).

    rows: the decoder layers' weights (layer_rows); caches: [(k, v)] per layer, each
    [b, h, max_len, kv], written in place at ``pos``; cross: cross_kv's output.
    """
    dec = params["decoder"]
    dt = opts.compute_dtype
    max_len = caches[0][0].shape[2]
    x = t5.embeddings(params["shared"], token[:, None], opts, tp_axis)  # [b, 1, d]
    rel = jnp.arange(max_len, dtype=jnp.int32) - pos
    buckets = L.relative_position_bucket(rel, False, opts.num_buckets, opts.max_distance)[None, None]  # [1, 1, K]
    causal = jnp.where(jnp.arange(max_len) <= pos, 0.0, L.MASK_VALUE)[None, None, None]
    per_layer = t5.per_layer_bias(opts)  # UMT5: each layer's own table
    bias = None if per_layer else t5.bucket_bias(dec["relpos"], buckets) + causal
    new_caches = []
    # layers unrolled: each uses its own weight arrays (no per-token slicing of the stack)
    for p, (k_c, v_c), (ck_l, cv_l) in zip(rows, caches, cross):
        if per_layer:
            bias = t5.bucket_bias(p["relpos"], buckets) + causal
        h = L.rms_norm(x, p["attn_norm"], opts.eps).astype(dt)
        h = L.identical_inputs(h, tp_axis)
        q = L.project_q(p, h)
        k_new, v_new = L.project_kv(p, h)
        k_c = lax.dynamic_update_slice_in_dim(k_c, _heads_major(k_new).astype(k_c.dtype), pos, axis=2)
        v_c = lax.dynamic_update_slice_in_dim(v_c, _heads_major(v_new).astype(v_c.dtype), pos, axis=2)
        x = x + L.attention_output(p, attend_cached(q, k_c, v_c, bias), tp_axis)
        h = L.rms_norm(x, p["cross_norm"], opts.eps).astype(dt)
        q = L.project_q(p, h, "c")
        x = x + L.attention_output(p, attend_cached(q, ck_l, cv_l, cross_bias), tp_axis, "c")
        h = L.rms_norm(x, p["ff_norm"], opts.eps).astype(dt)
        x = x + L.feed_forward(p, h, tp_axis, opts.scale_ff, proj=opts.feed_forward_proj)
        new_caches.append((k_c, v_c))
    logits = t5.head_logits(params, x, opts, tp_axis)[:, 0]
    return logits, new_caches


def generate(params: dict, input_ids: jax.Array, attention_mask: jax.Array, opts, max_new_tokens: int,
             tp_axis: Optional[str] = None, eos_id: int = 1, pad_id: int = 0) -> jax.Array:
    """Greedy decoding with a KV cache. ids/mask [b, k] -> int32 tokens [b, max_new_tokens].

    The decoder starts from ``pad_id``; a sequence stops at ``eos_id`` (kept) and is
    padded with ``pad_id`` afterwards; the loop ends when all have stopped.
    """
    p = t5.cast_params(params, opts.compute_dtype)
    enc = t5.encode(p, input_ids, attention_mask, opts, tp_axis)
    rows = layer_rows(p["decoder"]["layers"])
    cross = cross_kv(rows, enc.astype(opts.compute_dtype))
    cross_bias = L.padding_mask_bias(attention_mask)
    b = input_ids.shape[0]
    _, h, _, kv = cross[0][0].shape
    caches = [(jnp.zeros((b, h, max_new_tokens, kv), opts.compute_dtype),) * 2 for _ in rows]

    def cond(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, out, caches, done = carry
        logits, caches = _decoder_step(p, rows, token, i, caches, cross, cross_bias, opts, tp_axis)
        nxt = jnp.where(done, pad_id, greedy_token(logits, tp_axis))
        out = lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1)
        return i + 1, nxt, out, caches, done | (nxt == eos_id)

    init = (jnp.int32(0), jnp.full((b,), pad_id, jnp.int32), jnp.full((b, max_new_tokens), pad_id, jnp.int32),
            caches, jnp.zeros((b,), bool))
    return lax.while_loop(cond, body, init)[2]


def generate_uncached(params: dict, input_ids, attention_mask, opts, max_new_tokens: int,
                      tp_axis: Optional[str] = None, eos_id: int = 1, pad_id: int = 0) -> jax.Array:
    """Reference greedy decoding that re-runs the whole decoder for every token (the original's way)."""
    p = t5.cast_params(params, opts.compute_dtype)
    enc = t5.encode(p, input_ids, attention_mask, opts, tp_axis)
    b = input_ids.shape[0]
    dec_in = jnp.full((b, 1), pad_id, jnp.int32)
    done = jnp.zeros((b,), bool)
    out = []
    for _ in range(max_new_tokens):
        y = t5.decode(p, enc, attention_mask, dec_in, opts, tp_axis)
        logits = t5.head_logits(p, y, opts, tp_axis)[:, -1]
        nxt = jnp.where(done, pad_id, greedy_token(logits, tp_axis))
        out.append(nxt)
        done = done | (nxt == eos_id)
        dec_in = jnp.concatenate([dec_in, nxt[:, None]], axis=1)
    return jnp.stack(out, axis=1)
