"""Weight-only int8 for decoding: each matmul weight stored as int8 with a float32 scale per output channel.

The scheme is absmax per output channel, as LLM.int8()'s and CTranslate2's weight-only int8 define it:
``scale[o] = max_i |w[i, o]| / 127`` and ``q[i, o] = round(w[i, o] / scale[o])`` in [-127, 127], so that
``w ~ q * scale``. A matmul reads it as ``(x @ q) * scale``: the int8 weight is converted to the compute dtype
inside the product and the scale applied to the float32 accumulator, which equals ``x @ (q * scale)`` because
the scale is constant along the contracted dimension. No dequantized copy of a weight is kept; whether one is
formed per call is the compiler's choice (XLA:GPU fuses the int8 -> bfloat16 conversion into the GEMM's operand
load; XLA:CPU converts the weight into a temporary before its GEMM).

What is quantized (``quantizes``): every layer weight the family calls a matmul weight (``Family.is_dense``:
attention projections, feed-forward; not norms, biases or position tables) and the LM head. The token embedding is
not: decoding reads a few of its rows per token (a gather, not a matmul), so it costs device memory but no
bandwidth, and T5 v1.0 ties the head to it (that head stays in the compute dtype too).

A weight's layout says which dimensions are its input: the families' matmul weights either read the residual
stream (``embed`` first: q, k, v, wi, fc_in, lm_head: [d, out...]) or write it (``embed`` last: o, wo, fc_out:
[in..., d]) (``input_dims``). Stacked layers keep their leading ``layers`` axis on both ``q`` and ``scale``, so a
layer is sliced out of an ``Int8`` as out of an array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from modelling.tp import trivial

QMAX = 127  # symmetric: -127..127 (never -128, so that -q is representable and the grid is centred on 0)


@jax.tree_util.register_pytree_node_class
class Int8:
    """A matmul weight as int8 values and a float32 scale per output channel: w ~ q * scale.

    q int8 [lead..., in..., out...]; scale float32 [lead..., out...] (lead: the stacked ``layers`` axis, if any, so
    that a layer is sliced out of both alike); ``dtype``: the compute dtype the matmul reads it in; ``n_out``: how
    many trailing dimensions are its output. Both are static: they travel with the tree's structure.
    """

    def __init__(self, q, scale, dtype, n_out: int = 1):
        self.q, self.scale, self.dtype, self.n_out = q, scale, jnp.dtype(dtype), n_out

    shape = property(lambda self: self.q.shape)
    ndim = property(lambda self: len(self.q.shape))
    n_in = property(lambda self: len(self.q.shape) - len(self.scale.shape))  # the contracted dimensions
    lead = property(lambda self: len(self.scale.shape) - self.n_out)  # the dimensions q and scale share up front

    def tree_flatten(self):
        return (self.q, self.scale), (self.dtype.name, self.n_out)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def __repr__(self) -> str:
        shape = lambda x: tuple(getattr(x, "shape", ())) or x  # noqa: E731
        return f"Int8(q={shape(self.q)}, scale={shape(self.scale)}, {self.dtype.name})"


def is_int8(x) -> bool:
    return isinstance(x, Int8)


def input_dims(axes: tuple) -> int:
    """How many leading dimensions of a matmul weight with these logical axes (its ``layers`` axis aside) are its
    input: 1 for a weight that reads the residual stream (``embed`` first), all but the last for one that writes it
    (``embed`` last: o [heads, kv, embed] reads heads x kv)."""
    axes = tuple(a for a in axes if a != "layers")
    if axes[0] == "embed":
        return 1
    if axes[-1] == "embed":
        return len(axes) - 1
    raise ValueError(f"a matmul weight with axes {axes} neither reads nor writes the residual stream (embed): "
                     "say which of its dimensions are its input")


def quantize(w: jax.Array, n_in: int, lead: int = 0, dtype=jnp.bfloat16) -> Int8:
    """Absmax int8 per output channel. w [lead..., in..., out...] (the first ``lead`` dims kept, the next ``n_in``
    contracted) -> Int8. A channel whose weights are all zero gets scale 1 (q = 0), never a division by zero."""
    w = jnp.asarray(w).astype(jnp.float32)
    axes = tuple(range(lead, lead + n_in))
    amax = jnp.max(jnp.abs(w), axis=axes)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w / jnp.expand_dims(scale, axes)), -QMAX, QMAX).astype(jnp.int8)
    return Int8(q, scale, dtype, w.ndim - lead - n_in)


def dequantize(w: Int8) -> jax.Array:
    """q * scale, float32 (references and tests: decoding never forms it)."""
    return w.q.astype(jnp.float32) * jnp.expand_dims(w.scale, tuple(range(w.lead, w.lead + w.n_in)))


def integer_dots() -> bool:
    """Whether an int8 matmul multiplies int8 activations by the int8 weight (``matmul``): on a CPU, where XLA hands an
    s8 x s8 -> s32 product to YNNPACK's integer kernels (VNNI, AMX); elsewhere the weight is converted inside a
    product in the compute dtype (XLA:GPU fuses the conversion into the GEMM's operand load), as it always was. On
    XLA:CPU the converting product forms a float copy of the weight first, which made int8 no faster than float32."""
    return jax.default_backend() == "cpu"


def quantize_rows(x: jax.Array, split_axis=None) -> tuple:
    """Absmax int8 per row of activations, as CTranslate2's int8 quantizes them at each matmul: x [n, i] -> (int8
    [n, i], float32 scale [n, 1]), x ~ q * scale. ``split_axis``: the mesh axis x's inputs are split over (a
    row-parallel weight's input, under tensor parallelism): the row's maximum is taken over every device's share,
    so the grid and the tokens are the same at any tp."""
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    if not trivial(split_axis):
        amax = jax.lax.pmax(amax, split_axis)
    scale = jnp.where(amax > 0, amax / QMAX, 1.0)
    return jnp.clip(jnp.round(xf / scale), -QMAX, QMAX).astype(jnp.int8), scale


def matmul(x: jax.Array, w: Int8, split_axis=None) -> jax.Array:
    """x [n, i] @ w (one layer's weight, read as [i, o]) -> float32 [n, o]. Where ``integer_dots``: the rows of x
    quantized to int8 (``quantize_rows``), an integer product accumulated in int32, times both scales; else the int8
    values converted to the compute dtype inside the product, accumulated in float32, times the per-channel scale."""
    q2 = w.q.reshape(x.shape[-1], -1)
    if integer_dots():
        xq, sx = quantize_rows(x, split_axis)
        n = xq.shape[0]
        if n == 1:  # XLA:CPU gives a one-row s8 product to no integer kernel: it widens the weight to int32 first
            xq = jnp.pad(xq, ((0, 1), (0, 0)))
        acc = jax.lax.dot(xq, q2, preferred_element_type=jnp.int32)[:n]  # |acc| <= 127^2 i: exact below i = 133k
        return acc.astype(jnp.float32) * sx * w.scale.reshape(-1)
    out = jnp.einsum("ni,io->no", x.astype(w.dtype), q2.astype(w.dtype), preferred_element_type=jnp.float32)
    return out * w.scale.reshape(-1)


def quantizes(family, path: tuple) -> bool:
    """Whether decoding with int8 weights stores the weight at tree ``path`` (a tuple of keys) as int8: a layer
    weight the family calls a matmul weight, or the LM head (a model whose head is its embedding has none)."""
    if path == ("lm_head",):
        return True
    return len(path) >= 3 and path[-2] == "layers" and family.is_dense(path[-1])


def nbytes(x) -> int:
    """Bytes of an array, a ShapeDtypeStruct or an Int8 of either."""
    if is_int8(x):
        return nbytes(x.q) + nbytes(x.scale)
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
