"""Where a training run starts and what it may do to its --save directory (app/resume.py): nothing to train is
refused before work and periodic saves keep their count; foreign numbered folders survive pruning and a step that
would overwrite one is refused before work; a rollback is refused before work, or done on an explicit branch equal
to the uninterrupted run; --init_from starts a new run on new data, and a resume refuses every change of the data
order, naming --init_from; a resume takes the task from the checkpoint and names every disagreement at once; a
checkpoint of another shape names both shapes."""

from __future__ import annotations

import json
import logging
import os

import pytest

import run_finetuning
from tests.helpers import SMALL, fails, params_at, qa_dir, start, train
from tests.helpers import fails as _fails
from utils import checkpoint as ckpt


@pytest.mark.slow
def test_steps_at_or_below_the_checkpoint_and_periodic_saves(tmp_path, capsys, caplog):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "20", "--save", save])
    assert ckpt.saved_steps(save) == [14, 16, 18, 20]  # every tenth of the run by default with --save; 4 kept
    before = {f: os.path.getmtime(os.path.join(r, f)) for r, _, fs in os.walk(save) for f in fs}
    fails(capsys, run_finetuning.main, SMALL + ["--steps", "10", "--save", save, "--load", save],
          f"{save} is at step 20 and --steps is 10: nothing to train")
    assert before == {f: os.path.getmtime(os.path.join(r, f)) for r, _, fs in os.walk(save) for f in fs}
    # resuming with nowhere to save trains, but says so at its start
    with caplog.at_level(logging.WARNING, logger="flan_t5"):
        run_finetuning.main(SMALL + ["--steps", "21", "--load", save, "--run_dir", str(tmp_path / "run")])
    assert f"resuming {save}/20 without --save: nothing of this run will be saved; pass --save {save}" in caplog.text
    assert ckpt.saved_steps(save) == [14, 16, 18, 20]


@pytest.mark.slow
def test_a_checkpoint_of_another_shape_names_both_shapes_and_no_stray_traceback(tmp_path):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "1", "--save", save])
    # a new run from its weights (--init_from) in another shape: the weights' shapes and the flags that fit
    proc = start(["run_finetuning.py"] + SMALL + ["--init_from", save, "--steps", "3", "--hidden_size", "32",
                                                  "--save", str(tmp_path / "other")])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]
    assert "of shape (64,) but this run's model has (32,)" in last and "--hidden_size 64" in last, last
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-2000:]
    # a resume takes its shape from the checkpoint: a flag that contradicts it names both values
    proc = start(["run_finetuning.py"] + SMALL + ["--load", save, "--steps", "3", "--hidden_size", "32",
                                                  "--save", str(tmp_path / "other")])
    _, err = proc.communicate(timeout=300)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 2 and "--hidden_size 32 contradicts the checkpoint" in last, last
    assert "whose hidden_size is 64" in last and "Traceback" not in err


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
    ("mixture_cap", "100")])  # (mixture_rates needs a mixture: tests/data/test_mixture.py resumes one)
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


def test_a_shape_mismatch_hint_names_a_base_s_own_shape_flags_never_lora_s():
    """A LoRA run over weights of another vocabulary (--init_from a full checkpoint): the hint names the flags the
    weights were trained with (--vocab_size 64), not the adapters' fields that checkpoint never had (--lora_rank 0
    told a LoRA run to drop its adapters); a LoRA checkpoint's own rank is named where it differs."""
    from config import load_config
    from config.carry import shape_hint
    from config.presets import to_dict

    base = to_dict(load_config("finetuning", "tiny", {"vocab_size": 64}))
    lora_run = load_config("finetuning", "tiny", {"vocab_size": 128, "lora_rank": 4, "lora_targets": ["q", "v"]})
    assert shape_hint(lora_run, base) == "it was trained with --vocab_size 64: pass the same (or that run's preset)"
    adapters = to_dict(load_config("finetuning", "tiny", {"vocab_size": 128, "lora_rank": 8,
                                                          "lora_targets": ["q", "v"]}))
    assert shape_hint(lora_run, adapters) == "it was trained with --lora_rank 8: pass the same (or that run's preset)"


