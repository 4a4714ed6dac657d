"""End-to-end runs of run_finetuning.py / run_validation.py on the tiny preset (offline).

In-process calls share this process's 8 simulated devices; the crash test runs in a subprocess.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from tests.env import child_env
from tests.helpers import ROOT, SMALL, build, params_at

import run_finetuning
import run_validation
from app.resume import initial_state, resume_point
from utils import checkpoint as ckpt

pytestmark = pytest.mark.slow  # every test here runs a driver end to end (tests/test_trainer.py: the loop's own contracts)


@pytest.mark.parametrize("extra", [
    ["--dropout_prob", "0.1", "--warmup_steps", "3"],  # the dropout RNG and the schedule resume exactly
    # 16-bit master weights: the stochastic rounding's draws resume exactly
    ["--dropout_prob", "0.1", "--warmup_steps", "3", "--precision", "bfloat16", "--stochastic_rounding", "true"],
    # layers updated in the backward, clipped with the previous step's norm (in the checkpoint's metadata)
    ["--phased", "true", "--update_in_backward", "true", "--gradient_clipping", "0.05"],
], ids=["dropout-warmup", "bf16-stochastic-rounding", "phased-update-in-backward"])
def test_two_steps_then_resume_equals_uninterrupted(tmp_path, extra):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_finetuning.main(SMALL + extra + ["--steps", "2", "--save", a])
    run_finetuning.main(SMALL + extra + ["--steps", "1", "--save", b])
    run_finetuning.main(SMALL + extra + ["--steps", "2", "--save", b, "--load", b])
    # with --save, a checkpoint every tenth of the run by default (here every step)
    assert ckpt.saved_steps(a) == [1, 2] and ckpt.saved_steps(b) == [1, 2]
    meta_a, pa = params_at(a, 2)
    meta_b, pb = params_at(b, 2)
    # packed rows (the default): two steps of 8 rows took more than 16 examples; the resumed run
    # continued the same stream, held-over examples included
    assert meta_a["data_position"] == meta_b["data_position"] > 16
    assert meta_a["data_pending"] == meta_b["data_pending"]
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(x, y)
    _, p1 = params_at(b, 1)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(p1), jax.tree.leaves(pb)))
    if "--stochastic_rounding" in extra:  # saved as they train: 16-bit matmul weights, float32 norms
        assert pa["encoder"]["layers"]["q"].dtype == jax.numpy.bfloat16
        assert pa["encoder"]["layers"]["attn_norm"].dtype == np.float32
    # metrics file and loss curve of the run, one metrics line per step
    lines = [json.loads(x) for x in open(os.path.join(a, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [1, 2] and all(np.isfinite(r["loss"]) for r in lines)
    assert os.path.getsize(os.path.join(a, "loss_curve.png")) > 1000

def test_the_driver_clips_updates_in_the_backward_with_the_previous_norm(tmp_path):
    """--update_in_backward through run_finetuning.py: its weights are the executor's stepped with the previous
    step's norm as the clip norm (the driver's part), and unlike those of the same steps unclipped."""
    from app.args import make_config

    flags = {"update_in_backward": "true", "gradient_clipping": "0.05", "steps": "3"}
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + [x for k, v in flags.items() for x in (f"--{k}", v)] + ["--save", save])
    _, driver = params_at(save, 3)
    overrides = {a.lstrip("-"): b for a, b in zip(SMALL[2::2], SMALL[3::2])}
    cfg = make_config("finetuning", "tiny", {**overrides, **flags})
    executor, loader = build(cfg)
    batches = [executor.g.shard_batch(loader.next_batch()) for _ in range(3)]

    def stepped(stale: bool) -> list:
        state, norm = executor.init_state(), None
        for b in batches:
            state, m = executor.train_step(state, b, clip_norm=norm if stale else None)
            norm = float(m["grad_norm"])
        assert norm > 0.05  # clipping would trigger at every step
        return [np.asarray(x) for x in jax.tree.leaves(state.params)]

    clipped, unclipped = stepped(stale=True), stepped(stale=False)
    for x, y in zip(jax.tree.leaves(driver), clipped):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert max(float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(driver), unclipped)) > 1e-4


def test_phased_run_resumes_a_fused_checkpoint_and_saves_the_same_layout(tmp_path):
    """--phased true: a fused checkpoint resumes under the phased executor, which saves the stacked
    layout (any executor or run_validation loads it); equal to two phased steps uninterrupted."""
    phased, mixed = str(tmp_path / "phased"), str(tmp_path / "mixed")
    run_finetuning.main(SMALL + ["--steps", "2", "--save", phased, "--phased", "true"])
    run_finetuning.main(SMALL + ["--steps", "1", "--save", mixed])
    run_finetuning.main(SMALL + ["--steps", "2", "--save", mixed, "--load", mixed, "--phased", "true"])
    (meta_p, pp), (meta_m, pm) = params_at(phased, 2), params_at(mixed, 2)
    assert meta_p["data_position"] == meta_m["data_position"] > 16
    for x, y in zip(jax.tree.leaves(pm), jax.tree.leaves(pp)):
        assert x.shape == y.shape and np.linalg.norm(x - y) <= 1e-5 * np.linalg.norm(y)
    losses = [[json.loads(x)["loss"] for x in open(os.path.join(d, "metrics.jsonl"))] for d in (phased, mixed)]
    np.testing.assert_allclose(losses[0][1], losses[1][-1], rtol=1e-5)


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

def test_validation_after_training_writes_report(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "2", "--checkpoint_steps", "1", "--save", save])
    run_validation.main(["--config", "tiny", "--load", save + "/*", "--limit", "9", "--micro_batch_size", "4"])
    out = capsys.readouterr().out
    assert out.index("step 1:") < out.index("step 2:")  # every checkpoint, in step order
    for step in (1, 2):
        r = json.load(open(os.path.join(save, f"validation_step{step}_first9.json")))  # a --limit run's name
        assert r["samples"] == 9 and len(r["predictions"]) == 9 and r["step"] == step
        assert 0.0 <= r["accuracy"] <= 1.0
        assert sum(map(sum, r["confusion_matrix"]["counts"])) == 9
    from app.evaluate import report_name

    assert report_name("validation_mismatched", 1000) == "validation_mismatched_step1000.json"
    assert report_name("test") == "validation_test.json"
    assert report_name("validation_mismatched", 10, limit=5) == "validation_mismatched_step10_first5.json"
    assert report_name("validation", 10, decoding="beam4") == "validation_step10_beam4.json"

def _fails(capsys, main, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err[-1:]
    return err[-1]

def test_bad_inputs_fail_with_one_line_and_keep_saved_checkpoints(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run_finetuning.main(SMALL + ["--steps", "1", "--save", save])
    before = {f: os.path.getmtime(os.path.join(r, f)) for r, _, fs in os.walk(save) for f in fs}

    _fails(capsys, run_finetuning.main, ["--config", "xxl_pod4"], "unknown preset 'xxl_pod4'")
    _fails(capsys, run_finetuning.main, SMALL + ["--steps", "1", "--save", save], "already holds checkpoints")
    _fails(capsys, run_finetuning.main, SMALL + ["--load", str(tmp_path / "none")], "no checkpoint at")
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"premise": "x", "label": 0}\n')
    _fails(capsys, run_finetuning.main, SMALL + ["--dataset", str(bad)], "row 0 (line 1): column 'hypothesis' is missing")
    _fails(capsys, run_finetuning.main, SMALL + ["--hf_model", str(tmp_path / "nomodel")], "does not exist")
    _fails(capsys, run_finetuning.main, SMALL + ["--data_parallel", "4", "--tensor_parallel", "4"],
           "xla_force_host_platform_device_count=16")
    _fails(capsys, run_validation.main, ["--config", "tiny"], "nothing to validate")

    after = {f: os.path.getmtime(os.path.join(r, f)) for r, _, fs in os.walk(save) for f in fs}
    assert before == after  # nothing saved was touched

    # a corrupt checkpoint: its array data truncated
    step_dir = os.path.join(save, "1", "params")
    for root, _, files in os.walk(step_dir):
        for f in files:
            p = os.path.join(root, f)
            if os.path.getsize(p) > 100:
                with open(p, "r+b") as fh:
                    fh.truncate(10)
    _fails(capsys, run_validation.main, ["--config", "tiny", "--load", save], "cannot load checkpoint")


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


def test_hf_model_directory_initialises_training_and_validation(tmp_path, capsys):
    from config import load_config
    from modelling.hf_mapping import hf_state_dict_from_params
    from tests.hf_utils import make_hf

    hf, m, _ = make_hf("1.1", vocab_size=128, d_model=64, d_ff=256, num_heads=4, d_kv=16, num_layers=4,
                       relative_attention_num_buckets=32, relative_attention_max_distance=128)
    hf.save_pretrained(tmp_path / "hf")
    cfg = load_config("finetuning", "tiny", {"hf_model": str(tmp_path / "hf"), "sequence_length": 16})
    executor, loader = build(cfg)
    state, start = initial_state(cfg, executor, loader, resume_point(cfg))
    assert start == 0
    ours = hf_state_dict_from_params(jax.tree.map(np.asarray, state.params), cfg.model)
    assert not np.array_equal(hf.lm_head.weight.detach().numpy(), hf.shared.weight.detach().numpy())  # untied
    for name, ref in hf.state_dict().items():
        np.testing.assert_array_equal(ours[name], ref.numpy(), err_msg=name)

    out = tmp_path / "val.json"
    run_validation.main(["--config", "tiny", "--hf_model", str(tmp_path / "hf"), "--limit", "6", "--output", str(out)])
    r = json.load(open(out))
    assert r["samples"] == 6 and len(r["predictions"]) == 6 and r["checkpoint"] == str(tmp_path / "hf")
