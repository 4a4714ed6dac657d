"""Nothing a user owns is deleted or overwritten, and interruptions are clean (issue 22): foreign folders survive
pruning, one run per directory, rollback decided before any work, incomplete steps named with the fix, no
run truncating another's metrics, reports never replaced, validation never cutting a prompt, signals at
start-up and during validation. Each reproduces a reported failure on the code before it."""

import json
import logging
import os
import signal
import time

import pytest

import run_finetuning
import run_validation
from tests.helpers import SMALL, fails, params_at, start, wait_for_lines
from utils import checkpoint as ckpt


def train(save, steps, *extra):
    run_finetuning.main(SMALL + ["--steps", str(steps), "--save", save, *extra])


@pytest.mark.slow
def test_foreign_numbered_folders_survive_pruning(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    save = tmp_path / "ck"
    for name, text in (("2023", "my photos"), ("7", "my notes")):
        (save / name).mkdir(parents=True)
        (save / name / "keep.txt").write_text(text)
    train(str(save), 5, "--checkpoint_steps", "1", "--to_keep", "2")
    assert ckpt.saved_steps(str(save)) == [4, 5]  # only our own oldest steps were removed
    assert (save / "2023" / "keep.txt").read_text() == "my photos" and (save / "7" / "keep.txt").read_text() == "my notes"
    assert "removed checkpoint step(s)" in caplog.text and "left alone" in caplog.text


@pytest.mark.parametrize("saving", [["--checkpoint_steps", "1"], ["--checkpoint_steps", "0", "--eval_every", "3"]])
def test_a_foreign_folder_a_step_would_overwrite_is_refused_before_work(tmp_path, capsys, saving):
    """Every step the run may save: each --checkpoint_steps, and each evaluated one (saved when it is the best so
    far)."""
    save = tmp_path / "ck"
    (save / "3").mkdir(parents=True)
    (save / "3" / "mine.txt").write_text("x")
    fails(capsys, run_finetuning.main, SMALL + ["--steps", "4", "--save", str(save), *saving],
          "not this project's checkpoints")
    assert sorted(os.listdir(save)) == ["3"] and (save / "3" / "mine.txt").read_text() == "x"


@pytest.mark.slow
def test_rollback_is_refused_before_work_or_done_on_an_explicit_branch(tmp_path, capsys):
    save = str(tmp_path / "ck")
    train(save, 4, "--checkpoint_steps", "1", "--to_keep", "0")
    before = {s: os.path.getmtime(os.path.join(save, str(s))) for s in ckpt.saved_steps(save)}
    err = fails(capsys, run_finetuning.main, SMALL + ["--steps", "4", "--load", f"{save}/2", "--save", save],
                "--discard_later_steps")
    assert "--save NEW_DIR" in err
    assert {s: os.path.getmtime(os.path.join(save, str(s))) for s in ckpt.saved_steps(save)} == before
    run_finetuning.main(SMALL + ["--steps", "4", "--load", f"{save}/2", "--save", save, "--discard_later_steps",
                                 "--to_keep", "0"])
    assert ckpt.saved_steps(save) == [1, 2, 3, 4]  # 3 and 4 trained again on the new branch
    # the same steps as the uninterrupted run: the branch continues the data and weights of step 2
    other = str(tmp_path / "straight")
    train(other, 4)
    (_, a), (_, b) = params_at(save, 4), params_at(other, 4)
    import jax
    import numpy as np

    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


@pytest.mark.slow
def test_incomplete_and_corrupt_steps_name_the_step_and_the_previous_complete_one(tmp_path, capsys, caplog):
    save = str(tmp_path / "ck")
    train(save, 3, "--checkpoint_steps", "1", "--to_keep", "0")
    os.remove(os.path.join(save, "3", ckpt.COMMIT))  # a write that never finished
    assert ckpt.saved_steps(save) == [1, 2]
    err = fails(capsys, run_validation.main, ["--load", f"{save}/3", "--limit", "2"], "is incomplete")
    assert f"{save}/2" in err and "<bound method" not in err
    os.remove(os.path.join(save, "2", "meta", "metadata"))
    err = fails(capsys, run_validation.main, ["--load", f"{save}/2", "--limit", "2"], "has no meta/metadata")
    assert f"{save}/1" in err
    run_validation.main(["--load", save, "--limit", "2"])  # the directory: its latest complete step, 1
    assert os.path.exists(os.path.join(save, "validation_step1_first2.json"))
    assert "3 is incomplete" in caplog.text


@pytest.mark.slow
def test_two_runs_into_one_directory_the_second_stops_at_once(tmp_path, capsys):
    save = str(tmp_path / "ck")
    proc = start(["run_finetuning.py"] + SMALL + ["--steps", "400", "--save", save, "--checkpoint_steps", "0"])
    try:
        deadline = time.time() + 240
        while not os.path.exists(os.path.join(save, "metrics.jsonl")) and time.time() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-2000:]
            time.sleep(0.5)
        t0 = time.time()
        err = fails(capsys, run_finetuning.main, SMALL + ["--steps", "2", "--save", save], "is in use by another run")
        assert f"pid {proc.pid}" in err and time.time() - t0 < 60
    finally:
        proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_runs_without_save_get_their_own_directory_and_never_truncate_metrics(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    import glob

    run_finetuning.main(SMALL + ["--steps", "2"])
    run_finetuning.main(SMALL + ["--steps", "1"])
    dirs = sorted(glob.glob(str(tmp_path / "runs" / "tiny-*")))
    assert len(dirs) == 2
    lines = [open(os.path.join(d, "metrics.jsonl")).read().count("\n") for d in dirs]
    assert sorted(lines) == [1, 2]
    finished = max(dirs, key=lambda d: open(os.path.join(d, "metrics.jsonl")).read().count("\n"))
    fails(capsys, run_finetuning.main, SMALL + ["--steps", "1", "--run_dir", finished], "another run's metrics.jsonl")
    fails(capsys, run_finetuning.main, SMALL + ["--steps", "0", "--run_dir", finished], "--steps 0")
    assert open(os.path.join(finished, "metrics.jsonl")).read().count("\n") == 2


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
def test_validation_never_cuts_a_prompt(tmp_path):
    """A preset whose sequence_length is shorter than the prompts decodes exactly what the full prompts give."""
    save = str(tmp_path / "ck")
    train(save, 2)
    outs = []
    for length in ("8", "64"):
        out = tmp_path / f"v{length}.json"
        run_validation.main(["--load", save, "--limit", "12", "--sequence_length", length, "--output", str(out)])
        outs.append(json.load(open(out))["generated"])
    assert outs[0] == outs[1]


def test_device_iterations_other_than_one_is_refused(capsys):
    fails(capsys, run_finetuning.main, SMALL + ["--device_iterations", "4"], "--device_iterations 1")


@pytest.mark.slow
@pytest.mark.parametrize("when", ["start-up", "validation"])
def test_a_signal_at_start_up_or_during_validation_exits_cleanly(tmp_path, when):
    """No segmentation fault, no traceback, exit 130; an earlier report stays intact."""
    save = str(tmp_path / "ck")
    train(save, 1)
    earlier = os.path.join(save, "validation_step1.json")
    with open(earlier, "w") as f:
        f.write('{"earlier": true}')
    if when == "start-up":
        proc = start(["run_finetuning.py"] + SMALL + ["--steps", "50", "--save", str(tmp_path / "new")])
        time.sleep(1.5)
    else:
        # the whole synthetic split one prompt at a time: decoding lasts long past the signal
        proc = start(["run_validation.py", "--load", save, "--micro_batch_size", "1"])
        deadline, buf = time.time() + 240, ""
        while "model shape from the checkpoint" not in buf and time.time() < deadline and proc.poll() is None:
            buf += os.read(proc.stderr.fileno(), 4096).decode(errors="replace")
        time.sleep(4)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert "Segmentation fault" not in err and "Traceback" not in err and "Exception ignored" not in err
    assert "SIGINT: stopped" in err
    assert open(earlier).read() == '{"earlier": true}'
    assert not [f for f in os.listdir(save) if ".tmp" in f]


@pytest.mark.slow
def test_a_new_run_from_a_checkpoint_on_new_data_and_resume_keeps_the_data_order(tmp_path, capsys):
    """--init_from: step 0, fresh optimizer state, another dataset (resuming with --load on it was an IndexError
    traceback); --load with another dataset or batch size is refused before work, naming --init_from."""
    from data.synthetic import generate_split

    save = str(tmp_path / "ck")
    train(save, 2)
    new = tmp_path / "new"
    new.mkdir()
    (new / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate_split("train", 40, seed=5)))
    err = fails(capsys, run_finetuning.main, SMALL + ["--steps", "3", "--load", save, "--save", save, "--dataset",
                                                       str(new)], "--init_from")
    assert "--dataset synthetic" in err
    fails(capsys, run_finetuning.main, SMALL + ["--steps", "3", "--load", save, "--save", save,
                                                 "--global_batch_size", "16"], "--global_batch_size 8")
    warm = str(tmp_path / "warm")
    run_finetuning.main(SMALL + ["--steps", "2", "--init_from", save, "--save", warm, "--dataset", str(new),
                                 "--warmup_steps", "2"])
    meta, _ = params_at(warm, 2)
    assert meta["step"] == 2 and meta["config"]["data"]["dataset"] == str(new)
    lines = [json.loads(x) for x in open(os.path.join(warm, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [1, 2] and lines[0]["learning_rate"] == 0.0  # a fresh schedule


ORDER_FLAGS = ("dataset", "hub_config", "train_split", "holdout", "global_batch_size", "packing", "causal_packing",
               "sequence_length", "seed", "input_template", "input_column", "target_column", "labels", "mixture",
               "mixture_rates", "mixture_cap")


@pytest.fixture(scope="module")
def one_step(tmp_path_factory) -> str:
    save = str(tmp_path_factory.mktemp("order") / "ck")
    train(save, 1)
    return save


@pytest.mark.slow
@pytest.mark.parametrize("flag,value", [
    ("dataset", "synthetic-mnli"), ("hub_config", "plain_text"), ("train_split", "validation"), ("holdout", "8"),
    ("global_batch_size", "16"), ("packing", "false"), ("causal_packing", "concat"), ("sequence_length", "24"),
    ("seed", "7"), ("input_template", "nli {premise} | {hypothesis}"), ("input_column", "premise"),
    ("target_column", "hypothesis"), ("labels", "yes maybe no"), ("mixture", "tiny tiny_headlines"),
    ("mixture_cap", "100")])  # (mixture_rates needs a mixture: tests/test_mixture.py resumes one)
def test_resume_refuses_every_change_of_the_data_order(one_step, capsys, flag, value):
    """Each key that decides which examples the next batch holds (run_finetuning.DATA_ORDER, every one of them):
    resuming with another value could not continue the run's stream; the error names the key, both values and
    --init_from, before any work."""
    from app.resume import DATA_ORDER

    assert {f for f, _ in DATA_ORDER} == set(ORDER_FLAGS)
    given = value.split() if flag in ("labels", "mixture") else [value]
    shown = "mnli headlines" if flag == "mixture" else value  # a mixture is named by its tasks' names
    err = fails(capsys, run_finetuning.main, SMALL + ["--steps", "2", "--load", one_step, "--save", one_step,
                                                       f"--{flag}", *given], f"--{flag} {shown}")
    assert "it was trained with" in err and "--init_from" in err
    assert ckpt.saved_steps(one_step) == [1]  # nothing written


def test_malformed_lines_duplicated_columns_and_split_typos_are_named(tmp_path, capsys):
    from data.sources import DataError
    from tests.mnli import load_rows

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"premise": "a", "hypothesis": "b", "label": 0}\n{"premise": "a", "hypothesis": \n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2: not a valid JSON object"):
        load_rows(str(bad), "train")
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"premise": "a", "hypothesis": "b", "label": 0, "label": 2}\n')
    with pytest.raises(DataError, match=r"line 1: .*label appear more than once"):
        load_rows(str(dup), "train")
    csv = tmp_path / "dup.csv"
    csv.write_text("premise,hypothesis,label,label\na,b,0,2\n")
    with pytest.raises(DataError, match=r"line 1: column\(s\) label appear more than once"):
        load_rows(str(csv), "train")
    with pytest.raises(DataError, match=r"did you mean validation_mismatched"):
        load_rows("synthetic", "validaton_mismatched")
    fails(capsys, run_finetuning.main, SMALL + ["--steps", "1", "--sequence_length", "4"], "prompt template")


@pytest.mark.slow
def test_own_words_train_offline_with_a_tokenizer_learnt_from_the_data(tmp_path):
    """--tokenizer train: the tiny preset fine-tunes on sentences of words no shipped tokenizer knows (the
    synthetic tokenizer refused them as 100% unknown), with no download; validation uses the saved tokenizer."""
    import random

    from data import synthetic
    from tests.env import run_optimized

    words = synthetic.NOUNS + synthetic.ADJS + synthetic.VERBS + synthetic.PLACES + synthetic.TIMES
    rng = random.Random(0)
    new = {w: "".join(rng.choice("bcdfghjklmnprstvz") + rng.choice("aeiou") for _ in range(3)) for w in words}

    def own(r):
        return {k: " ".join(new.get(w, w) for w in r[k].split()) for k in ("premise", "hypothesis")} | {
            "label": r["label"]}

    data = tmp_path / "own"
    data.mkdir()
    for split, n in (("train", 3000), ("validation_mismatched", 150)):
        (data / f"{split}.jsonl").write_text("".join(json.dumps(own(r)) + "\n"
                                                     for r in synthetic.generate_split(split, n, seed=11)))
    save = str(tmp_path / "ck")
    run_optimized("run_finetuning.py", ["--config", "tiny", "--dataset", str(data), "--tokenizer", "train", "--save",
                                        save, "--steps", "120", "--learning_rate", "3e-3", "--warmup_steps", "20",
                                        "--checkpoint_steps", "0"])  # (tests/env.py: steps, not compilation)
    assert os.path.isfile(os.path.join(save, "tokenizer", "tokenizer.json"))
    out = tmp_path / "v.json"
    run_validation.main(["--load", save, "--output", str(out)])  # no data flag: the checkpoint's own data
    r = json.load(open(out))
    assert r["dataset"] == str(data) and "validation_mismatched" in r["data"] and r["samples"] == 150
    assert r["prompt_tokens_unknown"] == 0.0 and r["unknown"] == 0
    assert r["accuracy"] > 0.55, r["per_class"]  # chance: 1/3 (measured: 74.7% after 120 steps, 150 words unseen)


def test_no_network_is_one_line_at_once_naming_the_offline_choice(monkeypatch):
    from data.sources import DataError
    from data.tasks import load_tokenizer
    from utils import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "reachable", lambda timeout=3.0: False)  # as on a machine with no network
    t0 = time.time()
    with pytest.raises(DataError, match=r"no network .* --tokenizer train"):
        load_tokenizer("google/flan-t5-small-not-cached")
    assert time.time() - t0 < 20  # the hub's retries took 52 s


def test_no_network_for_a_hub_data_set_is_one_line_without_a_download_attempt(monkeypatch):
    """--config small offline: its data set (nyu-mll/glue) is looked up in the local cache alone, then refused in one
    line naming --dataset PATH; no request is made (datasets' retries took 25 s)."""
    import datasets

    from data.sources import DataError, read
    from utils import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "reachable", lambda timeout=3.0: False)
    calls = []

    def load_dataset(*a, **kw):
        calls.append(datasets.config.HF_HUB_OFFLINE)
        raise FileNotFoundError("not in the cache")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DataError, match=r"no network .* --dataset PATH") as e:
        read("nyu-mll/glue", "train", hub_config="mnli")
    assert calls == [True] and "\n" not in str(e.value)  # the cache, offline; never the network


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


