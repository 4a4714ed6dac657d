"""Prediction (app/predict.py): a predictions file records what wrote it (the checkpoint, its step, the weights'
fingerprint, the decoding) and is not continued by another model or setting; Ctrl-C keeps the finished batches whole
and says so; --limit takes the first rows of --input; validation never cuts a prompt."""

from __future__ import annotations

import json
import os

import pytest

import run_inference
import run_validation
from data.tasks import Example
from tests.helpers import fails as _fails
from tests.helpers import train


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


def test_the_predictions_keep_the_input_s_id_column_row_for_row(two_models, tmp_path):
    """An input with an id column (id, idx, uid or guid, in any case): each prediction carries its own row's id, under
    the input's name for it, a dropped row (label -1) skipped without shifting the others (the column was dropped);
    an input without one gets none."""
    a, _, _ = two_models
    rows = [{"ID": f"t-{i}", "premise": f"the cat sleeps in the park {i}", "hypothesis": "the cat sleeps",
             "label": -1 if i == 1 else 0} for i in range(4)]
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    run_inference.main(["--load", a, "--input", str(src), "--predictions", str(out)])
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(x["row"], x["ID"]) for x in lines] == [(0, "t-0"), (1, "t-2"), (2, "t-3")]
    assert [x["input"].split("park ")[1].split()[0] for x in lines] == ["0", "2", "3"]  # (each its own row's)
    from types import SimpleNamespace

    from app.predict import id_column, named

    task = SimpleNamespace(fields=("premise", "hypothesis"))
    assert id_column(SimpleNamespace(rows=[{"premise": "a", "hypothesis": "b"}]), task) is None
    assert id_column(SimpleNamespace(rows=[{"premise": "a", "Guid": 3}]), task) == "Guid"
    assert id_column(SimpleNamespace(rows=[{"id": "a"}]), SimpleNamespace(fields=("id",))) is None  # (the task's own)
    assert named(Example("a", "")) == {}
def test_a_bad_word_is_banned_alone_and_after_a_space_and_never_as_the_end_of_text_token_alone():
    """--bad_words: each word's tokens as a text starts with it and after a space (a byte-level BPE's two spellings
    of a word; a word-level or Metaspace tokenizer's one), each sequence once; a word that is the end-of-text token
    alone is left out (HF's NoBadWordsLogitsProcessor leaves it to end answers)."""
    from app.predict import bad_words
    from tests.tokenizer_kinds import make

    tok = make("bytelevel")
    ids = lambda text: tuple(tok(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert ids("cat") != ids(" cat")
    assert bad_words(tok, ("cat", " cat ", "the park"), tok.eos_token_id) == [ids("cat"), ids(" cat"), ids("the park"),
                                                                                ids(" the park")]
    assert (tok.eos_token_id,) not in bad_words(tok, ("<|endoftext|>",), tok.eos_token_id)
    word_level = make("synthetic")
    assert bad_words(word_level, ("cat",), word_level.eos_token_id) == [tuple(word_level("cat", add_special_tokens=False)
                                                                             ["input_ids"])]
