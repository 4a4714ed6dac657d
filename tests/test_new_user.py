"""What a new user hit with their own data (issue 45), each as the user met it: predictions continued by another
model, a learnt tokenizer filling a tiny vocabulary, training rows scored as held-out ones, a mixture task's split,
resuming an own-task run, the best step deleted, --limit with --input, empty run directories, a header-only CSV,
a truncated checkpoint's error, the task's name, a null target, --split warnings, --load missing from the decoding
drivers, PEFT's base path, hf/ in .gitignore, the decoder's layers in the log."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

import run_inference
from tests.helpers import fails as _fails

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_random_checkpoint(preset: str, directory: str, seed: int = 7, step: int = 1) -> None:
    """A random-init checkpoint of a preset, saved as run_finetuning saves one."""
    from config import load_config
    from config.presets import to_dict
    from graphs.graphs import Graphs
    from utils import checkpoint as ckpt

    cfg = load_config("finetuning", preset, {})
    mgr = ckpt.manager(directory)
    ckpt.save(mgr, step, Graphs(cfg).init_params(seed), None, {"step": step, "seed": cfg.model.seed,
                                                               "config": to_dict(cfg)})
    mgr.wait_until_finished()
    mgr.close()


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """Two random-init checkpoints of the tiny preset (other weights: another seed), saved as run_finetuning saves
    one, and a file of 11 rows in the task's format (MNLI's columns, no label)."""
    d = tmp_path_factory.mktemp("models")
    a, b = str(d / "a"), str(d / "b")
    save_random_checkpoint("tiny", a)
    save_random_checkpoint("tiny", b, seed=8)
    rows = d / "rows.jsonl"
    rows.write_text("".join(json.dumps({"premise": f"the cat sleeps in the park {i}", "hypothesis": "the cat sleeps"})
                            + "\n" for i in range(11)))
    return a, b, str(rows)


# ------------------------------------------------------------------------------------------ 1. predictions files

@pytest.mark.slow
def test_a_predictions_file_records_what_wrote_it_and_other_settings_do_not_continue_it(two_models, tmp_path,
                                                                                        capsys):
    a, b, rows = two_models
    out = str(tmp_path / "p.jsonl")
    run_inference.main(["--load", a, "--input", rows, "--predictions", out])
    full = open(out).read()
    record = json.load(open(str(tmp_path / "p.meta.json")))["written_by"]
    assert record["checkpoint"] == os.path.abspath(a) and record["step"] == 1 and record["hf_model"] is None
    assert record["quantization"] is None and len(record["weights"]) >= 16
    assert record["decoding"]["num_beams"] == 1 and record["decoding"]["do_sample"] is False
    cut = "".join(full.splitlines(keepends=True)[:4])
    with open(out, "w") as f:
        f.write(cut)
    # another model, or other decoding options: refused, every difference named, the file left as it was
    err = _fails(capsys, run_inference.main, ["--load", b, "--input", rows, "--predictions", out],
                 "--predictions NEW.jsonl")
    assert f"checkpoint '{os.path.abspath(a)}' (now '{os.path.abspath(b)}')" in err and "weights '" in err
    assert open(out).read() == cut
    err = _fails(capsys, run_inference.main, ["--load", a, "--input", rows, "--predictions", out, "--do_sample",
                                              "--temperature", "2.0"], "--predictions NEW.jsonl")
    assert "--do_sample False (now True)" in err and "--temperature 1.0 (now 2.0)" in err and "checkpoint" not in err
    assert open(out).read() == cut
    # the same model and settings continue it: the whole file, as one run wrote it
    run_inference.main(["--load", a, "--input", rows, "--predictions", out])
    assert open(out).read() == full
    # a file with no record of what wrote it is not continued either
    os.remove(str(tmp_path / "p.meta.json"))
    _fails(capsys, run_inference.main, ["--load", a, "--input", rows, "--predictions", out], "no record")


class Exited(Exception):
    """os._exit, in a test: the exit code, raised."""


@pytest.mark.parametrize("when", ["decoding", "writing"])
def test_ctrl_c_during_predictions_keeps_the_finished_batches_whole_and_says_so(tmp_path, capfd, monkeypatch, when):
    """Guards the line of a signal during run_inference.py --input (it said "the work in progress was not saved",
    though every finished batch is kept, and the same command continues after them), and each batch written whole
    before the process stops: Ctrl-C while the second batch decodes keeps the first; during the second batch's write,
    the second too, never half a line (which made the same command refuse the file)."""
    import signal
    from types import SimpleNamespace

    from app import entry, predict
    from data.tasks import Example

    path, on_disk, calls = str(tmp_path / "p.jsonl"), [], []

    def _exit(code):
        on_disk.append(open(path).read())  # what the file holds as the process ends (nothing flushed after)
        raise Exited(code)

    def predict_batch(params, feats, idx):
        calls.append(list(idx))
        if when == "decoding" and len(calls) == 2:
            entry.exit_on_signal(signal.SIGINT)
        return [f"out {i}" for i in idx]

    fsync = os.fsync

    def fsync_then_signal(fd):  # a signal while a batch's lines are being written
        fsync(fd)
        if when == "writing" and len(calls) == 2:
            entry.exit_on_signal(signal.SIGTERM)

    monkeypatch.setattr(entry.os, "_exit", _exit)
    monkeypatch.setattr(predict.os, "fsync", fsync_then_signal)
    examples = [Example(f"input {i}", "") for i in range(5)]
    predictor = SimpleNamespace(batch_size=2, predict_batch=predict_batch)
    with pytest.raises(Exited) as e:
        predict.predict_file(predictor, None, examples, {}, path, {"decoding": {}})
    rows = 2 if when == "decoding" else 4
    assert e.value.args == (130 if when == "decoding" else 143,)
    assert f"stopped; the predictions of the first {rows} of 5 rows are kept in {path}: the same command continues " \
           "after them" in capfd.readouterr().err
    assert on_disk[0] == "".join(json.dumps({"row": i, "input": f"input {i}", "prediction": f"out {i}"}) + "\n"
                                 for i in range(rows))
    assert entry._Stop.kept is None and not entry._Stop.writing  # what the next signal says: nothing kept
    when = "done"
    out, done = predict.predict_file(predictor, None, examples, {}, path, {"decoding": {}})
    assert done == rows and [json.loads(line)["row"] for line in open(path)] == list(range(5))


def test_the_record_names_another_step_and_other_weights(two_models, tmp_path, capsys):
    """The difference a user must see first: the checkpoint, its step, the weights' fingerprint (a step of the same
    run is other weights in the same directory)."""
    from app.predict import check_writer, write_record

    path = str(tmp_path / "x.jsonl")
    before = {"checkpoint": "/c", "step": 100, "hf_model": None, "weights": "w1", "tokenizer": "t",
              "decoding": {"num_beams": 1}, "quantization": None}
    write_record(path, before)
    check_writer(path, dict(before))  # the same: no error
    from utils.errors import FlanT5Error

    with pytest.raises(FlanT5Error) as e:
        check_writer(path, {**before, "step": 200, "weights": "w2", "quantization": "int8"})
    assert "step 100 (now 200)" in str(e.value) and "weights 'w1' (now 'w2')" in str(e.value)
    assert "quantization None (now 'int8')" in str(e.value) and "checkpoint" not in str(e.value)


# ------------------------------------------------------------------------------------------- 7. --limit with --input

def test_limit_takes_the_first_rows_of_the_input_file(two_models, tmp_path, capsys):
    a, _, rows = two_models
    out = tmp_path / "five.jsonl"
    run_inference.main(["--load", a, "--input", rows, "--predictions", str(out), "--limit", "5"])
    assert [json.loads(x)["row"] for x in out.read_text().splitlines()] == [0, 1, 2, 3, 4]
    _fails(capsys, run_inference.main, ["--load", a, "--prompt", "x", "--limit", "2"], "drop --limit")


# ------------------------------------------------------------------------------- 2. a learnt tokenizer's size

def sort_rows(path, n=600, seed=0):
    """The task nobody here wrote: sort three numbers (of 0-999: a thousand words)."""
    import random

    rng = random.Random(seed)
    rows = [[rng.randrange(1000) for _ in range(3)] for _ in range(n)]
    path.write_text("".join(json.dumps({"numbers": " ".join(map(str, xs)), "sorted": " ".join(map(str, sorted(xs)))})
                            + "\n" for xs in rows))
    return str(path)


def test_a_learnt_tokenizer_that_fills_a_small_vocabulary_says_so_with_the_size_that_holds_the_data(tmp_path,
                                                                                                   caplog):
    """The choice: the model's vocabulary stays the config's (part of the model's shape), and a tokenizer that fills
    it while splitting the data's words finely says so in one line, at every run that uses it, with the size that
    holds them whole, which then says nothing."""
    from config import load_config
    from data import cache, mixture

    data = sort_rows(tmp_path / "sort.jsonl")

    def learn(vocab):
        cfg = load_config("finetuning", "tiny", {"dataset": data, "input_template": "sort: {numbers}",
                                                 "target_column": "sorted", "labels": "none", "tokenizer": "train"})
        part = mixture.tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[0].part()
        req = cache.Request([part], "t5", "train", str(tmp_path / "c"), vocab_size=vocab)
        caplog.clear()
        with caplog.at_level("INFO", logger="flan_t5"):
            folder = cache.prepare(req)["tokenizer"]
        said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        return folder, said

    folder, said = learn(128)
    assert len(said) == 1 and "filled --vocab_size 128" in said[0], said
    size = int(said[0].rsplit("--vocab_size ", 1)[1])
    assert size % 128 == 0 and size > 128
    assert learn(128) == (folder, said)  # the cached tokenizer: said again, nothing learnt again
    bigger, quiet = learn(size)
    from data.tasks import load_tokenizer

    assert quiet == [] and len(load_tokenizer(bigger)) <= size
    assert len(load_tokenizer(bigger)("sort: 5 712 48", add_special_tokens=False)["input_ids"]) == 4  # words whole


# -------------------------------------------------- 3. training rows scored as held-out ones, 8. empty directories

def nli_file(path, n=200, seed=9):
    from data.synthetic import generate_split

    path.write_text("".join(json.dumps(r) + "\n" for r in generate_split("train", n, seed=seed)))
    return str(path)


SMALL = ["--config", "tiny", "--sequence_length", "16", "--global_batch_size", "8", "--micro_batch_size", "2",
         "--warmup_steps", "0"]


def test_eval_every_on_a_single_file_with_nothing_held_out_is_refused_and_leaves_no_directory(tmp_path, capsys,
                                                                                              monkeypatch):
    import run_finetuning

    data = nli_file(tmp_path / "train.jsonl")
    monkeypatch.chdir(tmp_path)  # (the fresh run directory goes under ./runs)
    save = tmp_path / "ck"
    _fails(capsys, run_finetuning.main, SMALL + ["--dataset", data, "--steps", "2", "--eval_every", "1",
                                                 "--save", str(save)], "pass --holdout N to score N rows held out")
    _fails(capsys, run_finetuning.main, SMALL + ["--dataset", data, "--steps", "2", "--eval_every", "1"],
           "--eval_every would score rows the run trains on")
    assert not save.exists() and not (tmp_path / "runs").exists()  # nothing of the refused runs is left
    # --load of a directory that does not exist makes none
    nope = tmp_path / "nope"
    _fails(capsys, run_finetuning.main, SMALL + ["--load", str(nope), "--save", str(nope)], str(nope))
    assert not nope.exists()


def test_a_failed_run_s_lock_leaves_the_directories_it_made_and_nothing_else(tmp_path):
    """The rule under item 8: a directory a run made goes when the run leaves nothing in it but its lock and an
    empty metrics.jsonl; one it did not make, or with anything else in it, stays whole."""
    from app.rundir import RunLock

    made = tmp_path / "runs" / "tiny-1"
    lock = RunLock(str(made))
    (made / "metrics.jsonl").write_text("")
    lock.release()
    assert not (tmp_path / "runs").exists()
    kept = tmp_path / "runs" / "tiny-2"
    lock = RunLock(str(kept))
    (kept / "metrics.jsonl").write_text('{"step": 1}\n')
    lock.release()
    assert (kept / "metrics.jsonl").exists()
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    RunLock(str(theirs)).release()
    assert theirs.exists()


# ------------------------------------------------------------------------- 6. the best step is never deleted

@pytest.mark.slow
def test_the_best_step_is_kept_whatever_to_keep_says_and_named_without_if(tmp_path, caplog, monkeypatch):
    import run_finetuning
    from app import evaluate
    from utils import checkpoint as ckpt

    scripted = iter([0.5, 0.9, 0.9, 0.7, 0.6, 0.8])  # step 2 is the best (step 3 ties: the earliest is the best)
    monkeypatch.setattr(evaluate.Decoder, "predict", lambda self, params, feats, progress="": [""] * len(
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


# ------------------------------------------------------------------------------------ 4. a mixture task's split

def qa_dir(path, splits=("train", "validation")):
    path.mkdir()
    for split in splits:
        (path / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"what is {i} plus one ?",
                                                                 "answer": str(i + 1)}) + "\n" for i in range(40)))
    return str(path)


QA_TASK = "{{name: qa, dataset: {}, input_column: question, target_column: answer, labels: none}}"


def test_a_directory_of_splits_is_scored_on_its_validation_file_and_a_mixture_task_s_split_is_named_as_set(
        tmp_path, capsys):
    import run_finetuning
    from config import load_config
    from data import cache
    from data.mixture import evaluation_sets, tasks_of

    own = qa_dir(tmp_path / "qa")
    cfg = load_config("finetuning", "tiny", {"mixture": ["tiny_headlines", QA_TASK.format(own)]})
    qa = tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[1]
    assert qa.split == "validation"  # not told: the directory's validation file
    assert evaluation_sets([qa])[0].what.endswith("validation.jsonl")
    # --split reaches the mapping tasks that name none (it did not: the default was always MNLI's)
    dev = qa_dir(tmp_path / "dev", ("train", "dev"))
    cfg = load_config("finetuning", "tiny", {"mixture": ["tiny_headlines", QA_TASK.format(dev)], "split": "dev"})
    assert tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)[1].split == "dev"
    assert evaluation_sets(tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed))[1].what.endswith("dev.jsonl")
    # a split that is not there: the fix names the mapping key that works, before anything is read or tokenized
    val = qa_dir(tmp_path / "val", ("train", "valid"))
    argv = ["--config", "tiny", "--mixture", "tiny_headlines", QA_TASK.format(val), "--eval_every", "2",
            "--steps", "2", "--tokenizer", "train", "--vocab_size", "256"]
    before = dict(cache.BUILDS)
    err = _fails(capsys, run_finetuning.main, argv, "in task qa's mapping")
    assert "name one of its splits (train, valid) with split: NAME in task qa's mapping" in err, err
    assert cache.BUILDS == before  # nothing read or tokenized first (it was, for 12-19 s)


# ------------------------------------------------------------------------------------- 5. resuming an own task

@pytest.mark.parametrize("given,resumes", [("train", True), (None, True), ("other/tokenizer", False)])
def test_tokenizer_train_on_a_resume_means_the_tokenizer_the_run_learnt(monkeypatch, caplog, given, resumes):
    """The argument logic of the long test below, in milliseconds (a checkpoint's meta faked): --tokenizer train
    on a resume is the tokenizer the run learnt (``resumed_fields`` drops the flag: it would learn another, whose
    ids are not the embedding's rows), named in the log; no flag is the same; another tokenizer is refused by the
    resume's check, naming the one it was trained with."""
    from types import SimpleNamespace

    from app.args import config_of
    from app.resume import resume_point
    from config import load_config
    from config.presets import to_dict
    from utils import checkpoint as ckpt
    from utils.errors import FlanT5Error

    learnt = "/runs/qa/tokenizer"
    saved = to_dict(load_config("finetuning", "tiny", {"tokenizer": learnt, "dataset": "qa.jsonl", "input_column":
                                                       "question", "target_column": "answer", "labels": "none"}))
    monkeypatch.setattr(ckpt, "resolve", lambda path: [("/runs/qa", 2)])
    monkeypatch.setattr(ckpt, "read_meta", lambda directory, step: {"step": 2, "config": saved})
    overrides = {"load": "/runs/qa", "save": "/runs/qa", "steps": 3, **({"tokenizer": given} if given else {})}
    with caplog.at_level("INFO", logger="flan_t5"):
        cfg = config_of("finetuning", SimpleNamespace(config="tiny"), overrides, resume=True)
    assert ("resuming with the tokenizer /runs/qa learnt, /runs/qa/tokenizer" in caplog.text) == (given == "train")
    if resumes:
        assert cfg.data.tokenizer == learnt and cfg.task.target_column == "answer" and cfg.training.steps == 3
        assert resume_point(cfg) == ("/runs/qa", 2)
    else:
        with pytest.raises(FlanT5Error, match="--tokenizer other/tokenizer \\(it was trained with --tokenizer "
                                              "/runs/qa/tokenizer\\)"):
            resume_point(cfg)


@pytest.mark.slow
def test_a_resume_takes_the_task_from_the_checkpoint_and_names_every_disagreement_at_once(tmp_path, capsys, caplog):
    import run_finetuning
    from data import cache
    from utils import checkpoint as ckpt

    own = qa_dir(tmp_path / "qa")
    save = str(tmp_path / "ck")
    task = ["--task_name", "qa", "--dataset", own, "--input_template", "question: {question}", "--target_column",
            "answer", "--labels", "none", "--tokenizer", "train", "--vocab_size", "256",
            "--decoder_sequence_length", "6"]
    run_finetuning.main(SMALL + task + ["--steps", "2", "--save", save])
    learnt = os.path.join(save, "tokenizer", "tokenizer.json")
    stamp, built = os.stat(learnt).st_ctime_ns, dict(cache.BUILDS)
    # none of the task's flags again (five attempts, one error each, before), nor --tokenizer train's relearning
    with caplog.at_level("INFO", logger="flan_t5"):
        run_finetuning.main(SMALL + ["--load", save, "--save", save, "--steps", "3", "--tokenizer", "train"])
    assert ckpt.saved_steps(save)[-2:] == [2, 3] and "resuming with the tokenizer" in caplog.text
    assert os.stat(learnt).st_ctime_ns == stamp and cache.BUILDS == built  # nothing learnt, read or tokenized again
    meta = ckpt.read_meta(save, 3)["config"]
    assert meta["task"]["input_template"] == "question: {question}" and meta["data"]["dataset"] == own
    # flags that disagree: every one named in one line, the checkpoint untouched
    other = qa_dir(tmp_path / "other")
    err = _fails(capsys, run_finetuning.main, SMALL + ["--load", save, "--save", save, "--steps", "4", "--dataset",
                                                       other, "--global_batch_size", "16", "--input_template",
                                                       "q: {question}"], "--init_from")
    for flag, ours, theirs in (("dataset", other, own), ("global_batch_size", "16", "8"),
                               ("input_template", "q: {question}", "question: {question}")):
        assert f"--{flag} {ours} (it was trained with --{flag} {theirs})" in err, err
    assert ckpt.saved_steps(save)[-1] == 3


# ---------------------------------------------------------------------- 9, 12. a header-only CSV, a null target

def test_a_header_only_csv_and_a_null_target_are_named_as_what_they_are(tmp_path):
    from data import sources
    from data.sources import DataError
    from data.tasks import Task
    from types import SimpleNamespace

    header = tmp_path / "rows.csv"
    header.write_text("question,answer\n")
    with pytest.raises(DataError, match=r"rows.csv: the file has no rows \(a header alone\): give a file"):
        sources.read(str(header), "train")
    task = Task(SimpleNamespace(name="qa", input_template=None, input_column="question", target_column="answer",
                                labels=None, metrics=("exact_match",)))
    null = tmp_path / "null.jsonl"
    null.write_text('{"question": "a", "answer": "b"}\n{"question": "c", "answer": null}\n')
    with pytest.raises(DataError, match=r"null.jsonl: row 1 \(line 2\): column 'answer' is null: give the answer"):
        task.examples(sources.read(str(null), "train"))
    absent = tmp_path / "absent.jsonl"
    absent.write_text('{"question": "a", "answer": "b"}\n{"question": "c"}\n')
    with pytest.raises(DataError, match=r"row 1 \(line 2\): column 'answer' is missing: .* the row has question"):
        task.examples(sources.read(str(absent), "train"))
    parquet = tmp_path / "null.parquet"
    import pandas as pd

    pd.DataFrame([{"question": "a", "answer": "b"}, {"question": "c", "answer": None}]).to_parquet(parquet)
    with pytest.raises(DataError, match=r"row 1: column 'answer' is null \(or absent from this row\)"):
        task.examples(sources.read(str(parquet), "train"))


# ------------------------------------------------------------------------------ 10. a truncated checkpoint

def test_a_truncated_checkpoint_s_error_ends_in_words_not_a_cut_internal_string(two_models, tmp_path, capsys):
    import glob
    import shutil

    import run_validation

    broken = str(tmp_path / "broken")
    shutil.copytree(two_models[0], broken)
    data = max((f for f in glob.glob(os.path.join(broken, "1", "params", "**", "*"), recursive=True)
                if os.path.isfile(f)), key=os.path.getsize)
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    err = _fails(capsys, run_validation.main, ["--load", broken, "--limit", "2"], "is corrupt or incomplete")
    assert "TensorStore details" not in err and "<bound method" not in err and "start afresh" in err, err
    cause = err.split("corrupt or incomplete (", 1)[1].rsplit("); ", 1)[0]
    assert "<" not in cause and (len(cause) < 170 or cause.endswith(" ...")), cause


def test_the_cause_of_a_checkpoint_error_is_cut_at_a_word():
    from utils.checkpoint import _cause

    long = "Error reading " + "shard " * 60 + "[source locations='x.cc:1'] more"
    assert _cause(Exception(long)).endswith("shard ...") and "source locations" not in _cause(Exception(long))
    assert _cause(ValueError("a: b. See full TensorStore details: <bound method pyb")) == "a: b"
    assert _cause(ValueError("")) == "ValueError"


# -------------------------------------------------------------------------- 11. an own task's name

def test_an_own_task_without_task_name_is_named_after_its_data_not_mnli():
    from config import load_config

    own = {"dataset": "/data/sort.csv", "input_template": "sort: {numbers}", "target_column": "sorted",
           "labels": "none"}
    assert load_config("finetuning", "tiny", own).task.name == "sort"
    assert load_config("finetuning", "tiny", {**own, "task_name": "mine"}).task.name == "mine"
    assert load_config("finetuning", "tiny", {"dataset": "/data/nli.jsonl"}).task.name == "mnli"  # MNLI's format
    assert load_config("finetuning", "tiny", {**own, "dataset": "knkarthick/samsum"}).task.name == "samsum"
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "| `--task_name` |" in readme and "| `--task_name` |" in open(os.path.join(ROOT, "docs", "tasks.md")).read()


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


# ---------------------------------------------------------------------- 14. the decoding drivers without --load

def test_export_and_server_without_a_model_say_what_they_would_do_and_export_s_help_is_short(capsys):
    import run_export
    import run_server

    _fails(capsys, run_export.main, ["--output", "/tmp/never"], "nothing to export: pass --load CKPT")
    _fails(capsys, run_server.main, [], "nothing to serve: pass --load CKPT")
    with pytest.raises(SystemExit):
        run_export.main(["--help"])
    shown = capsys.readouterr().out
    assert shown.startswith("usage: run_export.py (--load CKPT | --hf_model NAME_OR_DIR) --output DIR")
    assert len(shown.splitlines()) < 60 and "--learning_rate" not in shown and "--load" in shown


# ------------------------------------------------------------------ 15. PEFT's base path, 16. hf/ in .gitignore

@pytest.mark.slow
def test_a_peft_export_names_its_base_as_output_was_given_and_loads_after_its_folder_moves(tmp_path, monkeypatch):
    import run_export
    import run_finetuning

    project = tmp_path / "project"
    project.mkdir()
    monkeypatch.chdir(project)
    run_finetuning.main(SMALL + ["--lora_rank", "2", "--lora_random_base", "--steps", "1", "--save", "ck"])
    run_export.main(["--load", "ck", "--output", "hf/lora", "--peft"])
    config = json.load(open(project / "hf" / "lora" / "adapter_config.json"))
    assert config["base_model_name_or_path"] == os.path.join("hf", "lora", "base")
    moved = tmp_path / "moved"
    os.rename(project, moved)
    monkeypatch.chdir(moved)
    peft = pytest.importorskip("peft")
    model = peft.AutoPeftModelForSeq2SeqLM.from_pretrained("hf/lora")  # base and adapters, found where they moved
    assert model.peft_config["default"].r == 2


def test_the_export_folder_is_not_tracked_by_git():
    for path in ("hf/lora/adapter_config.json", "hf/merged/model.safetensors", ".venv/bin/python"):
        assert subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT).returncode == 0, path