@pytest.mark.slow
def test_truncation_and_unknown_counts_are_in_the_first_metrics_line(tmp_path, caplog):
    """Cut examples and targets are counted in the first metrics line, and a run that cuts targets says in one line
    how many and the flags that keep them whole (a newcomer's own task on tiny trained on targets cut to 4 tokens
    with a warning that named no flag)."""
    save = str(tmp_path / "ck")
    with caplog.at_level(logging.WARNING, logger="flan_t5"):
        run_finetuning.main(SMALL + ["--steps", "1", "--save", save, "--sequence_length", "12",
                                     "--decoder_sequence_length", "1"])  # MNLI's targets are a word and </s>
    first = json.loads(open(os.path.join(save, "metrics.jsonl")).readline())
    assert first["truncated_examples"] > 0 and 0 < first["truncated_share"] <= 1 and first["unknown_token_share"] == 0
    assert first["truncated_targets"] > 0
    line = [r.getMessage() for r in caplog.records if "targets" in r.getMessage()]
    assert len(line) == 1 and "are longer than decoder_sequence_length 1 tokens and are cut" in line[0]
    assert "pass --decoder_sequence_length 2 to keep them whole" in line[0]


@pytest.mark.slow
def test_a_second_signal_during_the_save_stops_at_once_and_earlier_steps_stay_loadable(tmp_path):
    save = str(tmp_path / "ck")
    proc = start(["run_finetuning.py"] + SMALL + ["--steps", "300", "--save", save, "--checkpoint_steps", "2"])

    wait_for_lines(os.path.join(save, "metrics.jsonl"), 5, proc)
    proc.send_signal(signal.SIGTERM)  # finish the step, then save it ...
    time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)  # ... and stop at once, mid-save
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143 and "Traceback" not in err and "Segmentation fault" not in err, err[-2000:]
    # every numbered folder on disk: the steps finished before the second signal are complete and ours; the one it
    # cut short (if its write had begun) is incomplete, never listed as saved, and validation takes the one before
    on_disk = sorted(int(d) for d in os.listdir(save) if d.isdigit())
    complete = [s for s in on_disk if ckpt.is_complete(os.path.join(save, str(s)))]
    assert complete and ckpt.saved_steps(save) == complete and set(on_disk) - set(complete) <= {on_disk[-1]}
    run_validation.main(["--load", save, "--limit", "2"])  # the newest complete step loads
    report = [f for f in os.listdir(save) if f.startswith("validation") and f"step{complete[-1]}" in f]
    assert report, os.listdir(save)
