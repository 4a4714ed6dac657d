"""Logits processors on the device, per row, each as Hugging Face ``generate``'s processor of the same name (OpenAI's
and vLLM's where HF has none), applied in HF's order before the warpers (temperature, top-k, top-p, min-p):

    sequence bias (OpenAI's ``logit_bias`` is its single-token case; HF's ``bad_words_ids`` its -inf case)
    repetition penalty (HF: the tokens the decoder has read, a causal LM's prompt and its output, T5's start token
        and its output), then OpenAI's presence and frequency penalties (the output's tokens only)
    no repeated n-grams
    the minimum of new tokens (the end-of-text token masked before it)
    an allowed-token mask (HF's ``prefix_allowed_tokens_fn``: a label trie here, or a host's grammar bitmask)

A row's past is its ``history``: int32 [b, H], the decoder's tokens in order (a prompt part, then the new tokens),
``length`` [b] of them read so far; the penalties read it through a gather and a scatter, O(rows x H), never a
[rows, V] count kept between steps. A mask sets a score to -inf, and -inf stays -inf through every later processor
(a penalty multiplies or divides it, a bias adds to it), so where a mask sits among them changes nothing.

``vocab_limit``: token ids at or past the tokenizer's vocabulary (the embedding's rows padded past it) are never
chosen, in any search: the scores are cut to the tokenizer's ids before anything chooses among them.

The batch searches (modelling/decoding.py) take their processors as one static ``Processors`` (the same for every
row of a run: validation's and inference's flags); the server's slots (modelling/continuous.py) carry theirs per
row (``Rows``'s siblings there), each step behind a ``lax.cond`` on whether any live row asks for it, so that rows
that ask for nothing pay nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from utils.host_call import host_call

NO_TOKEN = -1  # a history's place that holds no token (a left pad of a prompt, a token not written yet)


def vocab_limit(scores: jax.Array, n_tokens: int) -> jax.Array:
    """scores [b, V] -> [b, n_tokens]: the ids the tokenizer has (the same where ``n_tokens`` is 0 or V or more)."""
    return scores if not n_tokens or n_tokens >= scores.shape[-1] else scores[:, :n_tokens]


def _rows(x: jax.Array) -> jax.Array:
    return jnp.arange(x.shape[0])[:, None]


def _dump(ids: jax.Array, keep: jax.Array, vocab: int) -> jax.Array:
    """ids where ``keep`` and in the vocabulary, else ``vocab`` (one column past it, dropped after)."""
    return jnp.where(keep & (ids >= 0) & (ids < vocab), ids, vocab)


def add_bias(scores: jax.Array, ids: jax.Array, values: jax.Array) -> jax.Array:
    """Sparse additive bias: scores [b, V], ids int32 [b, K] (out of [0, V): none), values float32 [b, K] -> scores
    with each row's values added at its ids (an id twice: both added)."""
    vocab = scores.shape[-1]
    padded = jnp.pad(scores, ((0, 0), (0, 1)))
    return padded.at[_rows(ids), _dump(ids, True, vocab)].add(values)[:, :vocab]


def sequence_bias(scores: jax.Array, history: jax.Array, length: jax.Array, table: tuple) -> jax.Array:
    """HF's ``SequenceBiasLogitsProcessor`` (and ``NoBadWordsLogitsProcessor``: biases of -inf), static ``table``
    ((ids, bias), ...): a sequence's bias is added to its last token where the row's last ``len(ids) - 1`` tokens
    are the rest of it (a one-token sequence: always). history int32 [b, H], length int32 [b]."""
    vocab = scores.shape[-1]
    bias = jnp.zeros((scores.shape[0], vocab + 1), jnp.float32)
    for ids, value in table:
        *prefix, last = ids
        m = len(prefix)
        if m:
            at = length[:, None] - m + jnp.arange(m)[None]  # the row's last m tokens
            tail = jnp.take_along_axis(history, jnp.clip(at, 0, history.shape[1] - 1), axis=1)
            hit = (length >= m) & jnp.all(tail == jnp.asarray(prefix, jnp.int32)[None], axis=1)
        else:
            hit = jnp.ones(scores.shape[0], bool)
        if 0 <= last < vocab:
            bias = bias.at[:, last].add(jnp.where(hit, jnp.float32(value), 0.0))
    return scores + bias[:, :vocab]


