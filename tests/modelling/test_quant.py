"""Weight-only int8 (modelling/quant.py): the scheme's arithmetic and which weights it quantizes. Decoding with it is
tests/decoder/test_weights.py's.

- each int8 value is the nearest of its channel's grid: |w - q * scale| <= scale / 2, scale = max|w| / 127 over the
  channel's inputs; a channel's scale is its own; stacked layers keep their axis;
- the matmul applies the scale to the accumulator, exactly as to the weight; on a CPU (integer products) the
  activations are rounded to their row's int8 grid too, and the product is exactly that of the two grids; a row
  split over tp takes its maximum over every share; the integer products are a CPU's alone;
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


def test_the_matmul_scales_the_accumulator_as_it_would_the_weight(monkeypatch):
    """x @ q * scale (the scale on the float32 accumulator) equals x @ (q * scale) (the dequantized weight) for a
    weight whose input is several dims (attention's o: [heads, kv, d]): the product of a GPU, where the activations
    stay in the compute dtype."""
    monkeypatch.setattr(quant, "integer_dots", lambda: False)
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


# --------------------------------------------------------------------------- integer products (a CPU's)
@settings(max_examples=25, deadline=None)
@given(st.integers(1, 9), st.integers(1, 40), st.integers(1, 7), st.integers(0, 2 ** 31 - 1))
def test_integer_products_are_the_product_of_both_grids(n, i, o, seed):
    """Each row of x on its own int8 grid (scale max|x_row| / 127, every value within half a step, the row's maximum
    on the grid's end, a row of zeros scale 1), and the product x_q s_x @ q s_w exact up to float32 rounding: the
    int32 accumulator loses nothing."""
    assert quant.integer_dots()  # (the tests run on a CPU)
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, i)) * rng.choice([1e-3, 1.0, 30.0])).astype(np.float32)
    x[0] = 0.0
    w = quant.quantize(rng.standard_normal((i, o)).astype(np.float32), 1, 0, jnp.float32)
    xq, sx = (np.asarray(a) for a in quant.quantize_rows(jnp.asarray(x)))
    amax = np.abs(x).max(1, keepdims=True)
    np.testing.assert_allclose(sx, np.where(amax > 0, amax / 127, 1.0), rtol=1e-6)
    assert xq.dtype == np.int8 and (np.abs(x - xq * sx) <= sx / 2 * (1 + 1e-6)).all() and (xq[0] == 0).all()
    assert (np.abs(xq).max(1)[amax[:, 0] > 0] == 127).all()
    want = (xq.astype(np.float64) * sx) @ np.asarray(quant.dequantize(w), np.float64)
    got = np.asarray(quant.matmul(jnp.asarray(x), w))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max() + 1e-30)
    assert (got[0] == 0).all()


def test_a_split_row_takes_its_maximum_over_every_share():
    """A row-parallel weight (its input split over tp): each device's share of x quantized on the whole row's grid
    (its maximum over tp), so the summed shares are the unsplit product; on each share's own grid they are not."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    x[:, :8] *= 10  # the first share holds each row's maximum
    w = quant.quantize(rng.standard_normal((16, 5)).astype(np.float32), 1, 0, jnp.float32)
    mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))

    def shares(split):
        def f(x, q, s):
            part = quant.matmul(x, quant.Int8(q, s, jnp.float32), "tp" if split else None)
            return jax.lax.psum(part, "tp")

        return np.asarray(jax.shard_map(f, mesh=mesh, in_specs=(P(None, "tp"), P("tp", None), P()), out_specs=P())(
            jnp.asarray(x), w.q, w.scale))

    whole = np.asarray(quant.matmul(jnp.asarray(x), w))
    np.testing.assert_allclose(shares(True), whole, rtol=1e-5, atol=1e-5)
    assert np.abs(shares(False) - whole).max() > 1e-4  # (each share's own grid: another product)


def test_integer_products_are_a_cpu_s_alone(monkeypatch):
    """On a CPU the product is int8 x int8 -> int32; on any other backend the weight is converted and the product is
    in the compute dtype, as before (a GPU's GEMM loads the int8 operand itself)."""
    w = quant.quantize(np.ones((8, 4), np.float32), 1, 0, jnp.bfloat16)
    x = jnp.ones((2, 8), jnp.bfloat16)

    def dots():
        eqns = jax.make_jaxpr(lambda x, w: quant.matmul(x, w))(x, w).eqns
        return [(tuple(str(v.aval.dtype) for v in e.invars), str(e.outvars[0].aval.dtype)) for e in eqns
                if e.primitive.name == "dot_general"]

    assert jax.default_backend() == "cpu" and quant.integer_dots()
    assert dots() == [(("int8", "int8"), "int32")]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert not quant.integer_dots()
    assert dots() == [(("bfloat16", "bfloat16"), "float32")]


@pytest.mark.parametrize("rows", [1, 3])
def test_an_integer_product_of_any_rows_reads_the_int8_weight_itself(rows):
    """Compiled on the CPU, the integer product hands the int8 weight to an integer kernel as it is: no widened copy
    of it (XLA:CPU widened a one-row product's weight to int32, 25 ms for the small model's head, so one row is
    padded to two); and the padded row changes nothing of the product."""
    rng = np.random.default_rng(4)
    w = quant.quantize(rng.standard_normal((64, 96)).astype(np.float32), 1, 0, jnp.float32)
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    f = jax.jit(lambda x, q, s: quant.matmul(x, quant.Int8(q, s, jnp.float32)))
    hlo = f.lower(x, w.q, w.scale).compile().as_text()
    assert "s32[64,96]" not in hlo and "f32[64,96]" not in hlo  # (the weight neither widened nor dequantized)
    xq, sx = (np.asarray(a) for a in quant.quantize_rows(jnp.asarray(x)))
    want = (xq.astype(np.float64) * sx) @ np.asarray(quant.dequantize(w), np.float64)
    np.testing.assert_allclose(np.asarray(f(x, w.q, w.scale)), want, rtol=1e-5, atol=1e-5)
