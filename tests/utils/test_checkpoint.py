"""Checkpoints on disk (utils/checkpoint.py): a step is complete or it is not listed. A write killed half way, or
cut by a second signal mid-save, leaves the earlier steps loadable and no step listed that is not complete; an
incomplete or corrupt step is named with the previous complete one, its cause cut at a word, never an internal
string cut anywhere."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import run_finetuning
import run_validation
from tests.env import child_env
from tests.helpers import ROOT, SMALL, fails, params_at, start, train, wait_for_lines
from tests.helpers import fails as _fails
from utils import checkpoint as ckpt


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


CRASH = r"""
import os, sys
sys.path.insert(0, {root!r})
import orbax.checkpoint as ocp
calls = [0]
orig = ocp.CheckpointManager._finalize
def finalize(self, *a, **k):
    calls[0] += 1
    if calls[0] == 2:  # the second checkpoint's data is written, its commit never happens
        os._exit(17)
    return orig(self, *a, **k)
ocp.CheckpointManager._finalize = finalize
import run_finetuning
run_finetuning.main({argv!r})
"""


@pytest.mark.slow
def test_checkpoint_write_killed_half_way_leaves_the_earlier_one_loadable(tmp_path):
    save = str(tmp_path / "ck")
    argv = SMALL + ["--steps", "2", "--checkpoint_steps", "1", "--save", save]
    proc = subprocess.run([sys.executable, "-c", CRASH.format(root=ROOT, argv=argv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env=child_env(4))
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert ckpt.saved_steps(save) == [1]
    meta, params = params_at(save, 1)
    assert meta["step"] == 1 and all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))
    run_finetuning.main(SMALL + ["--steps", "2", "--save", save, "--load", save])  # resumes from step 1
    assert ckpt.saved_steps(save) == [1, 2]


def test_load_of_a_hugging_face_model_points_to_hf_model(tmp_path, capsys):
    """--load (or --init_from) of run_export.py's output, or any HF model directory, is one line naming --hf_model
    (it was "no checkpoint at DIR"); a directory of neither keeps its own line."""
    import run_validation
    from tests.helpers import fails
    from utils.checkpoint import CheckpointNotFound, resolve

    export = tmp_path / "hf"
    export.mkdir()
    (export / "config.json").write_text('{"model_type": "t5"}')
    with pytest.raises(CheckpointNotFound, match=rf"{export} is a Hugging Face model .*: pass --hf_model {export} "
                                                 "instead"):
        resolve(str(export))
    with pytest.raises(CheckpointNotFound, match="no checkpoint at"):
        resolve(str(tmp_path))
    fails(capsys, run_validation.main, ["--load", str(export)], f"pass --hf_model {export} instead")
