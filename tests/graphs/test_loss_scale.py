"""float16 training: dynamic loss scaling, the float32 residual stream and the feed-forward's overflow guard.

- The scaler's rule (halve and skip on overflow, double after a window of good steps, stop after too many skips in a
  row) and its config defaults (dynamic for float16 only, from 2**15).
- The step programs skip an overflowing update in both executors: an injected overflow (a loss scale that no
  float16 gradient survives) leaves every weight and optimizer state bit for bit as it was; the next step applies.
  The phased executor keeps its float16 gradients loss-scaled in host memory and agrees with the fused one.
- A run: the overflowing first steps are skipped and nothing of them reaches a checkpoint, the run goes on, the scale
  resumes from the checkpoint; a run whose every step overflows stops after --max_skipped_steps with exit 3.
- A model built to overflow float16 (feed-forward activations past 65504, a residual stream past it): its float16
  loss is finite and near float32's with --scale_ff, and not finite without the guard.
"""

import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import run_finetuning
from config import load_config
from data.generated import generated_batch
from graphs.executor import make_executor
from graphs.graphs import Graphs
from graphs.loss_scale import LossScale
from tests.helpers import SMALL, params_at
from utils import checkpoint as ckpt

OVERFLOW = 2.0 ** 40  # a loss scale no float16 gradient survives (finite in float32)


def leaves(tree):
    return [np.asarray(jax.device_get(x)).astype(np.float32) for x in jax.tree.leaves(tree)]


# --------------------------------------------------------------------------- the rule


def test_the_scale_halves_on_overflow_doubles_after_a_window_and_gives_up_after_repeated_skips():
    s = LossScale(scale=1024.0, dynamic=True, window=3, max_skipped=3)
    assert s.update(1.0) and s.update(2.0) and s.scale == 1024.0
    assert s.update(3.0) and s.scale == 2048.0 and s.good_steps == 0  # a window of good steps doubles it
    assert not s.update(float("inf")) and s.scale == 1024.0 and not s.gave_up
    assert not s.update(float("nan")) and s.scale == 512.0
    assert s.update(1.0) and s.skipped_in_a_row == 0 and s.skipped_total == 2  # a good step resets the run of skips
    for _ in range(3):
        s.update(float("inf"))
    assert s.gave_up and s.scale == 64.0
    # the state a checkpoint records continues a dynamic run exactly
    t = LossScale(scale=1.0, dynamic=True, window=3, max_skipped=3)
    t.restore(json.loads(json.dumps(s.state())))
    assert t.state() == s.state()
    # static: the scale never moves, and the first non-finite step stops the run
    st = LossScale(scale=4.0)
    assert st.update(1.0) and st.scale == 4.0
    assert not st.update(float("inf")) and st.scale == 4.0 and st.gave_up


@pytest.mark.parametrize("precision,overrides,dynamic,start", [
    ("float16", {}, True, 2.0 ** 15),
    ("bfloat16", {}, False, 1.0),
    ("float32", {"loss_scaling": 8.0}, False, 8.0),
    ("float16", {"dynamic_loss_scaling": False}, False, 1.0),
    ("float16", {"loss_scaling": 256.0}, True, 256.0),
])
def test_dynamic_scaling_is_the_float16_default(precision, overrides, dynamic, start):
    cfg = load_config("finetuning", "tiny", {"precision": precision, **overrides})
    assert cfg.dynamic_loss_scaling is dynamic and cfg.initial_loss_scale == start


# --------------------------------------------------------------------------- the step programs


def _f16(phased):
    return load_config("finetuning", "tiny", {
        "precision": "float16", "phased": phased, "data_parallel": 1, "tensor_parallel": 2, "micro_batch_size": 4,
        "global_batch_size": 8, "sequence_length": 32, "warmup_steps": 0, "learning_rate": 1e-3})


def _state_leaves(ex, state):
    st = ex.to_checkpoint(state)
    return leaves(st.params), leaves(st.opt_state)


@pytest.mark.slow
def test_an_injected_overflow_skips_the_update_in_both_executors():
    """One step at a loss scale whose float16 gradients overflow: its norm is not finite and no weight or optimizer
    state moves (bit for bit); the next step, at 2**15, applies, and the phased executor (float16 gradients stored
    loss-scaled) gives the fused executor's loss and gradient norm."""
    out = {}
    for phased in (False, True):
        ex = make_executor(Graphs(_f16(phased)))
        state = ex.init_state()
        batch = ex.g.shard_batch(generated_batch(ex.g.cfg, seed=0))
        before = _state_leaves(ex, state)
        state, m = ex.train_step(state, batch, loss_scale=OVERFLOW)
        assert not math.isfinite(float(m["grad_norm"])), ex.name
        after = _state_leaves(ex, state)
        for a, b in zip(before[0] + before[1], after[0] + after[1]):
            np.testing.assert_array_equal(a, b)
        state, m = ex.train_step(state, batch, loss_scale=2.0 ** 15)
        assert math.isfinite(float(m["grad_norm"])) and math.isfinite(float(m["loss"]))
        moved = sum(not np.array_equal(a, b) for a, b in zip(after[0], _state_leaves(ex, state)[0]))
        assert moved == len(after[0]), (ex.name, moved)  # every weight updated
        out[phased] = (float(m["loss"]), float(m["grad_norm"]), _state_leaves(ex, state)[0])
    (l0, n0, p0), (l1, n1, p1) = out[False], out[True]
    assert abs(l1 - l0) <= 1e-3 * l0 and abs(n1 - n0) <= 1e-2 * n0, (l0, l1, n0, n1)
    for a, b in zip(p0, p1):  # float16 weights after the same update: at most a rounding apart
        assert np.max(np.abs(a - b)) <= 1e-2 * max(np.max(np.abs(a)), 1e-3)


