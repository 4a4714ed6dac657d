"""Constrained decoding's host side: grammars compiled by xgrammar (a JSON schema, any JSON object, a regular
expression, a choice of texts, an EBNF grammar), each compiled once and cached, and the allowed tokens of every
constrained row, asked by the device at each step (``HostMasks``: modelling/processors.py's ``host_bits``).

A grammar matches the text the client receives: each token is the bytes it adds to the text before it
(data/tokenizer.py's ``token_pieces``: what the server shows of each token), never a library's guess at the
tokenizer (xgrammar's own reading of a Metaspace BPE keeps its word marker and refuses every document). Where that
text's first token loses its leading space (a Metaspace or word-level tokenizer's decode strips it, and nothing
comes before the output: an encoder-decoder's answer, a batch search's texts), the grammar takes one optional space
before it.

How a row's allowed tokens reach the device: the programs advance several tokens a call inside a loop, the host
dispatching the next call before it reads the last, so a step cannot wait for the host between calls. Each step asks
the host instead, from inside the loop (utils/host_call.py's ``host_call``: an FFI call on a CPU, a JAX callback
elsewhere; under a ``lax.cond`` that skips it when no live row is constrained): (key, the token's index in the row's
output, the row's token before it) -> the row's bitmask. The host keeps one matcher a key: it accepts the row's last
token once, fills the next bitmask, and answers the same question again from its cache (every tp device asks it; XLA
may ask from several threads: a lock). A key is unique to its sequence (``open``), so a stale row of an ended
sequence never feeds a new one's matcher; an unknown key (closed) allows every token. A matcher that ended (its
grammar complete and its end-of-text accepted) allows only the end-of-text token.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from typing import Optional

import numpy as np

from data.tokenizer import token_pieces

logger = logging.getLogger("flan_t5")
CACHE = 256  # compiled grammars kept (least recently used dropped)
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
WHITESPACE = 20  # the longest run of whitespace a JSON answer holds between its values and marks: a model cannot
# write spaces until max_tokens (a random or weak model did, in most answers cut short); pretty-printed JSON's line
# breaks and indentation fit


class GrammarError(ValueError):
    """A grammar the library refuses, or one no token of the vocabulary can start: ``field`` (the request's field
    that gave it) and ``reason`` (one line)."""

    def __init__(self, field: str, reason: str):
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def bitmask_words(vocab: int) -> int:
    """int32 words of an allowed-token bitmask over ``vocab`` tokens (modelling/processors.py's; here without JAX)."""
    return -(-vocab // 32)


def _reason(e: Exception) -> str:
    """xgrammar's error text as one line, without its ``[time] path:line:`` prefix."""
    text = re.sub(r"\[\d\d:\d\d:\d\d\]\s*\S+:\d+:\s*", "", str(e)).strip()
    return " ".join(text.split())[:300] or type(e).__name__


class Allowed:
    """A fixed set of allowed tokens (vLLM's ``allowed_token_ids``), as a matcher."""

    def __init__(self, ids, words: int):
        self.bits = np.zeros(words, np.uint32)
        for t in set(int(i) for i in ids):
            self.bits[t // 32] |= np.uint32(1) << np.uint32(t % 32)
        self.bits = self.bits.view(np.int32)

    def matcher(self):
        return self

    def accept(self, token: int) -> bool:
        return True

    def fill(self, out: np.ndarray, row: int) -> None:
        out[row] = self.bits

    def terminated(self) -> bool:
        return False


class Compiled:
    """A compiled grammar: ``matcher()`` gives a fresh matcher of it."""

    def __init__(self, compiled, kind: str, seconds: float):
        self.compiled, self.kind, self.seconds = compiled, kind, seconds

    def matcher(self):
        return _Matcher(self.compiled)


class _Matcher:
    def __init__(self, compiled):
        import xgrammar

        self.m = xgrammar.GrammarMatcher(compiled)

    def accept(self, token: int) -> bool:
        return self.m.accept_token(int(token))

    def fill(self, out: np.ndarray, row: int) -> None:
        self.m.fill_next_token_bitmask(out, row)

    def terminated(self) -> bool:
        return self.m.is_terminated()


class _Row:
    """One key's matcher and what it answered last."""

    __slots__ = ("constraint", "matcher", "index", "mask", "dead")

    def __init__(self, constraint):
        self.constraint, self.matcher, self.index, self.mask, self.dead = constraint, None, -1, None, False


class HostMasks:
    """The allowed tokens of every constrained row (see the module docstring): ``open(constraint) -> key`` (unique,
    from 1), ``close(key)``; called as the device's callback: (keys int32 [b], indices int32 [b], last tokens int32
    [b]) -> bitmask int32 [b, words] (every bit set where a key is 0 or unknown). ``vocab``: the scores' width,
    ``eos_id``: the end-of-text token a finished grammar allows alone."""

    def __init__(self, vocab: int, eos_id: int):
        self.words, self.eos_id = bitmask_words(vocab), eos_id
        self.lock = threading.Lock()
        self.rows: dict = {}
        self.next = 1
        self.asked = 0  # callbacks answered (their rows all told)
        self.seconds = 0.0  # the time they took

    def open(self, constraint, key: Optional[int] = None) -> int:
        with self.lock:
            if key is None:
                key, self.next = self.next, self.next + 1
            self.rows[key] = _Row(constraint)
            return key

    def close(self, key: int) -> None:
        with self.lock:
            self.rows.pop(key, None)

    def clear(self) -> None:
        with self.lock:
            self.rows.clear()

    def __call__(self, keys, indices, last) -> np.ndarray:
        t0 = time.perf_counter()
        keys, indices, last = (np.asarray(x).reshape(-1) for x in (keys, indices, last))
        out = np.full((keys.shape[0], self.words), -1, np.int32)
        with self.lock:
            for r in np.nonzero(keys > 0)[0]:
                row = self.rows.get(int(keys[r]))
                if row is not None:
                    out[r] = self._answer(row, int(indices[r]), int(last[r]), out, r)
            self.asked += 1
            self.seconds += time.perf_counter() - t0
        return out

    def _answer(self, row: _Row, index: int, last: int, out: np.ndarray, r: int) -> np.ndarray:
        if index == row.index:  # asked again (another tp device, or the same step): the same answer
            return row.mask
        if index == 0 or row.matcher is None:  # a row's first token (a batch search's next batch: anew)
            row.matcher, row.dead = row.constraint.matcher(), False
        elif index != row.index + 1 or not row.matcher.accept(last):
            row.dead = True  # (a token it did not allow: cannot happen while the mask is applied)
        if row.dead or row.matcher.terminated():
            mask = self._only_eos()
        else:
            row.matcher.fill(out, r)
            mask = out[r].copy()
        row.index, row.mask = index, mask
        return mask

    def _only_eos(self) -> np.ndarray:
        bits = np.zeros(self.words, np.uint32)
        bits[self.eos_id // 32] = np.uint32(1) << np.uint32(self.eos_id % 32)
        return bits.view(np.int32)


class Grammars:
    """Grammars compiled for one tokenizer (xgrammar's, imported at the first one: it imports torch), cached by
    what they were compiled from. ``vocab``: the scores' width (the tokenizer's ids the model has); ``optional_space``:
    the text the client receives loses its first token's leading space (module docstring), so one may come first."""

    def __init__(self, tokenizer, vocab: int, eos_id: int, optional_space: Optional[bool] = None):
        self.tokenizer, self.vocab, self.eos_id = tokenizer, vocab, eos_id
        self.optional_space = optional_space
        self._compiler = None
        self.cache: OrderedDict = OrderedDict()
        self.words = bitmask_words(vocab)

    def compiler(self):
        if self._compiler is None:
            import xgrammar

            pieces, strips = token_pieces(self.tokenizer)
            pieces = (pieces + [b""] * self.vocab)[:self.vocab]
            info = xgrammar.TokenizerInfo(pieces, xgrammar.VocabType.RAW, vocab_size=self.vocab,
                                          stop_token_ids=[self.eos_id])
            if self.optional_space is None:
                self.optional_space = strips
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=2)
        return self._compiler

    def compile(self, kind: str, spec, field: str) -> Compiled:
        """The grammar ``kind`` (``KINDS``) of ``spec`` (a schema dict, a pattern, a list of texts, an EBNF text;
        json_object: none), compiled or from the cache; GrammarError naming ``field`` where xgrammar refuses it or
        no token can start it."""
        key = (kind, json.dumps(spec, sort_keys=True))
        if key in self.cache:
            self.cache.move_to_end(key)
            return self.cache[key]
        t0 = time.perf_counter()
        compiler = self.compiler()
        import xgrammar

        try:
            grammar = _grammar(xgrammar, kind, spec)
            if self.optional_space:
                grammar = xgrammar.Grammar.concat(xgrammar.Grammar.from_ebnf('root ::= "" | " "'), grammar)
            compiled = Compiled(compiler.compile_grammar(grammar), kind, 0.0)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(field, _reason(e)) from None
        first = np.zeros((1, self.words), np.int32)
        compiled.matcher().fill(first, 0)
        if not first.any():
            raise GrammarError(field, "no token of this model's vocabulary can start it (its tokenizer has none of "
                                      "the characters it begins with)")
        compiled.seconds = time.perf_counter() - t0
        self.cache[key] = compiled
        if len(self.cache) > CACHE:
            self.cache.popitem(last=False)
        return compiled

    def allowed(self, ids) -> Allowed:
        return Allowed(ids, self.words)


def _grammar(xgrammar, kind: str, spec):
    """xgrammar's Grammar of a kind and its spec."""
    G = xgrammar.Grammar
    if kind == "json_schema":
        return G.from_json_schema(json.dumps(spec), any_whitespace=True, strict_mode=True,
                                  max_whitespace_cnt=WHITESPACE)
    if kind == "json_object":  # (OpenAI's JSON mode answers an object; xgrammar's built-in JSON takes any value)
        return G.from_json_schema(json.dumps({"type": "object"}), any_whitespace=True, strict_mode=False,
                                  max_whitespace_cnt=WHITESPACE)
    if kind == "regex":
        return G.from_regex(spec)
    if kind == "choice":
        return G.from_ebnf("root ::= " + " | ".join(_literal(t) for t in spec))
    if kind == "grammar":
        return G.from_ebnf(spec)
    raise ValueError(f"unknown grammar kind {kind!r}: one of {', '.join(KINDS)}")


def _literal(text: str) -> str:
    """An EBNF string literal of ``text`` (JSON's escapes, which xgrammar's EBNF reads); the empty text: ``""``."""
    return json.dumps(text, ensure_ascii=False)
