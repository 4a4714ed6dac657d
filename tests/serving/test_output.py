"""The output processor (serving/output.py) over the synthetic tokenizer and a byte-level BPE: stop strings across
token boundaries, streamed pieces that add up to the whole text, log-probabilities and their offsets, echo, special
tokens, characters split over tokens, the legacy ``top_logprobs``, the inter-token latency, and the events a
cancelled, failed or unchanged sequence gets."""

from __future__ import annotations

import numpy as np
import pytest

from data.synthetic import make_tokenizer
from serving import api
from serving.metrics import Metrics
from serving.output import Output, OutputProcessor
from serving.scheduler import Sequence, ShuttingDown, Update

TOK = make_tokenizer()


EOS = TOK.eos_token_id


def ids(text: str) -> list:
    return TOK(text, add_special_tokens=False)["input_ids"]


# --------------------------------------------------------------------------- the output side
class Out:
    """An output processor over the synthetic tokenizer, its events and the sequences it finished collected."""

    def __init__(self):
        self.finished: list = []
        self.p = OutputProcessor(TOK, Metrics(1), self.finished.extend)

    def feed(self, seq: Sequence, chunks: list, reason: str, scored=None) -> list:
        events = []
        for i, c in enumerate(chunks):
            last = i == len(chunks) - 1
            events += [e for _, e in self.p.handle(Update(seq, c, scored(c) if scored else None,
                                                          reason=reason if last else None))]
            if seq in self.finished:
                break
        return events


def sequence(text: str, stream: bool, stop=(), logprobs=None, echo=None, echo_ids=None) -> Sequence:
    return Sequence(ids("x"), 100, out=Output(0, None, stop, stream, logprobs, echo, echo_ids))


@pytest.mark.parametrize("stream", [True, False])
def test_a_stop_string_across_tokens_ends_the_text_before_it(stream):
    words = ids("the cat sleeps in the park the dog runs")
    out = Out()
    s = sequence("", stream, stop=("t sle", "dog"))
    events = out.feed(s, [words[:2], words[2:4], words[4:]], "length")
    text = "".join(e.text for e in events)
    assert text == "the ca" and events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == 3  # up to "sleeps", whose text completed the stop string
    assert out.finished == [s]  # the scheduler is told to free the slot
    assert [len(e.token_ids) for e in events][-1] >= 1 and sum(len(e.token_ids) for e in events) == 3


def test_streamed_pieces_add_up_to_the_whole_text_and_hold_back_a_stop_strings_start():
    words = ids("the cat sleeps in the park")
    out = Out()
    s = sequence("", True, stop=("park .",))
    events = out.feed(s, [[w] for w in words], "length")
    assert "".join(e.text for e in events) == TOK.decode(words)
    sent = ""
    for e in events[:-1]:
        sent += e.text
        assert not sent.endswith("par") and "park" not in sent  # the stop's start waits
    whole = Out().feed(sequence("", False), [[w] for w in words], "length")
    assert len(whole) == 1 and whole[0].text == TOK.decode(words)  # a whole completion: one event, at its end


def test_logprobs_name_each_token_as_the_text_it_adds_with_offsets_into_the_echoed_text():
    words = ids("the cat sleeps")
    out = Out()
    prompt = ids("a dog")
    s = sequence("", False, logprobs=2, echo="a dog", echo_ids=prompt)

    def scored(chunk):
        lp = np.array([-0.5] * len(chunk))
        return lp, np.array([[t, t + 1, t + 2] for t in chunk]), np.array([[-0.5, -1.0, -2.0]] * len(chunk))

    s.out.prompt_scored = (np.array([-3.0]), np.array([[prompt[1], 9, 10]]), np.array([[-3.0, -4.0, -5.0]]))
    (event,) = out.feed(s, [words], "length", scored)
    assert event.text == "a dog" + "the cat sleeps"
    lps = event.logprobs
    assert [e.token for e in lps] == ["a", " dog", "the", " cat", " sleeps"]
    assert [e.logprob for e in lps] == [None, -3.0, -0.5, -0.5, -0.5]
    assert lps[0].top is None and len(lps[1].top) == 2 and lps[2].top == [("the", -0.5), ("a", -1.0)]
    assert lps[3].top[0] == (" cat", -0.5) and lps[4].top[0] == (" sleeps", -0.5)  # each after the text before it
    assert [e.offset for e in lps] == [0, 1, 5, 8, 12]
    for e in lps[2:]:  # each completion token's text starts at its offset in the echoed text
        assert event.text[e.offset:].startswith(e.token)
    assert event.cumulative_logprob == pytest.approx(-1.5)


