"""The scheduler (serving/scheduler.py) driven with a fake backend (tests/fake_backend.py: the slot programs' contract
in numpy, no JAX): joins, leaves, cancels, max_tokens, the end-of-text token, the queue bound, a backend that raises
(once, and for good), drain and abort, the call after next dispatched before a call is read, prompts scored, the
sampling parameters as the slots read them. Its output side is tests/serving/test_output.py's.

Most tests drive the scheduler a round at a time (``_round``) from the test's thread, so every interleaving is the
test's choice; a few run its thread."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from data.synthetic import make_tokenizer
from serving.metrics import Metrics
from serving.scheduler import FATAL_AFTER, Failed, QueueFull, Scheduler, Sequence, ShuttingDown
from tests.fake_backend import FakeBackend, logprob

TOK = make_tokenizer()


EOS = TOK.eos_token_id


def ids(text: str) -> list:
    return TOK(text, add_special_tokens=False)["input_ids"]


class Harness:
    """A scheduler over a fake backend, its updates collected, driven a round at a time."""

    def __init__(self, max_queue: int = 8, min_join: int = 1, base=None, **backend):
        self.b = FakeBackend(**backend)
        self.metrics = Metrics(self.b.slots)
        self.s = Scheduler(self.b, max_queue, self.metrics, min_join, base)
        self.updates: list = []
        self.s.emit = self.updates.extend
        self.keeps: list = []
        advance = self.b.advance
        self.b.advance = lambda keep, n, span=None: (self.keeps.append(np.array(keep)), advance(keep, n, span))[1]

    def seq(self, prompt, max_tokens: int = 8, **kw) -> Sequence:
        return Sequence(prompt if isinstance(prompt, list) else ids(prompt), max_tokens, **kw)

    def run(self, rounds: int = 200) -> int:
        """Rounds until nothing is held -> how many."""
        for n in range(rounds):
            if not self.s.held_seqs and not self.s.pending:
                return n
            self.s._round()
        raise AssertionError("the scheduler never emptied")

    def of(self, seq) -> list:
        return [u for u in self.updates if u.seq is seq]

    def tokens(self, seq) -> list:
        return [t for u in self.of(seq) for t in u.tokens]

    def end(self, seq):
        ends = [u for u in self.of(seq) if u.reason or u.error]
        assert len(ends) == 1, ends  # every sequence ends exactly once
        return ends[0]


def expected(prompt: list, max_tokens: int) -> tuple:
    """The fake model's output for a prompt: its tokens cycled, up to the end-of-text or max_tokens."""
    out = []
    while len(out) < max_tokens:
        out.append(prompt[len(out) % len(prompt)])
        if out[-1] == EOS:
            return out, "stop"
    return out, "length"


def test_sequences_join_free_slots_and_leave_at_their_end():
    h = Harness(slots=4, steps=2)
    prompts = ["the cat sleeps", "a dog", "the bird runs in the park", "red", "old man . </s> in", "the child"]
    lengths = [5, 9, 3, 1, 12, 6]
    seqs = [h.seq(p, n) for p, n in zip(prompts, lengths)]
    h.s.submit(seqs)
    h.run()
    assert sorted({s.slot for s in seqs}) == [0, 1, 2, 3]  # every slot used, some twice
    assert sorted(h.b.limits) == sorted(lengths)  # the device stops each row where the host does
    for s, n in zip(seqs, lengths):
        tokens, reason = expected(s.ids, n)
        assert h.tokens(s) == tokens and h.end(s).reason == reason, (s.ids, n)
    assert h.end(seqs[4]).reason == "stop" and h.tokens(seqs[4])[-1] == EOS  # its end-of-text token, kept
    assert h.s.held() == 0 and all(s is None for s in h.s.running)
    assert h.metrics.generated._value.get() == sum(len(h.tokens(s)) for s in seqs)


def test_the_running_gauge_counts_every_slot_whose_sequence_still_decodes():
    """flan_t5_running_slots says what decodes: a sequence whose last token is on its way (its slot already free for
    a joiner, the call not yet read) still decodes; it once read 0 between such rounds, with every slot busy and
    sequences queued. Two slots, six sequences of 3 tokens: 2 after every round until the last are read, then 0."""
    h = Harness(slots=2, steps=2)
    seqs = [h.seq("the cat sleeps", 3) for _ in range(6)]
    h.s.submit(seqs)
    seen = []
    while h.s.held_seqs or h.s.pending:
        h.s._round()
        seen.append(h.metrics.running._value.get())
    assert seen[:3] == [2, 2, 2] and seen[-1] == 0, seen
    assert all(h.end(s).reason == "length" for s in seqs)
    h = Harness(slots=4, steps=2)  # one sequence in four slots: 1, not the slots
    h.s.submit([h.seq("the cat sleeps", 9)])
    h.s._round()
    assert h.metrics.running._value.get() == 1


