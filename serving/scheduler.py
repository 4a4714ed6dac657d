"""Continuous batching: a fixed number of decoding slots, requests joining and leaving between steps.

One thread drives the slots (JetStream's orchestrator, vLLM's scheduler, one step at a time): while slots are free
and requests wait, the waiting ones join (their prompts read into free slots in one ``insert`` per prompt width and
group size); then every running slot advances ``steps`` tokens (one ``advance``); a request that ends (its
end-of-text token, its ``max_tokens``, a stop string), is cancelled (its client went away) or aborted (shutdown)
leaves its slot at once, for the next waiting one. The HTTP layer only submits and reads events.

The backend (serving/engine.py's, over graphs/slots.py) answers:
``slots``, ``local`` (slots per dp shard), ``dp``, ``widths`` (prompt widths compiled, ascending), ``joins``
(joining rows per dp shard compiled, ascending), ``eos_id``, ``pad_id``, ``layout(ids, mask)``,
``insert(width, join, ids, mask, rows, sampling) -> first tokens``, ``set_sampling(temperature, top_k, drop_mass,
seed)``, ``advance(token, index, limit) -> tokens [slots, steps]`` and ``decode(token ids) -> text``.

Events go to each sequence's ``sink`` (whatever the HTTP layer gave) through ``deliver([(sink, Event), ...])``,
called once per step from this thread.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from serving.api import ApiError

logger = logging.getLogger("flan_t5")


@dataclass
class Event:
    """What a sequence did since its last event: new text (and its token ids); at its end, why it ended
    (``finish_reason``: "stop" or "length") or the error that ended it (``error``: an ApiError)."""

    index: int  # the sequence's choice index in its request
    text: str = ""
    token_ids: list = field(default_factory=list)
    finish_reason: Optional[str] = None
    error: Optional[ApiError] = None
    completion_tokens: int = 0


@dataclass(eq=False)
class Sequence:
    """One prompt's generation: what it asks for, and where it is."""

    ids: list  # the prompt's token ids
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop: tuple = ()
    stream: bool = False
    index: int = 0
    sink: Any = None
    # state (the scheduler's thread writes it; ``cancel`` and ``abort`` only set the flags)
    tokens: list = field(default_factory=list)
    sent_text: str = ""  # the text delivered so far
    sent_ids: int = 0  # the tokens delivered so far
    slot: Optional[int] = None
    cancelled: bool = False
    aborted: Optional[ApiError] = None
    done: bool = False
    arrival: float = field(default_factory=time.perf_counter)
    last: float = 0.0  # when its last token came

    def sampling(self) -> tuple:
        """(temperature, top_k, drop_mass, seed) as the slots read them: top-p's 1 - top_p in float64 (as HF)."""
        seed = self.seed if self.seed is not None else secrets.randbits(32)
        return self.temperature, max(self.top_k, 0), 1.0 - self.top_p if self.top_p < 1.0 else 0.0, seed


