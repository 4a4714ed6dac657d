"""A run that goes wrong says so (issue 15): bad numbers, non-finite losses, signals, paths that cannot be
written, malformed data, checkpoints of another shape, W&B without a login, logs and help for a cluster job.

Each test reproduces a reported failure mode: on the code before these changes it failed (or exited 0
with nothing useful, or lost work).
"""

import json
import logging
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.env import child_env

import run_finetuning
import run_validation
from tests.test_finetuning_cli import ROOT, SMALL, params_at
from utils import checkpoint as ckpt


def _fails(capsys, main, argv, message, code=2):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == code, e.value.code
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert err and message in err[-1], err[-3:]
    assert not any("Traceback" in line for line in err)
    return err[-1]


def _subprocess(argv, devices=4, **kw):
    env = child_env(devices, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable] + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


@pytest.mark.parametrize("value,message", [
    ("nan", "learning_rate=nan is not a finite number"),
    ("1e9", "learning_rate=1e+09 is outside (0, 1]"),
    ("-1e-3", "learning_rate=-0.001 is outside (0, 1]"),  # with a space: a value, not an argparse usage dump
])
def test_bad_learning_rates_are_refused_before_any_work(tmp_path, capsys, value, message):
    save = str(tmp_path / "ck")
    _fails(capsys, run_finetuning.main, SMALL + ["--save", save, "--learning_rate", value], message)
    assert not ckpt.saved_steps(save)
    _fails(capsys, run_finetuning.main, SMALL + ["--gradient_clipping", "inf"], "gradient_clipping=inf is not a finite")


def test_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, capsys, monkeypatch):
    """The loss and weights turn NaN in step 3 (as a too-high learning rate makes them): the run stops there
    with exit 3 and the step and causes named; checkpoints 1 and 2 stay, no checkpoint 3 is written."""
    from graphs.fused import FusedExecutor

    real = FusedExecutor.train_step

    def poisoned(self, state, batch, rng=None, loss_scale=None, clip_norm=None):
        state, metrics = real(self, state, batch, rng, loss_scale, clip_norm)
        if int(state.step) >= 3:
            state.params = jax.tree.map(lambda x: x * np.nan, state.params)
            metrics = {**metrics, "loss": metrics["loss"] * np.nan}
        return state, metrics

    monkeypatch.setattr(FusedExecutor, "train_step", poisoned)
    save = str(tmp_path / "ck")
    line = _fails(capsys, run_finetuning.main, SMALL + ["--steps", "5", "--checkpoint_steps", "1", "--save", save],
                  "step 3: loss nan", code=3)
    assert "learning rate" in line and f"{save}/2, is kept" in line
    assert ckpt.saved_steps(save) == [1, 2]
    _, params = params_at(save, 2)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))


def _wait_for_steps(path, n, proc, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read()[-3000:])
        time.sleep(0.2)
    raise AssertionError("the run did not reach step %d" % n)


def test_sigterm_saves_the_step_and_resuming_gives_the_uninterrupted_weights(tmp_path):
    steps = ["--steps", "150", "--checkpoint_steps", "0"]  # no periodic checkpoint: only the signal saves
    stopped, whole = str(tmp_path / "stopped"), str(tmp_path / "whole")
    proc = _subprocess(["run_finetuning.py"] + SMALL + steps + ["--save", stopped])
    _wait_for_steps(os.path.join(stopped, "metrics.jsonl"), 3, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert "Traceback" not in err and "SIGTERM: stopped after step" in err
    (k,) = ckpt.saved_steps(stopped)
    assert 3 <= k < 150
    # resuming: the metrics keep steps 1..k once, then the run continues to the same weights as one that never stopped
    run_finetuning.main(SMALL + steps + ["--save", stopped, "--load", stopped])
    run_finetuning.main(SMALL + steps + ["--save", whole])
    lines = [json.loads(x)["step"] for x in open(os.path.join(stopped, "metrics.jsonl"))]
    assert lines == list(range(1, 151))
    (_, a), (_, b) = params_at(stopped, 150), params_at(whole, 150)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_ctrl_c_saves_the_step_and_exits_130_without_a_traceback(tmp_path):
    save = str(tmp_path / "ck")
    proc = _subprocess(["run_finetuning.py"] + SMALL + ["--steps", "150", "--save", save, "--checkpoint_steps", "0"])
    _wait_for_steps(os.path.join(save, "metrics.jsonl"), 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    (k,) = ckpt.saved_steps(save)
    # the hint is the command that resumes and goes on saving
    assert f"SIGINT: stopped after step {k}: saved {save}/{k}; resume (and go on saving) with --load {save} " \
           f"--save {save}" in err, err[-2000:]


def test_steps_at_or_below_the_checkpoint_and_periodic_saves(tmp_path, capsys, caplog):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "20", "--save", save])
    assert ckpt.saved_steps(save) == [14, 16, 18, 20]  # every tenth of the run by default with --save; 4 kept
    before = {f: os.path.getmtime(os.path.join(r, f)) for r, _, fs in os.walk(save) for f in fs}
    _fails(capsys, run_finetuning.main, SMALL + ["--steps", "10", "--save", save, "--load", save],
           f"{save} is at step 20 and --steps is 10: nothing to train")
    assert before == {f: os.path.getmtime(os.path.join(r, f)) for r, _, fs in os.walk(save) for f in fs}
    # resuming with nowhere to save trains, but says so at its start
    with caplog.at_level(logging.WARNING, logger="flan_t5"):
        run_finetuning.main(SMALL + ["--steps", "21", "--load", save, "--run_dir", str(tmp_path / "run")])
    assert f"resuming {save}/20 without --save: nothing of this run will be saved; pass --save {save}" in caplog.text
    assert ckpt.saved_steps(save) == [14, 16, 18, 20]