def test_a_sequence_of_one_token_never_advances():
    h = Harness(slots=2, steps=4)
    one = h.seq("the cat", 1)
    h.s.submit([one])
    h.run()
    assert h.tokens(one) == ids("the") and h.end(one).reason == "length"
    assert "advance" not in h.b.calls


def test_the_next_call_is_dispatched_before_the_last_is_read_and_a_slot_ending_by_length_is_refilled_at_once():
    h = Harness(slots=1, steps=2)
    first, second = h.seq("the cat sleeps", 3), h.seq("a dog runs", 3)
    h.s.submit([first, second])
    h.s._round()  # first joins (1 token) and advances (2 more: its last): its slot is free before that is read
    assert h.b.calls == ["insert", "advance"] and h.s.running == [None] and h.tokens(first) == ids("the")
    h.s._round()  # second joins the freed slot; the first's advance is read after that insert's dispatch
    assert h.b.calls == ["insert", "advance", "insert", "advance", "read"]
    assert h.tokens(first) == ids("the cat sleeps") and h.end(first).reason == "length"
    h.run()
    assert h.tokens(second) == ids("a dog runs")


def test_a_cancelled_sequence_leaves_its_slot_and_gets_no_more_tokens():
    h = Harness(slots=2, steps=2)
    long, other = h.seq("the cat sleeps", 40), h.seq("a dog", 40)
    queued = h.seq("red bird", 4)
    h.s.submit([long, other, queued])
    h.s._round()
    h.s._round()
    before = len(h.tokens(long))
    h.s.cancel([long, queued])
    h.s._round()
    assert h.end(long).reason == "cancelled" and h.end(queued).reason == "cancelled"
    assert not h.keeps[-1][long.slot]  # the device is told at the next call
    h.s.cancel([other])
    h.run()
    assert len(h.tokens(long)) == before and not h.tokens(queued)  # the queued one never joined
    assert sum(c == "insert" for c in h.b.calls) == 1


def test_a_request_is_admitted_whole_while_the_slots_and_queue_have_room_refused_whole_while_full():
    """A request of many sequences is admitted while the server holds fewer than slots + max_queue, as one of one
    sequence is: it once had to fit beside the held ones, and while small requests kept the server near its bound it
    was refused for good."""
    h = Harness(slots=2, max_queue=3)
    h.s.submit([h.seq("the cat", 30) for _ in range(4)])
    h.s.submit([h.seq("a dog", 2) for _ in range(5)])  # 4 held < 2 slots + 3 queued: all five (9 held)
    assert h.s.held() == 9
    with pytest.raises(QueueFull) as e:
        h.s.submit([h.seq("a dog", 2)])  # full: none
    assert e.value.held == 9 and h.s.held() == 9
    h.run()
    h.s.submit([h.seq("a dog", 2) for _ in range(5)])  # the slots and the queue free again
    with pytest.raises(QueueFull):
        h.s.submit([h.seq("a dog", 2), h.seq("a dog", 2)])  # 5 held: all or none, none


def test_a_backend_that_raises_fails_the_calls_sequences_and_the_loop_goes_on():
    h = Harness(slots=2, steps=2)
    running = [h.seq("the cat", 20), h.seq("a dog", 20)]
    queued = h.seq("red bird", 5)
    h.s.submit(running + [queued])
    h.s._round()
    h.b.fail = lambda kind: OverflowError("int too big") if kind == "advance" else None
    with pytest.raises(OverflowError):
        h.s._round()
    # the loop's handler: what _loop does with an exception
    assert h.s._recover(OverflowError("int too big"))
    h.b.fail = None
    for s in running:
        assert isinstance(h.end(s).error, Failed) and "OverflowError" in str(h.end(s).error)
    assert h.b.resets == 2 and h.s.failure is None  # reset once (beside its construction), and it goes on
    h.run()
    assert h.tokens(queued) == expected(queued.ids, 5)[0] and h.end(queued).reason == "length"


def test_a_failing_insert_fails_its_joiners_only():
    h = Harness(slots=4, steps=2)
    a = h.seq("the cat", 20)
    h.s.submit([a])
    h.s._round()
    b = h.seq("a dog", 6)
    h.s.submit([b])
    h.b.fail = lambda kind: RuntimeError("bad insert") if kind == "insert" else None
    with pytest.raises(RuntimeError):
        h.s._round()
    h.s._recover(RuntimeError("bad insert"))
    h.b.fail = None
    assert isinstance(h.end(b).error, Failed)
    assert isinstance(h.end(a).error, Failed)  # its device state was lost with the reset
    c = h.seq("red bird", 3)
    h.s.submit([c])
    h.run()
    assert h.tokens(c) == expected(c.ids, 3)[0]


