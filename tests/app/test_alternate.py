"""app/alternate.py: engines measured in turn (A B C, C B A ...), kept alive or started anew each round, a failed
one reported and the others kept; the worker's protocol; a ratio as the median of the rounds' own ratios, with its
spread."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app import alternate as A


@given(st.lists(st.text(min_size=1, max_size=3), min_size=1, max_size=6, unique=True), st.integers(0, 50))
def test_two_rounds_in_a_row_give_every_engine_the_same_mean_place(names, r):
    first, second = A.round_order(names, r), A.round_order(names, r + 1)
    assert sorted(first) == sorted(names) == sorted(second)
    # a linear drift of the machine's speed over two rounds costs every engine the same
    assert {first.index(n) + second.index(n) for n in names} == {len(names) - 1}
    assert A.round_order(names, 0) == list(names)  # the first round in the order given: ours first


class FakeWorker:
    """A worker that logs what the parent asks of it; ``fails``: names that never say they are ready."""

    log: list = []
    fails: set = set()
    counts: dict = {}

    def __init__(self, name, argv, timeout):
        self.name, self.argv, self.alive = name, argv, False

    def start(self):
        self.log.append(("start", self.name))
        self.alive = self.name not in self.fails
        return self.alive

    def measure(self):
        if not self.alive:
            return None
        self.log.append(("measure", self.name))
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return {"n": self.counts[self.name], "argv": self.argv}

    def close(self):
        self.log.append(("close", self.name))


@pytest.fixture
def fake():
    FakeWorker.log, FakeWorker.fails, FakeWorker.counts = [], set(), {}
    return FakeWorker


def test_persistent_workers_start_once_then_alternate_a_repeat_at_a_time(fake):
    runs = A.alternate({"ours": ["a"], "peer": ["b"], "other": ["c"]}, repeats=3, persistent=True, settle_s=0,
                       make=fake)
    measured = [n for what, n in fake.log if what == "measure"]
    assert measured == ["ours", "peer", "other", "other", "peer", "ours", "ours", "peer", "other"]
    assert [e for e in fake.log if e[0] == "start"] == [("start", "ours"), ("start", "peer"), ("start", "other")]
    assert fake.log[:3] == [("start", "ours"), ("start", "peer"), ("start", "other")]  # all warmed up first
    assert sorted(e for e in fake.log if e[0] == "close") == [("close", n) for n in ("other", "ours", "peer")]
    assert runs["ours"] == [{"n": 1, "argv": ["a"]}, {"n": 2, "argv": ["a"]}, {"n": 3, "argv": ["a"]}]


def test_fresh_workers_each_round_are_started_measured_once_and_closed(fake):
    runs = A.alternate({"ours": ["a"], "peer": ["b"]}, repeats=2, persistent=False, settle_s=0, make=fake)
    assert fake.log == [("start", "ours"), ("measure", "ours"), ("close", "ours"),
                        ("start", "peer"), ("measure", "peer"), ("close", "peer"),
                        ("start", "peer"), ("measure", "peer"), ("close", "peer"),
                        ("start", "ours"), ("measure", "ours"), ("close", "ours")]
    assert [r["n"] for r in runs["peer"]] == [1, 2]


def test_a_failed_engine_is_none_in_every_round_and_the_others_are_measured(fake):
    fake.fails = {"peer"}
    runs = A.alternate({"ours": ["a"], "peer": ["b"]}, repeats=2, persistent=True, settle_s=0, make=fake)
    assert runs["peer"] == [None, None] and [r["n"] for r in runs["ours"]] == [1, 2]


def test_serve_answers_each_measure_line_until_its_input_ends():
    out, calls = io.StringIO(), []
    n = A.serve(lambda: calls.append(1) or {"x": len(calls)}, {"what": "w"}, io.StringIO("measure\nmeasure\n"), out)
    lines = out.getvalue().splitlines()
    assert n == 2 and all(line.startswith(A.TAG) for line in lines)
    assert [json.loads(line[len(A.TAG):]) for line in lines] == [{"ready": True, "what": "w"}, {"measure": {"x": 1}},
                                                                  {"measure": {"x": 2}}]


def test_serve_stops_at_a_line_that_is_not_measure():
    out = io.StringIO()
    assert A.serve(lambda: {}, None, io.StringIO("measure\nquit\nmeasure\n"), out) == 1


WORKER = """
import sys
sys.path.insert(0, {root!r})
from app.alternate import serve
print("a line of its own")
n = 0
def measure():
    global n
    n += 1
    if n > {fail_after}:
        sys.exit(3)
    return {{"n": n}}
serve(measure, {{"engine": "stub"}})
"""


def test_a_worker_process_answers_with_its_header_and_fails_once_it_exits(capsys):
    from app.bench import ROOT

    w = A.Worker("stub", ["-c", WORKER.format(root=ROOT, fail_after=2)], timeout=60)
    assert w.start() and w.header == {"ready": True, "engine": "stub"}
    assert w.measure() == {"engine": "stub", "n": 1} and w.measure() == {"engine": "stub", "n": 2}
    assert w.measure() is None and w.failed and w.measure() is None  # exited: failed, and stays so
    out = capsys.readouterr().out
    assert "a line of its own" in out  # its own output passes through
    assert "FAILED (exit 3): stub" in out


def test_a_worker_that_never_says_ready_fails_with_its_exit_code(capsys):
    w = A.Worker("broken", ["-c", "import sys; sys.exit(5)"], timeout=60)
    assert not w.start() and w.measure() is None
    assert "FAILED (exit 5): broken" in capsys.readouterr().out


def test_spread_is_median_min_max_and_their_range_over_the_median():
    s = A.spread([3.0, None, 1.0, 2.0, 10.0])
    assert s == {"median": 2.5, "min": 1.0, "max": 10.0, "relative_spread": pytest.approx(9.0 / 2.5), "n": 4}
    assert A.spread([None, None]) is None and A.spread([]) is None


@given(st.lists(st.floats(0.1, 100.0), min_size=1, max_size=9), st.floats(0.2, 5.0))
def test_a_paired_ratio_is_the_same_in_every_round_when_ours_is_a_fixed_multiple(peer, c):
    ours = [{"t": p * c} for p in peer]
    theirs = [{"t": p} for p in peer]
    r = A.paired_ratio(ours, theirs, "t")
    assert r["median"] == pytest.approx(c) and r["min"] == pytest.approx(c) and r["max"] == pytest.approx(c)
    # a time (lower is better): the peer's over ours, > 1 where ours is faster
    assert A.paired_ratio(ours, theirs, "t", higher_is_better=False)["median"] == pytest.approx(1 / c)


def test_a_paired_ratio_pairs_rounds_not_medians():
    # the machine slows down over the rounds; ours is 2x the peer in each round
    ours = [{"v": 2.0}, {"v": 20.0}, {"v": 200.0}]
    peer = [{"v": 1.0}, {"v": 10.0}, {"v": 100.0}]
    assert A.paired_ratio(ours, peer, "v")["rounds"] == [2.0, 2.0, 2.0]
    # a round either side failed, or without the figure, is left out
    r = A.paired_ratio(ours + [None, {"v": 3.0}], peer + [{"v": 1.0}, {"w": 1.0}], "v")
    assert r["rounds"] == [2.0, 2.0, 2.0, None, None] and r["n"] == 3
    assert A.paired_ratio([None], [{"v": 1.0}], "v") is None
