"""serving/remote.py: the decoding loop in an engine process of its own, over the tests' fake backend
(tests/fake_backend.py) built in that process. The same events as the scheduler in this process (tokens, text,
log-probabilities, stop strings, a call that fails), the metrics the same; admission here (the queue's bound, a
drain); cancels and stop strings reaching the engine process (it stops generating); the engine process killed
(every held sequence answered with a fatal error, once); its start-up errors; signals left to the HTTP process; an
engine process whose HTTP process went away exits."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from data.synthetic import make_tokenizer
from serving.engine import Engine, ServeOptions
from serving.output import Output
from serving.remote import Worker, error_from, error_of
from serving.scheduler import Failed, QueueFull, Scheduler, Sequence, ShuttingDown
from tests.env import ROOT
from tests.fake_backend import FailOnce, build_fake, refuse_to_start
from tests.helpers import alive, spawned_children
from utils.errors import CheckpointError, ConfigError

TOK = make_tokenizer()
WAIT = 60.0
LONG = 2000  # tokens of a sequence that surely outlasts a test's step (a SlowFake reads 2 of them in ``delay``)


def encode(texts) -> list:
    return TOK(list(texts), add_special_tokens=False)["input_ids"]


class Run:
    """An engine over the fake, in this process (``remote=False``) or in an engine process, started: each
    sequence's events (by its sink), the fatal errors."""

    def __init__(self, remote: bool, max_queue: int = 8, start: bool = True, **backend):
        kw = {"slots": 4, "widths": (8, 16), "joins": (1, 2, 4), "steps": 2, "vocab": len(TOK), "top": 3,
              "eos_id": TOK.eos_token_id, "pad_id": TOK.pad_token_id, **backend}
        options = ServeOptions(slots=4, max_queue=max_queue, widths=(8, 16), joins=(1, 2, 4), steps=2,
                               max_new_tokens=LONG, max_prompt_chars=2000, max_body_bytes=65536, model_id="fake",
                               max_logprobs=3)
        self.worker = Worker(build_fake, kw) if remote else None
        backend, scheduler = (self.worker.backend, self.worker.scheduler) if remote else (build_fake(kw), Scheduler)
        self.engine = Engine(backend, TOK, encode, options, scheduler=scheduler)
        self.events, self.fatal, self.cv = {}, [], threading.Condition()
        self.sinks = 0
        if start:
            self.engine.start(self._deliver, self.fatal.append)

    def _deliver(self, events) -> None:
        with self.cv:
            for sink, ev in events:
                self.events.setdefault(sink, []).append(ev)
            self.cv.notify_all()

    def seq(self, prompt: str, max_tokens: int, **out) -> Sequence:
        self.sinks += 1
        return Sequence(encode([prompt])[0], max_tokens, 0.0, logprobs=out.get("logprobs"),
                        out=Output(0, self.sinks, **out))

    def ended(self, s: Sequence) -> bool:
        return any(ev.finish_reason or ev.error for ev in self.events.get(s.out.sink, []))

    def wait(self, check, what: str) -> None:
        """Until ``check()`` (looked at as events come, and every 20 ms: some changes send none), at most WAIT s."""
        deadline = time.monotonic() + WAIT
        with self.cv:
            while not check():
                assert time.monotonic() < deadline, what
                self.cv.wait(0.02)

    def result(self, s: Sequence) -> tuple:
        """(text, token ids, finish reason, log-probabilities, the error as (type, message, fatal))."""
        evs = self.events.get(s.out.sink, [])
        lps = [(t.token, t.logprob, t.top, t.offset) for ev in evs for t in ev.logprobs or []]
        err = next((ev.error for ev in evs if ev.error is not None), None)
        return ("".join(ev.text for ev in evs), [t for ev in evs for t in ev.token_ids],
                next((ev.finish_reason for ev in evs if ev.finish_reason), None), lps, error_of(err))

    def metrics(self) -> dict:
        m = self.engine.metrics
        return {name: getattr(m, name)._value.get() for name in ("generated", "prompt_tokens", "queue_depth",
                                                                   "running")}

    def stop(self) -> None:
        self.engine.stop()