def test_calls_failing_again_and_again_stop_the_loop_for_good():
    h = Harness(slots=2)
    fatal = []
    h.s.on_fatal = fatal.append
    h.b.fail = lambda kind: RuntimeError("device lost")
    queued = [h.seq("the cat", 5) for _ in range(8)]
    h.s.submit(queued)
    goes_on = []
    for _ in range(FATAL_AFTER):
        with pytest.raises(RuntimeError):
            h.s._round()
        goes_on.append(h.s._recover(RuntimeError("device lost")))
    assert goes_on == [True] * (FATAL_AFTER - 1) + [False]
    assert fatal and fatal[0].fatal
    for s in queued:  # every held one answered
        assert isinstance(h.end(s).error, Failed)
    with pytest.raises(Failed) as e:
        h.s.submit([h.seq("a dog", 2)])
    assert e.value.fatal and "restart" in str(e.value)


def test_the_thread_answers_every_sequence_when_a_call_raises():
    """The loop itself (its thread): a failing call ends the sequences it held with an error, the rest finish."""
    h = Harness(slots=2, steps=1)
    boom = threading.Event()
    h.b.fail = lambda kind: (boom.set(), ValueError("boom"))[1] if kind == "advance" and not boom.is_set() else None
    done = threading.Event()
    seqs = [h.seq("the cat sleeps", 6) for _ in range(5)]

    def emit(updates):
        h.updates.extend(updates)
        if sum(1 for u in h.updates if u.reason or u.error) == len(seqs):
            done.set()

    h.s.start(emit)
    h.s.submit(seqs)
    assert done.wait(30)
    h.s.stop()
    errors = [s for s in seqs if h.end(s).error is not None]
    assert len(errors) == 2 and all(h.end(s).reason == "length" for s in seqs if s not in errors)


def test_drain_refuses_new_sequences_and_abort_ends_the_held_ones():
    h = Harness(slots=1)
    held = [h.seq("the cat", 30), h.seq("a dog", 30)]
    h.s.submit(held)
    h.s._round()
    h.s.stop_admitting()
    with pytest.raises(ShuttingDown):
        h.s.submit([h.seq("red", 2)])
    error = ShuttingDown("bye")
    h.s.abort_all(error)
    h.run()
    assert all(h.end(s).reason == "aborted" and h.end(s).error is error for s in held)


@pytest.mark.parametrize("left, n", [(1, 3), (3, 3), (4, 4), (7, 7), (8, 8), (9, 8), (40, 8)])
def test_with_every_slot_taken_an_advance_runs_the_fewest_tokens_any_has_left_from_the_base_to_the_most(left, n):
    """The base 3 steps, the backend's most 8: two sequences take both slots (the insert gives each its first token);
    the advance runs as many steps as the one with fewer tokens left to dispatch has, clamped to [3, 8]."""
    h = Harness(slots=2, steps=8, base=3)
    a, b = h.seq("the cat sleeps", 1 + left), h.seq("a dog runs", 50)
    h.s.submit([a, b])
    h.s._round()
    assert h.b.ns == [n]
    assert a.dispatched == min(1 + n, 1 + left) and b.dispatched == 1 + n
    assert h.s.running[a.slot] is (None if n >= left else a)  # freed when its last token is on its way
    h.run()
    for s in (a, b):
        assert (h.tokens(s), h.end(s).reason) == expected(s.ids, s.max_tokens)  # the columns past n: never taken


def test_a_sequence_ending_by_its_end_of_text_inside_a_longer_call_frees_its_slot_when_that_call_is_read():
    """Its end is not known in advance: its slot idles to the call's end (the longer calls' price), then the waiting
    one takes it; nobody's tokens are lost or repeated."""
    h = Harness(slots=2, steps=8, base=2)
    stops, long, waiting = h.seq("the cat </s> in", 30), h.seq("a dog runs", 30), h.seq("red bird", 5)
    h.s.submit([stops, long, waiting])
    h.s._round()  # both slots taken: 8 steps (29 left each); stops writes its end-of-text at its third token
    h.s._round()  # that call is read after the next is dispatched: the slot is free only now
    assert h.b.ns[:2] == [8, 8] and h.b.calls.count("insert") == 1 and h.end(stops).reason == "stop"
    h.run()
    assert h.b.calls.count("insert") == 2 and waiting.slot == stops.slot
    for s in (stops, long, waiting):
        assert (h.tokens(s), h.end(s).reason) == expected(s.ids, s.max_tokens)


