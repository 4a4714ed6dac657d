"""The logits processors (modelling/processors.py) against Hugging Face's.

Each processor on hand-made scores against HF's class of the same name, row by row, over random histories
(hypothesis): the repetition penalty (its sign rule, once per token, the prompt's padding skipped), no repeated
n-grams, the sequence bias (one token and several), bad words, min-p, the label trie against
``prefix_allowed_tokens_fn``; OpenAI's presence and frequency penalties against their definition; the host's bitmask
bit for bit.

Then whole searches against ``generate`` with the same processor, token for token, on the tiny random models of both
families (tests/hf_utils.py's ``search_models``, as tests/modelling/test_decoding.py's): greedy with each of repetition_penalty, no_repeat_ngram_size,
bad_words_ids and sequence_bias, the bias and the penalty together (HF's order: the bias first), a label trie with
greedy and with beam search; and the vocabulary's cut (the embedding's rows past the tokenizer's vocabulary never
chosen, in greedy, beam search and sampling: HF with those ids suppressed)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (MinPLogitsWarper, NoBadWordsLogitsProcessor,
                                                    NoRepeatNGramLogitsProcessor, PrefixConstrainedLogitsProcessor,
                                                    RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor)

from modelling import processors as P
from modelling.decoding import Options
from tests.hf_utils import N, hf_tokens, ours, search_models


V = 24


@pytest.fixture(scope="module", params=["t5", "gptj"])
def fixture(request):
    return search_models(request.param)


def _scores(seed: int, b: int = 3) -> np.ndarray:
    return (np.random.default_rng(seed).normal(size=(b, V)) * 3).astype(np.float32)


def _same(ours_, theirs) -> None:
    theirs = np.asarray(theirs)
    np.testing.assert_array_equal(np.isinf(ours_), np.isinf(theirs))
    np.testing.assert_allclose(np.where(np.isinf(theirs), 0, ours_), np.where(np.isinf(theirs), 0, theirs),
                               rtol=1e-6)


histories = st.lists(st.integers(0, V - 1), min_size=1, max_size=12)


@settings(max_examples=40, deadline=None)
@given(histories, st.floats(0.2, 3.0).filter(lambda x: abs(x - 1) > 0.05), st.integers(0, 4), st.integers(0, 99))
def test_repetition_penalty_is_hfs_once_a_token_and_skips_the_prompts_padding(hist, penalty, pads, seed):
    """HF's processor reads the row's tokens (a causal LM's left padding skipped by ``prompt_ignore_length``); ours
    reads the places ``read`` marks. Penalties below and above 1, scores of both signs, tokens read more than once."""
    scores = _scores(seed, 1)
    ids = np.array([[0] * pads + hist])
    theirs = RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=torch.tensor([pads]))(
        torch.tensor(ids), torch.tensor(scores)).numpy()
    read = np.arange(ids.shape[1])[None] >= pads
    got = P.repetition_penalty(jnp.asarray(scores), jnp.asarray(ids, jnp.int32), jnp.asarray(read),
                               jnp.asarray([penalty], jnp.float32))
    _same(np.asarray(got), theirs)
    assert (np.asarray(got) != scores).sum() == len(set(hist))  # each token read changed once, no other


@settings(max_examples=40, deadline=None)
@given(histories, st.integers(1, 4), st.integers(0, 99))
def test_no_repeat_ngram_is_hfs(hist, n, seed):
    scores = _scores(seed, 1)
    theirs = NoRepeatNGramLogitsProcessor(n)(torch.tensor([hist]), torch.tensor(scores)).numpy()
    padded = jnp.asarray([hist + [P.NO_TOKEN] * 5], jnp.int32)  # (places past the length: not read)
    got = P.no_repeat_ngram(jnp.asarray(scores), padded, jnp.asarray([len(hist)], jnp.int32), n)
    _same(np.asarray(got), theirs)


sequences = st.lists(st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=3).map(tuple),
                               st.floats(-5, 5).filter(lambda x: x != 0)), min_size=1, max_size=5, unique_by=lambda x: x[0])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=8), sequences, st.integers(0, 99))
def test_sequence_bias_and_bad_words_are_hfs(hist, table, seed):
    """A small alphabet (0-5), so that the sequences' prefixes match the history often."""
    scores = _scores(seed, 1)
    ids = torch.tensor([hist])
    theirs = SequenceBiasLogitsProcessor(dict(table))(ids, torch.tensor(scores)).numpy()
    length = jnp.asarray([len(hist)], jnp.int32)
    history = jnp.asarray([hist + [P.NO_TOKEN] * 3], jnp.int32)
    _same(np.asarray(P.sequence_bias(jnp.asarray(scores), history, length, tuple(table))), theirs)
    bad = [list(s) for s, _ in table]
    theirs = NoBadWordsLogitsProcessor(bad, eos_token_id=V - 1)(ids, torch.tensor(scores)).numpy()
    got = P.sequence_bias(jnp.asarray(scores), history, length, tuple((s, -np.inf) for s, _ in table))
    _same(np.asarray(got), theirs)


def test_presence_and_frequency_penalties_are_openais_definition():
    """OpenAI: mu[j] -= c[j] * frequency + (c[j] > 0) * presence, c[j] the times token j was sampled so far (the
    places ``read`` marks: the output's)."""
    scores = _scores(0, 2)
    hist = np.array([[3, 3, 3, 7, 9], [1, 2, 2, -1, -1]])
    read = np.array([[False, True, True, True, True], [True, True, True, False, False]])  # row 0's first: a prompt
    got = np.asarray(P.presence_frequency(jnp.asarray(scores), jnp.asarray(hist, jnp.int32), jnp.asarray(read),
                                          jnp.asarray([0.5, -1.0], jnp.float32), jnp.asarray([0.25, 2.0], jnp.float32)))
    want = scores.copy()
    for r, (p, f) in enumerate([(0.5, 0.25), (-1.0, 2.0)]):
        c = np.bincount(hist[r][read[r]], minlength=V)
        want[r] -= c * f + (c > 0) * p
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0, 3] == pytest.approx(scores[0, 3] - 0.5 - 2 * 0.25)  # the prompt's 3 not counted


