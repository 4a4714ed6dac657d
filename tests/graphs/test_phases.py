"""Gradient accumulation inside the weight-gradient GEMMs (layers.Accumulating, phases.with_accumulators).

Batch serialisation adds every micro-batch's weight gradients to float32 accumulators. The layers'
matmul weights take their accumulator into the backward (``acc + x^T dy`` as the GEMM's own float32
output), instead of returning a gradient tree that is then added to the accumulator tree. These tests
check the arithmetic against plain autodiff, the executors against the reference model over the whole
batch, and that the micro-batch loop no longer concatenates or re-adds stacked gradient trees.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from config import load_config
from data.generated import generated_batch
from graphs.fused import FusedExecutor
from graphs.graphs import Graphs
from modelling import layers as L
from modelling import t5
from tests.hf_utils import rel_err


# (weight shape, input size): q/k/v [d, h, kv], o [h, kv, d], wi [d, f], wo [f, d]
SHAPES = [((8, 2, 3), 8), ((2, 3, 8), 6), ((8, 5), 8), ((5, 8), 5)]


@pytest.mark.parametrize("shape,fan_in", SHAPES)
@pytest.mark.parametrize("f32_out", [False, True])
def test_accumulating_dense_adds_the_weight_gradient_to_its_accumulator(shape, fan_in, f32_out):
    ks = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(ks[0], (7, fan_in))
    w = jax.random.normal(ks[1], shape)
    acc = jax.random.normal(ks[2], shape)
    dy = jax.random.normal(ks[3], (7, int(np.prod(shape)) // fan_in))

    y, vjp = jax.vjp(lambda x_, w_: L.dense(x_, w_, f32_out), x, w)
    y_acc, vjp_acc = jax.vjp(lambda x_, w_, a_: L.dense(x_, L.Accumulating(w_, a_), f32_out), x, w, acc)
    dx, dw = vjp(dy)
    dx_acc, dw_acc, new_acc = vjp_acc(dy)

    np.testing.assert_array_equal(y_acc, y)
    np.testing.assert_allclose(dx_acc, dx, rtol=1e-6, atol=1e-6)
    assert not np.any(dw_acc)  # the weight's own gradient is zero: it went into the accumulator
    np.testing.assert_allclose(new_acc, acc + dw, rtol=1e-6, atol=1e-5)


def test_bfloat16_accumulation_is_one_bf16_gemm_with_a_float32_output(monkeypatch):
    """With bf16 weights the weight-gradient GEMM takes bf16 operands and writes float32 (no bf16
    rounding of each micro-batch's gradient before it is accumulated), added to the accumulator. The program
    lowered as for a GPU (XLA:CPU gets float32 operands: L.mixed_bf16_gemms)."""
    monkeypatch.setattr(L, "mixed_bf16_gemms", lambda: True)
    x = jax.random.normal(jax.random.key(0), (64, 16)).astype(jnp.bfloat16)
    w = jax.random.normal(jax.random.key(1), (16, 32)).astype(jnp.bfloat16)
    acc = jnp.zeros((16, 32), jnp.float32)
    dy = jax.random.normal(jax.random.key(2), (64, 32)).astype(jnp.bfloat16)

    def step(acc_):
        return jax.vjp(lambda a_: L.dense(x, L.Accumulating(w, a_)), acc_)[1](dy)[0]

    text = jax.jit(step).lower(acc).as_text()
    dots = [line for line in text.splitlines() if "dot_general" in line]
    assert any("tensor<16x64xbf16>" in d or "tensor<64x16xbf16>" in d for d in dots), dots
    assert any(d.rstrip().endswith("tensor<16x32xf32>") for d in dots), dots
    want = np.asarray(x, np.float32).T @ np.asarray(dy, np.float32)  # exact products, float32 sums
    np.testing.assert_allclose(step(acc), want, rtol=1e-5, atol=1e-4)


def _cfg(**overrides):
    base = dict(global_batch_size=16, micro_batch_size=4, data_parallel=1, tensor_parallel=1, sequence_length=16,
                layers=3, packing=False)
    base.update(overrides)
    return load_config("finetuning", "tiny", base)


@pytest.mark.slow
@pytest.mark.parametrize("unroll,recompute,dp,tp", [(False, True, 1, 1), (True, False, 2, 2)])
def test_micro_batched_gradients_equal_the_whole_batch_gradient(unroll, recompute, dp, tp):
    """The fused step's loss and gradients, accumulated over 4 micro-batches in the GEMMs, equal plain
    autodiff of the reference model over the whole batch at once."""
    cfg = _cfg(unroll_layers=unroll, recompute=recompute, data_parallel=dp, tensor_parallel=tp,
               micro_batch_size=4 // dp)
    f = FusedExecutor(Graphs(cfg))
    host = jax.tree.map(np.asarray, f.g.init_params())
    batch = generated_batch(cfg, seed=3)
    loss, grads = f.loss_and_grads(f.init_state(host), f.g.shard_batch(batch))

    whole = {k: jnp.asarray(v.reshape(-1, *v.shape[2:])) for k, v in batch.items()}
    opts = t5.T5Options.from_config(cfg)
    count = t5.token_count(whole["labels"])
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda p: t5.loss_sum(p, whole, opts) / count))(
        jax.tree.map(jnp.asarray, host))
    assert abs(float(loss) - float(ref_loss)) <= 1e-6 * float(ref_loss)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        assert rel_err(a, b) <= 1e-5, jax.tree_util.keystr(path)


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's jaxpr
                if hasattr(sub, "eqns"):
                    yield from _eqns(sub)


@pytest.mark.slow
def test_micro_batch_loop_neither_concatenates_nor_re_adds_stacked_gradients():
    """Unrolled layers: inside the loop over micro-batches no per-layer gradients are concatenated into
    the stacked [layers, ...] tree and no float32 stacked-gradient tree is added (both were ~25% of an
    xl step on an H100, benchmarks/results/h100/xl_train_profile.json); the layers are split into their
    own buffers once per step."""
    cfg = _cfg(unroll_layers=True, recompute=False)
    f = FusedExecutor(Graphs(cfg))
    state = f.init_state()
    batch = f.g.shard_batch(generated_batch(cfg, seed=0))
    rng = jax.random.key_data(jax.random.key(0))
    jaxpr = jax.make_jaxpr(f._step_fn)(state, batch, rng, f.g.loss_scale_input()).jaxpr
    loops = [e for e in _eqns(jaxpr) if e.primitive.name == "scan" and e.params["length"] == cfg.gradient_accumulation]
    assert len(loops) == 1
    body = list(_eqns(loops[0].params["jaxpr"].jaxpr))
    assert body
    assert not [e for e in body if e.primitive.name in ("scan", "while")]  # the layers really are unrolled
    stacked = [e for e in body if e.primitive.name in ("concatenate", "add", "add_any")
               and any(getattr(v.aval, "ndim", 0) >= 2 and v.aval.shape[0] == cfg.model.layers
                       and v.aval.dtype == jnp.float32 for v in e.outvars)]
    assert not stacked, [str(e)[:120] for e in stacked[:3]]
    accumulated = [e for e in body if e.primitive.name == "dot_general" and e.params["preferred_element_type"] == jnp.float32
                   and len(e.outvars[0].aval.shape) >= 2]
    assert len(accumulated) >= 6 * cfg.model.layers  # the weight-gradient GEMMs write float32
