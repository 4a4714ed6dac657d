"""A training run's data (app/train_data.py): truncation and unknown tokens counted in the first metrics line (the
targets cut said in one line with the flag that keeps them whole), and own words trained offline with a tokenizer
learnt from the data."""

import json
import logging
import os

import pytest

import run_finetuning
import run_validation
from tests.helpers import SMALL


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


def test_a_checkpoint_holds_absolute_paths_and_its_tokenizer_so_it_runs_from_another_directory(tmp_path, monkeypatch):
    """Trained in a project directory on a relative data file with --tokenizer DIR (relative too): the checkpoint
    records both by their absolute paths and holds a copy of the tokenizer (SAVE/tokenizer, which it names), so
    validation from another directory reads the same local file (once "cannot download data set ... no network");
    a resume naming the same --tokenizer DIR again takes the checkpoint's copy; DIR deleted, validation still runs."""
    import shutil

    import run_finetuning
    import run_validation
    from app.train_data import run_tasks
    from data.synthetic import make_tokenizer
    from tests.helpers import SMALL, nli_file, params_at

    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    monkeypatch.chdir(project)
    nli_file(project / "own.jsonl", n=64)
    make_tokenizer().save_pretrained(str(project / "tok"))
    run_finetuning.main(SMALL + ["--dataset", "own.jsonl", "--tokenizer", "tok", "--holdout", "8", "--steps", "1",
                                 "--save", "ck"])
    meta = params_at(str(project / "ck"), 1)[0]
    config = meta["config"]
    assert config["data"]["dataset"] == str(project / "own.jsonl")
    # the longest prompt of the task's rows (as the model reads it), which the server's default width then reads
    from config.presets import config_from_mapping
    from data.sources import read
    from modelling import registry

    run_cfg = config_from_mapping(config)
    family, task = registry.of_config(run_cfg), run_tasks(run_cfg)[0].task
    prompts = [family.prompt(e.input) for e in task.examples(read(str(project / "own.jsonl"), "train"))]
    longest = max(map(len, family.encode_inputs(make_tokenizer(), prompts)))
    assert meta["longest_prompt"] == longest > 16  # (past SMALL's sequence_length: those rows were cut)
    assert config["data"]["tokenizer"] == str(project / "ck" / "tokenizer")
    assert os.path.isfile(project / "ck" / "tokenizer" / "tokenizer.json")
    from app.args import resumed_fields

    _, given = resumed_fields({"load": "ck", "save": "ck", "tokenizer": "tok"})  # (a resume naming DIR again)
    assert "tokenizer" not in given
    _, given = resumed_fields({"load": "ck", "save": "ck", "tokenizer": "synthetic"})
    assert given["tokenizer"] == "synthetic"  # (another one: resume_point names it)
    shutil.rmtree(project / "tok")
    monkeypatch.chdir(elsewhere)
    run_validation.main(["--load", str(project / "ck"), "--limit", "4"])
    assert any(name.startswith("validation_heldout_step1") for name in os.listdir(project / "ck"))