def repetition_penalty(scores: jax.Array, history: jax.Array, read: jax.Array, penalty: jax.Array) -> jax.Array:
    """HF's ``RepetitionPenaltyLogitsProcessor`` per row: each token the row has read (``read`` bool [b, H] says
    which places of ``history`` hold one) has its score divided by ``penalty`` (float32 [b]) where positive, else
    multiplied by it; once per token, however often it was read. A penalty of 1 changes nothing."""
    vocab = scores.shape[-1]
    ids = _dump(history, read, vocab)
    padded = jnp.pad(scores, ((0, 0), (0, 1)))
    got = jnp.take_along_axis(padded, ids, axis=1)
    p = penalty[:, None]
    return padded.at[_rows(ids), ids].set(jnp.where(got < 0, got * p, got / p))[:, :vocab]


def counts(history: jax.Array, read: jax.Array, vocab: int) -> jax.Array:
    """How often each token was read: int32 [b, vocab] of history [b, H] where ``read``."""
    ids = _dump(history, read, vocab)
    return jnp.zeros((history.shape[0], vocab + 1), jnp.int32).at[_rows(ids), ids].add(1)[:, :vocab]


def presence_frequency(scores: jax.Array, history: jax.Array, read: jax.Array, presence: jax.Array,
                       frequency: jax.Array) -> jax.Array:
    """OpenAI's penalties per row (float32 [b] each): a token's score less ``presence`` where it was read at all and
    ``frequency`` times the number of times it was (``read``: the output's places, OpenAI's "so far")."""
    n = counts(history, read, scores.shape[-1]).astype(jnp.float32)
    return scores - presence[:, None] * (n > 0) - frequency[:, None] * n


def no_repeat_ngram(scores: jax.Array, history: jax.Array, length: jax.Array, n: int) -> jax.Array:
    """HF's ``NoRepeatNGramLogitsProcessor`` (static ``n``): a token that would complete an n-gram the row's first
    ``length`` tokens already hold is -inf. history int32 [b, H], length int32 [b]."""
    b, h = history.shape
    if n < 1 or h < n:
        return scores
    vocab = scores.shape[-1]
    at = length[:, None] - (n - 1) + jnp.arange(n - 1)[None]
    prefix = jnp.take_along_axis(history, jnp.clip(at, 0, h - 1), axis=1)  # [b, n - 1]
    starts = jnp.arange(h - n + 1)
    windows = jnp.stack([history[:, starts + j] for j in range(n)], axis=-1)  # [b, h - n + 1, n]
    matches = jnp.all(windows[..., :-1] == prefix[:, None], axis=-1) & (starts[None] + n <= length[:, None])
    matches &= (length >= n)[:, None]  # (HF: no whole n-gram yet, nothing banned)
    banned = jnp.zeros((b, vocab + 1), bool).at[_rows(windows), _dump(windows[..., -1], matches, vocab)].set(True)
    return jnp.where(banned[:, :vocab], -jnp.inf, scores)


def mask_ids(scores: jax.Array, ids: jax.Array, masked: jax.Array) -> jax.Array:
    """scores with ``ids`` (int32 [b, K]) at -inf where ``masked`` (bool [b, K] or [b, 1])."""
    vocab = scores.shape[-1]
    hit = jnp.zeros((scores.shape[0], vocab + 1), bool).at[_rows(ids), _dump(ids, masked, vocab)].set(True)
    return jnp.where(hit[:, :vocab], -jnp.inf, scores)


