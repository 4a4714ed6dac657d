"""Evaluation (app/evaluate.py): reports named so that none replaces another (--limit, two data sets of one stem, a
single file named as such), a checkpoint of every row of a file not scored on those rows, --split warned of only
when passed, the best evaluated step kept whatever --to_keep says and named, and the best logged evaluation the
highest score, the earliest of ties."""

from __future__ import annotations

import json
import os
import re

import pytest

import run_finetuning
import run_validation
from tests.helpers import SMALL, fails, nli_file, train


def test_the_best_logged_evaluation_is_the_highest_score_the_earliest_of_ties(tmp_path):
    """A resumed run's best step so far (app/evaluate.best_logged): the highest score in its metrics.jsonl, the
    earliest step of a tie; steps without an evaluation are not candidates."""
    from app.evaluate import best_logged

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 1, "loss": 0.1}, {"step": 2, "eval_x": 0.5}, {"step": 4, "eval_x": 0.9},
            {"step": 6, "eval_x": 0.2}, {"step": 8, "eval_x": 0.9}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert best_logged(str(path), "eval_x") == (0.9, 4)
    assert best_logged(str(path), "eval_y") is None and best_logged(str(tmp_path / "none.jsonl"), "eval_x") is None


# ------------------------------------------------------------------------- 6. the best step is never deleted
@pytest.mark.slow
def test_the_best_step_is_kept_whatever_to_keep_says_and_named_without_if(tmp_path, caplog, monkeypatch):
    import run_finetuning
    from app import evaluate
    from utils import checkpoint as ckpt

    scripted = iter([0.5, 0.9, 0.9, 0.7, 0.6, 0.8])  # step 2 is the best (step 3 ties: the earliest is the best)
    monkeypatch.setattr(evaluate.Decoder, "predict", lambda self, params, feats, progress="", options=None: [""] * len(
        feats["input_ids"]))
    monkeypatch.setattr(evaluate, "score", lambda task, examples, outputs: {"scores": {"accuracy": next(scripted)}})
    data = nli_file(tmp_path / "train.jsonl")
    save = str(tmp_path / "ck")
    with caplog.at_level("INFO", logger="flan_t5"):
        run_finetuning.main(SMALL + ["--dataset", data, "--holdout", "16", "--eval_rows", "4", "--steps", "4",
                                     "--eval_every", "1", "--checkpoint_steps", "1", "--to_keep", "1", "--save", save])
    assert ckpt.saved_steps(save) == [2, 4]
    assert re.search(r"the best held-out eval_accuracy: 0\.9000 at step 2 \(\S+/ck/2\)$", caplog.text, re.M), \
        caplog.text[-500:]
    # resumed, the run's best so far (from its metrics.jsonl) is kept too
    run_finetuning.main(["--load", save, "--save", save, "--steps", "6", "--eval_every", "1", "--checkpoint_steps",
                         "1", "--to_keep", "1"])
    assert ckpt.saved_steps(save) == [2, 6]


# ------------------------------------------------------ 13. --split warnings, 17. the decoder's layers in the log
def test_validating_a_single_file_warns_of_split_only_when_one_was_passed(two_models, tmp_path, caplog):
    import run_validation

    a, _, rows = two_models
    labelled = tmp_path / "scored.jsonl"
    labelled.write_text("".join(json.dumps({**json.loads(x), "label": 0}) + "\n" for x in open(rows)))
    with caplog.at_level("INFO", logger="flan_t5"):
        run_validation.main(["--load", a, "--dataset", str(labelled), "--limit", "2", "--output",
                             str(tmp_path / "a.json")])
    assert "does not apply" not in caplog.text and "validating on every row of" in caplog.text
    assert re.search(r"model shape from the checkpoint .*decoder_layers=4\b", caplog.text)  # as many as layers
    caplog.clear()
    with caplog.at_level("INFO", logger="flan_t5"):
        run_validation.main(["--load", a, "--dataset", str(labelled), "--split", "test", "--limit", "2", "--output",
                             str(tmp_path / "b.json")])
    assert "--split test does not apply" in caplog.text


@pytest.mark.slow
def test_limit_must_be_positive_and_never_replaces_the_full_report(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "1", "--save", save])
    run_validation.main(["--config", "tiny", "--load", save])
    full = os.path.join(save, "validation_step1.json")
    report = json.load(open(full))
    assert report["samples"] == 1000 and report["limit"] is None
    for bad in ("0", "-990"):
        fails(capsys, run_validation.main, ["--config", "tiny", "--load", save, "--limit", bad], "must be at least 1")
    run_validation.main(["--config", "tiny", "--load", save, "--limit", "10"])
    assert json.load(open(full)) == report  # untouched
    assert json.load(open(os.path.join(save, "validation_step1_first10.json")))["samples"] == 10


@pytest.mark.slow
def test_a_single_file_is_named_as_such_in_the_validation_report(tmp_path, capsys, caplog):
    from data import synthetic

    rows = synthetic.generate_split("train", 12)
    path = tmp_path / "mydata.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "1", "--save", save])
    with caplog.at_level("INFO", logger="flan_t5"):
        run_validation.main(["--config", "tiny", "--load", save, "--dataset", str(path)])
    out = capsys.readouterr().out
    assert f"of the rows of {path}" in out and "samples of validation" not in out
    report = json.load(open(os.path.join(save, "validation_mydata_step1.json")))  # not validation_step1.json
    assert report["split"] == "mydata" and report["single_file"] and report["samples"] == 12
    assert "a single file" in caplog.text and "does not apply" not in caplog.text  # (no --split was passed)


@pytest.mark.slow
def test_reports_of_two_datasets_with_one_stem_are_both_kept(tmp_path):
    save = str(tmp_path / "ck")
    train(save, 1)
    from data.synthetic import generate_split

    rows = generate_split("validation", 6, seed=3)
    (tmp_path / "own.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "own.csv").write_text("premise,hypothesis,label\n" + "".join(
        f"{r['premise']},{r['hypothesis']},{r['label']}\n" for r in rows[:4]))
    run_validation.main(["--load", save, "--dataset", str(tmp_path / "own.jsonl")])
    run_validation.main(["--load", save, "--dataset", str(tmp_path / "own.csv")])
    a = json.load(open(os.path.join(save, "validation_own_step1.json")))
    b = json.load(open(os.path.join(save, "validation_own_step1_2.json")))
    assert (a["samples"], b["samples"]) == (6, 4) and a["dataset"].endswith(".jsonl") and b["dataset"].endswith(".csv")


@pytest.mark.slow
def test_a_checkpoint_of_every_row_of_one_file_is_not_scored_on_them(tmp_path, capsys):
    """Trained on a single file with nothing held out: validation of the checkpoint refuses to score its own training
    rows (one line naming --dataset and --holdout); told another file, it scores that one and names it."""
    from data import synthetic

    data = tmp_path / "mine.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in synthetic.generate_split("train", 64, seed=3)))
    save = str(tmp_path / "ck")
    train(save, 1, "--dataset", str(data))
    fails(capsys, run_validation.main, ["--load", save], "a single file, nothing held out")
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(r) + "\n" for r in synthetic.generate_split("validation", 8, seed=4)))
    run_validation.main(["--load", save, "--dataset", str(other)])
    assert f"of {other}" in capsys.readouterr().out
