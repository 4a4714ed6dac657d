"""Decoding searches over any family, under tensor parallelism: greedy, beam search and sampling, each one
compiled ``lax.while_loop`` that stops as soon as every sequence has ended, each as Hugging Face ``generate``
defines it (HF's vectorised beam search with its length penalty and early-stopping rules; HF's temperature, top-k
and top-p warpers).

A search knows no model: the family (modelling/family.py) supplies ``decode_start`` (read the
prompts: T5's encoder, a causal LM's prefill; -> the first new token's logits and a KV cache) and
``decode_step`` (one new token -> the next one's logits and the cache), as t5x's decoding takes a
``tokens_to_logits`` callback. Every leaf of a cache has the batch as its leading axis.

Logits are vocab-sharded ([b, Vl] per device, Vl = padded vocab / tp): greedy picks its token without
gathering them (``greedy_token``); beam search and sampling gather a row's logits over tp (``gather_vocab``) and
every tp device makes the same choice. Finished sequences are padded with ``pad_id`` after their EOS (kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from modelling import processors
from modelling.processors import Processors
from modelling.tp import tp_index, trivial


def greedy_token(logits: jax.Array, tp_axis: Optional[str], vocab: int = 0) -> jax.Array:
    """Argmax over vocab-sharded logits. logits [b, Vl] -> int32 [b] global ids; ``vocab``: ids at or past it (the
    embedding's rows past the tokenizer's vocabulary) never chosen (0: every id).

    Each device takes its local max and index; the maxima are gathered over tp (a
    [tp, b] exchange, not the logits) and the first device holding the largest wins,
    which reproduces argmax's lowest-index tie-break.
    """
    offset = 0 if trivial(tp_axis) else tp_index(tp_axis) * logits.shape[-1]
    if vocab and vocab < logits.shape[-1] * (1 if trivial(tp_axis) else lax.axis_size(tp_axis)):
        logits = jnp.where(offset + jnp.arange(logits.shape[-1])[None] < vocab, logits, -jnp.inf)
    local_idx = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if trivial(tp_axis):
        return local_idx
    local_max = jnp.max(logits, axis=-1)
    maxes = lax.all_gather(local_max, tp_axis)  # [tp, b]
    idxs = lax.all_gather(local_idx + offset, tp_axis)
    best = jnp.argmax(maxes, axis=0)
    return jnp.take_along_axis(idxs, best[None], axis=0)[0]


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
           tp_axis: Optional[str] = None, eos_id: int = 1, pad_id: int = 0, encoded=None) -> jax.Array:
    """Greedy decoding with the KV cache. ids/mask [b, k] (left-padded for a family that says so) -> int32 tokens
    [b, max_new_tokens]: each sequence stops at ``eos_id`` (kept) and is padded with ``pad_id`` after it.
    ``encoded``: the prompt stacks' output read already (``start``), then ``input_ids`` is not read."""
    return _one_beam(family, params, input_ids, attention_mask, opts, max_new_tokens, tp_axis, eos_id, pad_id,
                     lambda logits, i, out: greedy_token(logits, tp_axis), encoded)


def start(family, w, input_ids, attention_mask, opts, max_new_tokens: int, tp_axis, encoded=None) -> tuple:
    """(the first new token's logits, the cache): the family reads the prompts (``decode_start``), or, given the
    output of its prompt stacks (``encoded``: T5's encoder streamed from host memory), the rest of them
    (``decode_start_encoded``)."""
    if encoded is None:
        return family.decode_start(w, input_ids, attention_mask, opts, max_new_tokens, tp_axis)
    return family.decode_start_encoded(w, encoded, attention_mask, opts, max_new_tokens, tp_axis)


