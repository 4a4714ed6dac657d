"""Tasks of your own: any text-to-text (T5) or prompt-to-completion (GPT-J) data, offline.

- Every source kind (JSONL, JSON, CSV, TSV, Parquet, a directory of split files, datasets' save_to_disk) gives
  the same examples; a bad row is one line naming the row, the column and the columns present, before any work.
- The metrics are the libraries' own (rouge-score, sacrebleu), on fixed strings.
- The generated free-text task (headlines) trains the tiny T5 and the tiny GPT-J to an exact match far above
  chance with a tokenizer learnt from the data; the task travels with the checkpoint (validation and inference
  need no task flags); --eval_every logs held-out scores without changing the run; predictions for a file.
"""

import json
import os
import re

import numpy as np
import pytest

import run_finetuning
import run_inference
import run_validation
from config import load_config
from data import sources
from data.synthetic import generate_headlines
from config.presets import preset_path, read_presets
from data.tasks import Example, Task
from tests.helpers import fails, params_at
from utils import checkpoint as ckpt

QA = {"task_name": "qa", "input_template": "question: {question} context: {context}", "target_column": "answer",
      "labels": "none"}
SENTIMENT = {"task_name": "sentiment", "input_column": "text", "target_column": "label",
             "labels": ["negative", "positive"]}


def rows_qa(n=5):
    """Rows whose answer is a number: JSON and Parquet hold it as one, CSV as its text; every format reads it as
    text (it was refused in JSONL and accepted in CSV)."""
    return [{"question": f"what is {i} plus one ?", "context": f"{i} plus one is {i + 1} .", "answer": i + 1,
             "id": i} for i in range(n)]


def write(rows, path):
    """rows as the file type of ``path``'s suffix."""
    import pandas as pd

    df = pd.DataFrame(rows)
    kind = os.path.splitext(str(path))[1]
    if kind == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif kind == ".json":
        df.to_json(path, orient="records")
    elif kind in (".csv", ".tsv"):
        df.to_csv(path, index=False, sep="\t" if kind == ".tsv" else ",")
    else:
        df.to_parquet(path)
    return str(path)


def test_every_source_kind_gives_the_same_examples(tmp_path):
    import datasets

    rows = rows_qa()
    task = Task(load_config("finetuning", "tiny", QA).task)
    expected = task.examples(sources.Rows(rows, "rows"))
    assert expected[3].input == "question: what is 3 plus one ? context: 3 plus one is 4 ." and expected[3].target == "4"
    paths = [write(rows, tmp_path / f"qa{suffix}") for suffix in (".jsonl", ".json", ".csv", ".tsv", ".parquet")]
    (tmp_path / "split_files").mkdir()
    write(rows, tmp_path / "split_files" / "validation.jsonl")
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "saved_dict"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved_one"))
    for path in paths + [str(tmp_path / d) for d in ("split_files", "saved_dict", "saved_one")]:
        got = task.examples(sources.read(path, "validation"))
        assert got == expected, path
    with pytest.raises(sources.DataError, match="did you mean --split validation"):
        sources.read(str(tmp_path / "split_files"), "validaton")
    with pytest.raises(sources.DataError, match="did you mean validation"):
        sources.read(str(tmp_path / "saved_dict"), "validaton")


@pytest.mark.parametrize("rows,flags,message", [
    ([{"question": "q", "answer": "a"}], QA, "row 0 (line 1): column 'context' is missing: the task reads question, "
                                             "context, answer; the row has question, answer"),
    ([{"question": "q", "context": "c", "answer": ""}], QA, "row 0 (line 1): column 'answer' is empty"),
    ([{"text": "good", "label": 1}, {"text": "bad", "label": 2}], SENTIMENT,
     "row 1 (line 2): column 'label' must be 0, 1 (or -1 for unlabelled), or negative, positive; got 2"),
    ([{"text": "good", "label": "great"}], SENTIMENT, "column 'label' must be 0, 1 (or -1 for unlabelled)"),
    # free text on a label set (a preset's labels): the error names the flag for free-text targets
    ([{"text": "good", "label": "GREEN HOUSE"}], SENTIMENT, "got 'GREEN HOUSE': fix the row, or, if the 'label' "
                                                            "column is free text rather than a label, pass --labels none"),
    ([{"question": "q", "context": "c", "answer": "a"}], {**QA, "input_template": "question: {question} {hint}"},
     "row 0 (line 1): column 'hint' is missing"),
])
def test_a_bad_row_is_one_line_before_any_work(tmp_path, capsys, rows, flags, message):
    data = write(rows, tmp_path / "train.jsonl")
    save = tmp_path / "ck"
    argv = ["--config", "tiny", "--dataset", data, "--tokenizer", "train", "--save", str(save), "--steps", "2"]
    flags = [x for k, v in flags.items() for x in [f"--{k}", *(v if isinstance(v, list) else [v])]]
    err = fails(capsys, run_finetuning.main, argv + flags, message)
    assert data in err
    assert not ckpt.saved_steps(str(save)) and not os.path.exists(save / "tokenizer")  # nothing learnt or trained


