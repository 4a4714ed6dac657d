"""Continuous batching: a fixed number of decoding slots, sequences joining and leaving between decoding calls.

One thread drives the slots (JetStream's orchestrator, vLLM's scheduler, a call at a time), in token ids only: while
slots are free and sequences wait, the waiting ones join (their prompts read into free slots, one ``insert`` per
group); then every running slot advances (one ``advance``: ``steps`` tokens, or with every slot taken as many as
the fewest any running sequence has left, up to the backend's most: ``_steps``). The device carries each slot's
position, so the thread dispatches call N + 1 before it reads call N's tokens: the host's work (reading,
bookkeeping, joins) overlaps the device's (vLLM's async scheduling). A sequence ends on its end-of-text token or its
``max_tokens`` (the device stops it too), when the output side says a stop string ended it (``finish``), when its
client goes away (``cancel``) or at shutdown (``abort``); its slot is free for the next waiting one at once.

What the scheduler reads and produces are token ids and log-probabilities; text, stop strings and the shapes the
API answers in are the output side's (serving/output.py), off this thread: every call's tokens go to ``emit`` as
``Update``s, in order.

Failures stay inside: an exception in a call ends every sequence that call held (joining or running) with an
``Update`` carrying the error, the backend is reset, and the loop goes on for the queued ones. Only a backend that
cannot be reset, or calls failing ``FATAL_AFTER`` times in a row, stop the loop for good: every held sequence then
ends with the error, ``submit`` raises ``Failed``, and ``on_fatal`` is called (the server exits non-zero, for its
supervisor to restart it). The scheduler raises its own exceptions (``QueueFull``, ``ShuttingDown``, ``Failed``);
the HTTP layer maps them to status codes.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol

import numpy as np

from serving.controls import NONE, TABLE, Controls

logger = logging.getLogger("flan_t5")
FATAL_AFTER = 3  # decoding calls failing in a row (none read in between) that stop the loop for good
JOIN_WAIT = 2  # decoding calls free slots wait at most for others, to join in one insert
SEED_BITS = 64


class SchedulerError(Exception):
    """What the scheduler refuses or ends a sequence with (the HTTP layer maps each kind to a status)."""


class QueueFull(SchedulerError):
    def __init__(self, held: int, slots: int, max_queue: int):
        super().__init__(f"the server holds {held} sequences ({slots} slots and a queue of {max_queue}): retry "
                         "later")
        self.held, self.slots, self.max_queue = held, slots, max_queue


class ShuttingDown(SchedulerError):
    pass


class Failed(SchedulerError):
    """A decoding call failed: the sequences it held end with it; ``fatal``: the loop stopped for good."""

    def __init__(self, message: str, fatal: bool = False):
        super().__init__(message)
        self.fatal = fatal


class Backend(Protocol):
    """The slots as the scheduler drives them (decoder/slot_programs.py's SlotPrograms; the tests' fake). Calls return
    handles that ``fetch`` turns into numpy: insert -> (first tokens [n], Scored [n]) in the joiners' order; advance
    -> (tokens [slots, steps], Scored [slots, steps]); score -> Scored [score_rows, max_prompt - 1] (row r, column c:
    prompt r's token c + 1), where Scored is (logprob, top_ids, top_logprobs) as modelling/continuous.py's."""

    slots: int  # decoding rows
    local: int  # rows per dp shard
    dp: int
    max_prompt: int  # the longest prompt (tokens) an insert reads
    steps: int  # the most tokens an advance gives (``advance(keep, n)``: n of them, 1 <= n <= steps)
    eos_id: int
    pad_id: int
    vocab_size: int  # token ids below it
    top: int  # the most likely tokens' log-probabilities each call gives
    scores_prompts: bool  # ``score`` exists (a causal model)
    score_rows: int  # prompts one ``score`` reads
    platform: str  # the devices' ("cpu", "gpu", "tpu"): what an insert costs there sets how free slots join
    masks: Any  # the allowed tokens of constrained rows, asked by the device (decoder/grammar.py's HostMasks: open
    # (constraint) -> its key, close(key))

    # joiners: [(a free slot, the prompt's ids, its sampling tuple (``Sequence.sampling``), its most tokens, its
    # processors (serving/controls.py's ``Controls.row``) or None, its LoRA adapter's slot (``Sequence.adapter``))];
    # the joiners of one insert hold at most ``TABLE`` table entries (the scheduler groups them so)
    def insert(self, joiners: list) -> Any: ...

    # ``span``: every row still writing writes its cache below column ``span`` in these n steps (a row whose prompt
    # holds p tokens writes its new token i at ``first_token_column(p)`` + i), so the steps may attend over those
    # columns only
    def advance(self, keep: np.ndarray, n: int, span: Optional[int] = None) -> Any: ...

    def first_token_column(self, prompt_length: int) -> int: ...

    def score(self, prompts: list, adapters: list) -> Any: ...  # at most score_rows prompts' ids, their adapters' slots

    def fetch(self, handle: Any) -> Any: ...

    def reset(self) -> None: ...


@dataclass(eq=False)
class Sequence:
    """One sequence to generate: its prompt's ids, what it asks for, and where it is. ``out``: whatever the output
    side keeps with it (the scheduler passes it along)."""

    ids: list
    max_tokens: int  # 0: no new token (its prompt scored, or echoed)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None  # 0 .. 2**64 - 1
    logprobs: Optional[int] = None  # the k best tokens' log-probabilities beside each token's (None: none)
    prompt_logprobs: bool = False  # the prompt's own log-probabilities (a causal model's)
    out: Any = None
    arrival: float = field(default_factory=time.perf_counter)
    adapter: int = -1  # the slot of its LoRA adapter in the backend's stack (-1: the base alone)
    # state: the scheduler's thread writes it; ``cancel``, ``finish`` and ``abort`` only set their flags
    count: int = 0  # tokens read
    dispatched: int = 0  # tokens the calls dispatched so far give at most
    slot: Optional[int] = None
    column: int = 0  # the cache column its first new token is written at (Backend.first_token_column)
    cancelled: bool = False
    finished: bool = False
    aborted: Optional[SchedulerError] = None
    ended: bool = False
    controls: Controls = NONE  # its processors beyond the sampling tuple (serving/controls.py)
    key: int = 0  # its key in the backend's ``masks`` while it holds a slot (0: none)

    def sampling(self) -> tuple:
        """(temperature, top_k, drop_mass, seed low, seed high, logprobs) as the slots read them: top-p's 1 - top_p
        in float64 (as HF); a random seed when none is given."""
        seed = self.seed if self.seed is not None else secrets.randbits(SEED_BITS)
        return (self.temperature, max(self.top_k, 0), 1.0 - self.top_p if self.top_p < 1.0 else 0.0,
                seed & 0xFFFFFFFF, seed >> 32, -1 if self.logprobs is None else self.logprobs)

    @property
    def gone(self) -> bool:
        return self.cancelled or self.finished or self.aborted is not None


@dataclass
class Update:
    """What a sequence did in one call: new tokens (with their Scored rows where it asked for log-probabilities),
    its prompt's scores, and at its end why (``reason``: "stop" at its end-of-text token, "length", "cancelled",
    "finished" (the output side ended it), "aborted") or the error that ended it."""

    seq: Sequence
    tokens: list = field(default_factory=list)
    scored: Any = None  # (logprob [n], top_ids [n, top], top_logprobs [n, top]) of the tokens
    prompt_scored: Any = None  # the same of the prompt's tokens 1..: [len(ids) - 1]
    reason: Optional[str] = None
    error: Optional[SchedulerError] = None


@dataclass
class _Call:
    """A dispatched call not yet read: its kind, handle, and the sequences of its rows."""

    kind: str  # "insert", "advance", "score"
    handle: Any
    rows: list  # [(row of the output, sequence)]
    steps: int = 0  # an advance's steps (its tokens' columns past them are padding)


def admit(failure: Optional[SchedulerError], admitting: bool, held: int, joining: int, slots: int,
          max_queue: int) -> None:
    """What refuses ``joining`` more sequences beside the ``held`` ones, raised: the loop's ``failure`` (Failed),
    ShuttingDown once it stops ``admitting``, QueueFull while its slots and queue are full. A request is admitted whole
    while fewer than ``slots + max_queue`` are held, however many sequences it brings (the HTTP layer refuses one of
    more than that, 413): one of many sequences waits for room as one of one does, never refused for good while
    smaller ones take each slot that frees (it was, when it had to fit beside the held ones); the server then holds
    fewer than twice its bound."""
    if failure is not None:
        raise failure
    if not admitting:
        raise ShuttingDown("the server is shutting down: no new requests")
    if held >= slots + max_queue:
        raise QueueFull(held, slots, max_queue)


class Scheduler:
    """The slots, the queue and the thread between them (see the module docstring). While ``slots + max_queue``
    sequences are held, a request is ``QueueFull`` (``admit``). ``min_join``: free slots that wait for a group (at
    most ``JOIN_WAIT`` calls) before they join, so that prompts join together rather than one insert each."""

    def __init__(self, backend: Backend, max_queue: int, metrics, min_join: int = 1, steps: Optional[int] = None):
        self.b, self.max_queue, self.metrics = backend, max_queue, metrics
        self.min_join = max(1, min(min_join, backend.slots))
        self.steps = backend.steps if steps is None else max(1, min(steps, backend.steps))  # an advance's base
        self.running: list = [None] * backend.slots
        self.waiting: deque = deque()  # sequences waiting for a slot, in arrival order
        self.scoring: deque = deque()  # sequences with no token to write (max_tokens 0): their prompts scored
        self.pending: deque = deque()  # _Calls dispatched, not yet read, in device order
        self.joining: list = []  # sequences out of the queue, not yet in a dispatched call
        self.cleared: set = set()  # slots whose sequence the host ended early: the device is told to stop them
        self.held_seqs: set = set()
        self.flagged: list = []  # sequences cancelled, finished or aborted since the last round
        self.cv = threading.Condition()
        self.admitting, self.stopping = True, False
        self.emit: Callable = lambda updates: None
        self.on_fatal: Callable = lambda error: None
        self.thread: Optional[threading.Thread] = None
        self.failure: Optional[Failed] = None
        self.failures = 0  # calls failed since the last one read
        self.deferred = 0  # calls the free slots waited for a group
        self.max_wait = JOIN_WAIT
        self.depth = 1  # decoding calls left in flight, unread, while the host works
        self.tasks: deque = deque()  # (fn, Future): work for the decoding thread between its calls (``between_calls``)

    # ------------------------------------------------------------------ any thread

    def start(self, emit: Callable, on_fatal: Callable = lambda error: None) -> None:
        self.emit, self.on_fatal = emit, on_fatal
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)
        self.thread.start()

    def submit(self, seqs: list) -> None:
        """Queues a request's sequences, all or none: Failed when the loop stopped, ShuttingDown when the server
        stops, QueueFull while its slots and queue are full (``admit``)."""
        with self.cv:
            admit(self.failure, self.admitting, len(self.held_seqs), len(seqs), self.b.slots, self.max_queue)
            self.waiting.extend(s for s in seqs if s.max_tokens > 0)
            self.scoring.extend(s for s in seqs if s.max_tokens == 0)
            self.held_seqs.update(seqs)
            self.metrics.queue_depth.set(len(self.waiting))
            self.cv.notify()

    def _flag(self, seqs: list, name: str, value=True) -> None:
        with self.cv:
            for s in seqs:
                setattr(s, name, value)
            self.flagged += seqs
            self.cv.notify()

    def cancel(self, seqs: list) -> None:
        """Their client went away: they leave their slots before the next call."""
        self._flag(seqs, "cancelled")

    def finish(self, seqs: list) -> None:
        """The output side ended them (a stop string): they leave their slots before the next call."""
        self._flag(seqs, "finished")

    def abort_all(self, error: SchedulerError) -> None:
        """Every held sequence ends with ``error`` before the next call (shutdown after its grace period)."""
        with self.cv:  # (a reentrant lock: _flag takes it again)
            self._flag(list(self.held_seqs), "aborted", error)

    def stop_admitting(self) -> None:
        with self.cv:
            self.admitting = False

    def held(self) -> int:
        with self.cv:
            return len(self.held_seqs)

    def holds_adapter(self, slot: int) -> bool:
        """Whether a sequence held (waiting, joining, running, or its last tokens not yet read) reads the LoRA adapter
        in the backend's slot ``slot``."""
        with self.cv:
            return any(s.adapter == slot for s in self.held_seqs)

    def between_calls(self, fn: Callable) -> Future:
        """``fn()`` run by the decoding thread before its next call, where no other work of the backend's runs beside
        it (an adapter written into the backend's stack, whose arrays every call reads) -> a Future of its result.
        Before the thread starts, or once it has stopped, it runs here and now."""
        future: Future = Future()
        with self.cv:
            if self.thread is not None and self.thread.is_alive() and not self.stopping:
                self.tasks.append((fn, future))
                self.cv.notify()
                return future
        _run(fn, future)
        return future

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()
        if self.thread is not None:
            self.thread.join(timeout=30)

    # ------------------------------------------------------------------ the loop (the scheduler's thread)

    def _idle(self) -> bool:
        return not (self.waiting or self.scoring or self.pending) and all(s is None for s in self.running)

    def _loop(self) -> None:
        while True:
            with self.cv:
                while not self.stopping and self._idle() and not self.flagged and not self.tasks:
                    self.cv.wait()
                if self.stopping:
                    for fn, future in self.tasks:  # (each caller answered, none left waiting)
                        future.set_exception(ShuttingDown("the server is shutting down"))
                    self.tasks.clear()
                    return
            try:
                self._round()
            except Exception as e:  # noqa: BLE001 (whatever a call raised: its sequences answered, the loop goes on)
                if not self._recover(e):
                    return

    def _round(self) -> None:
        """One round: leavers out, joiners in, an advance dispatched, every call but the newest advance read."""
        updates: list = []
        with self.cv:
            tasks, self.tasks = list(self.tasks), deque()
        for fn, future in tasks:
            _run(fn, future)
        try:
            self._leave(updates)
            self._score_only()
            self._join()
            running = [(slot, s) for slot, s in enumerate(self.running) if s is not None]
            if running:
                keep = np.array([slot not in self.cleared for slot in range(self.b.slots)])
                n = self._steps(running)
                call = self.b.advance(keep, n, self._span(running, n))
                self.pending.append(_Call("advance", call, running, steps=n))
                for slot, s in running:
                    s.dispatched = min(s.dispatched + n, s.max_tokens)
                    if s.dispatched >= s.max_tokens:  # its last token is on its way: the slot is free for a joiner
                        self.running[slot] = None
            while self.pending and (not running or self._unread_advances() - (self.pending[0].kind == "advance")
                                    >= self.depth):  # every call but the newest ``depth`` advances
                self._read(self.pending.popleft(), updates)
            self._gauges()
        finally:  # what the round already decided is sent, even when a call raises after it (then _recover)
            if updates:
                self.emit(updates)

    def _steps(self, running: list) -> int:
        """The next advance's steps: the base (``steps``) while a slot is free (a sequence that comes joins after it;
        free slots waiting for a group wait ``max_wait`` calls of the base at most). With every slot taken nothing
        joins before the first running sequence ends, so as many as the fewest tokens any of them has left to
        dispatch, from the base up to the backend's most (no row ends by its length inside the call, only at its
        last step): fewer calls, each the host's fixed work, for the same tokens."""
        if len(running) < self.b.slots:
            return self.steps
        left = min(s.max_tokens - s.dispatched for _, s in running)
        return max(self.steps, min(left, self.b.steps))

    @staticmethod
    def _span(running: list, n: int) -> int:
        """The cache columns the next ``n`` steps write, at most: a running sequence with d tokens dispatched feeds
        back its token d - 1 first (at its ``column`` + d - 1), then one a step until its last token is out (it
        has ``max_tokens`` - d left), the last at ``column`` + d - 2 + min(n, max_tokens - d). Rows not running
        (ended, cleared, free) write nothing anyone reads."""
        return max(s.column + s.dispatched - 1 + min(n, s.max_tokens - s.dispatched) for _, s in running)

    def _unread_advances(self) -> int:
        return sum(c.kind == "advance" for c in self.pending)

    def _gauges(self) -> None:
        self.metrics.queue_depth.set(len(self.waiting) + len(self.scoring))
        self.metrics.running.set(self.decoding())

    def decoding(self) -> int:
        """Slots decoding: those whose sequence has not ended, its last tokens dispatched or not (a sequence whose
        last token is on its way leaves ``running`` at once, for a joiner, but still decodes until that call is
        read; counted by ``running`` alone, the gauge read 0 between such rounds with every slot busy)."""
        with self.cv:
            return len({s.slot for s in self.held_seqs if s.slot is not None})

    def _end(self, s: Sequence, updates: list, reason: Optional[str], error: Optional[SchedulerError] = None,
             **kw) -> None:
        """A sequence's last update: its slot freed, no longer held."""
        if s.ended:
            return
        s.ended = True
        if s.key:
            self.b.masks.close(s.key)
        if s.slot is not None and self.running[s.slot] is s:
            self.running[s.slot] = None
        with self.cv:
            self.held_seqs.discard(s)
        updates.append(Update(s, reason=reason, error=error, **kw))

    def _leave(self, updates: list) -> None:
        """Cancelled, finished and aborted sequences leave the queue and their slots."""
        with self.cv:
            gone, self.flagged = [s for s in self.flagged if not s.ended], []
            for s in gone:
                for queue in (self.waiting, self.scoring):
                    if s in queue:
                        queue.remove(s)
        for s in gone:
            if s.slot is not None and self.running[s.slot] is s:  # still writing on the device: it stops there
                self.cleared.add(s.slot)
            reason = "cancelled" if s.cancelled else "finished" if s.finished else "aborted"
            self._end(s, updates, reason, s.aborted if reason == "aborted" else None)

    def _take_waiting(self, n: int, queue: Optional[deque] = None) -> list:
        """Up to n sequences out of a queue (the waiting one by default), first come first, and (the waiting ones)
        no more than one insert's ``TABLE`` table entries together (the first always); held in ``joining`` until a
        dispatched call holds them."""
        waiting = queue is None
        queue = self.waiting if waiting else queue
        picked, used = [], 0
        with self.cv:
            while queue and len(picked) < n:
                need = len(queue[0].controls.entries(self.b.eos_id)) if waiting else 0
                if picked and used + need > TABLE:
                    break
                picked.append(queue.popleft())
                used += need
        self.joining = picked
        return picked

    def _score_only(self) -> None:
        """Sequences with no new token to write: their prompts scored (a call per ``score_rows``), or nothing to do
        (ended at once, read with the next call)."""
        seqs = self._take_waiting(len(self.scoring), self.scoring)
        self._score([s for s in seqs if s.prompt_logprobs])
        self.pending.extend(_Call("none", None, [(0, s)]) for s in seqs if not s.prompt_logprobs)
        self.joining = []

    def _score(self, seqs: list) -> None:
        b = self.b
        for i in range(0, len(seqs), b.score_rows):
            group = seqs[i:i + b.score_rows]
            self.pending.append(_Call("score", b.score([s.ids for s in group], [s.adapter for s in group]),
                                      list(enumerate(group))))

    def _free(self) -> list:
        b = self.b
        return [[s for s in range(d * b.local, (d + 1) * b.local) if self.running[s] is None] for d in range(b.dp)]

    def _join(self) -> None:
        """Waiting sequences into free slots, all the free slots can take in one insert. Fewer free slots than
        ``min_join`` wait up to ``max_wait`` calls for others to free (not when nothing runs, or when every waiting
        one fits)."""
        free = self._free()
        room = sum(map(len, free))
        waiting = len(self.waiting)
        if not room or not waiting:
            return
        busy = any(s is not None for s in self.running)
        if busy and room < min(self.min_join, waiting) and self.deferred < self.max_wait:
            self.deferred += 1
            return
        self.deferred = 0
        joining = self._take_waiting(room)
        self._insert(joining, free)
        self.joining = []

    def _insert(self, joining: list, free: list) -> None:
        """The joiners into free slots, each to the dp shard with the most free slots left, in one insert."""
        b, taken, placed = self.b, [0] * self.b.dp, []
        for s in joining:
            d = max(range(b.dp), key=lambda d: len(free[d]) - taken[d])
            s.slot = free[d][taken[d]]
            taken[d] += 1
            placed.append(s)
        scored = [s for s in placed if s.prompt_logprobs]
        if scored:
            self._score(scored)
        for s in placed:  # a constrained row's key, unique to it (a stale row of an ended one never feeds its matcher)
            s.key = b.masks.open(s.controls.constraint) if s.controls.constraint is not None else 0
        call = b.insert([(s.slot, s.ids, s.sampling(), s.max_tokens,
                          None if s.controls is NONE else s.controls.row(s.key, b.eos_id), s.adapter) for s in placed])
        self.pending.append(_Call("insert", call, list(enumerate(placed))))
        for s in placed:
            self.cleared.discard(s.slot)
            s.dispatched, s.column = 1, b.first_token_column(len(s.ids))
            self.running[s.slot] = None if s.dispatched >= s.max_tokens else s
            self.metrics.prompt_tokens.inc(len(s.ids))

    # ------------------------------------------------------------------ reading a call's results

    def _read(self, call: _Call, updates: list) -> None:
        if call.kind == "none":
            self._end(call.rows[0][1], updates, "length")
            return
        if call.kind == "score":
            self._read_scores(call, updates)
            return
        tokens, scored = call.handle
        tokens = np.asarray(self.b.fetch(tokens))
        self.failures = 0
        if any(s.logprobs is not None for _, s in call.rows):
            scored = _fields(self.b.fetch(scored))
            if call.kind == "insert":  # one token a row: as an advance of one step
                scored = tuple(x[:, None] for x in scored)
        # an insert's one token a row; an advance's columns past its steps are padding
        tokens = tokens[:, None] if call.kind == "insert" else tokens[:, :call.steps]
        for r, s in call.rows:
            if not s.ended and not s.gone:
                self._take(s, tokens[r].tolist(), r, scored, updates)

    def _read_scores(self, call: _Call, updates: list) -> None:
        """A score call's results: each prompt's tokens 1.. (row r, column c: prompt r's token c + 1)."""
        scored = _fields(self.b.fetch(call.handle))
        self.failures = 0
        for r, s in call.rows:
            if s.ended or s.gone:
                continue
            updates.append(Update(s, prompt_scored=tuple(np.asarray(x[r][:len(s.ids) - 1]) for x in scored)))
            if s.max_tokens == 0:
                self._end(s, updates, "length")

    def _take(self, s: Sequence, row: list, r: int, scored, updates: list) -> None:
        """A sequence's new tokens of a call (up to its end), and its end."""
        taken, reason = [], None
        c = s.controls
        for t in row:
            taken.append(t)
            s.count += 1
            if (t == self.b.eos_id and not c.ignore_eos) or t in c.stop_ids:
                reason = "stop"
            elif s.count >= s.max_tokens:
                reason = "length"
            if reason:
                break
        if reason == "stop" and t != self.b.eos_id and s.slot is not None and self.running[s.slot] is s:
            self.cleared.add(s.slot)  # a stop token (the device knows only its end-of-text token): it stops there
        self.metrics.generated.inc(len(taken))
        rows = tuple(x[r][:len(taken)] for x in scored) if s.logprobs is not None else None
        if reason:
            self._end(s, updates, reason, tokens=taken, scored=rows)
        else:
            updates.append(Update(s, taken, rows))

    # ------------------------------------------------------------------ failures

    def _recover(self, e: BaseException) -> bool:
        """A call failed: the sequences of the calls in flight and in the slots end with the error, the backend is
        reset -> whether the loop goes on (not after FATAL_AFTER failures in a row, or a failed reset)."""
        logger.exception("a decoding call failed")
        self.failures += 1
        error = Failed(f"decoding failed ({type(e).__name__}: {str(e)[:200]})")
        # every held sequence but the queued ones (which go on): those in the slots, joining, in a call in flight,
        # and the rows of the call whose reading raised (an advance with their last tokens, whose slots were freed
        # when it was dispatched; a one-token insert; a score)
        with self.cv:
            queued = {id(s) for s in self.waiting} | {id(s) for s in self.scoring}
            held = sorted((s for s in self.held_seqs if id(s) not in queued), key=lambda s: s.arrival)
        self.pending.clear()
        self.joining = []
        self.cleared.clear()
        self.running = [None] * len(self.running)
        updates: list = []
        for s in held:
            self._end(s, updates, None, error)
        fatal = self.failures >= FATAL_AFTER
        if not fatal:
            try:
                self.b.reset()
            except Exception:  # noqa: BLE001
                logger.exception("the slots could not be reset")
                fatal = True
        if fatal:
            with self.cv:
                self.failure = Failed(f"the decoding loop stopped after {self.failures} failed call(s) "
                                      f"({type(e).__name__}): restart the server", fatal=True)
                rest = list(self.held_seqs)
                self.waiting.clear()
                self.scoring.clear()
            for s in rest:
                self._end(s, updates, None, self.failure)
        self._gauges()
        self.emit(updates)
        if fatal:
            self.on_fatal(self.failure)
        return not fatal


def _run(fn: Callable, future: Future) -> None:
    """``fn()``'s result, or what it raised, into ``future``."""
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 (the caller's to handle: it waits on the future)
        future.set_exception(e)


def _fields(scored) -> tuple:
    """(logprob, top_ids, top_logprobs) of a Scored (modelling/continuous.py's, or any object with those fields)."""
    return scored.logprob, scored.top_ids, scored.top_logprobs