def _one_beam(family, params, input_ids, attention_mask, opts, max_new_tokens: int, tp_axis, eos_id: int,
              pad_id: int, choose, encoded=None) -> jax.Array:
    """A search that follows one sequence per row: ``choose(logits [b, Vl], i, out) -> int32 [b]`` picks token i
    (out int32 [b, max_new_tokens]: the tokens so far, its columns from i on padding)."""
    w = family.decoding_params(params, opts)
    logits, cache = start(family, w, input_ids, attention_mask, opts, max_new_tokens, tp_axis, encoded)
    b = attention_mask.shape[0]
    out = jnp.full((b, max_new_tokens), pad_id, jnp.int32)
    first = choose(logits, 0, out)
    out = out.at[:, 0].set(first)

    def cond(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    def body(carry):
        i, token, out, cache, done = carry
        logits, cache = family.decode_step(w, token, i - 1, cache, opts, tp_axis)
        nxt = jnp.where(done, pad_id, choose(logits, i, out))
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


# --------------------------------------------------------------------------- options and the search they choose


@dataclass(frozen=True)
class Options:
    """How to decode (the config's ``inference`` section): greedy by default, beam search with ``num_beams`` > 1,
    sampling with ``do_sample``; hashable, static under jit."""

    max_new_tokens: int
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: str = "false"  # "true", "false" or "never", as HF's early_stopping (True, False, "never")
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    vocab: int = 0  # the tokenizer's vocabulary: ids at or past it are never chosen (0: every id the model has)
    processors: Processors = Processors()  # HF's logits processors, before the warpers (modelling/processors.py)

    @classmethod
    def of_config(cls, inference) -> "Options":
        """The config's decoding options (the processors that need a tokenizer or a task: ``app/predict.py``'s
        ``decoding_options``)."""
        i = inference
        return cls(i.output_length, i.num_beams, i.length_penalty, i.early_stopping, i.do_sample, i.temperature,
                   i.top_k, i.top_p)


def decode(family, params: dict, input_ids, attention_mask, opts, options: Options, tp_axis=None, eos_id: int = 1,
           pad_id: int = 0, key=None, row_offset=0, encoded=None) -> jax.Array:
    """The search ``options`` name -> int32 tokens [b, max_new_tokens] padded with ``pad_id`` after each EOS.
    ``key``: sampling's key (the same for every device); ``row_offset``: the global index of this device's first row
    (each row's draws depend on its index, so the outputs are the same at any dp x tp); ``encoded``: see ``start``."""
    n = options.max_new_tokens
    if options.num_beams > 1:
        return beam_search(family, params, input_ids, attention_mask, opts, options, tp_axis, eos_id, pad_id, encoded,
                           row_offset)
    rows = row_offset + jnp.arange(attention_mask.shape[0])
    scores = _processed(family, input_ids, attention_mask, options, tp_axis, rows, eos_id)

    def choose(logits, i, out):
        if options.do_sample:
            return sample_token(warp(scores(logits, i, out), options), jax.random.fold_in(key, i), rows)
        if scores is not _gathered:
            return jnp.argmax(scores(logits, i, out), axis=-1).astype(jnp.int32)
        return greedy_token(logits, tp_axis, options.vocab)

    return _one_beam(family, params, input_ids, attention_mask, opts, n, tp_axis, eos_id, pad_id, choose, encoded)


def _gathered(logits, i, out):
    return logits  # (a marker: the scores need no processing, greedy takes the sharded logits as they are)


def _processed(family, input_ids, attention_mask, options: Options, tp_axis, rows, eos_id: int):
    """(logits [b, Vl], i, out [b, n]) -> the scores token i is chosen from, float32 [b, V'] (gathered over tp, cut
    to the tokenizer's vocabulary, the processors applied with the row's tokens so far); ``_gathered`` itself for a
    greedy search with no processor (which needs no gathered logits)."""
    procs, n = options.processors, options.max_new_tokens
    if not procs.active and not options.do_sample:
        return _gathered
    if not procs.active:
        return lambda logits, i, out: processors.vocab_limit(gather_vocab(logits, tp_axis), options.vocab)
    history, read, p = processors.decoder_history(family, input_ids, attention_mask, n)
    cols = jnp.arange(n)[None]

    def scores(logits, i, out):
        full = processors.vocab_limit(gather_vocab(logits, tp_axis).astype(jnp.float32), options.vocab)
        new = jnp.where(cols < i, out, processors.NO_TOKEN)
        b = new.shape[0]
        count = jnp.full((b,), i, jnp.int32)
        hist = history.at[:, p:].set(new)
        keys = jnp.where(jnp.any(new == eos_id, axis=1), 0, rows + 1)  # (a row that ended asks the host nothing)
        return procs(full, hist, read.at[:, p:].set(cols < i), p + count, new, count, keys)

    return scores


def gather_vocab(logits: jax.Array, tp_axis: Optional[str]) -> jax.Array:
    """Vocab-sharded logits [b, Vl] -> the whole vocabulary [b, V] on every tp device."""
    return logits if trivial(tp_axis) else lax.all_gather(logits, tp_axis, axis=logits.ndim - 1, tiled=True)


def label_scores(family, params: dict, input_ids, attention_mask, opts, labels: jax.Array, tp_axis=None,
                 pad_id: int = 0, encoded=None) -> jax.Array:
    """Rank classification (SeqIO's and T5X's way of scoring a label task): each prompt's log-likelihood of each
    label, the sum of its tokens' log-probabilities (its end-of-text token's included) given the prompt and the
    tokens before them. ids/mask [b, k], labels int32 [L, T] (-1 past a label's tokens) -> float32 [b, L]. The
    prompts are read once; each is then followed by every label (as beam search follows its beams)."""
    w = family.decoding_params(params, opts)
    logits, cache = start(family, w, input_ids, attention_mask, opts, labels.shape[1], tp_axis, encoded)
    n, (L, T) = attention_mask.shape[0], labels.shape
    cache = jax.tree.map(lambda x: jnp.repeat(x, L, axis=0), cache)
    tokens = jnp.tile(labels, (n, 1))  # [n L, T]: row r * L + l is prompt r followed by label l

    def body(t, carry):
        logits, cache, total = carry
        lsm = jax.nn.log_softmax(gather_vocab(logits, tp_axis).astype(jnp.float32), axis=-1)
        tok = tokens[:, t]
        total += jnp.where(tok >= 0, jnp.take_along_axis(lsm, jnp.maximum(tok, 0)[:, None], axis=1)[:, 0], 0.0)
        logits, cache = family.decode_step(w, jnp.where(tok >= 0, tok, pad_id), t, cache, opts, tp_axis)
        return logits, cache, total

    init = (jnp.repeat(logits, L, axis=0), cache, jnp.zeros(n * L, jnp.float32))
    return lax.fori_loop(0, T, body, init)[2].reshape(n, L)


# --------------------------------------------------------------------------- sampling


def warp(logits: jax.Array, options: Options) -> jax.Array:
    """HF's sampling warpers, in HF's order: temperature, top-k, top-p (keeping at least one token). logits float32
    [b, V] -> [b, V] with the removed tokens at -inf."""
    scores = logits.astype(jnp.float32)
    if options.temperature != 1.0:
        scores = scores / options.temperature
    if 0 < options.top_k < scores.shape[-1]:
        kth = lax.top_k(scores, options.top_k)[0][..., -1:]
        scores = jnp.where(scores < kth, -jnp.inf, scores)
    if options.top_p < 1.0:
        order = jnp.argsort(scores, axis=-1)  # ascending, as HF sorts
        ascending = jnp.take_along_axis(scores, order, axis=-1)
        cumulative = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
        drop = (cumulative <= 1.0 - options.top_p).at[..., -1].set(False)  # the most likely token always stays
        drop = jnp.zeros_like(drop).at[jnp.arange(drop.shape[0])[:, None], order].set(drop)
        scores = jnp.where(drop, -jnp.inf, scores)
    return scores


def sample_token(scores: jax.Array, key, rows: jax.Array) -> jax.Array:
    """One token per row from softmax(scores) [b, V]; row r draws with fold_in(key, its global index ``rows[r]``)."""
    keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(rows)
    return jax.vmap(lambda k, s: jax.random.categorical(k, s))(keys, scores).astype(jnp.int32)


# --------------------------------------------------------------------------- beam search

NEG = -1.0e9  # HF's "very large negative value" for beams and candidates that must not be chosen


def beam_search(family, params: dict, input_ids, attention_mask, opts, options: Options, tp_axis=None,
                eos_id: int = 1, pad_id: int = 0, encoded=None, row_offset=0) -> jax.Array:
    """Beam search as HF's vectorised ``_beam_search`` (transformers 5) does it, one compiled loop: each step keeps
    the top 2 x num_beams continuations over all beams, the best num_beams that did not end continue, those of the
    top num_beams that ended (at EOS, or at max_new_tokens) join the finished hypotheses with their log-probability
    divided by (their length ** length_penalty), and the loop stops by HF's rules (``early_stopping``). -> int32
    [b, max_new_tokens]: the best finished hypothesis of each row, padded with ``pad_id`` after its EOS."""
    k, n = options.num_beams, options.max_new_tokens
    w = family.decoding_params(params, opts)
    logits, cache = start(family, w, input_ids, attention_mask, opts, n, tp_axis, encoded)
    b = attention_mask.shape[0]
    cache = jax.tree.map(lambda x: jnp.repeat(x, k, axis=0), cache)  # each row's prompt read once, then k beams
    logits = jnp.repeat(logits, k, axis=0)
    state = _BeamState.start(b, k, n, tp_axis)
    process = _beam_processors(family, input_ids, attention_mask, options, k, row_offset, eos_id)

    def cond(carry):
        i, _, _, st, go = carry
        return (i < n) & go

    def body(carry):
        i, logits, cache, st, _ = carry
        st, parents, go = _beam_step(st, gather_vocab(logits, tp_axis), i, options, eos_id, process)
        flat = (parents + jnp.arange(b)[:, None] * k).reshape(-1)  # each new beam's parent, as a row of the cache
        cache = family.reorder_beams(cache, flat)
        step = lambda: family.decode_step(w, st.tokens[:, :, i].reshape(-1), i, cache, opts, tp_axis)  # noqa: E731
        logits, cache = lax.cond(go & (i + 1 < n), step, lambda: (logits, cache))  # no forward after the last
        return i + 1, logits, cache, st, go

    _, _, _, st, _ = lax.while_loop(cond, body, (jnp.int32(0), logits, cache, state, jnp.bool_(True)))
    best = st.done_tokens[:, 0]
    ended = jnp.cumsum(best == eos_id, axis=1) - (best == eos_id) > 0  # positions after the first EOS
    return jnp.where(ended | (best < 0), pad_id, best)


@jax.tree_util.register_dataclass
@dataclass
class _BeamState:
    """The running beams and the finished hypotheses of every row (HF's running_sequences and sequences)."""

    tokens: jax.Array  # int32 [b, k, n] the running beams' tokens (-1 where none yet)
    scores: jax.Array  # float32 [b, k] their summed log-probabilities (beams 1.. start at NEG: beam 0 alone first)
    done_tokens: jax.Array  # int32 [b, k, n] the finished hypotheses, best first
    done_scores: jax.Array  # float32 [b, k] their length-penalised scores (NEG: an empty slot)
    done: jax.Array  # bool [b, k] whether a slot holds a finished hypothesis
    improvable: jax.Array  # bool [b] HF's is_early_stop_heuristic_unsatisfied

    @classmethod
    def start(cls, b: int, k: int, n: int, tp_axis) -> "_BeamState":
        scores = jnp.full((b, k), NEG, jnp.float32).at[:, 0].set(0.0)
        return cls(jnp.full((b, k, n), -1, jnp.int32), scores, jnp.full((b, k, n), -1, jnp.int32),
                   jnp.full((b, k), NEG, jnp.float32), jnp.zeros((b, k), bool), jnp.ones((b,), bool))


def _take(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [b, m, ...] at idx [b, j] along axis 1 -> [b, j, ...]."""
    return jnp.take_along_axis(x, idx.reshape(idx.shape + (1,) * (x.ndim - 2)), axis=1)


def _beam_processors(family, input_ids, attention_mask, options: Options, k: int, row_offset, eos_id: int):
    """(log-probabilities [b k, V], i, the running beams' tokens [b, k, n]) -> them processed as HF's beam search
    processes them (after the log-softmax: the vocabulary's cut, then the processors, each beam its own row)."""
    procs, n = options.processors, options.max_new_tokens
    if not procs.active:
        return lambda lp, i, tokens: processors.vocab_limit(lp, options.vocab)
    history, read, p = processors.decoder_history(family, input_ids, attention_mask, n)
    history, read = jnp.repeat(history, k, axis=0), jnp.repeat(read, k, axis=0)
    keys = jnp.repeat(row_offset + jnp.arange(input_ids.shape[0]), k) * k + jnp.tile(jnp.arange(k), input_ids.shape[0])
    cols = jnp.arange(n)[None]

    def process(lp, i, tokens):
        new = jnp.where(cols < i, tokens.reshape(-1, n), processors.NO_TOKEN)
        count = jnp.full((new.shape[0],), i, jnp.int32)
        live = jnp.where(jnp.any(new == eos_id, axis=1), 0, keys + 1)
        return procs(processors.vocab_limit(lp, options.vocab), history.at[:, p:].set(new),
                     read.at[:, p:].set(cols < i), p + count, new, count, live)

    return process


def _beam_step(st: _BeamState, logits: jax.Array, i, options: Options, eos_id: int, process) -> tuple:
    """One step of HF's beam search at new token i: (state, each new running beam's parent beam [b, k], whether
    the search goes on)."""
    b, k, n = st.tokens.shape
    lp, es = options.length_penalty, options.early_stopping
    log_probs = process(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), i, st.tokens)
    log_probs = log_probs.reshape(b, k, -1) + st.scores[..., None]
    vocab = log_probs.shape[-1]
    top, idx = lax.top_k(log_probs.reshape(b, -1), 2 * k)  # HF's beams_to_keep: (1 + one EOS token) x num_beams
    parent, token = idx // vocab, (idx % vocab).astype(jnp.int32)
    cand = _take(st.tokens, parent).at[:, :, i].set(token)  # [b, 2k, n]
    hits = (token == eos_id) | (i + 1 >= n)  # EOS, or max_new_tokens reached: the candidate ends here
    # the running beams of the next step: the best k candidates that did not end
    keep = lax.top_k(top + hits * NEG, k)[1]
    tokens, scores, parents = _take(cand, keep), _take(top + hits * NEG, keep), _take(parent, keep)
    # the finished hypotheses: those of the top k candidates that ended, length-penalised, merged with the old
    length = (i + 1).astype(jnp.float32)
    full = jnp.all(st.done, axis=1, keepdims=True) & (es == "true")
    new_scores = (top / length ** lp + full * NEG + (~st.improvable[:, None]) * NEG
                  + ~(hits & (jnp.arange(2 * k) < k)[None]) * NEG)
    merged = lax.top_k(jnp.concatenate([st.done_scores, new_scores], 1), k)[1]
    done_tokens = _take(jnp.concatenate([st.done_tokens, cand], 1), merged)
    done_scores = _take(jnp.concatenate([st.done_scores, new_scores], 1), merged)
    done = _take(jnp.concatenate([st.done, hits & (jnp.arange(2 * k) < k)[None]], 1), merged)
    # HF's heuristic: can a running beam still beat the worst finished hypothesis?
    best_length = jnp.float32(n) if (es == "never" and lp > 0.0) else length
    best_running = scores[:, :1] / best_length ** lp
    worst = jnp.where(done, jnp.min(done_scores, axis=1, keepdims=True), NEG)
    improvable = st.improvable & jnp.any(best_running > worst, axis=1)
    go = jnp.any(improvable) & ~(jnp.all(done) & (es == "true")) & ~jnp.all(hits)
    return _BeamState(tokens, scores, done_tokens, done_scores, done, improvable), parents, go
