"""What a new user hit with their own data (issue 45), each as the user met it: predictions continued by another
model, a learnt tokenizer filling a tiny vocabulary, training rows scored as held-out ones, a mixture task's split,
resuming an own-task run, the best step deleted, --limit with --input, empty run directories, a header-only CSV,
a truncated checkpoint's error, the task's name, a null target, --split warnings, --load missing from the decoding
drivers, PEFT's base path, hf/ in .gitignore, the decoder's layers in the log."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import run_inference
from tests.test_robustness import _fails

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
        req = cache.Request([mixture.tasks_of(cfg)[0].part(cfg)], "t5", "train", str(tmp_path / "c"),
                            vocab_size=vocab)
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