@pytest.mark.parametrize("p", [0.0, 0.05, 0.3, 1.0])
def test_min_p_is_hfs(p):
    scores = _scores(3, 4)
    if p == 0:  # (HF refuses 0: off; ours leaves the scores as they are)
        np.testing.assert_array_equal(np.asarray(P.min_p(jnp.asarray(scores), jnp.zeros(4))), scores)
        return
    theirs = MinPLogitsWarper(p)(None, torch.tensor(scores)).numpy()
    _same(np.asarray(P.min_p(jnp.asarray(scores), jnp.full(4, p, jnp.float32))), theirs)


def test_a_sparse_bias_adds_each_rows_values_at_its_ids_and_drops_ids_out_of_range():
    scores = _scores(4, 2)
    ids = jnp.asarray([[2, 5, V, -1], [5, 5, 0, V + 3]], jnp.int32)
    values = jnp.asarray([[1.0, -2.0, 9.0, 9.0], [0.5, 0.25, -100.0, 9.0]], jnp.float32)
    want = scores.copy()
    want[0, 2] += 1.0
    want[0, 5] -= 2.0
    want[1, 5] += 0.75
    want[1, 0] -= 100.0
    np.testing.assert_allclose(np.asarray(P.add_bias(jnp.asarray(scores), ids, values)), want, rtol=1e-6)