def test_an_advance_takes_the_base_steps_while_a_slot_is_free_even_one_waiting_for_a_group():
    h = Harness(slots=2, steps=8, base=2)
    long = h.seq("the cat sleeps", 40)
    h.s.submit([long])
    h.s._round()  # a slot free, none waiting: an arrival joins after 2 steps
    assert h.b.ns == [2]
    h.s.submit([h.seq("a dog", 30)])
    h.s._round()  # it joins: both slots taken (40 - 3 = 37 and 30 - 1 = 29 tokens left)
    assert h.b.ns == [2, 8]
    h3 = Harness(slots=4, steps=8, base=2, min_join=2)  # a free slot that waits for a group, a sequence waiting
    seqs = [h3.seq("the cat", 3)] + [h3.seq("a dog", 60) for _ in range(3)]
    h3.s.submit(seqs)
    h3.s._round()
    h3.s.submit([h3.seq("red bird", 4), h3.seq("old man", 4)])
    h3.s._round()  # the short one's slot is free and waits for a group: its wait counts calls of the base
    assert h3.b.ns == [2, 2] and h3.b.calls.count("insert") == 1
    h3.s._round()
    h3.s._round()  # JOIN_WAIT (2) calls of the base waited: it joins, every slot taken, the joiner 3 tokens left
    assert h3.b.ns == [2, 2, 2, 3] and h3.b.calls.count("insert") == 2
    h3.run()
    for s in seqs:
        assert (h3.tokens(s), h3.end(s).reason) == expected(s.ids, s.max_tokens)


def test_free_slots_wait_up_to_join_wait_calls_for_a_group():
    from serving.scheduler import JOIN_WAIT

    h = Harness(slots=4, steps=2, min_join=2)
    short, longs = h.seq("the cat", 3), [h.seq("a dog", 60) for _ in range(3)]
    h.s.submit([short] + longs)
    h.s._round()
    h.s.submit([h.seq("red bird", 4), h.seq("old man", 4)])
    for _ in range(JOIN_WAIT):
        h.s._round()  # the short one's slot is free, alone: it waits for a second one
        assert h.b.calls.count("insert") == 1
    h.s._round()  # no second one frees: it joins anyway
    assert h.b.calls.count("insert") == 2
    assert h.b.limits == [3, 60, 60, 60, 4]  # one joined: the other still waits for a slot


def test_after_a_group_joins_the_next_free_slot_waits_the_whole_join_wait_again():
    """The wait for a group restarts at each join: a slot freed after a deferred join waits JOIN_WAIT calls too."""
    from serving.scheduler import JOIN_WAIT

    h = Harness(slots=4, steps=2, min_join=2)
    h.s.submit([h.seq("the cat", 3)] + [h.seq("a dog", 80) for _ in range(3)])
    h.s._round()  # the short one's last tokens dispatched: its slot is free
    h.s.submit([h.seq("red bird", 3), h.seq("old man", 3), h.seq("the park", 3)])
    inserts = []
    for _ in range(2 * (JOIN_WAIT + 1)):
        h.s._round()
        inserts.append(h.b.calls.count("insert"))
    # a lone free slot: JOIN_WAIT calls of waiting, then it joins (and frees again at once: 3 tokens), then again
    assert inserts == [1] * JOIN_WAIT + [2] + [2] * JOIN_WAIT + [3], inserts


def test_the_base_steps_are_clamped_to_what_an_advance_can_run():
    b = FakeBackend(slots=2, steps=4)
    assert [Scheduler(b, 4, Metrics(2), 1, n).steps for n in (None, 0, 3, 9)] == [4, 1, 3, 4]


def test_a_slot_the_host_stopped_is_kept_again_for_the_sequence_that_joins_it():
    """A cancelled sequence's slot is cleared (its keep flag off) until another joins it: that one is kept, and gets
    every token (a slot left cleared would stop the joiner on the device after its first token)."""
    h = Harness(slots=1, steps=2)
    first, second = h.seq("the cat sleeps", 40), h.seq("a dog runs in", 9)
    h.s.submit([first, second])
    h.s._round()
    h.s.cancel([first])
    h.run()
    assert second.slot == first.slot == 0 and h.end(second).reason == "length"
    assert h.tokens(second) == expected(second.ids, 9)[0]
    assert all(k[0] for k in h.keeps)  # the joiner took the cleared slot in the round the cancel was read


