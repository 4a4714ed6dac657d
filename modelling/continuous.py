"""Continuous batching: the per-device programs of its decoding slots (serving/), for any family.

A fixed number of rows ("slots") share one KV cache, each row holding its own request at its own position:
``insert`` reads joining prompts packed several to a row (the family's ``decode_start_packed``: T5's encoder and
cross-attention keys/values, GPT-J's prefill, each prompt's share gathered out of the packed rows) and writes their
cache into free rows; ``advance`` moves every row a few tokens on (``decode_step`` with a per-row index). Rows come and go between
calls, so a short request never waits for a long one (JetStream's ``insert`` + ``generate``).

Where each row is (``Rows``: its last token, that token's index, its limit, whether it still writes) and how it
samples (``Sampling``) live on the device beside the cache: ``insert`` writes them for the joining rows and
``advance`` carries them from call to call, so the host dispatches the next call without reading the last one's
tokens (the host's work then overlaps the device's). A row ends on the device (its end-of-text token, its limit);
the host ends one early (a client gone, a stop string) by clearing its ``keep`` flag.

Each row samples with its own parameters (temperature 0 is greedy; HF's warpers in HF's order, as
modelling/decoding.py's ``warp`` for one row) and its own key: token n of a request is drawn with
``fold_in(fold_in(key(seed), seed_hi), n)`` (a 64-bit seed), so a seeded request gives the same tokens whatever else
runs beside it (bit for bit in one span; ``advance``'s ``span``, which the other rows' progress sets, may round the
attention's sums otherwise). A row that asks for log-probabilities (``Sampling.logprobs`` >= 0) gets, for each
token, the model's own log-probability of it (log-softmax of the float32 logits, before temperature and top-k/top-p,
as vLLM returns them) and the ``top`` most likely tokens with theirs.

Each row may carry its own logits processors too (modelling/processors.py's ``RowControls``, the state's third
part: a bias table, penalties over the tokens its decoder read, min-p, ignore_eos, a key for the host's grammar
bitmask), applied before the warpers in HF's order behind one ``lax.cond`` that a step whose live rows ask for none
skips; no row ever chooses an id past the tokenizer's vocabulary (``vocab``).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax

from modelling import decoding, processors
from modelling.processors import RowControls


@jax.tree_util.register_dataclass
@dataclass
class Sampling:
    """Each row's sampling parameters, [b] each."""

    temperature: jax.Array  # float32: 0 picks the most likely token (greedy), else the scores are divided by it
    top_k: jax.Array  # int32: keep the k most likely tokens (0: all)
    drop_mass: jax.Array  # float32: top-p's 1 - top_p (as HF computes it, in float64 on the host); 0: off
    seed: jax.Array  # uint32: the low half of the row's 64-bit seed
    seed_hi: jax.Array  # uint32: its high half
    logprobs: jax.Array  # int32: -1 no log-probabilities; k >= 0: the token's and the k best (the top computed)


@jax.tree_util.register_dataclass
@dataclass
class Rows:
    """Where each row is, [b] each: what ``advance`` carries from one call to the next."""

    token: jax.Array  # int32: its last token
    index: jax.Array  # int32: that token's index in the row's output
    limit: jax.Array  # int32: the most tokens it may write
    alive: jax.Array  # bool: it still writes (not ended by its end-of-text token or its limit)


@jax.tree_util.register_dataclass
@dataclass
class Scored:
    """Log-probabilities of chosen tokens, [...] each (zeros where no row asked for them)."""

    logprob: jax.Array  # float32 [...]: the chosen token's
    top_ids: jax.Array  # int32 [..., top]: the most likely tokens, most likely first
    top_logprobs: jax.Array  # float32 [..., top]: theirs


