"""The output side of the scheduler: token ids -> what a client reads, on a thread of its own (JetStream's detokenize
thread), so the decoding thread never waits for text.

For each sequence (its ``Output``: what its client asked for, and its text so far) the processor turns the
scheduler's ``Update``s into ``Event``s: the new text (the completion decoded whole and the part not yet sent
taken, so that a stream's pieces add up to the whole completion's text exactly), stop strings (the text ends before
the first one; the tokens counted are those up to the one whose text completed it; the scheduler is told to free
the slot), log-probabilities (each token as the text it adds after the tokens before it, its log-probability, the k
most likely tokens with theirs, its offset in the text), the prompt's text first where the client asked for an echo,
and the latency metrics (time to the first token, between tokens, to the end). A streamed sequence gets an event
per update with something new; a whole one only its last, with everything.

Text that could still become a stop string, or an unfinished character (a byte-level token that ends inside one),
waits for the next tokens, so what was sent is never taken back.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from serving.scheduler import Sequence, Update

logger = logging.getLogger("flan_t5")


@dataclass
class TokenLogprob:
    """One token as the logprobs fields show it."""

    token: str  # the text it adds after the tokens before it (a special token: its own name, adding no text)
    logprob: Optional[float]  # None: the prompt's first token (nothing before it predicts it)
    top: Optional[list]  # [(token, logprob)] of the k most likely at its place, most likely first (Output.distinct:
    # of the k most likely texts, each its most likely token's); None as above
    offset: int  # where its text starts in the choice's text


@dataclass
class Event:
    """What a sequence's client gets next: new text, its tokens and their log-probabilities; at its end, why it
    ended (``finish_reason``: "stop" or "length") or the error that ended it."""

    index: int  # the choice's index in its request
    text: str = ""
    token_ids: list = field(default_factory=list)
    logprobs: Optional[list] = None  # [TokenLogprob] of this event's tokens (the prompt's first, with echo)
    finish_reason: Optional[str] = None
    error: Optional[Exception] = None
    completion_tokens: int = 0
    cumulative_logprob: float = 0.0  # of the completion's tokens so far (where log-probabilities were computed)


@dataclass(eq=False)
class Output:
    """What the output side keeps of a sequence: what its client asked for, and its text so far."""

    index: int  # its choice index
    sink: Any  # where its events go (the HTTP layer's)
    stop: tuple = ()
    stream: bool = False
    logprobs: Optional[int] = None  # the k best tokens shown beside each token (None: no logprobs shown)
    echo: Optional[str] = None  # the prompt's text, sent before the completion (None: no echo)
    echo_ids: Optional[list] = None  # the prompt's tokens, shown with their log-probabilities (echo + logprobs)
    distinct: bool = False  # the k best shown are the k most likely distinct texts (the legacy API's, keyed by text)
    skip_special: bool = True  # special tokens left out of the text (vLLM's skip_special_tokens)
    include_stop: bool = False  # the stop string that ended it kept in its text (vLLM's include_stop_str_in_output)
    min_tokens: int = 0  # no stop string ends it before it holds this many tokens (vLLM's min_tokens)
    context: list = field(default_factory=list)  # the prompt's last tokens its text is read after (a causal LM's:
    # its first word keeps its space), none where its text stands alone
    spaces_between_special: bool = True  # transformers' decode's option (vLLM's spaces_between_special_tokens)
    # state
    tokens: list = field(default_factory=list)
    scored: list = field(default_factory=list)  # (logprob, top ids, top logprobs) of each token, where computed
    prompt_scored: Any = None
    sent_text: str = ""
    sent_tokens: int = 0
    text_len: int = 0  # characters of the completion's tokens' pieces so far (offsets)
    pieced: tuple = (0, 0)  # the pieces' state (OutputProcessor.pieces): tokens[prefix:read] is the text given last
    cumulative: float = 0.0
    started: bool = False  # the echo and the prompt's log-probabilities were sent
    first: Optional[float] = None
    last: float = 0.0
    done: bool = False

    def __post_init__(self):
        if self.context and self.pieced == (0, 0):
            self.pieced = (0, len(self.context))  # the pieces' window starts with the context given out


class OutputProcessor:
    """The thread between the scheduler and the clients (see the module docstring). ``finish(seqs)``: tells the
    scheduler a stop string ended them; ``deliver([(sink, Event)])``: hands events to the HTTP layer."""

    def __init__(self, tokenizer, metrics, finish: Callable):
        self.tokenizer, self.metrics, self.finish = tokenizer, metrics, finish
        # transformers' decode checks every id's type in Python first (a third of this thread's time at 8 slots);
        # its _decode is the same for a list of ints
        self._decode = getattr(tokenizer, "_decode", tokenizer.decode)
        self.special = set(tokenizer.all_special_ids)
        self.updates: queue.SimpleQueue = queue.SimpleQueue()
        self.deliver: Callable = lambda events: None
        self.thread: Optional[threading.Thread] = None

    def start(self, deliver: Callable) -> None:
        self.deliver = deliver
        self.thread = threading.Thread(target=self._loop, name="output", daemon=True)
        self.thread.start()

    def put(self, updates: list) -> None:
        """The scheduler's ``emit``: a call's updates, processed in order."""
        self.updates.put(updates)

    def stop(self) -> None:
        self.updates.put(None)
        if self.thread is not None:
            self.thread.join(timeout=30)

    def _loop(self) -> None:
        while True:
            batch = self.updates.get()
            if batch is None:
                return
            events = []
            for u in batch:
                try:
                    events += self.handle(u)
                except Exception as e:  # noqa: BLE001 (a sequence whose text failed: its client gets an error)
                    logger.exception("the output of a sequence failed")
                    events += self._fail(u.seq, e)
            if events:
                self.deliver(events)

    def _fail(self, seq: Sequence, e: Exception) -> list:
        o = seq.out
        if o.done:
            return []
        o.done = True
        self.finish([seq])
        self.metrics.requests.labels("error").inc()
        return [(o.sink, Event(o.index, error=e))]

    # ------------------------------------------------------------------ one update

    def handle(self, u: Update) -> list:
        """An update -> [(sink, Event)] (none for a cancelled sequence: its client is gone)."""
        o: Output = u.seq.out
        if o.done:
            return []
        now = time.perf_counter()
        if u.error is not None or u.reason in ("cancelled", "aborted", "finished"):
            o.done = True
            self.metrics.requests.labels(u.reason or "error").inc()
            self.metrics.duration.observe(now - u.seq.arrival)
            return [] if u.reason == "cancelled" else [(o.sink, Event(o.index, error=u.error))]
        if u.prompt_scored is not None:
            o.prompt_scored = u.prompt_scored
        if u.tokens:
            self._tokens(u, o, now)
        final = u.reason is not None
        if not (o.stream or o.stop or final):
            return []
        text, stopped_at = self._text(o, final)
        reason = u.reason
        if stopped_at is not None:
            reason = "stop"
            del o.tokens[stopped_at:]
            del o.scored[stopped_at:]
            if not final:
                self.finish([u.seq])
        if not (o.stream or reason):
            return []
        event = self._event(o, text, reason)
        if reason:
            o.done = True
            self.metrics.requests.labels(reason).inc()
            self.metrics.duration.observe(now - u.seq.arrival)
        empty = not (event.text or event.token_ids or event.logprobs or event.finish_reason)
        return [] if empty else [(o.sink, event)]

    def _tokens(self, u: Update, o: Output, now: float) -> None:
        if o.first is None:
            o.first = now
            self.metrics.ttft.observe(now - u.seq.arrival)
        else:
            self.metrics.itl.observe(now - o.last)
        o.last = now
        o.tokens += u.tokens
        if u.scored is not None:
            lp, ids, lps = u.scored
            o.scored += [(float(lp[i]), ids[i], lps[i]) for i in range(len(u.tokens))]

    def _text(self, o: Output, final: bool) -> tuple:
        """(the completion's text not yet sent that can be, the number of tokens kept where a stop string ended it
        or None). Text delivered never holds a stop string, nor its start."""
        text = self.text_of(o, o.tokens)
        start = max(len(o.sent_text) - max((len(x) for x in o.stop), default=0) + 1, 0)
        hits = [(at, x) for at, x in ((text.find(x, start), x) for x in o.stop) if at >= 0]
        if o.min_tokens > 1 and hits:  # a stop string ends it only where it ends past its first min_tokens - 1 tokens
            floor = len(self.text_of(o, o.tokens[:o.min_tokens - 1])) if len(o.tokens) >= o.min_tokens else None
            hits = [] if floor is None else [(at, x) for at, x in ((text.find(x, max(start, floor - len(x) + 1)), x)
                                                                   for x in o.stop) if at >= 0]
        if hits:
            at, x = min(hits)
            end = at + len(x)
            return text[len(o.sent_text):end if o.include_stop else at], self._stop_tokens(o, end)
        end = len(text)
        if not final:
            end -= max((len(x) - 1 for x in o.stop), default=0)
            while end > len(o.sent_text) and text[end - 1] == "\ufffd":
                end -= 1
        return text[len(o.sent_text):max(end, len(o.sent_text))], None

    def _stop_tokens(self, o: Output, end: int) -> int:
        """The fewest tokens whose text reaches ``end`` characters (those of the stop string that ended it)."""
        for n in range(o.sent_tokens + 1, len(o.tokens) + 1):
            if len(self.text_of(o, o.tokens[:n])) >= end:
                return n
        return len(o.tokens)

    def text_of(self, o: Output, tokens: list) -> str:
        """The text ``tokens`` (of ``o``'s completion) add after its ``context`` (the text the client reads)."""
        kw = {"skip_special_tokens": o.skip_special}
        if not o.spaces_between_special:
            kw["spaces_between_special_tokens"] = False
        if not o.context:
            return self._decode(tokens, **kw)
        return _after(self._decode(o.context, **kw), self._decode(o.context + list(tokens), **kw))

    def _event(self, o: Output, text: str, reason: Optional[str]) -> Event:
        """The event of what is new: the echo first (once), then the tokens not yet sent."""
        lead = ""
        logprobs = [] if o.logprobs is not None else None
        if not o.started:
            o.started = True
            lead = o.echo or ""
            if o.echo_ids is not None and logprobs is not None:
                logprobs += self._prompt_logprobs(o)
        new = o.tokens[o.sent_tokens:]
        if logprobs is not None:
            logprobs += self._logprobs(o, o.sent_tokens, len(o.echo or ""), reason is not None)
        for lp, _, _ in o.scored[o.sent_tokens:]:
            o.cumulative += lp
        o.sent_tokens = len(o.tokens)
        o.sent_text += text
        return Event(o.index, lead + text, new, logprobs, reason, completion_tokens=len(o.tokens),
                     cumulative_logprob=o.cumulative)

    # ------------------------------------------------------------------ log-probabilities

    def pieces(self, tokens: list, start: int, state: tuple, final: bool, candidates: Optional[list] = None,
               k: Optional[int] = None, distinct: bool = False) -> tuple:
        """The text each of ``tokens[start:]`` adds to the text of the tokens before it, as a stream gives text out
        (vLLM's incremental detokenizing): ``state`` (prefix, read) says that ``tokens[prefix:read]`` decoded is the
        text given out last (from a token boundary before it, so that a tokenizer's merges and leading spaces see
        their context); a token whose text so far ends in U+FFFD (a character split over tokens, not finished)
        adds nothing yet and the token that finishes it adds all of it; a special token shows its own name and adds
        nothing; the last token of a ``final`` run adds what is left, a U+FFFD that never became a character
        included. So the pieces add up to the text. ``candidates``: for each token, other tokens in its place, most
        likely first -> the text each would add there, by the same rules (the token itself among them: its own
        piece), as (its index in the candidates, its text): the first ``k`` (None: all), or with ``distinct`` the
        first ``k`` of distinct texts (a text that an earlier candidate adds is passed over, and the candidates past
        the k-th are read until k texts are found or none are left). -> (pieces, candidates' pieces, the state
        after)."""
        prefix, read = state
        out, tops = [], []
        for i in range(start, len(tokens)):
            t = tokens[i]
            given = self._decode(tokens[prefix:read], skip_special_tokens=True)
            flush = final and i == len(tokens) - 1
            options = candidates[i - start] if candidates else []
            tops.append(self._candidates(given, tokens[prefix:i], options, flush, k, distinct))
            piece = self._piece(given, tokens[prefix:i + 1], flush)
            out.append(piece)
            if t not in self.special and (piece or flush):  # text given out: the next window starts after it
                prefix, read = read, i + 1
        return out, tops, (prefix, read)

    def _candidates(self, given: str, window: list, options: list, flush: bool, k: Optional[int],
                    distinct: bool) -> list:
        """[(index, text)] of the candidates ``options`` in the place after ``window`` shown (``pieces``)."""
        k = len(options) if k is None else k
        out, seen = [], set()
        for j, c in enumerate(options):
            if len(out) >= k:
                break
            text = self._piece(given, window + [c], flush)
            if distinct:
                if text in seen:
                    continue
                seen.add(text)
            out.append((j, text))
        return out

    def _piece(self, given: str, window: list, flush: bool) -> str:
        """The text the window's last token adds to ``given``: its name for a special token, nothing for an
        unfinished character (U+FFFD at the end) unless ``flush``."""
        token = window[-1]
        if token in self.special:
            return self.tokenizer.convert_ids_to_tokens(int(token))
        text = self._decode(window, skip_special_tokens=True)
        return "" if text.endswith("\ufffd") and not flush else _after(given, text)

    def _logprobs(self, o: Output, start: int, base: int, final: bool) -> list:
        """TokenLogprobs of the completion's tokens from ``start`` (offsets after ``base`` characters: the echo);
        ``final``: its last tokens (what an unfinished character left is given to the last)."""
        new = o.tokens[start:]
        if not new:
            return []
        wide = None if o.distinct else o.logprobs  # (distinct texts may need candidates past the k-th)
        cands = [[int(c) for c in ids[:wide]] for _, ids, _ in o.scored[start:]]
        texts, tops, o.pieced = self.pieces(o.context + o.tokens, len(o.context) + start, o.pieced, final, cands,
                                            o.logprobs, o.distinct)
        out = []
        for i, t in enumerate(new):
            lp, _, lps = o.scored[start + i]
            out.append(TokenLogprob(texts[i], lp, [(text, float(lps[j])) for j, text in tops[i]], base + o.text_len))
            o.text_len += 0 if t in self.special else len(texts[i])
        return out

    def _prompt_logprobs(self, o: Output) -> list:
        """TokenLogprobs of the prompt's tokens: the first with none, each other given the ones before it."""
        ids = o.echo_ids
        lp, top_ids, top_lps = o.prompt_scored
        wide = None if o.distinct else o.logprobs
        cands = [[]] + [[int(c) for c in top_ids[i][:wide]] for i in range(len(ids) - 1)]
        texts, tops, _ = self.pieces(list(ids), 0, (0, 0), True, cands, o.logprobs, o.distinct)
        out, offset = [], 0
        for i, t in enumerate(ids):
            if i == 0:
                out.append(TokenLogprob(texts[0], None, None, offset))
            else:
                out.append(TokenLogprob(texts[i], float(lp[i - 1]),
                                        [(text, float(top_lps[i - 1][j])) for j, text in tops[i]], offset))
            offset += 0 if t in self.special else len(texts[i])
        return out


def _after(given: str, text: str) -> str:
    """What ``text`` (a window decoded with a token more) adds to ``given`` (the window without it): what follows
    their shared start (all that follows ``given`` where the tokenizer left it as it was)."""
    return text[len(os.path.commonprefix([given, text])):]
