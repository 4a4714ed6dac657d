"""The engine's decoding loop in a process of its own (``run_server.py --engine_process``): the HTTP process keeps
the HTTP layer, the tokenizer, the output processor (text, stop strings, log-probabilities) and the metrics; the
engine process holds the model, its compiled slot programs and the scheduler, and never waits for the HTTP
process's interpreter lock between two decoding calls (vLLM's engine-core process, SGLang's scheduler process).

    worker = Worker(backend_in_process, cfg, options)   # the engine process started, its programs compiled
    engine = Engine(worker.backend, tokenizer, encode, options, scheduler=worker.scheduler)

``RemoteScheduler`` is the scheduler as the engine and the HTTP layer use it (``submit``, ``cancel``, ``finish``,
``abort_all``, ``stop_admitting``, ``held``, ``start``, ``stop``, ``admitting``, ``failure``), over a pipe:

    HTTP process -> engine process   ("scheduler", max_queue, min_join, steps), ("start",), ("submit", [spec]),
                                     ("flag", "cancelled" | "finished", [key]), ("abort", error), ("stop",)
    engine process -> HTTP process   ("ready", BackendInfo) or ("error", type, message) at start-up;
                                     ("updates", [(key, tokens, scored, prompt_scored, reason, error)], tally),
                                     ("tally", tally), ("fatal", error), ("stopped",)

A sequence is named by its ``key`` between the two; an error travels as (type name, message, fatal) and is made
again on the other side. The HTTP process admits a request itself (the queue's bound, shutting down, a failed loop:
the same exceptions, at once) and counts a sequence held until its last update comes back, so the engine process
never holds more than it admitted. The engine process's scheduler metrics (queue depth, running slots, tokens)
come back with every message. The HTTP process's messages go out through a queue and a thread of their own, as a
signal handler (SIGTERM's drain) may send one while the main thread is inside a send. If the engine process dies,
every held sequence ends with ``Failed`` (fatal: the server exits non-zero for its supervisor to restart it), and
it exits by itself when the HTTP process goes away.
"""

from __future__ import annotations

import atexit
import ctypes
import itertools
import logging
import multiprocessing
import os
import queue
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from app.logs import setup_logging
from serving.scheduler import Failed, Scheduler, SchedulerError, Sequence, ShuttingDown, Update, admit
from utils import errors
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")
ERRORS = {"Failed": lambda message, fatal: Failed(message, fatal),
          "ShuttingDown": lambda message, fatal: ShuttingDown(message)}
STOP_WAIT = 30.0  # seconds the engine process has to stop before it is killed


def error_of(e: Optional[BaseException]) -> Optional[tuple]:
    """An error as it crosses the pipe: (type name, message, fatal)."""
    return None if e is None else (type(e).__name__, str(e), bool(getattr(e, "fatal", False)))


def error_from(t: Optional[tuple]) -> Optional[SchedulerError]:
    """``error_of``'s tuple -> the scheduler's error again (one of another type: Failed with its message)."""
    if t is None:
        return None
    name, message, fatal = t
    return ERRORS.get(name, ERRORS["Failed"])(message, fatal)


@dataclass(frozen=True)
class BackendInfo:
    """What the HTTP process knows of the backend in the engine process (what ``Engine`` reads of one)."""

    slots: int
    dp: int
    widths: tuple
    joins: tuple
    vocab_size: int
    top: int
    scores_prompts: bool
    platform: str

    @classmethod
    def of(cls, b) -> "BackendInfo":
        return cls(b.slots, b.dp, tuple(b.widths), tuple(b.joins), b.vocab_size, b.top, b.scores_prompts, b.platform)


class _Pipe:
    """One end of the pipe, its sends from any thread."""

    def __init__(self, conn):
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg) -> bool:
        """Whether it went (False: the other end is gone, or the message could not be sent: then the two sides
        no longer agree, and the caller ends as if the other side died). ``msg`` may be a callable, made under the
        lock: what it reads is then the newest that any message says (the tally, which two threads send)."""
        with self.lock:
            try:
                self.conn.send(msg() if callable(msg) else msg)
                return True
            except (OSError, EOFError):
                return False
            except Exception:  # noqa: BLE001 (a message that does not pickle: a bug, said)
                logger.exception("a message to the other process could not be sent")
                return False

    def recv(self):
        """The next message; None when the other end is gone (or this one closed meanwhile: CPython's Connection
        then raises TypeError), or when a message does not unpickle (a bug, said)."""
        try:
            return self.conn.recv()
        except (OSError, EOFError, TypeError):
            return None
        except Exception:  # noqa: BLE001
            logger.exception("a message from the other process could not be read")
            return None


