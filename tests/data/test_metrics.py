"""The tasks' scores (data/metrics.py) are the maintained libraries' (rouge-score with its stemmer, sacrebleu) on the
texts as decoded, exact match is exact, and MNLI's accuracy is counted on hand-written predictions: each check
below fails on the bug it names."""

import pytest
from rouge_score import rouge_scorer

from data.metrics import clean, exact_match, primary, rouge
from tests.mnli import score


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


def test_accuracy_on_hand_written_predictions():
    labels = [0, 0, 1, 2, 2, 1]
    generated = ["entailment", "neutral", "neutral</s>", "contradiction", "maybe", " entailment "]
    r = score(labels, generated)
    assert r["correct"] == 3 and r["samples"] == 6 and r["accuracy"] == 0.5
    assert r["unknown"] == 1
    assert r["confusion_matrix"]["counts"] == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1]]
    assert r["per_class"]["contradiction"] == {"support": 2, "correct": 1, "accuracy": 0.5}
    assert r["predictions"] == ["entailment", "neutral", "neutral", "contradiction", "unknown", "entailment"]
    assert r["generated"] == generated