PROMPTS = ["the cat sat on the mat", "a dog", "house horse kitchen tonight swims", "x y z", "one two three four",
           "the the the", "red blue", "green"]


def serve_all(run: Run) -> list:
    """Every PROMPTS request (mixed lengths, some with log-probabilities, one with a stop string), in two
    submissions, -> their results once all ended."""
    seqs = [run.seq(p, 3 + 5 * (i % 4), logprobs=2 if i % 3 == 0 else None, stream=i % 2 == 0,
                    stop=("horse",) if i == 2 else ()) for i, p in enumerate(PROMPTS)]
    run.engine.submit(seqs[:5])
    run.engine.submit(seqs[5:])
    run.wait(lambda: all(run.ended(s) for s in seqs), "every request answered")
    run.wait(lambda: run.engine.held() == 0, "none held")
    if run.worker is not None:  # nor by the engine process
        run.wait(lambda: run.engine.scheduler.engine_held == 0, "none held in the engine process")
    return [run.result(s) for s in seqs]


def served(remote: bool, fail=None) -> tuple:
    """(results, metrics, fatal errors) of PROMPTS served. The tokens counted as generated are left out: a stop
    string's sequence generates on until the output side's word reaches the loop, a matter of the threads' timing."""
    run = Run(remote, fail=fail)
    try:
        results, metrics = serve_all(run), run.metrics()
    finally:
        run.stop()
    if remote:  # stopped, not killed: its loop ended when told
        assert run.worker.process.exitcode == 0
    return results, {k: v for k, v in metrics.items() if k != "generated"}, list(run.fatal), metrics["generated"]


def test_the_engine_process_gives_the_events_of_the_scheduler_in_this_process():
    """Tokens, text, log-probabilities, a stop string and the metrics: the same whichever process the loop runs in."""
    here, there = served(False), served(True)
    assert there[:3] == here[:3]
    results, metrics, fatal, generated = there
    assert fatal == [] and metrics["queue_depth"] == metrics["running"] == 0
    assert metrics["prompt_tokens"] == sum(len(encode([p])[0]) for p in PROMPTS)
    assert generated >= sum(len(r[1]) for r in results)  # (and the tokens after a stop string)
    assert results[2][0] == "house " and results[2][2] == "stop"  # (the fake repeats its prompt) before "horse"
    assert any(r[3] for r in results) and len({r[0] for r in results}) > 4  # log-probabilities; outputs differ
    assert all(r[4] is None for r in results)


def test_a_call_that_fails_in_the_engine_process_answers_its_sequences_and_the_loop_goes_on():
    """The sequences the failed call held end with its error, made again here (type, message, not fatal); the
    others are served as without the failure. (Which ones it held depends on the threads' timing.)"""
    clean = served(True)[0]
    results, _, fatal, _ = served(True, FailOnce("read", at=3))
    errors = [r[4] for r in results if r[4] is not None]
    assert errors and len(errors) < len(results) and fatal == []
    for r, want in zip(results, clean):
        if r[4] is not None:
            assert r[4][0] == "Failed" and r[4][2] is False and "read 3 failed" in r[4][1], r[4]
        else:
            assert r == want


def test_admission_is_decided_here_and_cancels_reach_the_engine_process():
    run = Run(True, max_queue=2, delay=0.01)
    try:
        seqs = [run.seq("the cat sat", LONG, stream=True) for _ in range(6)]  # 4 slots + a queue of 2
        run.engine.submit(seqs[:3])
        run.engine.submit(seqs[3:])
        assert run.engine.held() == 6
        with pytest.raises(QueueFull):
            run.engine.submit([run.seq("a dog", 4)])
        run.wait(lambda: all(s.out.sink in run.events for s in seqs[:4]), "the first four generate")
        run.wait(lambda: (run.metrics()["running"], run.metrics()["queue_depth"]) == (4, 2), "the gauges come here")
        run.engine.drain()
        with pytest.raises(ShuttingDown):
            run.engine.submit([run.seq("a dog", 4)])
        assert run.engine.healthy is False and run.engine.held() == 6  # a drain: the held ones go on
        run.engine.cancel(seqs)
        run.wait(lambda: run.engine.held() == 0, "the cancelled sequences leave the engine process")
        cancelled = run.engine.metrics.requests.labels("cancelled")._value
        run.wait(lambda: cancelled.get() == 6, "they ended there as cancelled")  # (counted by the output thread)
        assert run.metrics()["generated"] < 4 * LONG / 4  # they stopped long before their max_tokens
        assert not any(run.ended(s) for s in seqs)  # (a cancelled sequence's client is gone: nothing sent)
    finally:
        run.stop()