# --------------------------------------------------------------------------- the HTTP process's side


class Worker:
    """The engine process: started, its backend built (``build``) and every program compiled, or the error that
    stopped it raised here."""

    def __init__(self, build: Callable, *args):
        ctx = multiprocessing.get_context("spawn")  # (a fork would copy this process's threads' locks)
        ours, theirs = ctx.Pipe()
        self.process = ctx.Process(target=engine_main, args=(theirs, build, args), name="engine", daemon=True)
        self.process.start()
        theirs.close()
        atexit.register(self.kill)  # (before multiprocessing's own, which would wait for it without end)
        self.pipe = _Pipe(ours)
        msg = self.pipe.recv()
        if msg is None or msg[0] != "ready":
            self.process.join(STOP_WAIT)
            if msg is None:
                raise RuntimeError(f"the engine process stopped while it started (exit code "
                                   f"{self.process.exitcode}); its log above says why")
            _, name, message = msg
            kind = getattr(errors, name, None)  # an expected error (utils/errors.py): one line and its exit code
            if isinstance(kind, type) and issubclass(kind, FlanT5Error):
                raise kind(message)
            raise RuntimeError(f"{name}: {message}")
        self.backend: BackendInfo = msg[1]

    def scheduler(self, backend, max_queue: int, metrics, min_join: int, steps: Optional[int]) -> "RemoteScheduler":
        """Engine's ``scheduler`` factory."""
        return RemoteScheduler(self, max_queue, metrics, min_join, steps)

    def kill(self) -> None:
        """Ends the engine process now (at this process's exit, where nothing stopped it: an error before the
        server served, say)."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def close(self) -> None:
        self.process.join(STOP_WAIT)
        if self.process.is_alive():
            logger.warning("the engine process did not stop within %.0f s: killed", STOP_WAIT)
            self.process.kill()
            self.process.join()


class RemoteScheduler:
    """The scheduler as seen from the HTTP process (see the module docstring)."""

    def __init__(self, worker: Worker, max_queue: int, metrics, min_join: int, steps: Optional[int]):
        self.w, self.pipe, self.max_queue, self.metrics = worker, worker.pipe, max_queue, metrics
        self.slots = worker.backend.slots
        self.lock = threading.RLock()  # held, admitting, failure (reentrant: SIGTERM's handler may take it)
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()  # (its put is safe in a signal handler)
        threading.Thread(target=self._send, name="engine-writer", daemon=True).start()
        self.held_seqs: dict = {}  # key -> Sequence admitted, not yet ended
        self.keys = itertools.count()
        self.admitting, self.failure, self.stopping = True, None, False
        self.totals = {"generated": 0.0, "prompt_tokens": 0.0}  # the engine process's counters applied so far
        self.engine_held = 0  # sequences the engine process held when it last said
        self.emit: Callable = lambda updates: None
        self.on_fatal: Callable = lambda error: None
        self.thread: Optional[threading.Thread] = None
        self.outbox.put(("scheduler", max_queue, min_join, steps))

    def _send(self) -> None:
        while True:
            msg = self.outbox.get()
            if msg is None:
                return
            if not self.pipe.send(msg):
                self._died()
                return

    def start(self, emit: Callable, on_fatal: Callable = lambda error: None) -> None:
        self.emit, self.on_fatal = emit, on_fatal
        self.thread = threading.Thread(target=self._loop, name="engine-reader", daemon=True)
        self.thread.start()
        self.outbox.put(("start",))

    def submit(self, seqs: list) -> None:
        """As Scheduler.submit: all or none, QueueFull, ShuttingDown or Failed raised here."""
        with self.lock:
            admit(self.failure, self.admitting, len(self.held_seqs), len(seqs), self.slots, self.max_queue)
            for s in seqs:
                s.key = next(self.keys)
                self.held_seqs[s.key] = s
            specs = [(s.key, s.ids, s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.logprobs,
                      s.prompt_logprobs) for s in seqs]
            self.outbox.put(("submit", specs))

    def cancel(self, seqs: list) -> None:
        self.outbox.put(("flag", "cancelled", [s.key for s in seqs]))

    def finish(self, seqs: list) -> None:
        self.outbox.put(("flag", "finished", [s.key for s in seqs]))

    def abort_all(self, error: SchedulerError) -> None:
        self.outbox.put(("abort", error_of(error)))

    def stop_admitting(self) -> None:
        """No new sequences (this process admits them: the engine process needs no word of it)."""
        with self.lock:
            self.admitting = False

    def held(self) -> int:
        with self.lock:
            return len(self.held_seqs)

    def stop(self) -> None:
        self.stopping = True
        self.outbox.put(("stop",))
        self.outbox.put(None)
        if self.thread is not None:
            self.thread.join(STOP_WAIT)
        self.w.close()

    # ------------------------------------------------------------------ the reading thread

    def _loop(self) -> None:
        while True:
            msg = self.pipe.recv()
            if msg is None or msg[0] == "stopped":
                if msg is None or not self.stopping:  # (gone without saying it stopped: died, even while stopping)
                    self._died()
                return
            if msg[0] == "updates":
                self._updates(msg[1])
                self._tally(msg[2])
            elif msg[0] == "tally":
                self._tally(msg[1])
            elif msg[0] == "fatal":
                with self.lock:
                    self.failure = error_from(msg[1])
                self.on_fatal(self.failure)

    def _updates(self, rows: list) -> None:
        updates = []
        with self.lock:
            for key, tokens, scored, prompt_scored, reason, error in rows:
                s = self.held_seqs.get(key)
                if s is None:  # (already ended: the engine process died meanwhile)
                    continue
                if reason is not None or error is not None:  # its last update
                    del self.held_seqs[key]
                updates.append(Update(s, tokens, scored, prompt_scored, reason, error_from(error)))
        if updates:
            self.emit(updates)

    def _tally(self, tally: dict) -> None:
        self.metrics.queue_depth.set(tally["queue_depth"])
        self.metrics.running.set(tally["running"])
        for name, counter in (("generated", self.metrics.generated), ("prompt_tokens", self.metrics.prompt_tokens)):
            counter.inc(tally[name] - self.totals[name])
            self.totals[name] = tally[name]
        self.engine_held = tally["held"]  # (last: who sees it sees the metrics of the same message)

    def _died(self) -> None:
        """The engine process went away (or a message could not cross): every held sequence ends with a fatal Failed,
        and so does the server, once (the reading and the writing thread may both find it)."""
        with self.lock:
            if self.failure is not None and self.failure.fatal:
                return
            self.failure = Failed("the engine process stopped: restart the server", fatal=True)  # (until said below)
        self.w.process.join(1.0)
        exit_code = self.w.process.exitcode
        if exit_code is None:  # alive, but the two no longer agree: it goes, as the server does
            self.w.process.kill()
        why = (f"stopped (exit code {exit_code})" if exit_code is not None else
               "no longer answers (a message could not cross)")
        error = Failed(f"the engine process {why}: restart the server", fatal=True)
        with self.lock:
            self.failure = error
            held, self.held_seqs = list(self.held_seqs.values()), {}
        self.metrics.queue_depth.set(0)
        self.metrics.running.set(0)
        self.emit([Update(s, error=error) for s in held])
        self.on_fatal(error)


# --------------------------------------------------------------------------- the engine process's side


class _Value:
    """A gauge's or counter's value in the engine process's tally (the metrics' ``set`` and ``inc``)."""

    def __init__(self, tally: dict, name: str):
        self.tally, self.name = tally, name

    def set(self, v) -> None:
        self.tally[self.name] = v

    def inc(self, v=1) -> None:
        self.tally[self.name] += v


class _Tally:
    """The scheduler's metrics in the engine process: values sent to the HTTP process's metrics."""

    def __init__(self):
        self.values = {"queue_depth": 0, "running": 0, "generated": 0, "prompt_tokens": 0}
        for name in self.values:
            setattr(self, name, _Value(self.values, name))


def engine_main(conn, build: Callable, args: tuple) -> None:
    """The engine process: ``build(*args)`` -> the backend, then the scheduler over it, driven by the pipe until
    ``stop`` or until the HTTP process goes away (on Linux it is killed with the HTTP process, even while it
    compiles). Once it is ready, Ctrl-C and SIGTERM are the HTTP process's (a terminal and a supervisor's control
    group send them to both): it drains, then stops this one; before, they stop it as they stop the server."""
    _die_with_parent()
    setup_logging(force=True)  # (JAX, imported when this process unpickled ``build``, set absl's up first)
    pipe = _Pipe(conn)
    try:
        backend = build(*args)
    except BaseException as e:  # noqa: BLE001 (whatever stopped the start-up: said in the HTTP process)
        if not isinstance(e, FlanT5Error):
            logger.exception("the engine process could not start")
        pipe.send(("error", type(e).__name__, str(e)))
        raise SystemExit(1) from None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if pipe.send(("ready", BackendInfo.of(backend))):
        _Engine(pipe, backend).run()


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when the one that started it ends (prctl's PR_SET_PDEATHSIG), so that an
    engine process never outlives its server (a server killed while this one compiles); elsewhere the closed pipe
    says it, once this one reads or writes it."""
    if not sys.platform.startswith("linux"):
        return
    started_by = multiprocessing.parent_process()
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    if started_by is not None and os.getppid() != started_by.pid:  # (it ended before the call: this one goes too)
        os._exit(1)