# --------------------------------------------------------------------------- runs


def _metrics(path):
    return [json.loads(line) for line in open(os.path.join(path, "metrics.jsonl"))]


F16 = SMALL + ["--precision", "float16", "--checkpoint_steps", "1", "--to_keep", "0"]


@pytest.mark.slow
def test_a_float16_run_skips_its_overflowing_steps_saves_nothing_of_them_and_resumes_its_scale(tmp_path):
    save = str(tmp_path / "ck")
    run_finetuning.main(F16 + ["--steps", "4", "--loss_scaling", str(2.0 ** 19), "--save", save])
    rows = _metrics(save)
    skipped = [r["grad_norm"] is None for r in rows]
    assert skipped[0] and not all(skipped), rows  # overflowed first, then trained
    n = skipped.index(False)
    assert not any(skipped[n:])
    assert [r["loss_scale"] for r in rows[:n + 1]] == [2.0 ** (19 - i) for i in range(n + 1)]  # halved per skip
    assert rows[-1]["skipped_steps"] == n
    # nothing of a skipped step is saved: its checkpoint holds the initial weights, the next applied one moves them
    cfg = load_config("finetuning", "tiny", {"sequence_length": 16, "global_batch_size": 8, "micro_batch_size": 2,
                                             "precision": "float16"})
    init = leaves(Graphs(cfg).init_params())
    for a, b in zip(init, leaves(params_at(save, n)[1])):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(init, leaves(params_at(save, n + 1)[1])))
    assert ckpt.read_meta(save, 4)["loss_scale"]["scale"] == rows[-1]["loss_scale"]
    # resuming continues the scale and the count of skips
    run_finetuning.main(F16 + ["--steps", "5", "--loss_scaling", str(2.0 ** 19), "--save", save, "--load", save])
    last = _metrics(save)[-1]
    assert last["step"] == 5 and last["loss_scale"] == rows[-1]["loss_scale"] and last["skipped_steps"] == n


@pytest.mark.slow
def test_a_run_whose_every_step_overflows_stops_after_max_skipped_steps(tmp_path, capsys):
    save = str(tmp_path / "ck")
    with pytest.raises(SystemExit) as e:
        run_finetuning.main(F16 + ["--steps", "6", "--loss_scaling", str(OVERFLOW), "--max_skipped_steps", "2",
                                   "--save", save])
    assert e.value.code == 3
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "step 2: 2 steps in a row overflowed (--max_skipped_steps 2)" in line and f"{save}/1, is kept" in line
    assert ckpt.saved_steps(save) == [1]  # the first skip was saved (weights untouched); nothing of the second


# --------------------------------------------------------------------------- a model that overflows float16


@pytest.mark.slow
def test_feed_forward_activations_past_float16_range_survive_with_the_guard():
    """The tiny model with its feed-forward weights scaled up: the gated hidden activations and the residual
    stream pass 65504 (float16's largest value; measured in the float32 model), so a model that keeps either in
    float16 overflows. Ours forms the hidden activations in float32, divides them by --scale_ff before rounding
    them to float16, and keeps the residual stream float32: the float16 loss and gradients are finite and the loss
    is within 1% of float32's. Without the guard (--scale_ff 1) the same model's float16 loss is not finite."""
    from modelling import layers as L

    base = {"data_parallel": 1, "tensor_parallel": 1, "micro_batch_size": 8, "global_batch_size": 8,
            "sequence_length": 32, "layers": 2}
    cfg32 = load_config("finetuning", "tiny", base)
    g32 = Graphs(cfg32)
    params = jax.tree.map(np.asarray, jax.device_get(g32.init_params()))
    for stack in ("encoder", "decoder"):
        params[stack]["layers"]["wi_1"] = params[stack]["layers"]["wi_1"] * 10000.0
        params[stack]["layers"]["wo"] = params[stack]["layers"]["wo"] * 5.0
    host_batch = generated_batch(cfg32, seed=0)

    # the float32 model's first encoder feed-forward: its hidden activations pass float16's range
    x = L.embed(jnp.asarray(params["shared"]), jnp.asarray(host_batch["input_ids"][0]), None)
    lp = jax.tree.map(lambda w: jnp.asarray(w[0]), params["encoder"]["layers"])
    h = L.rms_norm(x, lp["ff_norm"], cfg32.model.eps)  # (the attention's share of the residual is small here)
    hidden = L.ACTIVATIONS["gated-gelu"](h @ lp["wi_0"]) * (h @ lp["wi_1"])
    assert float(jnp.max(jnp.abs(hidden))) > 65504
    assert float(jnp.max(jnp.abs(x + hidden @ lp["wo"]))) > 65504  # the residual stream after it

    def loss_and_grads(**kw):
        ex = make_executor(Graphs(load_config("finetuning", "tiny", {**base, **kw})))
        loss, grads = ex.loss_and_grads(ex.init_state(params), ex.g.shard_batch(host_batch),
                                        loss_scale=1.0)
        return float(loss), leaves(grads)

    ref, _ = loss_and_grads()
    guarded, grads = loss_and_grads(precision="float16", scale_ff=64)
    naive, _ = loss_and_grads(precision="float16", scale_ff=1)
    assert math.isfinite(guarded) and all(np.all(np.isfinite(g)) for g in grads)
    assert abs(guarded - ref) <= 0.01 * ref, (guarded, ref)
    assert not math.isfinite(naive), naive