class Scheduler:
    """The slots, the queue and the thread between them (see the module docstring). At most ``slots + max_queue``
    sequences are held; more is a 429."""

    def __init__(self, backend, max_queue: int, metrics, retry_after: int = 1):
        self.b, self.max_queue, self.metrics, self.retry_after = backend, max_queue, metrics, retry_after
        n = backend.slots
        self.running: list = [None] * n
        self.waiting: deque = deque()
        self.token, self.index, self.limit = (np.zeros(n, np.int32) for _ in range(3))
        self.sampling = [np.zeros(n, np.float32), np.zeros(n, np.int32), np.zeros(n, np.float32),
                         np.zeros(n, np.uint32)]
        self.cv = threading.Condition()
        self.admitting, self.stopping = True, False
        self.deliver: Callable = lambda batch: None
        self.thread: Optional[threading.Thread] = None
        self.failure: Optional[BaseException] = None

    # ------------------------------------------------------------------ the HTTP side (any thread)

    def start(self, deliver: Callable) -> None:
        self.deliver = deliver
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()

    def submit(self, seqs: list) -> None:
        """Queues a request's sequences, all or none: 503 when the server stops, 429 when it holds too many."""
        with self.cv:
            if self.failure is not None:
                raise ApiError(503, f"the decoding loop failed ({type(self.failure).__name__}): restart the server",
                               code="server_error")
            if not self.admitting:
                raise ApiError(503, "the server is shutting down: no new requests", code="shutting_down")
            held = len(self.waiting) + sum(s is not None for s in self.running)
            if held + len(seqs) > self.b.slots + self.max_queue:
                raise ApiError(429, f"the server holds {held} requests ({self.b.slots} slots, a queue of "
                                    f"{self.max_queue}): retry after {self.retry_after} s", code="queue_full",
                               headers={"Retry-After": str(self.retry_after)})
            self.waiting.extend(seqs)
            self.metrics.queue_depth.set(len(self.waiting))
            self.cv.notify()

    def cancel(self, seqs: list) -> None:
        """The client went away: its sequences leave their slots at the next step."""
        with self.cv:
            for s in seqs:
                s.cancelled = True
            self.cv.notify()

    def stop_admitting(self) -> None:
        with self.cv:
            self.admitting = False

    def abort_all(self, error: ApiError) -> None:
        """Every held sequence ends with ``error`` at the next step (shutdown after its grace period)."""
        with self.cv:
            for s in list(self.waiting) + [s for s in self.running if s is not None]:
                s.aborted = error
            self.cv.notify()

    def held(self) -> int:
        with self.cv:
            return len(self.waiting) + sum(s is not None for s in self.running)

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    # ------------------------------------------------------------------ the loop (the scheduler's thread)

    def _loop(self) -> None:
        try:
            while True:
                with self.cv:
                    while not self.stopping and not self.waiting and all(s is None for s in self.running):
                        self.cv.wait()
                    if self.stopping:
                        return
                events: list = []
                self._leave(events)
                while self._join(events):
                    pass
                if any(s is not None for s in self.running):
                    self._advance(events)
                self._gauges()
                if events:
                    self.deliver(events)
        except BaseException as e:  # a failed program: every held request gets an error, new ones a 503
            logger.exception("the decoding loop failed")
            with self.cv:
                self.failure = e
            error = ApiError(500, f"decoding failed ({type(e).__name__}: {str(e)[:200]})", code="server_error")
            with self.cv:
                held = [s for s in list(self.waiting) + self.running if s is not None]
                self.waiting.clear()
                self.running = [None] * len(self.running)
            self.deliver([(s.sink, Event(s.index, error=error)) for s in held])

    def _gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.waiting))
        self.metrics.running.set(sum(s is not None for s in self.running))

    def _leave(self, events: list) -> None:
        """Cancelled and aborted sequences leave the queue and their slots."""
        with self.cv:
            gone = [s for s in self.waiting if s.cancelled or s.aborted]
            for s in gone:
                self.waiting.remove(s)
        for s in gone + [s for s in self.running if s is not None and (s.cancelled or s.aborted)]:
            self._end(s, events, "cancelled" if s.aborted is None else "aborted", error=s.aborted)

    def _join(self, events: list) -> bool:
        """Waiting sequences into free slots, one insert (a prompt width, a number of rows per dp shard) -> whether
        any joined."""
        b = self.b
        free = [[s for s in range(d * b.local, (d + 1) * b.local) if self.running[s] is None] for d in range(b.dp)]
        with self.cv:
            room = min(sum(map(len, free)), b.dp * b.joins[-1])
            joining = [self.waiting.popleft() for _ in range(min(room, len(self.waiting)))]
        if not joining:
            return False
        per_shard = [[] for _ in range(b.dp)]  # the sequences each shard takes, its freest first
        for s in joining:
            d = max(range(b.dp), key=lambda d: len(free[d]) - len(per_shard[d]))
            per_shard[d].append(s)
        join = next(j for j in b.joins if j >= max(map(len, per_shard)))
        longest = max(len(s.ids) for s in joining)
        width = next(w for w in b.widths if w >= longest)
        ids = np.full((b.dp * join, width), b.pad_id, np.int32)
        mask = np.zeros((b.dp * join, width), np.int32)
        rows = np.full(b.dp * join, b.local, np.int32)  # fillers: a row past the shard's, dropped
        sampling = [np.zeros(b.dp * join, a.dtype) for a in self.sampling]
        for d, group in enumerate(per_shard):
            for j, s in enumerate(group):
                r, s.slot = d * join + j, free[d][j]
                ids[r, :len(s.ids)], mask[r, :len(s.ids)], rows[r] = s.ids, 1, s.slot - d * b.local
                for a, v in zip(sampling, s.sampling()):
                    a[r] = v
        ids, mask = b.layout(ids, mask)
        first = b.insert(width, join, ids, mask, rows, sampling)
        now = time.perf_counter()
        for d, group in enumerate(per_shard):
            for j, s in enumerate(group):
                self.running[s.slot] = s
                for a, v in zip(self.sampling, sampling):
                    a[s.slot] = v[d * join + j]
                self.metrics.ttft.observe(now - s.arrival)
                self.metrics.prompt_tokens.inc(len(s.ids))
                s.last = now
                self._take(s, [int(first[d * join + j])], now, events)
        b.set_sampling(*self.sampling)
        return True

    def _advance(self, events: list) -> None:
        for s, seq in enumerate(self.running):
            if seq is None:
                self.token[s], self.index[s], self.limit[s] = self.b.pad_id, 0, 0
            else:
                self.token[s], self.index[s], self.limit[s] = seq.tokens[-1], len(seq.tokens) - 1, seq.max_tokens
        out = self.b.advance(self.token, self.index, self.limit)
        now = time.perf_counter()
        for s, seq in enumerate(self.running):
            if seq is not None:
                self._take(seq, out[s].tolist(), now, events)

    def _take(self, s: Sequence, tokens: list, now: float, events: list) -> None:
        """A sequence's new tokens (up to its end), its text, and its end."""
        reason, taken = None, 0
        for t in tokens:
            if s.tokens:  # the time since the previous token (0 for the tokens of one multi-step call after the first)
                self.metrics.itl.observe(now - s.last)
            s.tokens.append(t)
            s.last, taken = now, taken + 1
            if t == self.b.eos_id:
                reason = "stop"
            elif len(s.tokens) >= s.max_tokens:
                reason = "length"
            if reason:
                break
        self.metrics.generated.inc(taken)
        if s.stream or s.stop or reason:
            text, stopped = self._text(s, final=reason is not None)
            reason = "stop" if stopped else reason
            if reason:
                self._end(s, events, reason, text=text)
            elif text or s.sent_ids < len(s.tokens):
                events.append((s.sink, self._delta(s, text, False)))
                s.sent_text += text

    def _text(self, s: Sequence, final: bool) -> tuple:
        """(the text not yet delivered that can be, whether a stop string ended the sequence). Text that could
        still become a stop string, or an unfinished character, waits for the next tokens."""
        text = self.b.decode(s.tokens)
        # text delivered never holds a whole stop string, nor its start: a stop string begins after it
        hits = [at for at in (text.find(x, len(s.sent_text)) for x in s.stop) if at >= 0]
        if hits:
            return text[len(s.sent_text):min(hits)], True
        end = len(text)
        if not final:
            end -= max((len(x) - 1 for x in s.stop), default=0)
            while end > len(s.sent_text) and text[end - 1] == "\ufffd":
                end -= 1
        return text[len(s.sent_text):max(end, len(s.sent_text))], False

    def _delta(self, s: Sequence, text: str, final: bool) -> Event:
        ids = s.tokens[s.sent_ids:]
        s.sent_ids = len(s.tokens)
        return Event(s.index, text, ids, completion_tokens=len(s.tokens))

    def _end(self, s: Sequence, events: list, reason: str, text: str = "", error: Optional[ApiError] = None):
        """A sequence leaves: its last event (its rest of text and why it ended, or its error), its slot freed."""
        if s.slot is not None and self.running[s.slot] is s:
            self.running[s.slot] = None
        s.done = True
        self.metrics.requests.labels(reason).inc()
        self.metrics.duration.observe(time.perf_counter() - s.arrival)
        if reason == "cancelled":
            return
        event = self._delta(s, text, True)
        event.finish_reason, event.error = (reason, None) if error is None else (None, error)
        s.sent_text += text
        events.append((s.sink, event))