def warp_rows(scores: jax.Array, s: Sampling, min_p=None) -> jax.Array:
    """HF's warpers with per-row parameters, in HF's order: temperature, top-k, top-p (at least one token kept),
    min-p (float32 [b], 0 off; None: none). scores float32 [b, V] -> [b, V] with removed tokens at -inf; a row
    equals ``decoding.warp`` with its options."""
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
    scores = lax.cond(jnp.any(s.drop_mass > 0), top_p, lambda x: x, scores)
    if min_p is None:
        return scores
    return lax.cond(jnp.any(min_p > 0), lambda x: processors.min_p(x, min_p), lambda x: x, scores)


def score(full: jax.Array, token: jax.Array, top: int) -> Scored:
    """The model's log-probabilities: full float32 logits [..., V], token int [...] -> its log-probability and the
    ``top`` most likely tokens' (log-softmax over the whole vocabulary; padded columns are masked by the head)."""
    lsm = jax.nn.log_softmax(full, axis=-1)
    vals, ids = lax.top_k(lsm, top)
    return Scored(jnp.take_along_axis(lsm, token[..., None].astype(jnp.int32), axis=-1)[..., 0], ids.astype(jnp.int32),
                  vals)


def no_scores(shape: tuple, top: int) -> Scored:
    return Scored(jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (top,), jnp.int32),
                  jnp.zeros(shape + (top,), jnp.float32))


def choose(logits: jax.Array, s: Sampling, index: jax.Array, tp_axis, top: int, process=None, min_p=None,
           vocab: int = 0) -> tuple:
    """Each row's next token: the most likely one where its temperature is 0, else drawn from its warped scores
    with its key folded with ``index``; and its log-probabilities where the row asks (``Scored``, ``top`` best).
    logits vocab-sharded [b, Vl], index int32 [b] (the token's index in its request's output) -> (int32 [b],
    Scored [b]), the same on every tp device. ``vocab``: ids at or past it are never chosen (0: none cut);
    ``process``: the rows' logits processors (scores [b, V] -> [b, V]: modelling/processors.py's ``process_rows``),
    before the warpers; ``min_p``: the rows' min-p warper. The log-probabilities are the model's own, before all."""
    full = decoding.gather_vocab(logits, tp_axis).astype(jnp.float32)
    real = processors.vocab_limit(full, vocab)
    if process is not None:
        real = process(real)
    greedy = jnp.argmax(real, axis=-1).astype(jnp.int32)

    def sampled():
        def key(seed, hi, i):
            return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), hi), i)

        keys = jax.vmap(key)(s.seed, s.seed_hi, index)
        drawn = jax.vmap(jax.random.categorical)(keys, warp_rows(real, s, min_p)).astype(jnp.int32)
        return jnp.where(s.temperature > 0, drawn, greedy)

    token = lax.cond(jnp.any(s.temperature > 0), sampled, lambda: greedy)
    scored = lax.cond(jnp.any(s.logprobs >= 0), lambda: score(full, token, top),
                      lambda: no_scores(token.shape, top))
    return token, scored


def _set(x, rows, v):
    return x.at[rows].set(v.astype(x.dtype), mode="drop")