def byte_level():
    """A byte-level BPE (as GPT-J's) learnt from a few words: any other character is its UTF-8 bytes, a token each."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    bpe.train_from_iterator(["the cat sleeps"], trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def test_a_character_split_over_tokens_is_sent_whole():
    """A byte-level tokenizer splits "é" over two tokens: the first alone decodes to U+FFFD, which is never sent."""
    tok = byte_level()
    words = tok("le café noir", add_special_tokens=False)["input_ids"]
    assert "\ufffd" in tok.decode(words[:7])  # "le caf" and half of "é"
    p = OutputProcessor(tok, Metrics(1), lambda seqs: None)
    seq = Sequence(words[:1], 100, out=Output(0, None, stream=True))
    texts = [e.text for t in words for _, e in p.handle(Update(seq, [t]))]
    texts += [e.text for _, e in p.handle(Update(seq, [], reason="length"))]
    assert "".join(texts) == "le café noir" and not any("\ufffd" in t for t in texts)


@pytest.mark.parametrize("cut", [False, True])
@pytest.mark.parametrize("stream", [True, False])
def test_the_log_probabilities_tokens_of_a_character_split_over_tokens_add_up_to_the_text(stream, cut):
    """Byte-level tokens of "é" (2 bytes) and an emoji (4): each byte before the last adds no text, the last the whole
    character, so the tokens' texts add up to the completion's (and the prompt's, echoed) and every offset points at
    its token's text. (They once showed the window decoded before them, "e café", and the offsets ran past the
    text.)"""
    tok = byte_level()
    text = "le café noir 😀 ok"
    words = tok(text, add_special_tokens=False)["input_ids"]
    assert len(words) > len(text)  # (characters split over tokens)
    p = OutputProcessor(tok, Metrics(1), lambda seqs: None)
    prompt = tok("à ça", add_special_tokens=False)["input_ids"]
    if cut:  # the prompt (token ids) and the completion (its length) end inside a character: its U+FFFD at the end
        prompt = tok("à ç", add_special_tokens=False)["input_ids"][:-1]
        words = tok("le caf😀", add_special_tokens=False)["input_ids"][:-2]
        text = tok.decode(words)
        assert text.endswith("\ufffd") and tok.decode(prompt).endswith("\ufffd")
    echo = tok.decode(prompt)
    seq = Sequence(prompt, 100, out=Output(0, None, stream=stream, logprobs=1, echo=echo, echo_ids=prompt))
    seq.out.prompt_scored = (np.full(len(prompt) - 1, -1.0), np.array([[t] for t in prompt[1:]]),
                             np.full((len(prompt) - 1, 1), -1.0))

    def scored(chunk):
        return np.full(len(chunk), -0.5), np.array([[t] for t in chunk]), np.full((len(chunk), 1), -0.5)

    chunks = [words[i:i + 3] for i in range(0, len(words), 3)] if stream else [words]
    events = [e for i, c in enumerate(chunks) for _, e in p.handle(
        Update(seq, c, scored(c), reason="length" if i == len(chunks) - 1 else None))]
    whole = "".join(e.text for e in events)
    lps = [x for e in events for x in e.logprobs]
    assert whole == echo + text and "".join(x.token for x in lps) == whole
    assert len(lps) == len(prompt) + len(words)
    for x in lps:
        assert whole[x.offset:x.offset + len(x.token)] == x.token and ("\ufffd" not in x.token or cut)
        if x.top:  # the most likely candidate is the token itself (the scores above): the same text
            assert x.top[0][0] == x.token
    assert [x.offset for x in lps] == list(np.cumsum([0] + [len(x.token) for x in lps[:-1]]))


def test_a_stream_holds_back_exactly_what_could_still_begin_a_stop_string():
    """len(stop) - 1 characters wait (the longest stop's), no more: a stop string of 6 characters never seen."""
    words = ids("the cat sleeps in the park")
    p = OutputProcessor(TOK, Metrics(1), lambda seqs: None)
    s = sequence("", True, stop=("park .", "xy"))
    sent = ""
    for k, w in enumerate(words):
        sent += "".join(e.text for _, e in p.handle(Update(s, [w])))
        text = TOK.decode(words[:k + 1])
        assert sent == text[:max(len(text) - 5, 0)], (sent, text)


def test_the_tokens_kept_end_with_the_one_whose_text_completes_the_stop_string():
    words = ids("the cat sleeps in the park")
    for stop, kept, text in (("cat", 2, "the "), ("at sl", 3, "the c"), ("the", 1, "")):
        (event,) = Out().feed(sequence("", False, stop=(stop,)), [words], "length")
        assert (event.text, event.completion_tokens, event.finish_reason) == (text, kept, "stop"), stop


def test_the_first_stop_string_in_the_text_ends_it_and_at_one_place_the_shortest():
    words = ids("the cat sleeps in the park")
    for stops, text, kept in ((("park", "cat"), "the ", 2), (("cat", "park"), "the ", 2),
                              (("cat sleeps", "cat"), "the ", 2), (("sleeps in", "in the"), "the cat ", 4)):
        (event,) = Out().feed(sequence("", False, stop=stops), [words], "length")
        assert (event.text, event.completion_tokens) == (text, kept), stops


@pytest.mark.parametrize("text", ["le café noir", "a 😀😀😀🎉é b", "ab\ufffd", "ab" + "\ufffd" * 8 + "c", "é" * 9])
def test_the_pieces_of_any_text_add_up_to_it_a_character_split_over_tokens_given_by_the_token_that_ends_it(text):
    """``pieces`` on a byte-level tokenizer: characters of 2 and 4 bytes side by side (a window of fixed width once
    began inside one and gave its bytes' U+FFFD), a real U+FFFD, a run of them longer than any window: the pieces add
    up to the text, each byte before a character's last adds nothing; given a token at a time or all at once."""
    tok = byte_level()
    p = OutputProcessor(tok, Metrics(1), lambda seqs: None)
    ids_ = tok(text, add_special_tokens=False)["input_ids"]
    whole, _, _ = p.pieces(ids_, 0, (0, 0), True)
    assert "".join(whole) == text == tok.decode(ids_)
    state, one_by_one = (0, 0), []
    for n in range(1, len(ids_) + 1):
        got, _, state = p.pieces(ids_[:n], n - 1, state, n == len(ids_))
        one_by_one += got
    assert one_by_one == whole
    starts = np.cumsum([0] + [len(x) for x in whole[:-1]])
    for piece, at in zip(whole, starts):  # every character given whole, by one token
        assert text[at:at + len(piece)] == piece


def test_an_unfinished_character_at_the_end_is_given_by_the_last_token_and_candidates_show_their_own_text():
    tok = byte_level()
    p = OutputProcessor(tok, Metrics(1), lambda seqs: None)
    ids_ = tok("le café", add_special_tokens=False)["input_ids"]
    cut = ids_[:-1]  # "le caf" and the first byte of "é" (a completion stopped by its length there)
    pieces, _, _ = p.pieces(cut, 0, (0, 0), False)
    assert "".join(pieces) == "le caf" and pieces[-1] == ""  # not final: it may still become a character
    pieces, _, _ = p.pieces(cut, 0, (0, 0), True)
    assert "".join(pieces) == tok.decode(cut) == "le caf\ufffd"  # final: what is left, U+FFFD included
    other = tok("è", add_special_tokens=False)["input_ids"]  # (its last byte differs from "é"'s)
    pieces, tops, _ = p.pieces(ids_, len(ids_) - 1, (0, len(ids_) - 2), True, [[ids_[-1], other[-1]]])
    assert pieces == ["é"] and tops == [[(0, "é"), (1, "è")]]
    special, _, _ = p.pieces(ids_[:2] + [tok.eos_token_id] + ids_[2:], 0, (0, 0), True)
    assert special[2] == "<eos>" and "".join(special[:2] + special[3:]) == "le café"


@pytest.mark.parametrize("echo", [False, True])
def test_the_legacy_top_logprobs_are_the_k_most_likely_distinct_texts_chat_s_the_k_most_likely_tokens(echo):
    """Byte-level candidates that begin other characters all add no text yet (""): the legacy API, whose
    top_logprobs is keyed by text, shows the k most likely distinct texts, each its most likely token's
    log-probability, reading the candidates past the k-th (it showed fewer than k: they fell onto one key); the chat
    API's list shows the k most likely tokens, texts repeated as they are."""
    tok = byte_level()
    p = OutputProcessor(tok, Metrics(1), lambda seqs: None)
    words = tok("le café", add_special_tokens=False)["input_ids"]
    lead = len(words) - 2  # the first byte of "é": it adds no text yet
    starts = [tok(c, add_special_tokens=False)["input_ids"][0] for c in "жש"]  # first bytes of other characters
    letters = tok("x y", add_special_tokens=False)["input_ids"][::2]
    assert len(words) == 8 and len(starts) == 2 and len(letters) == 2
    row_lps = np.array([-0.1, -0.2, -0.3, -0.4, -0.5])

    def candidates(t):  # the token itself, two first bytes, two letters, in that order of likelihood
        return [t, *starts, *letters]

    def scored(chunk):
        return np.full(len(chunk), -0.1), np.array([candidates(t) for t in chunk]), np.tile(row_lps, (len(chunk), 1))

    shown = {}
    for distinct in (True, False):
        prompt = words if echo else tok("a", add_special_tokens=False)["input_ids"]
        out = Output(0, None, logprobs=3, echo=tok.decode(prompt) if echo else None, echo_ids=prompt if echo else None,
                     distinct=distinct)
        seq = Sequence(prompt, 100, out=out)
        if echo:
            out.prompt_scored = (np.full(len(prompt) - 1, -0.1), np.array([candidates(t) for t in prompt[1:]]),
                                 np.tile(row_lps, (len(prompt) - 1, 1)))
        (ev,) = [e for _, e in p.handle(Update(seq, words, scored(words), reason="length"))]
        entries = ev.logprobs[len(prompt):] if echo else ev.logprobs
        shown[distinct] = entries[lead].top
        for e in ev.logprobs[1 if echo else 0:]:
            assert len(e.top) == 3
            if distinct:
                assert len({t for t, _ in e.top}) == 3 and len(api.completion_logprobs([e])["top_logprobs"][0]) >= 3
    assert shown[True] == [("", -0.1), ("x", -0.4), ("y", -0.5)]  # "" once (its most likely), then the letters
    assert shown[False] == [("", -0.1), ("", -0.2), ("", -0.3)]
    assert api.chat_logprobs(entries[lead:lead + 1])["content"][0]["top_logprobs"][1]["logprob"] == -0.2


def test_a_token_s_text_where_the_tokenizer_rewrites_the_text_before_it_is_what_follows_the_shared_start():
    from serving.output import _after

    assert _after("the", "the cat") == " cat" and _after("the cat ", "the cat.") == "."  # (a clean-up of " .")


def test_a_stop_string_s_tokens_past_it_count_in_no_log_probability():
    """The tokens after the one that completed a stop string are dropped with their scores: the cumulative
    log-probability (best_of's ranking) is the kept tokens'."""
    words = ids("the cat sleeps in the park")

    def scored(chunk):
        return -0.5 * np.arange(1, len(chunk) + 1), np.array([[t] for t in chunk]), np.zeros((len(chunk), 1))

    (event,) = Out().feed(sequence("", False, stop=("cat",), logprobs=0), [words], "length", scored)
    assert event.completion_tokens == 2 and [e.token for e in event.logprobs] == ["the", " cat"]
    assert event.cumulative_logprob == -0.5 - 1.0


def test_special_tokens_show_their_names_but_add_no_text_to_the_offsets():
    prompt = ids("a") + [EOS] + ids("dog")  # a token-id prompt may hold any id
    completion = ids("the") + [TOK.pad_token_id] + ids("cat")  # (a model may write a special token)
    s = sequence("", False, logprobs=1, echo=TOK.decode(prompt, skip_special_tokens=True), echo_ids=prompt)
    s.out.prompt_scored = (np.array([-1.0, -2.0]), np.array([[EOS], [prompt[2]]]), np.array([[-1.0], [-2.0]]))

    def scored(chunk):
        return np.full(len(chunk), -0.5), np.array([[t] for t in chunk]), np.full((len(chunk), 1), -0.5)

    (event,) = Out().feed(s, [completion], "length", scored)
    assert event.text == "a dog" + "the cat"
    assert [(e.token, e.offset) for e in event.logprobs] == [
        ("a", 0), ("</s>", 1), (" dog", 1), ("the", 5), ("<pad>", 8), (" cat", 8)]


def test_the_cumulative_log_probability_counts_each_streamed_token_once():
    words = ids("the cat sleeps in")

    def scored(chunk):
        return -0.25 * np.arange(1, len(chunk) + 1), np.array([[t] for t in chunk]), np.zeros((len(chunk), 1))

    events = Out().feed(sequence("", True, logprobs=0), [words[:2], words[2:]], "length", scored)
    assert [e.cumulative_logprob for e in events] == [-0.75, -0.75 - 0.75]


def test_the_inter_token_latency_is_the_time_between_a_sequence_s_calls(monkeypatch):
    import types

    import serving.output as output

    clock = iter([1.0, 2.0, 4.0, 4.5])  # one reading per update (a later one: the last again)
    monkeypatch.setattr(output, "time", types.SimpleNamespace(perf_counter=lambda: next(clock, 4.5)))
    out = Out()
    s = sequence("", True)
    s.arrival = 0.5
    words = ids("the cat sleeps in")
    out.feed(s, [[w] for w in words], "length")
    itl = out.p.metrics.itl
    assert itl._sum.get() == pytest.approx(1.0 + 2.0 + 0.5)  # 2 - 1, 4 - 2, 4.5 - 4: not since the first
    assert out.p.metrics.ttft._sum.get() == pytest.approx(0.5)


def test_a_cancelled_sequence_gets_no_event_an_aborted_one_its_error():
    out = Out()
    gone, aborted = sequence("", True), sequence("", True)
    error = ShuttingDown("bye")
    assert out.p.handle(Update(gone, reason="cancelled")) == []
    assert [e.error for _, e in out.p.handle(Update(aborted, reason="aborted", error=error))] == [error]


def test_a_sequence_whose_text_fails_is_answered_with_the_error_and_its_slot_freed():
    out = Out()
    s = sequence("", True)
    got = []
    out.p.deliver = got.extend
    out.p.handle = lambda u: 1 / 0
    out.p.put([Update(s, ids("the"))])
    out.p.updates.put(None)
    out.p._loop()
    assert [type(e.error) for _, e in got] == [ZeroDivisionError] and out.finished == [s]
    assert out.p.metrics.requests.labels("error")._value.get() == 1


def test_an_update_with_nothing_new_for_the_client_sends_no_event():
    """A streamed sequence's prompt scored (no token yet, no echo): nothing to send, so no empty chunk."""
    out = Out()
    s = sequence("", True)
    assert out.p.handle(Update(s, prompt_scored=(np.zeros(1), np.zeros((1, 1), int), np.zeros((1, 1))))) == []
    assert [e.token_ids for _, e in out.p.handle(Update(s, ids("the")))] == [ids("the")]


# --------------------------------------------------------------------------- vLLM's text options, and a prompt's context


@pytest.mark.parametrize("stream", [True, False])
def test_a_completion_read_after_its_prompt_keeps_its_first_words_space(stream):
    """Issue 69's "in theriver": a causal model's completion continues its prompt, so its text is read after the
    prompt's last tokens (``context``): the first word keeps its space, echo joins the words, and each token's
    text in the log-probabilities (and the stream's pieces) is the text it adds."""
    prompt, words = ids("a dog runs in the"), ids("river .")
    out = Out()
    s = Sequence(prompt, 100, out=Output(0, None, (), stream, 0, "a dog runs in the", None, context=prompt[-6:]))

    def scored(chunk):
        return np.zeros(len(chunk)), np.array([[t] for t in chunk]), np.zeros((len(chunk), 1))

    events = out.feed(s, [[w] for w in words], "length", scored)
    assert "".join(e.text for e in events) == "a dog runs in the river ."
    assert [lp.token for e in events for lp in e.logprobs] == [" river", " ."]
    alone = Out().feed(sequence("", stream), [words], "length")  # no context (T5's answer): its own text
    assert "".join(e.text for e in alone) == "river ."


@pytest.mark.parametrize("kind", ["synthetic", "metaspace", "bytelevel", "sentencepiece"])
def test_each_tokens_text_after_a_prompt_is_its_piece_for_every_tokenizer_kind(kind):
    """The server shows each token as data/tokenizer.py's ``token_pieces`` says (what a grammar matches it
    against): the log-probabilities' tokens of a completion read after its prompt are its tokens' pieces."""
    from data.tokenizer import token_pieces
    from tests.tokenizer_kinds import make

    tok = make(kind)
    pieces, _ = token_pieces(tok)
    prompt = tok("the cat sleeps in", add_special_tokens=False)["input_ids"]
    words = tok(" the park . a dog", add_special_tokens=False)["input_ids"]
    p = OutputProcessor(tok, Metrics(1), lambda seqs: None)
    seq = Sequence(prompt, 100, out=Output(0, None, logprobs=0, context=prompt[-6:]))
    (_, event), = p.handle(Update(seq, words, (np.zeros(len(words)), np.array([[t] for t in words]),
                                               np.zeros((len(words), 1))), reason="length"))
    assert [lp.token for lp in event.logprobs] == [pieces[t].decode("utf-8") for t in words]
    assert event.text == b"".join(pieces[t] for t in words).decode("utf-8")


def test_special_tokens_are_left_out_of_the_text_unless_asked():
    words = ids("the cat") + [EOS]
    assert Out().feed(sequence("", False), [words], "stop")[0].text == "the cat"
    s = Sequence(ids("x"), 100, out=Output(0, None, skip_special=False))
    assert Out().feed(s, [words], "stop")[0].text == "the cat </s>"


@pytest.mark.parametrize("stream", [True, False])
def test_include_stop_str_in_output_keeps_the_stop_string_that_ended_it(stream):
    words = ids("the cat sleeps in the park")
    s = Sequence(ids("x"), 100, out=Output(0, None, ("sleeps",), stream, include_stop=True))
    events = Out().feed(s, [[w] for w in words], "length")
    assert "".join(e.text for e in events) == "the cat sleeps" and events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == 3


@pytest.mark.parametrize("min_tokens, text", [(3, "the cat"), (4, "the cat sleeps in the park")])
def test_a_stop_string_ends_a_completion_only_where_it_ends_at_its_min_tokens_th_token_or_later(min_tokens, text):
    """vLLM's min_tokens: a stop string is looked for from the min_tokens-th token on ("sleeps", the third token,
    completes "sleeps": it counts with min_tokens 3, not with 4, and nothing later completes it)."""
    words = ids("the cat sleeps in the park")
    s = Sequence(ids("x"), 100, out=Output(0, None, (" sleeps",), False, min_tokens=min_tokens))
    (event,) = Out().feed(s, [[w] for w in words], "length")
    assert event.text == text
    assert event.finish_reason == ("stop" if min_tokens == 3 else "length")