def test_the_host_bitmask_allows_exactly_its_bits():
    """xgrammar's layout: bit j of word w allows token 32 w + j (the sign bit included)."""
    vocab = 70
    scores = jnp.zeros((2, vocab))
    allowed = [[0, 31, 32, 69], [5]]
    bits = np.zeros((2, P.bitmask_words(vocab)), np.uint32)
    for r, ids in enumerate(allowed):
        for t in ids:
            bits[r, t // 32] |= np.uint32(1) << np.uint32(t % 32)
    got = np.asarray(P.allowed_bits(scores, jnp.asarray(bits.view(np.int32))))
    for r, ids in enumerate(allowed):
        assert sorted(np.nonzero(np.isfinite(got[r]))[0].tolist()) == ids


LABELS = [[5, 6, 1], [5, 7, 1], [9, 1], [5, 6, 8, 1]]  # shared prefixes, one label a prefix of another


def test_the_label_trie_allows_what_prefix_allowed_tokens_fn_allows():
    trie = P.LabelTrie.of(LABELS, 1)
    fn = lambda batch_id, sent: trie.allowed(sent.tolist())  # noqa: E731
    sents = [[], [5], [5, 6], [9], [5, 6, 8], [5, 7]]
    n = 4
    new = jnp.asarray([s + [0] * (n - len(s)) for s in sents], jnp.int32)
    count = jnp.asarray([len(s) for s in sents], jnp.int32)
    scores = _scores(5, len(sents))
    got = np.asarray(trie.mask(jnp.asarray(scores), trie.state(new, count)))
    for r, s in enumerate(sents):  # HF's fn is asked with each row's own tokens
        theirs = PrefixConstrainedLogitsProcessor(lambda b, sent: fn(b, sent), 1)(
            torch.tensor([s]) if s else torch.zeros((1, 0), dtype=torch.long), torch.tensor(scores[r:r + 1]))
        _same(got[r:r + 1], theirs.numpy())
    assert sorted(np.nonzero(np.isfinite(got[2]))[0].tolist()) == [1, 8]
    off = np.asarray(trie.mask(jnp.asarray(scores[:1]), trie.state(jnp.asarray([[5, 9, 0, 0]]), jnp.asarray([2]))))
    assert np.nonzero(np.isfinite(off[0]))[0].tolist() == [1]  # off the trie: its end-of-text alone


# --------------------------------------------------------------------------- whole searches against generate


def _tokens_of(ref: np.ndarray, n: int = 2) -> list:
    """A few tokens the free search writes early (so that a processor on them changes its output)."""
    return list(dict.fromkeys(ref[:, 1:1 + n].ravel().tolist()))


@pytest.mark.slow
@pytest.mark.parametrize("processor", ["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
                                       "sequence_bias", "bias_then_penalty"])
def test_greedy_with_each_processor_gives_hf_generates_tokens(fixture, processor):
    name, hf, m, params, ids, mask = fixture
    free = hf_tokens(name, hf, ids, mask, do_sample=False)
    a, b = _tokens_of(free)[:2]
    kw, procs = {
        "repetition_penalty": (dict(repetition_penalty=1.6), P.Processors(repetition_penalty=1.6)),
        "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), P.Processors(no_repeat_ngram_size=2)),
        "bad_words_ids": (dict(bad_words_ids=[[a], [b, a]]), P.Processors(sequence_bias=(((a,), -np.inf),
                                                                                        ((b, a), -np.inf)))),
        "sequence_bias": (dict(sequence_bias={(a,): -4.0, (b, a): 3.0}), P.Processors(sequence_bias=(((a,), -4.0),
                                                                                                    ((b, a), 3.0)))),
        # a bias that flips a score's sign, then the penalty: HF's order (the other order gives other tokens)
        "bias_then_penalty": (dict(sequence_bias={(a,): 6.0, (b,): -6.0}, repetition_penalty=3.0),
                              P.Processors(sequence_bias=(((a,), 6.0), ((b,), -6.0)), repetition_penalty=3.0)),
    }[processor]
    ref = hf_tokens(name, hf, ids, mask, do_sample=False, **kw)
    assert not np.array_equal(ref, free)  # the processor changes the output: a real check
    np.testing.assert_array_equal(ours(m, params, ids, mask, Options(N, processors=procs)), ref)


@pytest.mark.slow
@pytest.mark.parametrize("beams", [1, 3])
def test_a_label_trie_gives_prefix_allowed_tokens_fns_tokens_greedy_and_beam_search(fixture, beams):
    name, hf, m, params, ids, mask = fixture
    eos = 1
    free = hf_tokens(name, hf, ids, mask, do_sample=False)
    a, b, c = (_tokens_of(free, 3) + [40, 41, 42])[:3]
    labels = [[a, b, eos], [a, c, eos], [c, eos], [b, a, c, eos]]
    trie = P.LabelTrie.of(labels, eos)
    start = ids.shape[1] if name == "gptj" else 1  # HF's sentence: the prompt (GPT-J) or the start token (T5) first
    ref = hf_tokens(name, hf, ids, mask, do_sample=False, num_beams=beams, eos=eos,
                    prefix_allowed_tokens_fn=lambda batch_id, sent: trie.allowed(sent[start:].tolist()))
    got = ours(m, params, ids, mask, Options(N, num_beams=beams, processors=P.Processors(trie=trie)), eos=eos)
    np.testing.assert_array_equal(got, ref)
    for row in got:  # every output a label
        assert row.tolist()[:row.tolist().index(eos) + 1] in labels


@pytest.mark.slow
def test_ids_past_the_tokenizers_vocabulary_are_never_chosen_in_any_search(fixture):
    """HF with those ids suppressed (``suppress_tokens``) gives the same tokens, greedy and beam search; sampling at
    temperature 2 never draws one."""
    name, hf, m, params, ids, mask = fixture
    free = hf_tokens(name, hf, ids, mask, do_sample=False)
    vocab = int(np.sort(np.unique(free))[len(np.unique(free)) // 2])  # half the free tokens are past it
    assert (free >= vocab).any()
    cut = list(range(vocab, m.embedding.vocab_size))
    for beams in (1, 2):
        ref = hf_tokens(name, hf, ids, mask, do_sample=False, num_beams=beams, suppress_tokens=cut)
        np.testing.assert_array_equal(ours(m, params, ids, mask, Options(N, num_beams=beams, vocab=vocab)), ref)
    drawn = ours(m, params, ids, mask, Options(N, do_sample=True, temperature=2.0, top_k=0, vocab=vocab), seed=1)
    assert drawn.max() < vocab and len(np.unique(drawn)) > 5


@pytest.mark.slow
def test_a_causal_models_repetition_penalty_reads_its_prompt():
    """HF's repetition penalty reads a causal LM's whole input_ids: a prompt holding the token greedy writes first
    (put in its left padding's last place) keeps it from being written first; ours the same, token for token. (GPT-J
    alone: T5's decoder reads its start token alone, which the other cases hold.)"""
    name, hf, m, params, ids, mask = search_models("gptj")
    free = hf_tokens(name, hf, ids, mask, do_sample=False)
    row = int(np.argmax((mask == 0).sum(1)))  # the row with the most padding
    ids, mask = ids[row:row + 1].copy(), mask[row:row + 1].copy()
    pad = int((mask[0] == 0).sum())
    ids[0, pad - 1], mask[0, pad - 1] = free[row, 0], 1  # the prompt now holds its first token
    again = hf_tokens(name, hf, ids, mask, do_sample=False)
    ref = hf_tokens(name, hf, ids, mask, do_sample=False, repetition_penalty=50.0)
    assert again[0, 0] == free[row, 0] and ref[0, 0] != free[row, 0]  # (the prompt's copy alone keeps it away)
    np.testing.assert_array_equal(ours(m, params, ids, mask, Options(N, processors=P.Processors(
        repetition_penalty=50.0))), ref)



def test_the_slots_processors_give_the_batch_processors_scores_in_hfs_order():
    """modelling/processors.py's ``process_rows`` (each slot row its own bias, penalties and mask) on hand-made
    scores: a row's scores are the batch ``Processors``' (held to HF's) with that row's settings: a bias of +6 on a
    token the row has read, whose score is -2, then the penalty of 3 ((-2 + 6) / 3, not -2 x 3 + 6); a row that asks
    nothing, and a row that no longer writes (its settings ignored), unchanged."""
    from modelling.processors import TABLE, UNTIL_ALWAYS, RowControls

    scores = _scores(7, 3)
    scores[:, 5] = -2.0
    history = np.full((3, 8), P.NO_TOKEN, np.int32)
    history[:, :3] = [[5, 9, 2], [5, 9, 2], [5, 9, 2]]
    table = np.full((3, TABLE, 3), -1, np.int32)
    table[:, 0] = [5, np.asarray(6.0, np.float32).view(np.int32), UNTIL_ALWAYS]
    table[:, 1] = [11, np.asarray(-1.5, np.float32).view(np.int32), UNTIL_ALWAYS]
    c = RowControls(jnp.zeros(3), jnp.zeros(3), jnp.asarray([3.0, 1.0, 3.0]), jnp.zeros(3), jnp.zeros(3, bool),
                    jnp.zeros(3, jnp.int32), jnp.asarray(table).at[1].set(-1), jnp.asarray(history))
    live = jnp.asarray([True, True, False])
    got = np.asarray(P.process_rows(jnp.asarray(scores), c, live, jnp.full(3, 3, jnp.int32), jnp.full(3, 2),
                                    prompt_part=2, eos_id=1))
    want = P.Processors(sequence_bias=(((5,), 6.0), ((11,), -1.5)), repetition_penalty=3.0)(
        jnp.asarray(scores[:1]), jnp.asarray(history[:1]), jnp.asarray(history[:1] >= 0), jnp.asarray([3]),
        jnp.asarray(history[:1, 2:]), jnp.asarray([1]))
    np.testing.assert_allclose(got[0], np.asarray(want)[0], rtol=1e-6)
    assert got[0, 5] == pytest.approx(4.0 / 3.0)
    np.testing.assert_array_equal(got[1:], scores[1:])