def test_a_score_only_sequence_queued_when_a_call_fails_is_still_served():
    """A call failing ends the sequences it held; the queued ones go on, those waiting to be scored too."""
    h = Harness(slots=2, steps=2)
    running = h.seq("the cat", 20)
    h.s.submit([running])
    h.s._round()
    h.b.fail = lambda kind: RuntimeError("device lost") if kind == "advance" else None
    with pytest.raises(RuntimeError):
        h.s._round()
    score_only, waiting = h.seq("a dog runs", 0, prompt_logprobs=True), h.seq("red bird", 3)
    h.s.submit([score_only, waiting])  # (from the HTTP thread, while the loop handles the failure)
    assert h.s._recover(RuntimeError("device lost"))
    h.b.fail = None
    h.run()
    assert isinstance(h.end(running).error, Failed)
    assert h.end(score_only).reason == "length" and h.end(score_only).error is None
    assert any(u.prompt_scored is not None for u in h.of(score_only))
    assert h.tokens(waiting) == expected(waiting.ids, 3)[0]


def test_logprobs_of_the_tokens_and_of_the_prompt():
    for after_prompt in (False, True):
        h = Harness(slots=2, steps=3, after_prompt=after_prompt)
        s = h.seq("the cat sleeps in", 6, logprobs=2, prompt_logprobs=True)  # (its last call: 2 of 3 columns)
        score_only = h.seq("a dog runs", 0, prompt_logprobs=True)
        h.s.submit([s, score_only])
        h.run()
        tokens = h.tokens(s)
        for u in h.of(s):  # an update's scores are its tokens' (an advance's columns past its end: not one of them)
            assert all(len(x) == len(u.tokens) for x in u.scored) if u.tokens else u.scored is None
        lps = np.concatenate([u.scored[0] for u in h.of(s) if u.tokens])
        np.testing.assert_allclose(lps, logprob(np.array(tokens), np.arange(len(tokens))))
        for seq in (s, score_only):
            (scored,) = [u.prompt_scored for u in h.of(seq) if u.prompt_scored is not None]
            np.testing.assert_allclose(scored[0], logprob(np.array(seq.ids[1:]), np.array(seq.ids[:-1])))
        assert h.end(score_only).reason == "length" and not h.tokens(score_only)
        assert h.b.calls.count("insert") == 1 and score_only.slot is None  # the score-only sequence took no slot


@pytest.mark.parametrize("kind", ["insert", "advance", "read", "score"])
@pytest.mark.parametrize("nth", range(5))
def test_whichever_call_fails_every_sequence_ends_exactly_once_and_the_rest_finish(kind, nth):
    """A call raising where it is dispatched or where its tokens are read (a device error surfaces at the read):
    every sequence held ends exactly once, the failed ones with the error, and none is left held (a row whose last
    tokens were in flight, its slot already freed, once stayed held forever: its client never answered). What a
    round decided before the failure (a sequence that ended) is sent too."""
    h = Harness(slots=2, steps=2)
    seqs = [h.seq(p, n) for p, n in (("the cat", 3), ("a dog", 1), ("red bird", 6), ("the cat sleeps", 4),
                                      ("a", 2), ("bird", 5))]
    seqs.append(h.seq("a dog runs", 0, prompt_logprobs=True))
    count = [0]

    def fail(k):
        if k == kind:
            count[0] += 1
            if count[0] == nth + 1:
                return RuntimeError("boom")
        return None

    h.b.fail = fail
    h.s.submit(seqs)
    for _ in range(200):
        if not h.s.held_seqs and not h.s.pending:
            break
        try:
            h.s._round()
        except RuntimeError:
            assert h.s._recover(RuntimeError("boom"))
    assert not h.s.held_seqs and not h.s.pending
    ends = [h.end(s) for s in seqs]  # (exactly one each)
    for s, e in zip(seqs, ends):
        if e.error is None and s.max_tokens:
            assert h.tokens(s) == expected(s.ids, s.max_tokens)[0]


def test_a_sequence_ended_in_a_round_whose_call_then_fails_is_still_answered():
    """A cancelled sequence leaves at the start of a round; the round's advance then raises: the cancelled one's
    end is sent (it was lost with the round's updates once: its client never answered), the others fail."""
    h = Harness(slots=2, steps=2)
    a, b = h.seq("the cat sleeps", 40), h.seq("a dog", 40)
    h.s.submit([a, b])
    h.s._round()
    h.s.cancel([a])
    h.b.fail = lambda kind: RuntimeError("boom") if kind == "advance" else None
    with pytest.raises(RuntimeError):
        h.s._round()
    h.s._recover(RuntimeError("boom"))
    assert h.end(a).reason == "cancelled" and isinstance(h.end(b).error, Failed)
    assert not h.s.held_seqs