DATES = {"task_name": "dates", "input_template": "date: {date}", "target_column": "text", "labels": "none"}


def test_rows_to_predict_need_the_input_alone_and_an_empty_text_column_reads_plainly():
    """Guards the columns a missing one names when rows are predicted (run_inference.py --input: the input's alone;
    it said "the task reads date, text" of a file that needs no target) and the empty-target line of a column named
    text (it read "give the text text")."""
    task = Task(load_config("finetuning", "tiny", DATES).task)
    with pytest.raises(sources.DataError) as e:
        task.examples(sources.Rows([{"day": "1950-01-01"}], "new.jsonl"), targets=False)
    assert str(e.value) == ("new.jsonl: row 0: column 'date' is missing: the task's input reads date (its target "
                            "column, text, is not needed to predict); the row has day")
    assert task.examples(sources.Rows([{"date": "1950-01-01"}], "new.jsonl"), targets=False) == \
        [Example("date: 1950-01-01", "")]
    # training and scoring read the target too, and say so
    with pytest.raises(sources.DataError, match="column 'date' is missing: the task reads date, text; the row has "
                                                "day$"):
        task.examples(sources.Rows([{"day": "1950-01-01"}], "train.jsonl"))
    with pytest.raises(sources.DataError) as e:
        task.examples(sources.Rows([{"date": "1950-01-01", "text": " "}], "train.jsonl"))
    assert str(e.value) == "train.jsonl: row 0: column 'text' is empty: write its text, or remove the row"


@pytest.mark.parametrize("preset", sorted(read_presets(preset_path("finetuning"))))
def test_a_task_of_one_s_own_is_trained_on_its_target_on_every_preset_unless_asked(preset):
    """Guards the own task's loss on an MNLI preset (gptj_tiny with the task flags trained on every token, its
    MNLI `all`): on every preset a task of one's own (flags, or a mixture) counts the target's tokens, --loss_tokens
    all asks for every token, and a preset's own task keeps what the preset says (its MNLI task too)."""
    own = {k: v for k, v in DATES.items() if k != "task_name"}
    as_is = load_config("finetuning", preset, {})
    assert load_config("finetuning", preset, own).data.loss_tokens == (
        as_is.data.loss_tokens if (as_is.task.target_column != "label" or as_is.mixture.tasks) else "target")
    assert load_config("finetuning", preset, {**own, "loss_tokens": "all"}).data.loss_tokens == "all"
    if preset == "gptj_tiny":  # MNLI's task on another file is still MNLI's: the original's loss on every token
        assert as_is.data.loss_tokens == "all" and load_config(
            "finetuning", preset, {"dataset": "mnli.jsonl"}).data.loss_tokens == "all"
        mixed = load_config("finetuning", preset, {"mixture": ["tiny_headlines", "gptj_tiny"]})
        assert mixed.data.loss_tokens == "target"


