"""Decoding slots: the per-device programs of continuous batching (serving/), for any family.

A fixed number of rows ("slots") share one KV cache, each row holding its own request at its own position:
``insert`` reads joining prompts (the family's ``decode_start``: T5's encoder and cross-attention keys/values,
GPT-J's prefill), widens their cache to the slots' widest prompt (``Family.widen_cache``) and writes it into free
rows; ``advance`` moves every row a few tokens on (``decode_step`` with a per-row index). Rows come and go between
calls, so a short request never waits for a long one (JetStream's ``insert`` + ``generate``).

Each row samples with its own parameters (``Sampling``: temperature 0 is greedy; HF's warpers in HF's order, as
modelling/decoding.py's ``warp`` for one row) and its own key: token n of a request is drawn with
``fold_in(key(seed), n)``, so a seeded request gives the same tokens whatever else runs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from modelling import decoding


@jax.tree_util.register_dataclass
@dataclass
class Sampling:
    """Each row's sampling parameters, [b] each."""

    temperature: jax.Array  # float32: 0 picks the most likely token (greedy), else the scores are divided by it
    top_k: jax.Array  # int32: keep the k most likely tokens (0: all)
    drop_mass: jax.Array  # float32: top-p's 1 - top_p (as HF computes it, in float64 on the host); 0: off
    seed: jax.Array  # uint32: the row's key is key(seed), folded with the token index


def warp_rows(scores: jax.Array, s: Sampling) -> jax.Array:
    """HF's warpers with per-row parameters, in HF's order: temperature, top-k, top-p (at least one token kept).
    scores float32 [b, V] -> [b, V] with removed tokens at -inf; a row equals ``decoding.warp`` with its options."""
    b, vocab = scores.shape
    scores = scores / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]

    def top_k(scores):
        k = s.top_k[:, None]
        kth = jnp.take_along_axis(-jnp.sort(-scores, axis=-1), jnp.clip(k - 1, 0, vocab - 1), axis=-1)
        return jnp.where((k > 0) & (k < vocab) & (scores < kth), -jnp.inf, scores)

    def top_p(scores):
        order = jnp.argsort(scores, axis=-1)  # ascending, as HF sorts
        cumulative = jnp.cumsum(jax.nn.softmax(jnp.take_along_axis(scores, order, axis=-1), axis=-1), axis=-1)
        drop = (cumulative <= s.drop_mass[:, None]).at[:, -1].set(False)  # the most likely token always stays
        drop = jnp.zeros_like(drop).at[jnp.arange(b)[:, None], order].set(drop)
        return jnp.where(drop & (s.drop_mass > 0)[:, None], -jnp.inf, scores)

    scores = lax.cond(jnp.any((s.top_k > 0) & (s.top_k < vocab)), top_k, lambda x: x, scores)
    return lax.cond(jnp.any(s.drop_mass > 0), top_p, lambda x: x, scores)


def choose(logits: jax.Array, s: Sampling, index: jax.Array, tp_axis) -> jax.Array:
    """Each row's next token: the most likely one where its temperature is 0, else drawn from its warped scores
    with ``fold_in(key(seed), index)``. logits vocab-sharded [b, Vl], index int32 [b] (the token's index in its
    request's output) -> int32 [b], the same on every tp device."""
    full = decoding.gather_vocab(logits, tp_axis).astype(jnp.float32)
    greedy = jnp.argmax(full, axis=-1).astype(jnp.int32)

    def sampled():
        keys = jax.vmap(lambda seed, i: jax.random.fold_in(jax.random.key(seed), i))(s.seed, index)
        drawn = jax.vmap(jax.random.categorical)(keys, warp_rows(full, s)).astype(jnp.int32)
        return jnp.where(s.temperature > 0, drawn, greedy)

    return lax.cond(jnp.any(s.temperature > 0), sampled, lambda: greedy)


def insert(family, dp, opts, cache, ids, mask, rows, s: Sampling, width: int, max_new_tokens: int, tp_axis=None):
    """Joining prompts into free rows of the slots' cache. ids/mask [j, k] (laid out as the family decodes them),
    rows int32 [j]: the cache row each joins (a row past the cache's: a filler, dropped), s: their sampling ->
    (their first tokens int32 [j], cache). ``width``: the widest prompt the cache holds; ``max_new_tokens``: the
    most tokens a row writes."""
    logits, new = family.decode_start(dp, ids, mask, opts, max_new_tokens, tp_axis)
    new = family.widen_cache(new, ids.shape[1], width)
    first = choose(logits, s, jnp.zeros(ids.shape[0], jnp.int32), tp_axis)
    cache = jax.tree.map(lambda c, n: c.at[rows].set(n.astype(c.dtype), mode="drop"), cache, new)
    return first, cache


def advance(family, dp, opts, cache, token, index, limit, s: Sampling, steps: int, eos_id: int, pad_id: int,
            tp_axis=None):
    """``steps`` decoding steps of every row. token int32 [b]: each row's last token, ``index`` [b] its index in the
    row's output, ``limit`` [b] the most tokens the row may write (0: an empty row) -> (int32 [b, steps]: the next
    tokens, ``pad_id`` once a row wrote its end-of-text token or its limit, cache)."""

    def body(carry, _):
        token, index, cache, done = carry
        logits, cache = family.decode_step(dp, token, index, cache, opts, tp_axis)
        nxt = jnp.where(done, pad_id, choose(logits, s, index + 1, tp_axis))
        ended = done | (nxt == eos_id) | (index + 2 >= limit)
        return (nxt, jnp.where(ended, index, index + 1), cache, ended), nxt

    init = (token, index, cache, index + 1 >= limit)
    (_, _, cache, _), out = lax.scan(body, init, None, length=steps)
    return out.T, cache
