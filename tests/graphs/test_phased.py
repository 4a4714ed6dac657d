"""The phased executor equals the fused one (8 simulated CPU devices, float32), AdamW and Adafactor.

Tolerances reached: loss 1e-6 relative (measured ~1e-7); gradients max |a - b| / max |b| per
weight < 1e-5 (measured < 1e-6: the two executors sum the same terms in another order, e.g.
the relative-bias gradient per layer instead of once per stack); weights after two AdamW
steps ||a - b|| / ||b|| < 1e-5 (see tests/graphs/test_graphs.py for why not an elementwise max).
"""

import jax
import numpy as np
import pytest

from data.generated import generated_batch
from graphs.fused import FusedExecutor
from graphs.graphs import Graphs
from graphs.phase_ops import DeviceOps, PhaseMemory
from graphs.phased import PhasedExecutor
from graphs.state import TrainState
from modelling import t5
from partitioning.memory import per_device_bytes
from partitioning.sharding import HOST
from tests.helpers import fro_rel, leaves, max_rel, tiny

pytestmark = pytest.mark.slow  # every test here compiles and runs phased and fused steps


def _rng():
    return jax.random.key_data(jax.random.key(3))


def _both(cfg, steps=2):
    g = Graphs(cfg)
    f, ph = FusedExecutor(g), PhasedExecutor(g)
    batch = g.shard_batch(generated_batch(cfg, seed=0))
    params = g.init_params()
    pparams = ph.init_params()
    ps = ph.init_state(pparams)
    loss, grads = f.loss_and_grads(f.init_state(params), batch, _rng())
    ploss, pgrads = ph.loss_and_grads(ps, batch, _rng())
    params = jax.tree.map(np.asarray, params)
    pparams = jax.tree.map(np.asarray, pparams)
    # the fused steps as the fused program runs them (loss_and_grads, then the optimizer phase update) without
    # compiling the fused step a second time: this file compares executors, tests/graphs/test_graphs.py the fused step
    state = f.init_state(params)
    update = jax.jit(f.update)
    stale = cfg.execution.update_in_backward  # both clip with the previous step's norm (none at the first)
    clip = pclip = jax.numpy.float32(0) if stale else None
    for step in range(steps):
        rng = jax.random.key_data(jax.random.fold_in(jax.random.key(cfg.model.seed), step))
        loss_s, grads_s = f.loss_and_grads(state, batch, rng)
        new_params, opt_state, g_norm = update(state.params, state.opt_state, grads_s, None, clip)
        state = TrainState(state.step + 1, new_params, opt_state)
        metrics = {"loss": loss_s, "grad_norm": g_norm}
        ps, pmetrics = ph.train_step(ps, batch, clip_norm=pclip)
        if stale:
            clip, pclip = g_norm, float(pmetrics["grad_norm"])
    return dict(g=g, ph=ph, params=params, pparams=pparams, loss=loss, ploss=ploss, grads=grads, pgrads=pgrads,
                state=state, ps=ps, metrics=metrics, pmetrics=pmetrics, steps=steps)


def _check(r, state_tol=1e-5):
    assert abs(float(r["ploss"]) - float(r["loss"])) / float(r["loss"]) < 1e-6
    for a, b in zip(leaves(r["pgrads"]), leaves(r["grads"])):
        assert a.shape == b.shape
        assert max_rel(a, b) < 1e-5
    assert abs(float(r["pmetrics"]["grad_norm"]) - float(r["metrics"]["grad_norm"])) < 1e-5 * float(r["metrics"]["grad_norm"])
    assert abs(float(r["pmetrics"]["loss"]) - float(r["metrics"]["loss"])) < 1e-6 * float(r["metrics"]["loss"])
    stacked = r["ph"].to_checkpoint(r["ps"])
    assert int(stacked.step) == int(r["state"].step) == r["steps"]
    moved = 0
    for a, b, b0 in zip(leaves(stacked.params), leaves(r["state"].params), leaves(r["params"])):
        assert fro_rel(a, b) < 1e-5
        moved += not np.array_equal(b, b0)
    assert moved == len(leaves(r["params"]))  # every weight was updated
    for a, b in zip(leaves(stacked.opt_state), leaves(r["state"].opt_state)):
        assert a.shape == b.shape and fro_rel(a, b) < state_tol