def test_a_stop_string_ends_the_sequence_in_the_engine_process():
    run = Run(True, delay=0.01)
    try:
        s = run.seq("house horse kitchen tonight swims", LONG, stop=("kitchen",))
        run.engine.submit([s])
        run.wait(lambda: run.ended(s), "the stop string ends it")
        run.wait(lambda: run.engine.held() == 0, "the engine process ends it too")
        assert run.result(s)[:3:2] == ("house horse ", "stop")
        assert run.metrics()["generated"] < LONG / 10  # it did not run on to its max_tokens there
    finally:
        run.stop()


def test_a_killed_engine_process_answers_every_held_sequence_and_stops_the_server():
    run = Run(True, delay=0.01)
    try:
        seqs = [run.seq("the cat sat", LONG, stream=True) for _ in range(6)]  # 4 running, 2 queued
        run.engine.submit(seqs)
        run.wait(lambda: all(s.out.sink in run.events for s in seqs[:4]), "the first four generate")
        for sig in (signal.SIGTERM, signal.SIGINT):  # (the HTTP process's: a supervisor's and Ctrl-C's)
            os.kill(run.worker.process.pid, sig)
        time.sleep(0.3)
        assert run.worker.process.is_alive() and not any(run.ended(s) for s in seqs)
        run.worker.process.kill()
        run.wait(lambda: all(run.ended(s) for s in seqs), "every held sequence answered")
        for s in seqs:
            name, message, fatal = run.result(s)[4]
            assert (name, fatal) == ("Failed", True) and "engine process stopped" in message, message
        run.wait(lambda: len(run.fatal) == 1, "the server told to stop")
        assert isinstance(run.fatal[0], Failed) and run.fatal[0].fatal
        assert run.engine.held() == 0 and not run.engine.healthy
        with pytest.raises(Failed, match="engine process stopped"):
            run.engine.submit([run.seq("a dog", 4)])
    finally:
        run.stop()


@pytest.mark.parametrize("started", [False, True])
def test_the_engine_process_exits_when_the_http_process_goes_away(started):
    """Before its scheduler starts, and while it serves (its loop stopped first)."""
    if started:
        run = Run(True, delay=0.01)
        run.engine.submit([run.seq("the cat sat", LONG, stream=True)])
        run.wait(lambda: run.events, "it generates")
        worker = run.worker
    else:
        worker = Worker(build_fake, {"slots": 4, "joins": (1, 2, 4)})
    worker.pipe.conn.close()
    worker.process.join(WAIT)
    assert worker.process.exitcode == 0


@pytest.mark.parametrize("kind, error, message", [("config", ConfigError, "--slots 3 must divide over data_parallel 2"),
                                                  ("checkpoint", CheckpointError, "ckpt/x holds no weights"),
                                                  ("bug", RuntimeError, "ZeroDivisionError: a bug")])
def test_an_engine_process_that_cannot_start_raises_its_error_here(kind, error, message):
    with pytest.raises(error) as e:
        Worker(refuse_to_start, kind)
    assert str(e.value) == message and type(e.value) is error  # (an expected error: its one line and exit code)


