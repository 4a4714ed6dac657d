"""Weight-only int8 (modelling/quant.py): the scheme's arithmetic and which weights it quantizes. Decoding with it is
tests/decoder/test_weights.py's.

- each int8 value is the nearest of its channel's grid: |w - q * scale| <= scale / 2, scale = max|w| / 127 over the
  channel's inputs; a channel's scale is its own; stacked layers keep their axis;
- the matmul applies the scale to the accumulator, exactly as to the weight;
- a weight's inputs are read from its logical axes; a weight that touches no residual stream is refused."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from modelling import quant


# --------------------------------------------------------------------------- the scheme
@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 6), min_size=2, max_size=4), st.integers(0, 2 ** 31 - 1), st.data())
def test_each_value_is_the_nearest_point_of_its_channel_s_grid(shape, seed, data):
    """Any weight, any split of its dims into input and output: the scale of an output channel is its absmax over
    the inputs / 127; every value is within half a step of q * scale, q in [-127, 127]; an all-zero channel gets
    scale 1."""
    n_in = data.draw(st.integers(1, len(shape) - 1))
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32) * rng.choice([1e-3, 1.0, 50.0])
    w[..., 0] = 0.0  # a channel of zeros
    qw = quant.quantize(w, n_in, 0, jnp.float32)
    q, scale = np.asarray(qw.q), np.asarray(qw.scale)
    axes = tuple(range(n_in))
    assert q.dtype == np.int8 and q.shape == w.shape and scale.shape == w.shape[n_in:]
    assert np.abs(q).max() <= 127 and qw.n_in == n_in and qw.lead == 0
    amax = np.abs(w).max(axis=axes)
    np.testing.assert_allclose(scale, np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    assert (scale[..., 0] == 1.0).all() and (q[..., 0] == 0).all()
    err = np.abs(w - np.asarray(quant.dequantize(qw)))
    assert (err <= np.expand_dims(scale, axes) / 2 * (1 + 1e-6) + 1e-30).all()
    # the largest value of a channel is on the grid's end: nothing is clipped
    assert (np.abs(q).max(axis=axes)[..., 1:] == 127).all() or not (amax[..., 1:] > 0).all()


def test_a_channel_s_scale_is_its_own():
    """Per output channel, not per tensor: one large output column leaves the others' scales (and values) alone; a
    large input row is every channel's (each channel's maximum runs over its inputs)."""
    w = np.ones((4, 3), np.float32)
    w[:, 1] = 100.0
    s = np.asarray(quant.quantize(w, 1, 0, jnp.float32).scale)
    np.testing.assert_allclose(s, [1 / 127, 100 / 127, 1 / 127], rtol=1e-6)
    w[2, :] = 1000.0
    np.testing.assert_allclose(np.asarray(quant.quantize(w, 1, 0, jnp.float32).scale), [1000 / 127] * 3, rtol=1e-6)


def test_stacked_layers_keep_their_axis_and_slice_like_arrays():
    """A stacked [layers, in..., out...] weight quantized with lead 1: each layer has its own scales, and layer i
    sliced out of the Int8 (as decoding slices its layers) is the quantization of layer i alone."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 8, 2, 4)).astype(np.float32)
    w[1] *= 10
    stacked = quant.quantize(w, 1, 1, jnp.float32)
    assert stacked.scale.shape == (3, 2, 4) and stacked.lead == 1 and stacked.n_in == 1
    for i in range(3):
        row = jax.tree.map(lambda x: x[i], stacked)
        alone = quant.quantize(w[i], 1, 0, jnp.float32)
        assert isinstance(row, quant.Int8) and row.lead == 0
        np.testing.assert_array_equal(np.asarray(row.q), np.asarray(alone.q))
        np.testing.assert_array_equal(np.asarray(row.scale), np.asarray(alone.scale))


def test_the_matmul_scales_the_accumulator_as_it_would_the_weight():
    """x @ q * scale (the scale on the float32 accumulator) equals x @ (q * scale) (the dequantized weight) for a
    weight whose input is several dims (attention's o: [heads, kv, d])."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((2, 4, 6)).astype(np.float32)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    qw = quant.quantize(w, 2, 0, jnp.float32)
    want = x @ np.asarray(quant.dequantize(qw)).reshape(8, 6)
    np.testing.assert_allclose(np.asarray(quant.matmul(jnp.asarray(x), qw)), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axes,n_in", [(("layers", "embed", "heads", "kv"), 1), (("layers", "heads", "kv", "embed"), 2),
                                       (("embed", "mlp"), 1), (("mlp", "embed"), 1), (("embed", "vocab"), 1)])
def test_a_weight_s_inputs_are_read_from_its_axes(axes, n_in):
    assert quant.input_dims(axes) == n_in


def test_a_weight_that_touches_no_residual_stream_is_refused():
    with pytest.raises(ValueError, match="embed"):
        quant.input_dims(("heads", "kv"))