def test_unwritable_paths_fail_before_the_model_is_built(tmp_path, capsys, monkeypatch):
    import graphs.graphs

    def never(*a, **k):
        raise AssertionError("the model was built before the path was checked")

    monkeypatch.setattr(graphs.graphs.Graphs, "__init__", never)
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where a directory would have to be: unwritable even for root
    _fails(capsys, run_finetuning.main, SMALL + ["--save", str(blocker / "ck")], f"--save {blocker / 'ck'} cannot be written")
    _fails(capsys, run_finetuning.main, SMALL + ["--run_dir", str(blocker / "run")], "--run_dir")
    _fails(capsys, run_validation.main, ["--config", "tiny", "--hf_model", "x", "--output", str(blocker / "r.json")],
           "--output")


def test_limit_must_be_positive_and_never_replaces_the_full_report(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "1", "--save", save])
    run_validation.main(["--config", "tiny", "--load", save])
    full = os.path.join(save, "validation_step1.json")
    report = json.load(open(full))
    assert report["samples"] == 1000 and report["limit"] is None
    for bad in ("0", "-990"):
        _fails(capsys, run_validation.main, ["--config", "tiny", "--load", save, "--limit", bad], "must be at least 1")
    run_validation.main(["--config", "tiny", "--load", save, "--limit", "10"])
    assert json.load(open(full)) == report  # untouched
    assert json.load(open(os.path.join(save, "validation_step1_first10.json")))["samples"] == 10


def _csv(path, rows):
    import pandas as pd

    pd.DataFrame(rows, columns=["premise", "hypothesis", "label"]).to_csv(path, index=False)
    return str(path)


def test_labels_as_class_names_and_blank_cells_named_by_row(tmp_path):
    from data.mnli import DataError, load_rows

    ok = _csv(tmp_path / "a.csv", [["the cat runs .", "the cat runs .", "entailment"],
                                   ["the dog eats .", "the dog eats now .", "Neutral"],
                                   ["the cow .", "the pig .", 2]])
    assert [r["label"] for r in load_rows(ok, "train")] == [0, 1, 2]
    # a blank cell makes pandas read every label as text: '0' is a label, the blank one is the error
    blank = _csv(tmp_path / "b.csv", [["a .", "a .", 0], ["b .", "b .", 1], ["c .", "c .", ""]])
    with pytest.raises(DataError, match=r"row 2 \(line 4\): column 'label' is empty"):
        load_rows(blank, "train")
    bad = _csv(tmp_path / "c.csv", [["a .", "a .", 0], ["b .", "b .", "maybe"]])
    with pytest.raises(DataError, match=r"row 1 \(line 3\): column 'label' must be .* got 'maybe'"):
        load_rows(bad, "train")
    empty_text = _csv(tmp_path / "d.csv", [["a .", "", 0]])
    with pytest.raises(DataError, match=r"row 0 \(line 2\): column 'hypothesis' is empty"):
        load_rows(empty_text, "train")


def test_a_tokenizer_that_does_not_know_the_text_is_refused(tmp_path, capsys):
    english = _csv(tmp_path / "train.csv", [[f"The quarterly report number {i} was published late.",
                                             "A report was published.", i % 3] for i in range(40)])
    _fails(capsys, run_finetuning.main, SMALL + ["--dataset", english],
           "are unknown (<unk>) to tokenizer 'synthetic': the synthetic tokenizer knows only")


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


def test_a_checkpoint_of_another_shape_names_both_shapes_and_no_stray_traceback(tmp_path):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "1", "--save", save])
    # a new run from its weights (--init_from) in another shape: the weights' shapes and the flags that fit
    proc = _subprocess(["run_finetuning.py"] + SMALL + ["--init_from", save, "--steps", "3", "--hidden_size", "32",
                                                        "--save", str(tmp_path / "other")])
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 2
    last = err.strip().splitlines()[-1]
    assert "of shape (64,) but this run's model has (32,)" in last and "--hidden_size 64" in last, last
    assert "Traceback" not in err and "Event loop is closed" not in err, err[-2000:]
    # a resume takes its shape from the checkpoint: a flag that contradicts it names both values
    proc = _subprocess(["run_finetuning.py"] + SMALL + ["--load", save, "--steps", "3", "--hidden_size", "32",
                                                        "--save", str(tmp_path / "other")])
    _, err = proc.communicate(timeout=300)
    last = err.strip().splitlines()[-1]
    assert proc.returncode == 2 and "--hidden_size 32 contradicts the checkpoint" in last, last
    assert "whose hidden_size is 64" in last and "Traceback" not in err


