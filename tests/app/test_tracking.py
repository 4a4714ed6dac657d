"""Run logging (app/tracking.py): W&B without a login is one line before any work, an offline W&B run logs the
metrics and the config, and a cluster's log gets progress lines and a readable loss curve."""

import os

import pytest

import run_finetuning
from tests.helpers import SMALL, fails, start


def test_wandb_without_a_login_is_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    fails(capsys, run_finetuning.main, SMALL + ["--wandb", "--save", str(tmp_path / "ck")],
          "W&B has no login on this machine: run `wandb login`")
    assert not os.path.exists(tmp_path / "ck" / "metrics.jsonl")


@pytest.mark.slow
def test_a_cluster_log_gets_progress_lines_and_a_readable_loss_curve(tmp_path):
    run_dir = str(tmp_path / "run")
    proc = start(["run_finetuning.py"] + SMALL + ["--steps", "8", "--run_dir", run_dir, "--log_every", "2"])
    _, err = proc.communicate(timeout=300)  # stderr is a pipe, not a terminal
    assert proc.returncode == 0, err[-2000:]
    lines = [line for line in err.splitlines() if " step " in line and " ETA " in line]
    assert [line.split(" step ")[1].split()[0] for line in lines] == ["2/8", "4/8", "6/8", "8/8"], lines
    assert all("loss" in line and "lr" in line and "samples/s" in line for line in lines)
    from app.tracking import plot_loss_curve

    drawn = plot_loss_curve(os.path.join(run_dir, "metrics.jsonl"), str(tmp_path / "curve.png"), "tiny (run)")
    assert drawn["curves"] == ["loss", "loss, smoothed", "learning rate"] and "tiny (run)" in drawn["title"]
    assert os.path.getsize(os.path.join(run_dir, "loss_curve.png")) > 10000


@pytest.mark.slow
def test_wandb_offline_run_logs_metrics_and_config(tmp_path, monkeypatch):
    import glob

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = str(tmp_path / "run")
    run_finetuning.main(SMALL + ["--steps", "2", "--run_dir", run_dir, "--wandb", "--wandb-name", "smoke",
                                 "--holdout", "16", "--eval_every", "2", "--eval_rows", "4"])
    # run.finish() in offline mode can return before W&B's service process has flushed the run file
    # (seen on CI); teardown waits for the service to exit, as the atexit hook does at process end.
    import wandb

    wandb.teardown()
    runs = glob.glob(os.path.join(run_dir, "wandb", "offline-run-*"))
    assert len(runs) == 1
    files = glob.glob(os.path.join(runs[0], "*.wandb"))
    assert files and os.path.getsize(files[0]) > 0
    data = open(files[0], "rb").read()
    for needle in (b"smoke", b"learning_rate", b"samples_per_s", b"micro_batch_size", b"jaxlib", b"eval_accuracy"):
        assert needle in data, needle  # run name, logged metrics (the held-out score too), config, library versions