# --------------------------------------------------------------------------- boundaries (each test: a contract
# that a one-token change of the scheduler or the output side breaks)
def test_sampling_parameters_as_the_slots_read_them():
    """(temperature, top_k, drop_mass, seed low, seed high, logprobs): the 64-bit seed split low half first (the
    device keys with the low half and folds in the high), top-p as the mass dropped, 1 - top_p."""
    s = Sequence([5], 4, temperature=0.7, top_p=0.9, top_k=5, seed=(7 << 32) | 3, logprobs=2)
    temperature, top_k, drop, low, high, logprobs = s.sampling()
    assert (temperature, top_k, low, high, logprobs) == (0.7, 5, 3, 7, 2)
    assert drop == 1.0 - 0.9  # in float64, as HF computes it
    plain = Sequence([5], 4, top_k=-1).sampling()
    assert plain[1] == 0 and plain[2] == 0.0 and plain[5] == -1  # top-k off, top-p off, no log-probabilities
    for seed, halves in ((2 ** 64 - 1, (2 ** 32 - 1, 2 ** 32 - 1)), (1 << 31, (1 << 31, 0)), (1 << 32, (0, 1))):
        assert Sequence([5], 4, seed=seed).sampling()[3:5] == halves, seed  # every bit of each half kept
    draws = {Sequence([5], 4).sampling()[3:5] for _ in range(8)}  # no seed: a fresh 64-bit one each time
    assert len(draws) == 8 and all(0 <= x < 2 ** 32 for d in draws for x in d)


def test_fewer_waiting_than_min_join_join_at_once_when_they_all_fit():
    h = Harness(slots=4, steps=2, min_join=4)
    h.s.submit([h.seq("a dog", 60) for _ in range(2)])
    h.s._round()
    late = h.seq("red bird", 4)
    h.s.submit([late])
    h.s._round()  # two slots free, one waiting: a group of all that wait, it joins now
    assert h.b.calls.count("insert") == 2 and late.slot is not None
    h = Harness(slots=4, steps=2, min_join=4)
    h.s.submit([h.seq("a dog", 60) for _ in range(2)])
    h.s._round()
    pair = [h.seq("red bird", 4), h.seq("old man", 4)]
    h.s.submit(pair)
    h.s._round()  # two slots free, two waiting: as many as wait (fewer than min_join), they join now
    assert h.b.calls.count("insert") == 2 and all(s.slot is not None for s in pair)


