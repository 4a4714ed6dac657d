"""The tasks' scores are the maintained libraries' (rouge-score with its stemmer, sacrebleu) on the texts as decoded,
and exact match is exact: each check below fails on the bug it names."""

import pytest
from rouge_score import rouge_scorer

from data.metrics import clean, exact_match, primary, rouge


def test_rouge_is_rouge_score_with_its_stemmer():
    """Words a stemmer folds ("running dogs" / "run dog") count as matches, as HF's run_summarization scores them:
    a scorer without the stemmer scores these pairs lower."""
    refs, outs = ["the running dogs barked", "cats were sleeping"], ["the dog runs barking", "a cat sleeps"]
    ours = rouge(refs, outs)
    for kind in ("rouge1", "rouge2", "rougeL"):
        stemmed = rouge_scorer.RougeScorer([kind], use_stemmer=True)
        plain = rouge_scorer.RougeScorer([kind], use_stemmer=False)
        want = sum(stemmed.score(r, o)[kind].fmeasure for r, o in zip(refs, outs)) / 2
        assert ours[kind] == pytest.approx(want)
        if kind != "rouge2":
            assert want > sum(plain.score(r, o)[kind].fmeasure for r, o in zip(refs, outs)) / 2


def test_exact_match_keeps_case_and_words_and_normalises_only_whitespace():
    assert exact_match(["Dog sleeps"], ["dog sleeps"]) == 0.0  # case is part of the answer
    assert exact_match(["dog sleeps"], ["dog  sleeps </s>"]) == 1.0  # spaces and a left special token are not
    assert exact_match(["dog sleeps", "cat"], ["dog sleeps", "cats"]) == 0.5
    assert clean(" a\tb <pad> ") == "a b"


def test_the_primary_score_is_the_first_metric():
    class Task:
        metrics = ("rouge", "exact_match")

    assert primary(Task()) == "rougeL"
    Task.metrics = ("exact_match", "rouge")
    assert primary(Task()) == "exact_match"