def test_metrics_are_the_libraries_own():
    import sacrebleu
    from rouge_score import rouge_scorer

    from data import metrics

    refs = ["the cat sat on the mat", "a dog runs in the park today", "hello world"]
    outs = ["the cat sat on a mat", "the dog ran in the park", "hello  world "]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    theirs = [scorer.score(r, " ".join(o.split())) for r, o in zip(refs, outs)]
    assert metrics.rouge(refs, outs) == pytest.approx({k: np.mean([t[k].fmeasure for t in theirs])
                                                       for k in ("rouge1", "rouge2", "rougeL")})
    clean = [" ".join(o.split()) for o in outs]
    assert metrics.bleu(refs, outs) == pytest.approx(sacrebleu.corpus_bleu(clean, [refs]).score)
    assert metrics.chrf(refs, outs) == pytest.approx(sacrebleu.corpus_chrf(clean, [refs]).score)
    assert metrics.exact_match(refs, outs) == pytest.approx(1 / 3)  # whitespace aside, the third alone is equal
    task = Task(load_config("finetuning", "tiny", {**SENTIMENT, "metrics": ["accuracy", "exact_match"]}).task)
    examples = task.examples(sources.Rows([{"text": "x", "label": 1}, {"text": "y", "label": "negative"}], "r"))
    report = metrics.score(task, examples, ["positive</s>", "maybe"])
    assert report["scores"] == {"accuracy": 0.5, "exact_match": 0.5} and report["unknown"] == 1
    assert report["references"] == ["positive", "negative"] and report["inputs"] == ["x", "y"]