@pytest.mark.parametrize("dp,tp,extra", [
    (1, 1, {}),
    (1, 4, {}),
    # dropout (the same keys per micro-batch, stream and layer), clipping that triggers, loss scaling
    (2, 2, dict(dropout_prob=0.1, gradient_clipping=0.05, loss_scaling=4.0)),
])
def test_phased_equals_fused(dp, tp, extra):
    cfg = tiny(data_parallel=dp, tensor_parallel=tp, micro_batch_size=8 // dp, **extra)
    assert cfg.gradient_accumulation == 2
    r = _both(cfg)
    if extra:
        assert float(r["metrics"]["grad_norm"]) > 0.05  # the clipping branch is taken
    # the same random weights, created layer by layer into host memory
    for a, b in zip(leaves(r["pparams"]), leaves(r["params"])):
        np.testing.assert_array_equal(a, b)
    _check(r)


def test_update_in_backward_equals_fused_with_the_previous_norm_and_keeps_no_layer_gradients():
    """execution.update_in_backward: each layer updated right after its backward, every group clipped with the
    previous step's norm (none at the first step); three steps with clipping that triggers equal the fused
    executor's clipping the same way, and differ from clipping with each step's own norm. The plan then holds no
    layer gradients in host memory."""
    cfg = tiny(data_parallel=2, tensor_parallel=2, micro_batch_size=4, gradient_clipping=0.05, update_in_backward=True)
    r = _both(cfg, steps=3)
    assert float(r["metrics"]["grad_norm"]) > 0.05
    _check(r)
    own = _both(tiny(data_parallel=2, tensor_parallel=2, micro_batch_size=4, gradient_clipping=0.05), steps=3)
    assert max(fro_rel(a, b) for a, b in zip(leaves(own["state"].params), leaves(r["state"].params))) > 1e-3
    plans = {"in backward": r["ph"].plan().host_items, "after": own["ph"].plan().host_items}
    assert "weight gradients" not in plans["in backward"] and plans["after"]["weight gradients"] > 0, plans


def test_phased_adafactor_equals_fused_adafactor():
    """Adafactor with factored second moments (dims >= 128) and a first moment: each layer's
    matrices are factored on their own in both executors."""
    cfg = tiny(data_parallel=1, tensor_parallel=2, micro_batch_size=8, hidden_size=128, d_ff=256, layers=2,
               optimizer="adafactor", beta1=0.9, vocab_size=256)
    r = _both(cfg)
    # Adafactor's first moment holds normalised updates g / sqrt(v) of unfactored weights (q: [128, 4, 16]
    # has one dim >= 128): where v is tiny, float32 summation-order noise of g is amplified, as for Adam's
    # update (see tests/graphs/test_graphs.py); measured 2.6e-5, while the weights agree to 1e-5
    _check(r, state_tol=1e-4)
    state = r["state"].opt_state["encoder"]
    factored = [x for x in jax.tree.leaves(state) if x.ndim == 2 and x.shape[0] == 2]  # [layers, dim] rows/cols
    assert factored, jax.tree.map(lambda x: x.shape, state)
    mu = [x for x in jax.tree.leaves(state) if x.shape == r["state"].params["encoder"]["layers"]["wo"].shape]
    assert mu  # the first moment is kept (beta1 set)


def test_state_conversion_round_trip():
    cfg = tiny(data_parallel=2, tensor_parallel=2, micro_batch_size=4)
    g = Graphs(cfg)
    f, ph = FusedExecutor(g), PhasedExecutor(g)
    state = f.init_state()
    state, _ = f.train_step(state, g.shard_batch(generated_batch(cfg, seed=0)))
    ps = ph.from_train_state(state)
    assert ps.step == 1
    # every per-layer weight and optimizer state lives in host memory
    for x in jax.tree.leaves((ps.rest, ps.layers, ps.opt, ps.opt_layers)):
        assert x.sharding.memory_kind == HOST
    np.testing.assert_array_equal(np.asarray(ps.layers["decoder"][2]["wo"]),
                                  np.asarray(state.params["decoder"]["layers"]["wo"])[2])
    back = ph.to_checkpoint(ps)
    for a, b in zip(leaves(back), leaves(state)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(back.params), jax.tree.leaves(state.params)):
        assert a.sharding.spec == b.sharding.spec


class RecordingOps(DeviceOps):
    """The phased schedule's real operations, recording (as host copies, before anything is donated or freed)
    every activation row it stores and every phase program's inputs and outputs."""

    def __init__(self):
        super().__init__()
        self.rows, self.runs = [], []

    def store(self, tree, shardings, label=""):
        out = super().store(tree, shardings, label)
        if label == "activations":
            self.rows.append(out)
        return out

    def run(self, name, program, *args, label=""):
        inputs = jax.tree.map(lambda x: np.asarray(jax.device_get(x)) if isinstance(x, jax.Array) else x, args)
        out = super().run(name, program, *args, label=label)
        self.runs.append((name, inputs, jax.tree.map(lambda x: np.asarray(jax.device_get(x)), out)))
        return out

    def inputs(self, name):
        return [i for n, i, _ in self.runs if n == name]

    def outputs(self, name):
        return [o for n, _, o in self.runs if n == name]


def test_activation_buffer_rows_hold_each_phase_output():
    cfg = tiny(data_parallel=2, tensor_parallel=2, micro_batch_size=4)
    g = Graphs(cfg)
    rec = RecordingOps()
    ph = PhasedExecutor(g, ops=rec)
    host_batch = generated_batch(cfg, seed=1, lengths="short")  # packed rows, several examples each
    assert host_batch["attention_mask"].max() > 1
    ph.loss_and_grads(ph.init_state(), g.shard_batch(host_batch), _rng())
    n = cfg.model.layers
    # stored rows, in order: the encoder layers' inputs and its final norm's input, then the decoder layers' inputs
    assert len(rec.rows) == 2 * n + 1
    row = rec.rows[0]
    assert row.sharding.memory_kind == HOST
    assert tuple(row.sharding.spec) == (None, "dp", None, "tp")  # RTS on activations: d split over tp
    assert row.addressable_shards[0].data.shape[-1] == cfg.model.hidden_size // 2
    rows = [np.asarray(jax.device_get(r)) for r in rec.rows]
    x_buf = np.stack(rows[: n + 1] + rec.outputs("encoder_output_fwd"))  # + the encoder output
    x_dec = np.stack(rows[n + 1:] + [rec.inputs("head")[0][1]])  # + the last decoder layer's output (head input)
    d_enc = rec.inputs("encoder_output_bwd")[0][2]  # the encoder output's gradient, summed over decoder layers

    # the single-device model, phase by phase, on the same weights and micro-batches
    p = jax.tree.map(np.asarray, g.init_params())
    opts = t5.T5Options.from_config(cfg)
    for i in range(cfg.gradient_accumulation):
        b = {k: np.asarray(v[i]) for k, v in host_batch.items()}
        x = t5.embeddings(p["shared"], b["input_ids"], opts, None)
        np.testing.assert_allclose(x_buf[0, i], x, atol=1e-6)
        bias = t5.encoder_self_bias(p["encoder"]["relpos"], b["attention_mask"], opts, b["positions"])
        for j in range(n):
            lp = jax.tree.map(lambda w: w[j], p["encoder"]["layers"])
            x = t5.t5_block(lp, x, bias, opts, None)
            np.testing.assert_allclose(x_buf[1 + j, i], x, rtol=1e-5, atol=1e-5)
        enc = t5.encoder_head(p["encoder"]["final_norm"], x, opts)
        np.testing.assert_allclose(x_buf[n + 1, i], enc, rtol=1e-5, atol=1e-5)
        y = t5.embeddings(p["shared"], b["decoder_input_ids"], opts, None)
        np.testing.assert_allclose(x_dec[0, i], y, atol=1e-6)
        sb = t5.decoder_self_bias(p["decoder"]["relpos"], y.shape[1], opts, b["decoder_attention_mask"],
                                  b["decoder_positions"])
        cb = t5.cross_bias(b["attention_mask"], b["decoder_attention_mask"], packed=True)
        for j in range(n):
            lp = jax.tree.map(lambda w: w[j], p["decoder"]["layers"])
            y = t5.t5_block(lp, y, sb, opts, None, enc, cb)
            np.testing.assert_allclose(x_dec[1 + j, i], y, rtol=1e-5, atol=1e-5)

        # d_enc: the encoder output's gradient, summed over the decoder layers on the device,
        # equals autodiff of the loss (scaled by 1 / token count, as the step's loss is) w.r.t. it
        count = float(np.sum(host_batch["labels"] != -100))

        def loss_from_enc(e):
            y_ = t5.embeddings(p["shared"], b["decoder_input_ids"], opts, None)
            for j in range(n):
                y_ = t5.t5_block(jax.tree.map(lambda w: w[j], p["decoder"]["layers"]), y_, sb, opts, None, e, cb)
            return t5.head(p, y_, b["labels"], opts, None) / count

        np.testing.assert_allclose(d_enc[i], jax.grad(loss_from_enc)(enc), rtol=1e-5, atol=1e-7)


def test_layer_phases_hold_one_layer_of_weights_on_device():
    """During a layer phase, the weights on device are that layer's and the next one's (prefetched),
    plus the small non-layer ones."""
    import gc

    gc.collect()
    before = {id(x) for x in jax.live_arrays()}  # (arrays earlier tests in this process still hold: not this step's)
    cfg = tiny(data_parallel=1, tensor_parallel=2, micro_batch_size=8, layers=6)
    g = Graphs(cfg)
    ph = PhasedExecutor(g)
    ps = ph.init_state()
    batch = g.shard_batch(generated_batch(cfg, seed=0))
    seen = {}

    class Spy(PhaseMemory):
        def record(self, name, program, args):
            ours = [x for x in jax.live_arrays() if id(x) not in before and not x.is_deleted()
                    and getattr(x.sharding, "memory_kind", None) in ("device", None)]
            seen[name] = max(seen.get(name, 0), max(per_device_bytes(ours).values(), default=0))

    layer_bytes = sum(x.nbytes for x in jax.tree.leaves(ps.layers["decoder"][0])) // 2  # per device (tp=2)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves((ps.rest, ps.layers))) // 2
    ph.with_ops(DeviceOps(memory=Spy())).train_step(ps, batch)  # consumes ps
    assert {"encoder_layer_fwd", "decoder_layer_bwd", "head", "optimizer"} <= set(seen)
    # live on device at the start of a decoder backward phase: its weights, inputs and the small
    # gradient sums; far from the whole model (6 layers per stack)
    assert layer_bytes < seen["decoder_layer_bwd"] < model_bytes / 2