def insert(family, w, opts, cache, state: tuple, block: tuple, at, lengths, rows, s: Sampling, limit,
           max_new_tokens: int, eos_id: int, top: int, tp_axis=None, controls=None, entries=None, host=None,
           vocab: int = 0):
    """Joining prompts into free rows of the slots' cache, read packed several to a row: block (ids, segments,
    positions) [R, W] (modelling/rows.py's packed rows), at int32 [J]: each joiner's first position in the rows
    flattened (r * W + c), lengths int32 [J] its tokens (0: a filler), rows int32 [J]: the cache row each joins (a
    row past the cache's: a filler, dropped), s: their sampling, limit int32 [J]: their most tokens; state: (Rows,
    Sampling) of every row, or (Rows, Sampling, RowControls) -> (their first tokens int32 [J], their Scored [J],
    cache, state). ``max_new_tokens``: the most tokens a row writes. With RowControls: ``controls`` the joiners'
    (their table and history aside: made here), ``entries`` int32 [E, 5] their tables' entries
    (``processors.joiner_table``), ``host`` the grammars' bitmask (``processors.host_bits``); ``vocab``: ids at or
    past it never chosen."""
    ids, segments, positions = block
    width = ids.shape[1]
    cols = jnp.arange(width)[None]
    where = jnp.where(cols < lengths[:, None], at[:, None] + cols, ids.size)  # (past a prompt: the row of zeros)
    logits, new = family.decode_start_packed(w, ids, segments, positions, where, jnp.maximum(lengths, 1), opts,
                                             max_new_tokens, tp_axis)
    r, all_s, *rest = state
    index = jnp.zeros(rows.shape[0], jnp.int32)
    if not rest:
        first, scored = choose(logits, s, index, tp_axis, top, vocab=vocab)
    else:
        size = rest[0].history.shape[1]
        c = RowControls(*(getattr(controls, f) for f in ("presence", "frequency", "repetition", "min_p",
                                                            "ignore_eos", "grammar")),
                        processors.joiner_table(entries, rows.shape[0]),
                        processors.joiner_history(family, ids, at, lengths, width, size, index - 1))
        p = RowControls.prompt_part(family, width)
        process = lambda x: processors.process_rows(x, c, lengths > 0, index, index - 1, p, eos_id, host)  # noqa
        first, scored = choose(logits, s, index, tp_axis, top, process, c.min_p, vocab)
        c = RowControls(*(getattr(c, f) for f in RowControls.__dataclass_fields__ if f != "history"),
                        c.history.at[:, p].set(first))
        rest = [jax.tree.map(lambda a, v: _set(a, rows, v), rest[0], c)]
    cache = jax.tree.map(lambda c, n: _set(c, rows, n), cache, new)
    goes_on = (first != eos_id) | (controls.ignore_eos if rest else jnp.zeros_like(first, bool))
    r = Rows(_set(r.token, rows, first), _set(r.index, rows, jnp.zeros_like(first)), _set(r.limit, rows, limit),
             _set(r.alive, rows, goes_on & (limit > 1)))
    all_s = jax.tree.map(lambda a, v: _set(a, rows, v), all_s, s)
    return first, scored, cache, (r, all_s, *rest)


def cache_span(family, cache) -> int:
    """The positions a step of the slots' cache attends over at most (its width along ``Family.cache_positions``);
    None for a family whose steps read all of their cache."""
    axes = family.cache_positions(cache)
    if axes is None:
        return None
    widths = {x.shape[a] for x, a in zip(jax.tree.leaves(cache), jax.tree.leaves(axes)) if a >= 0}
    assert len(widths) == 1, widths
    return widths.pop()


def narrow(family, cache, span: int):
    """The cache's first ``span`` positions (a copy), what a step reads and writes of them."""
    return jax.tree.map(lambda x, a: x if a < 0 else lax.slice_in_dim(x, 0, span, axis=a), cache,
                        family.cache_positions(cache))


def merge(family, cache, narrowed):
    """``narrowed`` (``narrow``'s, after steps) written back over the first positions of ``cache``."""
    return jax.tree.map(lambda x, n, a: n if a < 0 else lax.dynamic_update_slice_in_dim(x, n, 0, axis=a), cache,
                        narrowed, family.cache_positions(cache))