def test_a_run_from_a_base_reads_text_with_the_base_s_tokenizer_and_lora_is_refused_another(tmp_path, capsys, caplog):
    """--init_from's checkpoint names the tokenizer its embedding's rows are the ids of: a run given none takes it;
    a LoRA run given another, or --tokenizer train (which once learnt one keeping 72 of 512 ids' meaning, without a
    word), is refused in one line before anything is written; a full fine-tune given another is warned; --tokenizer
    train on an --hf_model base is refused too."""
    import logging

    import run_finetuning
    from app.resume import base_tokenizer
    from config import load_config
    from data.synthetic import make_tokenizer
    from tests.helpers import save_random_checkpoint
    from utils.errors import FlanT5Error

    learnt = str(tmp_path / "learnt")
    make_tokenizer().save_pretrained(learnt)
    ck = str(tmp_path / "base")
    save_random_checkpoint("tiny", ck, tokenizer=learnt)

    def cfg(**kw):
        return load_config("finetuning", "tiny", kw)

    run = cfg(lora_rank=2)
    base_tokenizer(run, ck, given=False)
    assert run.data.tokenizer == learnt
    for lora, tokenizer in ((2, "train"), (2, "synthetic")):
        with pytest.raises(FlanT5Error, match="LoRA adapters read their base's frozen embedding") as e:
            base_tokenizer(cfg(lora_rank=lora, tokenizer=tokenizer), ck, given=True)
        assert "drop --tokenizer" in str(e.value) and "\n" not in str(e.value)
    with caplog.at_level(logging.WARNING, logger="flan_t5"):
        full = cfg(tokenizer="synthetic")
        base_tokenizer(full, ck, given=True)
    assert full.data.tokenizer == "synthetic" and f"the tokenizer {learnt}, which {ck}/1 was trained" in caplog.text
    same = cfg(lora_rank=2, tokenizer=learnt)
    base_tokenizer(same, ck, given=True)  # (the base's own: taken)
    with pytest.raises(FlanT5Error, match="--tokenizer train learns a new tokenizer"):
        base_tokenizer(cfg(lora_rank=2, tokenizer="train", hf_model=str(tmp_path)), None, given=True)
    base_tokenizer(cfg(lora_rank=2, tokenizer="train"), None, given=True)  # (a random base: nothing to keep)
    save = tmp_path / "lora"
    fails(capsys, run_finetuning.main, SMALL + ["--init_from", ck, "--lora_rank", "2", "--tokenizer", "train",
                                                "--save", str(save), "--steps", "1"],
          "--tokenizer train learns a new tokenizer, but LoRA adapters read their base's frozen embedding")
    assert not save.exists()


def test_a_checkpoint_that_recorded_a_relative_path_resumes_with_its_absolute_form(tmp_path, monkeypatch):
    """A run's local paths are now absolute; a checkpoint that recorded one relative (before) resumes from the
    directory it was trained in: the same file, not 'another data order'."""
    from app.resume import resume_point
    from config import load_config
    from tests.helpers import nli_file, save_random_checkpoint

    monkeypatch.chdir(tmp_path)
    nli_file(tmp_path / "own.jsonl", n=8)
    save_random_checkpoint("tiny", "ck", dataset="own.jsonl")
    cfg = load_config("finetuning", "tiny", {"dataset": str(tmp_path / "own.jsonl"), "load": "ck", "steps": 5})
    assert resume_point(cfg) == ("ck", 1)
    other = load_config("finetuning", "tiny", {"dataset": "synthetic", "load": "ck", "steps": 5})
    with pytest.raises(Exception, match="--dataset synthetic"):
        resume_point(other)