def test_joiners_are_spread_over_the_dp_shards_in_one_insert():
    h = Harness(slots=4, dp=2, steps=2)
    seqs = [h.seq(p, 5) for p in ("the cat", "a dog", "red bird", "old man")]
    h.s.submit(seqs)
    h.run()
    assert [sorted(slots) for slots in h.b.inserts] == [[0, 1, 2, 3]]  # every free slot at once
    assert [s.slot // 2 for s in seqs] == [0, 1, 0, 1]  # each to the shard with the most free slots left
    assert sorted(s.slot for s in seqs) == [0, 1, 2, 3]
    for s in seqs:
        assert h.tokens(s) == expected(s.ids, 5)[0]


def test_every_waiting_sequence_that_a_free_slot_takes_joins_in_one_insert_and_prompts_are_scored_whole():
    """Joiners go to the backend as their prompts' ids, all the free slots take in one insert (the backend packs
    them: decoder/slot_programs.py); a prompt as long as the widest taken joins; prompts scored alone go in one score call,
    each as its ids."""
    h = Harness(slots=4, max_prompt=16)
    words = ids("the cat sleeps in the park the dog runs in the house")
    seqs = [h.seq((words * 2)[:n], 3) for n in (16, 1, 5, 9, 2)]
    h.s.submit(seqs)
    h.s._round()
    assert [len(slots) for slots in h.b.inserts] == [4] and seqs[4].slot is None  # 4 slots: 4 join, one waits
    h.run()
    assert [len(slots) for slots in h.b.inserts] == [4, 1]
    assert all(h.tokens(s) == expected(s.ids, 3)[0] for s in seqs)
    scored = [h.seq((words * 2)[:n], 0, prompt_logprobs=True) for n in (16, 3)]
    h.s.submit(scored)
    h.run()
    assert h.b.scores == [[s.ids for s in scored]]


def test_only_calls_failing_in_a_row_stop_the_loop():
    """A call read after a failure starts the count again: FATAL_AFTER failures, but never two in a row, and the
    loop goes on."""
    h = Harness(slots=2, steps=2, max_queue=40)
    h.s.submit([h.seq("the cat sleeps", 40) for _ in range(4 * FATAL_AFTER + 4)])
    for _ in range(FATAL_AFTER + 1):
        h.b.fail = lambda kind: RuntimeError("flaky") if kind == "advance" else None
        with pytest.raises(RuntimeError):
            h.s._round()
        assert h.s._recover(RuntimeError("flaky"))
        h.b.fail = None
        h.s._round()  # an insert and an advance, the insert read
    assert h.s.failure is None and h.s.failures == 0


def test_a_score_only_sequence_without_log_probabilities_takes_no_call_and_prompt_tokens_are_counted():
    h = Harness(slots=2, steps=2, score_rows=1)  # a score call of one prompt
    echo_only, scored = h.seq("the cat", 0), h.seq("a dog runs", 0, prompt_logprobs=True)
    running = h.seq("red bird", 3)
    h.s.submit([echo_only, scored, running])
    h.run()
    assert h.end(echo_only).reason == "length" and h.b.calls.count("score") == 1  # the scored one's only
    assert echo_only.slot is None and scored.slot is None and h.b.calls.count("insert") == 1
    assert h.metrics.prompt_tokens._value.get() == len(running.ids)  # the prompts read into slots, in tokens


def test_a_sequence_the_output_side_ended_ends_as_finished():
    h = Harness(slots=2, steps=2)
    s = h.seq("the cat sleeps", 40)
    h.s.submit([s])
    h.s._round()
    h.s.finish([s])
    h.run()
    assert h.end(s).reason == "finished" and h.end(s).error is None


def test_a_sequence_cancelled_while_a_round_runs_gets_no_tokens_after_it():
    h = Harness(slots=1, steps=2)
    s = h.seq("the cat sleeps in the park", 40)
    h.s.submit([s])
    h.s._round()
    advance = h.b.advance
    # the client goes away mid-round
    h.b.advance = lambda keep, n, span=None: (h.s.cancel([s]), advance(keep, n, span))[1]
    h.s._round()
    h.b.advance = advance
    before = len(h.tokens(s))
    h.run()
    assert len(h.tokens(s)) == before == 1 and h.end(s).reason == "cancelled"  # its first token only


@pytest.mark.parametrize("after_prompt", [True, False])
def test_each_advance_asks_for_the_columns_its_running_rows_write_and_no_more(after_prompt):
    """An advance's span: the furthest column a running sequence writes in its n steps, + 1. A sequence with d tokens
    dispatched writes ``first_token_column(its prompt's length)`` + d - 1 on, a column a step until its last token
    is out: at most min(n, max_tokens - d) of them (the fake raises on a row writing past its span). A causal
    model's cache holds its prompt from column 0 (2 and 10 tokens here), T5's decoder's the start token (new token i
    at 1 + i). Ended and cancelled sequences ask for nothing."""
    h = Harness(slots=2, steps=2, after_prompt=after_prompt)
    short, wide = h.seq("the cat", 6), h.seq(" ".join(["a"] * 10), 3)
    h.s.submit([short])
    h.s._round()  # short joins (2 tokens: 1 dispatched), then 2 steps: columns c + 0, c + 1
    c8, c16 = (len(short.ids), len(wide.ids)) if after_prompt else (1, 1)
    assert h.b.spans == [c8 + 2]
    h.s.submit([wide])
    h.s._round()  # wide joins (10 tokens), both step: short from c8 + 2, wide from c16
    assert h.b.spans[-1] == max(c8 + 3 - 1 + 2, c16 + 1 - 1 + 2)
    h.s._round()  # wide's last token (3 dispatched) went out: only short runs, 5 dispatched, its last 1 to go
    assert h.b.spans[-1] == c8 + 5 - 1 + 1
    h.s.cancel([short])
    h.s._round()
    h.run()
    assert len(h.b.spans) == 3 and h.tokens(wide) == ids(" ".join(["a"] * 3))


def test_the_fake_refuses_a_span_its_writing_rows_would_write_at_or_past():
    """The fake's side of the span contract (the slots' programs': tests/modelling/test_continuous.py): a row at index i
    that still writes writes columns first_token_column + i .. + i + min(n, limit - 1 - i) - 1 in an advance of n steps; a span
    of that last column is refused, one past it taken; a row that no longer writes (or is not kept) asks nothing."""
    from tests.fake_backend import SpanTooNarrow

    b = FakeBackend(slots=2, max_prompt=8, steps=4)
    b.insert([(0, [5] * 8, None, 10), (1, [5] * 8, None, 3)])
    # row 0: index 0, 10 tokens, 4 steps: columns 8 .. 11; row 1: 3 tokens, 2 left: columns 8, 9
    with pytest.raises(SpanTooNarrow, match="span 11: rows \\[0\\]"):
        b.advance(np.array([True, True]), 4, 11)
    b.advance(np.array([True, True]), 4, 12)
    # row 0 at index 4 (columns 12 .. 15 next); row 1 ended: nothing asked of it
    with pytest.raises(SpanTooNarrow):
        b.advance(np.array([True, True]), 4, 15)
    b.advance(np.array([False, True]), 4, 1)  # (row 0 not kept: it stops, writing nothing)
    assert b.spans == [11, 12, 15, 1]


# --------------------------------------------------------------------------- each sequence's processors (serving/controls.py)


def test_a_sequences_controls_reach_the_slots_as_its_row_and_only_a_constrained_one_holds_a_key():
    """Each joiner's processors reach the insert as ``Controls.row`` (its key, its table: logit_bias held always,
    the end-of-text and stop tokens held below min_tokens); a free one as None; a constrained row gets a key of its
    own in the backend's masks, closed when it ends."""
    from decoder.grammar import Allowed
    from serving.controls import ALWAYS, Controls

    h = Harness(slots=4, steps=2)
    allowed = Allowed(ids("the cat"), h.b.masks.words)
    c = Controls(presence=0.5, frequency=-0.25, repetition=1.3, min_p=0.1, min_tokens=3, stop_ids=(7, 8),
                 bias=((4, -2.5), (9, 100.0)), constraint=allowed)
    free, ruled = h.seq("the cat sleeps"), h.seq("the cat . </s>", controls=c)
    h.s.submit([free, ruled])
    h.s._round()
    assert h.b.controls == [None, (0.5, -0.25, 1.3, 0.1, False, ruled.key, (
        (4, -2.5, ALWAYS), (9, 100.0, ALWAYS), (EOS, float("-inf"), 3), (7, float("-inf"), 3),
        (8, float("-inf"), 3)))]
    assert ruled.key > 0 and free.key == 0 and ruled.key in h.b.masks.rows
    h.run()
    assert ruled.key not in h.b.masks.rows  # closed at its end
    assert set(h.tokens(ruled)) <= set(ids("the cat")) | {EOS}  # (the fake writes what the host allows)
    assert Controls(min_tokens=2, ignore_eos=True, stop_ids=(5,)).entries(EOS) == ((5, float("-inf"), 2),)


def test_a_stop_token_ends_its_sequence_kept_in_its_output_and_clears_its_row():
    """vLLM's stop_token_ids: the sequence ends at the first (finish_reason "stop"), the token kept; the device,
    which knows its end-of-text token alone, is told to stop the row (its keep flag cleared)."""
    from serving.controls import Controls

    h = Harness(slots=2, steps=4)
    words = ids("the cat sleeps in the park")
    s = h.seq(words, 20, controls=Controls(stop_ids=(words[3],)))
    h.s.submit([s, h.seq("a dog", 30)])  # (another runs on: its advances carry the keep flags)
    h.run()
    assert h.tokens(s) == words[:4] and h.end(s).reason == "stop"
    assert any(not k[s.slot] for k in h.keeps)  # cleared on the device after its stop token


def test_ignore_eos_goes_past_the_end_of_text_token_to_max_tokens():
    """vLLM's ignore_eos: a fixed-length run gives exactly max_tokens tokens, the end-of-text token among them."""
    from serving.controls import Controls

    h = Harness(slots=2, steps=3)
    prompt = ids("the cat") + [EOS]
    on, off = h.seq(prompt, 8, controls=Controls(ignore_eos=True)), h.seq(prompt, 8)
    h.s.submit([on, off])
    h.run()
    assert h.tokens(on) == (prompt * 3)[:8] and h.end(on).reason == "length"
    assert h.tokens(off) == prompt and h.end(off).reason == "stop"


def test_the_joiners_of_one_insert_hold_at_most_a_tables_entries_together():
    """Each insert's joiners' table entries fit one insert (``TABLE``, the first joiner always): three sequences of
    200 bias entries each join one by one (first come, first served: the free one behind them joins with the
    last)."""
    from serving.controls import TABLE, Controls

    h = Harness(slots=4, steps=2)
    big = Controls(bias=tuple((t, 1.0) for t in range(200)))
    seqs = [h.seq("the cat", controls=big) for _ in range(3)] + [h.seq("a dog")]
    h.s.submit(seqs)
    h.run()
    for slots, rows in zip(h.b.inserts, _grouped(h.b.controls, h.b.inserts)):
        assert sum(len(r[6]) for r in rows if r) <= TABLE, slots
    assert [len(x) for x in h.b.inserts] == [1, 1, 2]  # 200 | 200 | 200 + the free one


def _grouped(controls: list, inserts: list) -> list:
    out, k = [], 0
    for slots in inserts:
        out.append(controls[k:k + len(slots)])
        k += len(slots)
    return out