def test_validation_takes_the_model_shape_from_the_checkpoint_and_the_hf_config(tmp_path, capsys):
    from modelling.hf_mapping import save_hf_model
    from tests.hf_utils import make_hf

    save = str(tmp_path / "ck")  # a shape the tiny inference preset does not have
    run_finetuning.main(SMALL + ["--steps", "1", "--save", save, "--hidden_size", "32", "--layers", "2", "--heads", "2"])
    run_validation.main(["--config", "tiny", "--load", save, "--limit", "4"])
    assert json.load(open(os.path.join(save, "validation_step1_first4.json")))["samples"] == 4
    _fails(capsys, run_validation.main, ["--config", "tiny", "--load", save, "--layers", "4"],
           "--layers 4 contradicts the checkpoint")
    # an HF model directory of another shape: no shape flags needed
    _, m, params = make_hf("1.1", vocab_size=128, d_model=40, d_ff=96, num_heads=5, d_kv=8, num_layers=3)
    save_hf_model(jax.tree.map(np.asarray, params), m, str(tmp_path / "hf"))
    out = tmp_path / "hf.json"
    run_validation.main(["--config", "tiny", "--hf_model", str(tmp_path / "hf"), "--limit", "3", "--output", str(out),
                         "--tensor_parallel", "1", "--data_parallel", "1"])
    assert json.load(open(out))["samples"] == 3


def test_wandb_without_a_login_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    _fails(capsys, run_finetuning.main, SMALL + ["--wandb", "--save", str(tmp_path / "ck")],
           "W&B has no login on this machine: run `wandb login`")
    assert not os.path.exists(tmp_path / "ck" / "metrics.jsonl")


def test_a_cluster_log_gets_progress_lines_and_a_readable_loss_curve(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = _subprocess(["run_finetuning.py"] + SMALL + ["--steps", "8", "--run_dir", run_dir, "--log_every", "2"])
    _, err = proc.communicate(timeout=300)  # stderr is a pipe, not a terminal
    assert proc.returncode == 0, err[-2000:]
    lines = [line for line in err.splitlines() if " step " in line and " ETA " in line]
    assert [line.split(" step ")[1].split()[0] for line in lines] == ["2/8", "4/8", "6/8", "8/8"], lines
    assert all("loss" in line and "lr" in line and "samples/s" in line for line in lines)
    from app.tracking import plot_loss_curve

    drawn = plot_loss_curve(os.path.join(run_dir, "metrics.jsonl"), str(tmp_path / "curve.png"), "tiny (run)")
    assert drawn["curves"] == ["loss", "loss, smoothed", "learning rate"] and "tiny (run)" in drawn["title"]
    assert os.path.getsize(os.path.join(run_dir, "loss_curve.png")) > 10000


def test_help_shows_the_presets_values_without_internal_names(capsys):
    with pytest.raises(SystemExit):
        run_finetuning.main(["--config", "xl_pod8", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "residual stream (hf: d_model). [xl_pod8: 2048]" in out  # hidden_size
    assert "(mesh axis 'tp'). [xl_pod8: 8]" in out  # tensor_parallel
    assert "CFG__" not in out and "(default: None)" not in out


def test_every_driver_shares_the_entry_wrapper_and_the_error_base():
    import finetuning
    import inference
    from benchmarks import hf_baseline
    from config import ConfigError
    from data.mnli import DataError
    from graphs.plan import PlanError
    from graphs.sharding import DeviceCountError
    from modelling.hf_mapping import CheckpointError
    from utils.errors import FlanT5Error

    for module in (run_finetuning, run_validation, finetuning, inference, hf_baseline):
        assert module.main.__wrapped__  # utils.cli.entry
    for cls in (ConfigError, DataError, PlanError, DeviceCountError, CheckpointError, ckpt.CheckpointNotFound,
                ckpt.CheckpointShapeError):
        assert issubclass(cls, FlanT5Error)


def test_a_device_out_of_memory_is_one_line_with_the_bytes_and_the_knobs(capsys):
    """A real XLA out-of-memory error (4 TiB asked of this CPU) under the drivers' entry wrapper."""
    import jax.numpy as jnp

    from app.entry import entry

    @entry
    def main(argv):
        jnp.zeros((2 ** 40,), jnp.float32).block_until_ready()

    line = _fails(capsys, main, [], "a device ran out of memory allocating 4096.0 GiB", code=4)
    assert "--micro_batch_size" in line and "--phased true" in line and "--plan" in line
