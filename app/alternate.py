"""Measurements alternated within one invocation: every engine of a comparison (ours and its peers) measured in
turn, round after round, so that a shared machine's drift falls on both sides of each ratio; a ratio is the median
of the rounds' own ratios (each round's figures measured minutes, or seconds, apart), with its spread.

A worker is a benchmark process started with ``--worker``: it builds its engine and warms it up (compiles), says
so (a ``ready`` line), then answers each ``measure`` line it reads with one repeat's figures (a JSON line) until its
input ends. Lines of the protocol start with ``TAG``; whatever else a worker prints passes through.

Workers are kept alive over the rounds where they fit beside each other (``persistent``: a CPU, where each holds a
model in host memory and the rounds interleave them a repeat at a time, seconds apart), or each started, measured
once and closed in every round (an accelerator, whose memory holds one engine at a time).

    runs = alternate({"ours": ["inference.py", ...], "HF eager": [...]}, repeats=5, persistent=True)
    ratio = paired_ratio(runs["ours"], runs["HF eager"], "generated_tokens_per_s")
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

from app.bench import ROOT

TAG = "@alternate "
MEASURE = "measure"


# --------------------------------------------------------------------------- the worker's side


def say(message: dict, out=None) -> None:
    """One protocol line (``TAG`` + JSON) on ``out`` (stdout), flushed."""
    out = sys.stdout if out is None else out
    out.write(TAG + json.dumps(message) + "\n")
    out.flush()


def serve(measure, header: dict | None = None, inp=None, out=None) -> int:
    """The worker's loop: says it is ready (with ``header``: what it is), then answers each ``measure`` line of
    ``inp`` (stdin) with ``measure()``'s figures -> the number of repeats measured, at the end of its input."""
    inp = sys.stdin if inp is None else inp
    say({"ready": True, **(header or {})}, out)
    n = 0
    for line in inp:
        if line.strip() != MEASURE:
            break
        say({"measure": measure()}, out)
        n += 1
    return n


# --------------------------------------------------------------------------- the parent's side


class Worker:
    """One worker process (``python3 ARGV --worker`` from the repository root): ``start`` -> whether it said it is
    ready; ``measure`` -> one repeat's figures with what its ready line said, or None once it has failed (it is
    closed then and stays failed)."""

    def __init__(self, name: str, argv: list, timeout: float | None = None, env=None):
        self.name, self.argv, self.timeout, self.env = name, list(argv), timeout, env
        self.proc, self.lines, self.failed, self.header = None, queue.Queue(), False, None

    def start(self) -> bool:
        self.proc = subprocess.Popen([sys.executable, *self.argv, "--worker"], cwd=ROOT, env=self.env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=1)
        threading.Thread(target=self._read, daemon=True).start()
        self.header = self._answer("ready")
        return self.header is not None

    def _read(self) -> None:
        for line in self.proc.stdout:  # its own lines pass through; the protocol's are queued
            if line.startswith(TAG):
                self.lines.put(json.loads(line[len(TAG):]))
            else:
                sys.stdout.write(line)
        self.lines.put(None)  # (its output ended: it exited)

    def _answer(self, key: str):
        try:
            message = self.lines.get(timeout=self.timeout)
        except queue.Empty:
            return self._fail(f"no {key} within {self.timeout:.0f} s")
        if message is None or key not in message:
            return self._fail(f"exit {self.proc.wait()}")
        return message if key == "ready" else message[key]

    def _fail(self, why: str):
        print(f"FAILED ({why}): {self.name}: {' '.join(self.argv)}", flush=True)
        self.failed = True
        self.close()
        return None

    def measure(self):
        if self.failed or self.proc is None:
            return None
        try:
            self.proc.stdin.write(MEASURE + "\n")
            self.proc.stdin.flush()
        except OSError:
            return self._fail("its input closed")
        figures = self._answer("measure")
        return None if figures is None else {**{k: v for k, v in self.header.items() if k != "ready"}, **figures}

    def close(self) -> None:
        if self.proc is None:
            return
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def round_order(names: list, r: int) -> list:
    """Round r's order: the names as given in even rounds, reversed in odd ones (A B C, C B A, A B C ...), so that
    over any two rounds every engine has run as often before as after each other: a drift in the machine's speed
    falls on both sides."""
    return list(names) if r % 2 == 0 else list(reversed(names))


def alternate(commands: dict, repeats: int, persistent: bool, settle_s: float = 0.3, timeout: float | None = None,
              make=Worker) -> dict:
    """{name: [one repeat's figures, or None where it failed, per round]}: the engines of ``commands`` ({name:
    argv}) measured in turn (``round_order``), ``repeats`` rounds. ``persistent``: every worker started once (one
    after the other, each warmed up alone) and kept over the rounds; else started, measured once and closed in each
    round. ``settle_s`` seconds pass between two measurements (the last engine's spinning threads go idle)."""
    names, runs = list(commands), {n: [] for n in commands}
    workers = {}
    if persistent:
        for n in names:
            workers[n] = make(n, commands[n], timeout)
            workers[n].start()
    try:
        for r in range(repeats):
            for n in round_order(names, r):
                w = workers[n] if persistent else make(n, commands[n], timeout)
                if persistent or w.start():
                    time.sleep(settle_s)
                runs[n].append(w.measure())
                if not persistent:
                    w.close()
    finally:
        for w in workers.values():
            w.close()
    return runs


# --------------------------------------------------------------------------- the figures


def spread(values: list) -> dict | None:
    """{median, min, max, relative_spread: (max - min) / median, n} of the values that are not None; None if none."""
    xs = [v for v in values if v is not None]
    if not xs:
        return None
    m = statistics.median(xs)
    return {"median": m, "min": min(xs), "max": max(xs), "relative_spread": (max(xs) - min(xs)) / m if m else None,
            "n": len(xs)}


def figures(runs: list, key: str) -> list:
    """``key`` of every round's report (None where the round failed or lacks it)."""
    return [None if r is None else r.get(key) for r in runs]


def paired_ratio(ours: list, peer: list, key: str, higher_is_better: bool = True) -> dict | None:
    """Ours over the peer in each round (their figures ``key``; for a time, where lower is better, the peer's over
    ours: > 1 means ours is faster either way) -> ``spread`` of the rounds' ratios plus their list, or None where no
    round has both."""
    ratios = []
    for o, p in zip(figures(ours, key), figures(peer, key)):
        if o is None or p is None or not o or not p:
            ratios.append(None)
        else:
            ratios.append(o / p if higher_is_better else p / o)
    s = spread(ratios)
    return None if s is None else {**s, "rounds": ratios}


def machine_load() -> list | None:
    """The 1, 5 and 15 minute load averages (``uptime``'s), recorded beside a measurement; None where unknown."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None