@pytest.mark.slow
@pytest.mark.parametrize("preset,steps,least", [("gptj_tiny_headlines", 120, 0.8)])
def test_the_tiny_models_learn_a_free_text_task_of_their_own(tmp_path, caplog, preset, steps, least):
    """Offline: a tokenizer learnt from the data, validation scores every half run, the best step named; then
    validation and inference of the checkpoint with no task flag: the task, its data, tokenizer and output length
    travel with it. Chance is well below 1% (four words to get right). (The tiny T5 learns the same task in
    tests/test_mixture.py, beside the NLI task.)"""
    save = str(tmp_path / "ck")
    with caplog.at_level("INFO", logger="flan_t5"):
        run_finetuning.main(["--config", preset, "--steps", str(steps), "--eval_every", str(steps // 2),
                             "--eval_rows", "64", "--save", save, "--checkpoint_steps", "0"])
    lines = [json.loads(x) for x in open(os.path.join(save, "metrics.jsonl"))]
    evals = [r for r in lines if "eval_exact_match" in r]
    assert [r["step"] for r in evals] == [steps // 2, steps] and "eval_rougeL" in evals[0]
    # the best step named is the best score's (its validation split: no rows held out)
    best = re.search(r"the best validation eval_exact_match: ([0-9.]+) at step (\d+)", caplog.text)
    top = max(r["eval_exact_match"] for r in evals)
    assert best and int(best.group(2)) == min(r["step"] for r in evals if r["eval_exact_match"] == top), evals
    run_validation.main(["--load", save, "--limit", "100"])
    report = json.load(open(os.path.join(save, f"validation_step{steps}_first100.json")))
    assert report["task"] == "headlines" and report["dataset"] == "synthetic-headlines"
    assert report["scores"]["exact_match"] > least, report["scores"]  # measured: 0.97 (GPT-J, 120 steps)
    assert report["scores"]["rougeL"] > report["scores"]["exact_match"]
    assert len(report["generated"]) == len(report["references"]) == len(report["inputs"]) == 100
    # bfloat16 decoding, and bfloat16 with int8 weights: within a point of each other
    scores = {}
    for q in ("none", "int8"):
        run_validation.main(["--load", save, "--limit", "100", "--precision", "bfloat16", "--quantize", q,
                             "--output", str(tmp_path / f"bf16_{q}.json")])
        scores[q] = json.load(open(tmp_path / f"bf16_{q}.json"))["scores"]["exact_match"]
    assert scores["none"] > least and abs(scores["int8"] - scores["none"]) <= 0.01, scores
    # beam search and sampling from the command line, scored the same way
    run_validation.main(["--load", save, "--limit", "32", "--num_beams", "3", "--output", str(tmp_path / "b.json")])
    run_validation.main(["--load", save, "--limit", "32", "--do_sample", "--top_k", "3", "--sampling_seed", "5",
                         "--output", str(tmp_path / "s.json")])
    beams, sampled = (json.load(open(tmp_path / f)) for f in ("b.json", "s.json"))
    assert beams["decoding"]["num_beams"] == 3 and sampled["decoding"]["do_sample"] is True
    assert beams["scores"]["exact_match"] > least and sampled["samples"] == 32, (beams["scores"], sampled["scores"])
    # predictions for a file of inputs (no targets), batch by batch; the same command continues a cut-short file
    rows = [{"text": r["text"]} for r in generate_headlines("test", 9, seed=1)]
    data = write(rows, tmp_path / "in.jsonl")
    out = tmp_path / "in.predictions.jsonl"
    run_inference.main(["--load", save, "--input", data])
    first = out.read_text().splitlines()
    out.write_text("\n".join(first[:4]) + "\n")
    run_inference.main(["--load", save, "--input", data])
    again = [json.loads(x) for x in out.read_text().splitlines()]
    assert out.read_text().splitlines() == first and [r["row"] for r in again] == list(range(9))
    assert all(r["prediction"] and r["input"].startswith("summarize: ") for r in again)


@pytest.mark.slow
def test_eval_every_changes_nothing_of_the_run_and_resumes_exactly(tmp_path):
    """The same weights with and without --eval_every, stopped and resumed with it (the evaluation reads no
    training data, draws no random number of the run's and changes no weight); the data is read and tokenized once
    (counted): the second run, the resume and the validation of the held-out rows map the first run's cache."""
    from data import cache
    from data.synthetic import generate_split

    data = write(generate_split("train", 400, seed=9), tmp_path / "train.jsonl")
    base = ["--config", "tiny", "--sequence_length", "16", "--global_batch_size", "8", "--micro_batch_size", "2",
            "--warmup_steps", "0", "--holdout", "32", "--eval_rows", "8", "--dataset", data]
    a, c = (str(tmp_path / n) for n in "ac")
    before = dict(cache.BUILDS)
    run_finetuning.main(base + ["--steps", "4", "--save", a])
    built = dict(cache.BUILDS)
    assert {k: built[k] - before[k] for k in built} == {"texts": 1, "tokens": 1, "tokenizers": 0}
    run_finetuning.main(base + ["--steps", "2", "--save", c, "--eval_every", "2"])
    run_finetuning.main(base + ["--steps", "4", "--save", c, "--load", c, "--eval_every", "2"])
    (_, pa), (_, pc) = params_at(a, 4), params_at(c, 4)
    for x, z in zip(*(jax_leaves(p) for p in (pa, pc))):
        np.testing.assert_array_equal(x, z)
    lines = [json.loads(x) for x in open(os.path.join(c, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and [r["step"] for r in lines if "eval_accuracy" in r] == [2, 4]
    # the loss plot carries the held-out score beside the loss
    from app.tracking import plot_loss_curve

    drawn = plot_loss_curve(os.path.join(c, "metrics.jsonl"), str(tmp_path / "curve.png"))
    assert any("eval_accuracy" in label for label in drawn["curves"]) and os.path.getsize(tmp_path / "curve.png")
    # validation of the checkpoint scores the rows held out of its training, by default
    run_validation.main(["--load", c, "--limit", "8"])
    report = json.load(open(os.path.join(c, "validation_heldout_step4_first8.json")))
    assert "held out of training" in report["data"] and report["samples"] == 8
    assert cache.BUILDS == built  # nothing read or tokenized again


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_the_readme_s_own_task_command_is_the_tiny_headlines_preset():
    """docs/tasks.md says the tiny_headlines preset is `--config tiny` with its flags: they give the same
    config, field for field (the flags it named once left out the lengths, the learning rate and the steps)."""
    import re
    import shlex

    from app.args import parse_config
    from config.fields import get_path
    from config.schema import FIELDS

    text = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "tasks.md")).read()
    block = re.search(r"```bash\n(python3 run_finetuning\.py --config tiny --task_name headlines .*?)```", text, re.S)
    argv = shlex.split(block.group(1).replace("\\\n", " "))[2:]
    del argv[argv.index("--save"): argv.index("--save") + 2]
    flags, _ = parse_config("finetuning", "", "tiny", argv)
    preset = load_config("finetuning", "tiny_headlines")
    differ = {f: (get_path(flags, r.path), get_path(preset, r.path)) for f, r in FIELDS.items()
              if get_path(flags, r.path) != get_path(preset, r.path)}
    assert not differ, differ


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