def advance(family, w, opts, cache, state: tuple, keep, steps: int, eos_id: int, pad_id: int, top: int,
            tp_axis=None, n=None, span=None, host=None, vocab: int = 0, prompt_part: int = 0):
    """``n`` decoding steps of every row (a traced int32 scalar, at most ``steps``; ``steps`` when None). state: (Rows,
    Sampling) of every row, or (Rows, Sampling, RowControls): each row's processors too (``host``: the grammars'
    bitmask; ``prompt_part``: its history's places before the output, ``RowControls.prompt_part``); keep bool [b]:
    the rows the host still holds (a row it cleared ends now) -> (int32 [b, steps]: the next tokens, ``pad_id`` once
    a row ended and in the columns past ``n``, Scored [b, steps], cache, state). One program runs any number of steps
    up to ``steps`` (a loop of ``n`` turns, not ``steps``). ``vocab``: ids at or past it are never chosen.

    ``span``: the steps attend over the cache's first ``span`` positions only (``cache_span``'s at most; None: all of
    them): a copy of those, stepped, written back. The caller promises that every row still writing writes only
    there in these ``n`` steps (``Family.first_token_column``); a row that no longer writes may write past it (a
    write clamped to the last position it holds), which only it reads, until an insert fills it anew."""
    if span is not None and span < cache_span(family, cache):
        full = cache
        out, scored, cache, state = advance(family, w, opts, narrow(family, cache, span), state, keep, steps, eos_id,
                                            pad_id, top, tp_axis, n, None, host, vocab, prompt_part)
        return out, scored, merge(family, full, cache), state
    r, s, *rest = state
    live = r.alive & keep
    # the rows that no longer write ask for nothing (a sampled or scored row gone leaves greedy rows greedy)
    s = Sampling(jnp.where(live, s.temperature, 0.0), jnp.where(live, s.top_k, 0), jnp.where(live, s.drop_mass, 0.0),
                 s.seed, s.seed_hi, jnp.where(live, s.logprobs, -1))
    b = r.token.shape[0]
    n = jnp.minimum(jnp.asarray(steps if n is None else n, jnp.int32), steps)

    ignore_eos = rest[0].ignore_eos if rest else jnp.zeros(b, bool)
    history = rest[0].history if rest else jnp.zeros((b, 0), jnp.int32)

    def body(carry):
        i, token, index, cache, alive, out, scored, history = carry
        logits, cache = family.decode_step(w, token, index, cache, opts, tp_axis)
        process, min_p = None, None
        if rest:
            c = RowControls(*(getattr(rest[0], f) for f in RowControls.__dataclass_fields__ if f != "history"),
                            history)
            process = lambda x: processors.process_rows(x, c, alive, index + 1, token, prompt_part, eos_id,  # noqa
                                                        host)
            min_p = jnp.where(alive, c.min_p, 0.0)
        nxt, sc = choose(logits, s, index + 1, tp_axis, top, process, min_p, vocab)
        nxt = jnp.where(alive, nxt, pad_id)
        ended = ((nxt == eos_id) & ~ignore_eos) | (index + 2 >= r.limit)
        if rest:  # the row's new token in its history (a row that no longer writes: nothing)
            at = jnp.where(alive, prompt_part + index + 1, history.shape[1])
            history = history.at[jnp.arange(b), at].set(nxt, mode="drop")
        out = out.at[i].set(nxt)
        scored = jax.tree.map(lambda a, x: a.at[i].set(x), scored, sc)
        return (i + 1, jnp.where(alive, nxt, token), jnp.where(alive, index + 1, index), cache, alive & ~ended, out,
                scored, history)

    init = (jnp.int32(0), r.token, r.index, cache, live, jnp.full((steps, b), pad_id, jnp.int32),
            no_scores((steps, b), top), history)
    _, token, index, cache, alive, out, scored, history = lax.while_loop(lambda c: c[0] < n, body, init)
    scored = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), scored)
    if rest:
        rest = [RowControls(*(getattr(rest[0], f) for f in RowControls.__dataclass_fields__ if f != "history"),
                            history)]
    return out.T, scored, cache, (Rows(token, index, r.limit, alive), state[1], *rest)


def score_prompts(family, w, opts, ids, mask, top: int, tp_axis=None) -> Scored:
    """The prompts' own log-probabilities (a causal family's: each token given the ones before). ids/mask [n, k]
    laid out as the family decodes them -> Scored [n, k - 1]: column c holds token c + 1's."""
    full = decoding.gather_vocab(family.prompt_logits(w, ids, mask, opts, tp_axis), tp_axis).astype(jnp.float32)
    return score(full[:, :-1], ids[:, 1:], top)