def allowed_bits(scores: jax.Array, bits: jax.Array) -> jax.Array:
    """An allowed-token bitmask int32 [b, ceil(V / 32)] (bit j of word w: token 32 w + j, xgrammar's layout) -> the
    scores of the tokens it does not allow at -inf."""
    vocab = scores.shape[-1]
    ids = jnp.arange(vocab)
    allowed = (bits[:, ids // 32] >> (ids % 32)[None]) & 1
    return jnp.where(allowed != 0, scores, -jnp.inf)


def min_p(scores: jax.Array, p: jax.Array) -> jax.Array:
    """HF's ``MinPLogitsWarper`` per row (float32 [b]; 0: off): a token whose probability is below ``p`` times the
    most likely one's is -inf (the most likely always stays)."""
    probs = jax.nn.softmax(scores, axis=-1)
    top = jnp.max(probs, axis=-1, keepdims=True)
    keep = (probs >= p[:, None] * top) | (jnp.arange(scores.shape[-1])[None] == jnp.argmax(probs, -1)[:, None])
    return jnp.where(keep | (p[:, None] <= 0), scores, -jnp.inf)


# --------------------------------------------------------------------------- a label trie (prefix-allowed tokens)


@dataclass(frozen=True)
class LabelTrie:
    """The token sequences a row may write (a task's labels, each ending with its end-of-text token) as a token-level
    automaton, HF's ``prefix_allowed_tokens_fn`` over a trie: state 0 the root; ``tokens[s]`` the tokens allowed in
    state s (padded with -1), ``nexts[s]`` the state each leads to; a row off the trie (a beam that ended inside a
    label, which beam search still carries) may write ``end`` alone (its end-of-text token). Static (hashable) under
    jit."""

    tokens: tuple  # ((int, ...), ...) [states][branching]
    nexts: tuple
    end: int

    @classmethod
    def of(cls, sequences: list, end: int) -> "LabelTrie":
        children: list = [{}]
        for seq in sequences:
            s = 0
            for t in seq:
                if int(t) not in children[s]:
                    children[s][int(t)] = len(children)
                    children.append({})
                s = children[s][int(t)]
        width = max(1, max(len(c) for c in children))
        pad = lambda xs: tuple(xs) + (-1,) * (width - len(xs))  # noqa: E731
        return cls(tuple(pad(sorted(c)) for c in children), tuple(pad([c[t] for t in sorted(c)]) for c in children),
                   int(end))

    def allowed(self, sent: list) -> list:
        """The tokens allowed after ``sent`` (a row's new tokens so far): HF's ``prefix_allowed_tokens_fn``'s answer,
        on the host (the reference the device's is held to); off the trie: ``end``."""
        s = 0
        for t in sent:
            row = self.tokens[s]
            if t not in row:
                return [self.end]
            s = self.nexts[s][row.index(t)]
        return [t for t in self.tokens[s] if t >= 0] or [self.end]

    def state(self, new: jax.Array, count: jax.Array) -> jax.Array:
        """The state after each row's first ``count`` new tokens: new int32 [b, n], count int32 [b] -> int32 [b]
        (-1: off the trie)."""
        tokens, nexts = jnp.asarray(self.tokens, jnp.int32), jnp.asarray(self.nexts, jnp.int32)

        def step(j, s):
            row = tokens[jnp.maximum(s, 0)]
            hit = row == new[:, j][:, None]
            to = jnp.where(jnp.any(hit, -1), jnp.sum(jnp.where(hit, nexts[jnp.maximum(s, 0)], 0), -1), -1)
            return jnp.where(j < count, jnp.where(s < 0, -1, to), s)

        return lax.fori_loop(0, new.shape[1], step, jnp.zeros(new.shape[0], jnp.int32))

    def mask(self, scores: jax.Array, state: jax.Array) -> jax.Array:
        """Every token the state does not allow at -inf (off the trie, or at a leaf: all but ``end``)."""
        vocab = scores.shape[-1]
        row = jnp.asarray(self.tokens, jnp.int32)[jnp.maximum(state, 0)]  # [b, width]
        row = jnp.where((state[:, None] < 0) | jnp.all(row < 0, axis=1, keepdims=True),
                        jnp.where(jnp.arange(row.shape[1])[None] == 0, self.end, -1), row)
        ok = jnp.zeros((scores.shape[0], vocab + 1), bool).at[_rows(row), _dump(row, True, vocab)].set(True)
        return jnp.where(ok[:, :vocab], scores, -jnp.inf)


# --------------------------------------------------------------------------- the batch searches' processors


@dataclass(frozen=True)
class Processors:
    """The processors of a batch search, the same for every row (static under jit; validation's and inference's
    flags, modelling/decoding.py's ``Options.processors``). ``host``: a grammar's allowed tokens, asked of the host
    each step (decoder/grammar.py's ``HostMasks``: (keys, indices, last tokens) -> bitmask [b, words])."""

    sequence_bias: tuple = ()  # ((ids, bias), ...): HF's sequence_bias, bad words with -inf
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    trie: Optional[LabelTrie] = None
    host: Optional[Callable] = None
    words: int = 0  # the host bitmask's int32 words a row

    @property
    def active(self) -> bool:
        return bool(self.sequence_bias or self.repetition_penalty != 1.0 or self.no_repeat_ngram_size
                    or self.trie is not None or self.host is not None)

    def __call__(self, scores: jax.Array, history: jax.Array, read: jax.Array, length: jax.Array, new: jax.Array,
                 count: jax.Array, keys: Optional[jax.Array] = None) -> jax.Array:
        """scores float32 [b, V] processed in HF's order. history int32 [b, H] (the decoder's tokens, a prompt part
        and the new tokens), read bool [b, H] (which places hold a token the decoder read), length int32 [b] (the
        places read so far, in order), new int32 [b, n] / count int32 [b]: the new tokens alone; keys int32 [b]:
        each row's key for ``host`` (0: none asked)."""
        if self.sequence_bias:
            scores = sequence_bias(scores, history, length, self.sequence_bias)
        if self.repetition_penalty != 1.0:
            penalty = jnp.full(scores.shape[:1], self.repetition_penalty, jnp.float32)
            scores = repetition_penalty(scores, history, read, penalty)
        if self.no_repeat_ngram_size:
            scores = no_repeat_ngram(scores, history, length, self.no_repeat_ngram_size)
        if self.trie is not None:
            scores = self.trie.mask(scores, self.trie.state(new, count))
        if self.host is not None:
            last = jnp.take_along_axis(new, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
            scores = allowed_bits(scores, host_bits(self.host, self.words, keys, count, last))
        return scores


def host_bits(host: Callable, words: int, keys: jax.Array, index: jax.Array, last: jax.Array) -> jax.Array:
    """The host's allowed-token bitmask of each row (keys int32 [b], 0: a row that asks none, all allowed; index int32
    [b]: the token's place in the row's output; last int32 [b]: the row's token before it) -> int32 [b, words]:
    asked only where some row has a key (a ``lax.cond``), once a step on each device (the host answers a repeated
    question from its cache: every tp device asks it)."""
    b = keys.shape[0]

    def ask():
        out = host_call(host, jax.ShapeDtypeStruct((b, words), jnp.int32), keys, index, last)
        return jnp.where(keys[:, None] > 0, out, -1)

    return lax.cond(jnp.any(keys > 0), ask, lambda: jnp.full((b, words), -1, jnp.int32))


def decoder_history(family, ids: jax.Array, mask: jax.Array, n: int) -> tuple:
    """The history a batch search's processors read: (history int32 [b, P + n]: the decoder's tokens before the new
    ones (a causal LM's prompt, as HF's input_ids hold it with its left padding; an encoder-decoder's start token),
    then ``n`` places for the new ones; read bool [b, P + n]: its places that hold a token the decoder read (not a
    prompt's padding, which HF's repetition penalty skips too); P)."""
    b = ids.shape[0]
    if family.causal:
        prompt, read = ids.astype(jnp.int32), mask > 0
    else:
        prompt, read = jnp.full((b, 1), family.decoder_start, jnp.int32), jnp.ones((b, 1), bool)
    p = prompt.shape[1]
    history = jnp.concatenate([prompt, jnp.full((b, n), NO_TOKEN, jnp.int32)], axis=1)
    return history, jnp.concatenate([read, jnp.zeros((b, n), bool)], axis=1), p


def bitmask_words(vocab: int) -> int:
    """int32 words of an allowed-token bitmask over ``vocab`` tokens (xgrammar's layout)."""
    return int(np.ceil(vocab / 32))


# --------------------------------------------------------------------------- the server's slots: each row its own

TABLE = 320  # a row's sparse table: OpenAI's 300 logit_bias entries, and the end-of-text and stop tokens min_tokens
# holds back (serving/api.py bounds both)
UNTIL_ALWAYS = 2 ** 31 - 1


@jax.tree_util.register_dataclass
@dataclass
class RowControls:
    """Each slot row's processors ([b, ...] each), beside its ``Rows`` and ``Sampling`` (modelling/continuous.py):
    written by ``insert``, read at every step; a row asks for none of them with presence 0, frequency 0, repetition
    1, min_p 0, grammar 0 and an empty table."""

    presence: jax.Array  # float32 [b]: OpenAI's presence penalty (the output's tokens)
    frequency: jax.Array  # float32 [b]: OpenAI's frequency penalty
    repetition: jax.Array  # float32 [b]: HF's (vLLM's) repetition penalty over the decoder's tokens (1: off)
    min_p: jax.Array  # float32 [b]: the min-p warper's (0: off)
    ignore_eos: jax.Array  # bool [b]: the end-of-text token does not end the row (vLLM's ignore_eos)
    grammar: jax.Array  # int32 [b]: the row's key for the host's allowed-token bitmask (0: none; decoder/grammar.py)
    table: jax.Array  # int32 [b, TABLE, 3]: (token id (-1: none), a float32 bias's bits, the token index it holds
    # below): logit_bias's entries (held always), min_tokens' (-inf below the minimum)
    history: jax.Array  # int32 [b, P + max_new]: the tokens the decoder read (a causal LM's prompt or T5's start
    # token in the first P places, then the row's output), -1 where none

    @staticmethod
    def prompt_part(family, width: int) -> int:
        """P: a history's places before the output (a causal LM's prompt, at most ``width`` tokens; else the
        decoder's start token)."""
        return width if family.causal else 1


def _bits(x: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(x, jnp.float32)


def process_rows(scores: jax.Array, c: RowControls, live: jax.Array, index: jax.Array, last: jax.Array,
                 prompt_part: int, eos_id: int, host: Optional[Callable] = None) -> jax.Array:
    """Each live row's processors (``RowControls``) on its scores float32 [b, V], in HF's order (the module
    docstring), for its token ``index`` (int32 [b]) after its token ``last``; a row whose every token is masked
    (a grammar and min_tokens that disagree) may write its end-of-text token. One ``lax.cond`` for the whole batch
    (a batch whose live rows ask for nothing pays it alone), and one for each processor some row asks for."""
    b, vocab = scores.shape
    has_table = jnp.any(c.table[..., 0] >= 0, axis=1)
    pens = (c.repetition != 1.0) | (c.presence != 0) | (c.frequency != 0)
    wants = live & (has_table | pens | (c.grammar > 0))

    def run(x):
        def bias(x):
            on = live[:, None] & (c.table[..., 0] >= 0) & (index[:, None] < c.table[..., 2])
            return add_bias(x, jnp.where(on, c.table[..., 0], vocab), _bits(c.table[..., 1]))

        read = c.history >= 0
        x = lax.cond(jnp.any(live & has_table), bias, lambda x: x, x)
        x = lax.cond(jnp.any(live & (c.repetition != 1.0)), lambda x: repetition_penalty(
            x, c.history, read, jnp.where(live, c.repetition, 1.0)), lambda x: x, x)
        out = read & (jnp.arange(c.history.shape[1]) >= prompt_part)[None]
        x = lax.cond(jnp.any(live & ((c.presence != 0) | (c.frequency != 0))), lambda x: presence_frequency(
            x, c.history, out, jnp.where(live, c.presence, 0.0), jnp.where(live, c.frequency, 0.0)), lambda x: x, x)
        if host is not None:
            keys = jnp.where(live, c.grammar, 0)
            x = lax.cond(jnp.any(keys > 0), lambda x: allowed_bits(
                x, host_bits(host, bitmask_words(vocab), keys, index, last)), lambda x: x, x)
        dead = jnp.all(jnp.isneginf(x), axis=1, keepdims=True)
        return jnp.where(dead & (jnp.arange(vocab)[None] == eos_id), 0.0, x)

    return lax.cond(jnp.any(wants), run, lambda x: x, scores)


def joiner_history(family, ids: jax.Array, at: jax.Array, lengths: jax.Array, width: int, size: int,
                   first: jax.Array) -> jax.Array:
    """Joining rows' histories int32 [J, size]: a causal LM's prompt (its ``lengths`` tokens of the packed rows'
    ``ids``, flattened, from ``at``) or the decoder's start token in the first P places
    (``RowControls.prompt_part``), their ``first`` token after them, -1 elsewhere."""
    p = RowControls.prompt_part(family, width)
    j = at.shape[0]
    if family.causal:
        cols = jnp.arange(width)[None]
        flat = ids.reshape(-1)
        prompt = jnp.where(cols < lengths[:, None], flat[jnp.clip(at[:, None] + cols, 0, flat.size - 1)], NO_TOKEN)
    else:
        prompt = jnp.full((j, 1), family.decoder_start, jnp.int32)
    rest = jnp.full((j, size - p), NO_TOKEN, jnp.int32).at[:, 0].set(first)
    return jnp.concatenate([prompt.astype(jnp.int32), rest], axis=1)


def joiner_table(entries: jax.Array, joiners: int) -> jax.Array:
    """Joining rows' tables int32 [J, TABLE, 3] from an insert's entries int32 [E, 5]: (the joiner's index in the
    insert (J or more: none), its place in the row's table, the token id, the bias's bits, the index it holds
    below)."""
    table = jnp.full((joiners, TABLE, 3), NO_TOKEN, jnp.int32)
    return table.at[entries[:, 0], entries[:, 1]].set(entries[:, 2:], mode="drop")
