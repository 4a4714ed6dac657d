"""Run directories (app/rundir.py): one run at a time in a directory (the second stops at once, naming the first), a
fresh directory for a run without --save, another run's metrics never truncated, and a failed run's lock leaving
the directories it made and nothing else."""

from __future__ import annotations

import os
import time

import pytest

import run_finetuning
from tests.helpers import SMALL, fails, start


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


def test_a_run_refused_after_it_learnt_its_tokenizer_leaves_no_directory(tmp_path, capsys, monkeypatch):
    """--holdout as large as the data is refused after --tokenizer train learnt a tokenizer into the run directory:
    the directory it made goes, lock and tokenizer with it (docs/training.md: a refused run leaves none), with or
    without --save; a tokenizer beside a checkpoint step, or in a directory the run did not make, stays."""
    from app.rundir import RunLock
    from tests.helpers import nli_file

    monkeypatch.chdir(tmp_path)
    data = nli_file(tmp_path / "small.jsonl", n=8)
    run = SMALL + ["--dataset", data, "--holdout", "8", "--tokenizer", "train", "--steps", "1"]
    for extra in (["--save", "r1"], []):
        fails(capsys, run_finetuning.main, run + extra, "--holdout 8 holds out every one of the 8 training examples")
        assert not (tmp_path / "r1").exists() and not (tmp_path / "runs").exists(), os.listdir(tmp_path)
    made = tmp_path / "r2"
    lock = RunLock(str(made))
    (made / "tokenizer").mkdir()
    (made / "1").mkdir()  # a step: the run's result
    lock.release()
    assert (made / "tokenizer").exists()
    theirs = tmp_path / "theirs"
    (theirs / "tokenizer").mkdir(parents=True)
    RunLock(str(theirs)).release()
    assert (theirs / "tokenizer").exists()
