"""End-to-end runs of run_finetuning.py on the tiny presets (offline), both families: two steps then a resume equal
the uninterrupted run (dropout, warm-up, stochastic rounding, updates in the backward), a phased run resumes a fused
checkpoint, bad inputs fail with one line and keep the saved checkpoints, an HF model directory initialises training
and validation; a non-finite loss stops the run and keeps the last good checkpoint; SIGTERM and Ctrl-C save the step
(resuming gives the uninterrupted weights).

In-process calls share this process's 8 simulated devices; the signal tests run the driver in a process of its own."""

import json
import os
import signal

import jax
import numpy as np
import pytest
import torch
from transformers import GPTJConfig, GPTJForCausalLM

import run_finetuning
import run_validation
from app.resume import initial_state, resume_point
from tests.helpers import GPTJ_SMALL, SMALL, build, fails, params_at, start, wait_for_lines
from utils import checkpoint as ckpt


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


def _fails(capsys, main, argv, message):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1], err[-1:]
    return err[-1]


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_resume_with_dropout_and_warmup_equals_uninterrupted(tmp_path):
    """2 + 2 steps equal 4 steps: weights, data position and held-over examples (the dropout RNG and the
    learning-rate schedule resume exactly)."""
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    run_finetuning.main(GPTJ_SMALL + ["--steps", "4", "--save", a])
    run_finetuning.main(GPTJ_SMALL + ["--steps", "2", "--save", b])
    run_finetuning.main(GPTJ_SMALL + ["--steps", "4", "--save", b, "--load", b])
    meta_a, pa = params_at(a, 4)
    meta_b, pb = params_at(b, 4)
    assert meta_a["data_position"] == meta_b["data_position"] > 8  # packed: more examples than rows
    assert meta_a["data_pending"] == meta_b["data_pending"]
    for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
        np.testing.assert_array_equal(x, y)
    lines = [json.loads(x) for x in open(os.path.join(a, "metrics.jsonl"))]
    assert [r["step"] for r in lines] == [1, 2, 3, 4] and lines[0]["learning_rate"] == 0.0


@pytest.mark.slow
def test_hf_gptj_directory_initialises_training_and_validation(tmp_path):
    from modelling import gptj

    torch.manual_seed(0)
    hf = GPTJForCausalLM(GPTJConfig(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                                    n_inner=256, tie_word_embeddings=False))
    hf.save_pretrained(tmp_path / "hf")
    from config import load_config

    cfg = load_config("finetuning", "gptj_tiny", {"hf_model": str(tmp_path / "hf"), "sequence_length": 32,
                                                  "rotary_dim": 8})
    executor, loader = build(cfg)
    state, start = initial_state(cfg, executor, loader, resume_point(cfg))
    assert start == 0
    ours = gptj.hf_state_dict(jax.tree.map(np.asarray, state.params), cfg.model)
    for name, ref in hf.state_dict().items():
        np.testing.assert_array_equal(ours[name], ref.numpy(), err_msg=name)
    out = tmp_path / "val.json"
    # the default (T5) preset: the family and shape come from config.json
    run_validation.main(["--hf_model", str(tmp_path / "hf"), "--limit", "5", "--output", str(out)])
    r = json.load(open(out))
    assert r["samples"] == 5 and r["checkpoint"] == str(tmp_path / "hf")
    assert ckpt.saved_steps(str(tmp_path)) == []


@pytest.mark.slow
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
    line = fails(capsys, run_finetuning.main, SMALL + ["--steps", "5", "--checkpoint_steps", "1", "--save", save],
                 "step 3: loss nan", code=3)
    assert "learning rate" in line and f"{save}/2, is kept" in line
    assert ckpt.saved_steps(save) == [1, 2]
    _, params = params_at(save, 2)
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))


@pytest.mark.slow
def test_sigterm_saves_the_step_and_resuming_gives_the_uninterrupted_weights(tmp_path):
    steps = ["--steps", "150", "--checkpoint_steps", "0"]  # no periodic checkpoint: only the signal saves
    stopped, whole = str(tmp_path / "stopped"), str(tmp_path / "whole")
    proc = start(["run_finetuning.py"] + SMALL + steps + ["--save", stopped])
    wait_for_lines(os.path.join(stopped, "metrics.jsonl"), 3, proc)
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


@pytest.mark.slow
def test_ctrl_c_saves_the_step_and_exits_130_without_a_traceback(tmp_path):
    save = str(tmp_path / "ck")
    proc = start(["run_finetuning.py"] + SMALL + ["--steps", "150", "--save", save, "--checkpoint_steps", "0"])
    wait_for_lines(os.path.join(save, "metrics.jsonl"), 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    (k,) = ckpt.saved_steps(save)
    # the hint is the command that resumes and goes on saving
    assert f"SIGINT: stopped after step {k}: saved {save}/{k}; resume (and go on saving) with --load {save} " \
           f"--save {save}" in err, err[-2000:]