class _Engine:
    """The engine process's loop over the pipe (see the module docstring)."""

    def __init__(self, pipe: _Pipe, backend):
        self.pipe, self.backend, self.tally = pipe, backend, _Tally()
        self.seqs: dict = {}  # key -> Sequence held here
        self.aborted: Optional[SchedulerError] = None  # the abort said: it ends what comes after it too

    def run(self) -> None:
        msg = self.pipe.recv()
        if msg is None:
            return
        _, max_queue, min_join, steps = msg
        self.scheduler = s = Scheduler(self.backend, max_queue, self.tally, min_join, steps)
        msg = self.pipe.recv()
        if msg is None or msg[0] != "start":  # (gone, or stopped before it started)
            self.pipe.send(("stopped",))
            return
        s.start(self._emit, lambda error: self.pipe.send(("fatal", error_of(error))))
        while True:
            msg = self.pipe.recv()
            if msg is None or msg[0] == "stop":
                s.stop()
                self.pipe.send(("stopped",))
                return
            if msg[0] == "submit":
                self._submit(msg[1])
            elif msg[0] == "flag":
                (s.cancel if msg[1] == "cancelled" else s.finish)([self.seqs[k] for k in msg[2] if k in self.seqs])
            elif msg[0] == "abort":
                self.aborted = error_from(msg[1])
                s.abort_all(self.aborted)

    def _submit(self, specs: list) -> None:
        seqs = []
        for key, ids, max_tokens, temperature, top_p, top_k, seed, logprobs, prompt_logprobs in specs:
            seqs.append(Sequence(ids, max_tokens, temperature, top_p, top_k, seed, logprobs, prompt_logprobs, key=key))
            self.seqs[key] = seqs[-1]
        try:
            if self.aborted is not None:  # (submitted before the abort, sent after it: a signal's handler)
                raise self.aborted
            self.scheduler.submit(seqs)
        except SchedulerError as e:  # (the HTTP process admitted them: a loop that failed meanwhile) answered
            self._emit([Update(s, error=e) for s in seqs])
            return
        self.pipe.send(lambda: ("tally", self._tally()))

    def _emit(self, updates: list) -> None:
        rows = []
        for u in updates:
            if u.reason is not None or u.error is not None:
                self.seqs.pop(u.seq.key, None)
            rows.append((u.seq.key, u.tokens, u.scored, u.prompt_scored, u.reason, error_of(u.error)))
        self.pipe.send(lambda: ("updates", rows, self._tally()))

    def _tally(self) -> dict:
        """The metrics' values, and ``held``: the sequences this process holds (not a metric: the tests read it)."""
        return {**self.tally.values, "held": len(self.seqs)}