def test_an_abort_ends_a_submit_sent_after_it():
    """A SIGTERM handler's abort may be sent between a request's admission and its submit: the request ends with
    the abort's error too, rather than running on after it."""
    run = Run(True, delay=0.01)
    try:
        run.engine.abort(ShuttingDown("the server shut down before this request finished"))
        s = run.seq("the cat sat", LONG, stream=True)
        run.engine.submit([s])
        run.wait(lambda: run.ended(s), "it ends at once")
        assert run.result(s)[4] == ("ShuttingDown", "the server shut down before this request finished", False)
        assert run.metrics()["generated"] == 0
    finally:
        run.stop()


def test_an_engine_stopped_before_it_started_stops_its_process():
    run = Run(True, start=False)
    t = time.monotonic()
    run.stop()
    assert run.worker.process.exitcode == 0 and time.monotonic() - t < 10  # (not the 30 s of a kill)


def test_a_message_that_cannot_cross_ends_the_held_sequences_and_the_server():
    """A bug that makes a message unpicklable: every held sequence gets a fatal error and the server stops, rather
    than requests that wait forever."""
    run = Run(True, delay=0.01)
    try:
        held = run.seq("the cat sat", LONG, stream=True)
        run.engine.submit([held])
        run.wait(lambda: held.out.sink in run.events, "it generates")
        bad = run.seq("a dog", 4)
        bad.ids = [lambda: 0]  # (does not pickle)
        run.engine.submit([bad])
        run.wait(lambda: run.ended(held) and run.ended(bad), "both answered")
        for s in (held, bad):
            name, message, fatal = run.result(s)[4]
            assert name == "Failed" and fatal and "restart the server" in message
        run.wait(lambda: len(run.fatal) == 1, "the server told to stop")
    finally:
        run.stop()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_an_engine_process_dies_with_its_server_even_while_it_starts(tmp_path):
    """A server killed (SIGKILL: no drain, no goodbye) while its engine process builds: that process ends too,
    rather than compiling on and holding the device's memory."""
    marker = str(tmp_path / "building")
    script = ("import sys, time\nsys.path.insert(0, %r)\nfrom serving.remote import Worker\n"
              "from tests.fake_backend import slow_build\nimport threading\n"
              "threading.Thread(target=Worker, args=(slow_build, 60.0, %r), daemon=True).start()\n"
              "time.sleep(60)\n") % (ROOT, marker)
    server = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + WAIT
        while not (engines := spawned_children(server.pid)):
            assert time.monotonic() < deadline, "the engine process did not start"
            time.sleep(0.05)
        while not os.path.exists(marker):  # (its build begun: after its prctl)
            assert time.monotonic() < deadline, "the engine process did not begin its build"
            time.sleep(0.05)
        server.kill()
        server.wait()
        deadline = time.monotonic() + WAIT
        while alive(engines[0]):
            assert time.monotonic() < deadline, "the engine process outlived its server"
            time.sleep(0.05)
    finally:
        server.kill()


def test_a_server_that_exits_without_stopping_its_engine_process_exits():
    """An error between the engine process's start and the server's serving (nothing calls stop): the server's exit
    ends it rather than waiting on it without end (it ignores SIGTERM once ready, which multiprocessing's exit
    sends)."""
    script = ("import sys\nsys.path.insert(0, %r)\nfrom serving.remote import Worker\n"
              "from tests.fake_backend import build_fake\nw = Worker(build_fake, {})\n"
              "w.scheduler(w.backend, 8, None, 1, None)\nprint(w.process.pid, flush=True)\n") % ROOT
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert server.wait(WAIT) == 0
        assert not alive(int(server.stdout.readline()))
    finally:
        server.kill()


def test_errors_cross_with_their_type_message_and_fatality():
    for e in (Failed("a call failed"), Failed("the loop stopped", fatal=True), ShuttingDown("shut down")):
        back = error_from(error_of(e))
        assert (type(back), str(back), getattr(back, "fatal", False)) == (type(e), str(e), getattr(e, "fatal", False))
    other = error_from(error_of(QueueFull(1, 2, 3)))  # (never sent; any other type: a Failed with its message)
    assert type(other) is Failed and str(other) == str(QueueFull(1, 2, 3))
    assert error_of(None) is None and error_from(None) is None
