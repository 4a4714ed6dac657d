"""Transformer layers (T5's and GPT-J's) as pure functions over (local shards of) parameter trees.

Shapes are those one device sees: under tensor parallelism ``h`` is
heads / tp, ``f`` is d_ff / tp and ``Vl`` is padded_vocab / tp; on one
device they are the full sizes. ``b`` batch, ``q``/``k`` query/key length,
``d`` hidden size, ``kv`` head size. The residual stream, norms and softmax
are float32; matmuls run in the dtype of the weights they are given.
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from modelling.quant import Int8, matmul as quant_matmul
from modelling.tp import trivial, identical_grad_inputs, identical_inputs, share_of_sum, tp_index

F32 = jnp.float32
MASK_VALUE = -1e9  # exp(MASK_VALUE - max) is exactly 0 in float32


def dropout(x: jax.Array, rate: float, rng: Optional[jax.Array]) -> jax.Array:
    """Inverted dropout; identity when rate == 0 or rng is None (eval)."""
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """T5 layer norm (RMS, no mean, no bias). x [..., d] -> float32 [..., d]."""
    x = x.astype(F32)
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    return weight.astype(F32) * (x * lax.rsqrt(var + eps))


def layer_norm(x: jax.Array, weight: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm with bias (GPT-J). x [..., d] -> float32 [..., d]."""
    x = x.astype(F32)
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * lax.rsqrt(var + eps) * weight.astype(F32) + bias.astype(F32)


# --------------------------------------------------------------------------- mixed-precision matmul


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def einsum_f32(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(spec, a, b)`` with a float32 result (accumulated and returned in float32).

    Its backward runs in the operands' dtype: the float32 cotangent is rounded to it
    first. With bfloat16 operands the gradient GEMMs are then bfloat16 GEMMs, as in any
    mixed-precision training; differentiating a plain ``preferred_element_type=float32``
    dot instead gives float32 x float32 gradient GEMMs (TF32 on a GPU, measured 13% of an
    XL training step on an H100). With float32 operands it is exactly the plain einsum.
    """
    return jnp.einsum(spec, a, b, preferred_element_type=F32)


def _einsum_f32_fwd(spec, a, b):
    return einsum_f32(spec, a, b), (a, b)


def _einsum_f32_bwd(spec, res, g):
    a, b = res
    _, vjp = jax.vjp(lambda a_, b_: jnp.einsum(spec, a_, b_, preferred_element_type=a.dtype), a, b)
    return vjp(g.astype(a.dtype))


einsum_f32.defvjp(_einsum_f32_fwd, _einsum_f32_bwd)


# --------------------------------------------------------------------------- weight matmuls, accumulating


@jax.tree_util.register_pytree_node_class
class Accumulating:
    """A weight (compute dtype) paired with the float32 accumulator of its gradient.

    Given to ``dense`` in place of the weight, its gradient is not returned as a new array but
    added to the accumulator inside the weight-gradient GEMM: the backward computes
    ``acc + x^T dy`` as the float32 output of the (bf16) GEMM, in the weight's own shape: the
    pattern XLA:GPU's GEMM rewriter folds into the cuBLAS call (beta = 1, the accumulator
    overwritten in place). The cotangent of ``w`` is zero; the cotangent of
    ``acc`` is the new accumulator. Batch serialisation then no longer re-reads and re-writes a
    whole float32 gradient tree per micro-batch.
    """

    def __init__(self, w: jax.Array, acc: jax.Array):
        self.w, self.acc = w, acc

    shape = property(lambda self: self.w.shape)
    dtype = property(lambda self: self.w.dtype)

    def tree_flatten(self):
        return (self.w, self.acc), None

    @classmethod
    def tree_unflatten(cls, _aux, children):
        return cls(*children)


class Adapted:
    """A frozen weight with its low-rank adapter (LoRA, modelling/lora.py): ``dense`` computes
    x w + scale (dropout(x) a) b, with a [in..., rank] and b [rank, out...] in the weight's layout.

    Under tensor parallelism the adapter follows its weight's split: a column-parallel weight (its output split
    over tp) has a replicated ``a`` (its gradient summed over tp, as a replicated weight feeding a split one) and a
    split ``b``; a row-parallel one (``row``: its input split over tp, its output summed) has a split ``a``, a
    replicated ``b``, and the rank-sized activation is summed over tp before ``b``, whose identical output joins the
    weight's partial sums as a 1/tp share each (``tp.share_of_sum``)."""

    def __init__(self, w, a, b, scale: float, row: bool, tp_axis, rate: float = 0.0, rng=None):
        self.w, self.a, self.b, self.scale, self.row, self.tp, self.rate, self.rng = w, a, b, scale, row, tp_axis, \
            rate, rng

    shape = property(lambda self: self.w.shape)
    dtype = property(lambda self: self.w.dtype)

    def delta(self, x: jax.Array) -> jax.Array:
        """scale (dropout(x) a) b, float32 [n, out] (x [n, in])."""
        # column-parallel: each device's share of the output gives a partial gradient of the replicated ``a``,
        # summed over tp by ``identical_inputs`` (x's own gradient stays partial, as x's psum expects); row-parallel:
        # the rank-sized activation is summed over tp forward, its gradient identical on every device
        a = (self.a if self.row else identical_inputs(self.a, self.tp)).reshape(x.shape[-1], -1)
        rng = self.rng if self.rng is None or not self.row else jax.random.fold_in(self.rng, tp_index(self.tp))
        z = dense(dropout(x, self.rate, rng).astype(a.dtype), a, f32_out=True)  # a split input: a mask per share
        if self.row:
            z = identical_grad_inputs(z, self.tp)
        out = dense(z.astype(self.b.dtype), self.b.reshape(z.shape[-1], -1), f32_out=True) * self.scale
        return share_of_sum(out, self.tp) if self.row else out


@jax.tree_util.register_pytree_node_class
class MultiAdapted:
    """A frozen weight with the LoRA adapters of many fine-tuned tasks stacked beside it (modelling/lora_stack.py),
    each token reading its own: ``dense`` computes x w + scale_t (x a_t) b_t with token t's adapter, x w alone for a
    token of none.

    a [in..., slots, rank] and b [slots, rank, out...] hold every slot's adapter (its rank padded with zeros; an
    empty slot all zeros); index int32 [n]: each token's slot (-1: none); scale float32 [n]: its adapter's alpha /
    rank (0: none). The product is taken for every slot at once and masked to the token's own: z = x a (a read as
    [in, slots * rank]), z's columns of other slots zeroed and the token's scaled, then z b (b read as [slots * rank,
    out]): exactly the token's own scale (x a_t) b_t, at slots * rank / out of the base matmul's work. (A gather of
    each token's a_t and b_t, the BGMV form S-LoRA and Punica run on GPUs, was 1.1 to 10x slower than this on XLA:CPU
    at serving's shapes: benchmarks/probes/README.md, ``lora_forms.py``.)

    Under tensor parallelism a and b are split as training splits a weight's adapter (``Adapted``): a column-parallel
    weight has a replicated a and a b split like its output, so each device gets its share of the output; a
    row-parallel weight has an a split like its input and a replicated b, so each device's delta is its partial
    product, which the family's own sum over tp of the weight's partial outputs completes (no collective of its
    own). A pytree: a scan over stacked layers slices w, a, b, index and scale alike (index and scale then
    [layers, n])."""

    def __init__(self, w, a, b, index, scale):
        self.w, self.a, self.b, self.index, self.scale = w, a, b, index, scale

    shape = property(lambda self: self.w.shape)
    dtype = property(lambda self: self.w.dtype)

    def tree_flatten(self):
        return (self.w, self.a, self.b, self.index, self.scale), None

    @classmethod
    def tree_unflatten(cls, _aux, children):
        return cls(*children)

    def delta(self, x: jax.Array) -> jax.Array:
        """Each token's scale (x a_t) b_t, float32 [n, out] (x [n, in]; this device's share, or partial product)."""
        slots, rank = self.b.shape[0], self.b.shape[1]
        z = einsum_f32("ni,ic->nc", x.astype(self.a.dtype), self.a.reshape(x.shape[-1], slots * rank))
        owner = jnp.arange(slots * rank) // rank  # the slot of each of z's columns
        z = jnp.where(owner[None] == self.index[:, None], z * self.scale[:, None], 0.0)
        return einsum_f32("nc,co->no", z.astype(self.b.dtype), self.b.reshape(slots * rank, -1))


DENSE = "dense"  # the name of every weight matmul's output (jax.checkpoint policies)


def dense(x: jax.Array, w, f32_out: bool = False, split_axis=None) -> jax.Array:
    """x [n, i] @ w, w of any shape [i..., o...] read as the matrix [i, o] -> [n, o].

    The result is float32 (``f32_out``, accumulated in float32 as ``einsum_f32``) or in the weight's
    dtype. ``w`` may be an ``Accumulating`` weight, whose gradient goes into its accumulator, an ``Adapted`` one
    (LoRA), a ``MultiAdapted`` one (many adapters, each token its own: serving) or an ``Int8`` one
    (modelling/quant.py: decoding with int8 weights; ``split_axis``: the mesh axis a row-parallel weight's input is
    split over, where int8 activations take their row's maximum).
    """
    if isinstance(w, Int8):  # int8 (decoding): scaled per channel (and per row of x where its products are integer)
        out = quant_matmul(x, w, split_axis)
        return checkpoint_name(out if f32_out else out.astype(w.dtype), DENSE)
    if isinstance(w, (Adapted, MultiAdapted)):
        out = dense(x, w.w, f32_out)
        return (out.astype(F32) + w.delta(x.astype(w.dtype))).astype(out.dtype)
    if isinstance(w, Accumulating):
        out = _dense_acc(x.astype(w.dtype), w.w, w.acc, f32_out)
    else:
        x = x.astype(w.dtype)
        w2 = w.reshape(x.shape[-1], -1)
        out = einsum_f32("ni,io->no", x, w2) if f32_out else x @ w2
    return checkpoint_name(out, DENSE)  # what ``--remat_policy save_dots`` keeps


def mixed_bf16_gemms() -> bool:
    """Whether the backend runs a bfloat16 x bfloat16 -> float32 GEMM. XLA:CPU runs a GEMM it does not fuse as a
    DotThunk, which has no such kernel (a bfloat16 step failed at run time): there the weight-gradient GEMM's
    operands go up to float32; GPUs and TPUs keep them bfloat16."""
    return jax.default_backend() != "cpu"


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dense_acc(x, w, acc, f32_out):
    return jnp.matmul(x, w.reshape(x.shape[-1], -1), preferred_element_type=F32 if f32_out else None)


def _dense_acc_fwd(x, w, acc, f32_out):
    return _dense_acc(x, w, acc, f32_out), (x, w, acc)


def _dense_acc_bwd(f32_out, res, g):
    x, w, acc = res
    g = g.astype(w.dtype)  # the gradient GEMMs run in the operands' dtype (see einsum_f32)
    dx = lax.dot_general(g, w.reshape(x.shape[-1], -1), (((1,), (1,)), ((), ())), preferred_element_type=x.dtype)
    # the weight gradient in the weight's own shape (x and dy viewed as [n, in dims...], [n, out dims...]), so
    # that it is added to the accumulator as the GEMM's own output
    k = int(np.searchsorted(np.cumprod(w.shape), x.shape[-1])) + 1  # w.shape[:k] multiply to the input size
    xs, gs = x.reshape(-1, *w.shape[:k]), g.reshape(-1, *w.shape[k:])
    if xs.dtype == jnp.bfloat16 and not mixed_bf16_gemms():
        xs, gs = xs.astype(F32), gs.astype(F32)  # exact: a bfloat16 product fits float32
    dw = lax.dot_general(xs, gs, (((0,), (0,)), ((), ())), preferred_element_type=F32)
    return dx, None, acc + dw


_dense_acc.defvjp(_dense_acc_fwd, _dense_acc_bwd)


# --------------------------------------------------------------------------- relative position bias


def relative_position_bucket(relative_position: jax.Array, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> jax.Array:
    """T5's bucketing of (key - query) distances. int [...] -> int32 [...]."""
    ret = jnp.zeros_like(relative_position)
    n = num_buckets
    if bidirectional:
        n //= 2
        ret = ret + (relative_position > 0).astype(relative_position.dtype) * n
        rp = jnp.abs(relative_position)
    else:
        rp = -jnp.minimum(relative_position, 0)
    max_exact = n // 2
    is_small = rp < max_exact
    rp_f = jnp.maximum(rp, 1).astype(F32)
    large = max_exact + (
        jnp.log(rp_f / max_exact) / np.log(max_distance / max_exact) * (n - max_exact)
    ).astype(relative_position.dtype)
    large = jnp.minimum(large, n - 1)
    return (ret + jnp.where(is_small, rp, large)).astype(jnp.int32)


def segment_mask_bias(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
    """Additive bias that keeps attention inside a segment of a packed row.

    Segment ids: 0 padding, 1, 2, ... the examples of the row. A query sees a key when the key is
    not padding and both belong to the same example. A padding query sees every non-padding key, as
    with a plain padding mask: its output reaches no real token, and its softmax row is never empty.
    query_segments [b, q], key_segments [b, k] -> float32 [b, 1, q, k].
    """
    q, k = query_segments[:, :, None], key_segments[:, None, :]
    visible = (k > 0) & ((q == k) | (q == 0))
    return jnp.where(visible, 0.0, MASK_VALUE).astype(F32)[:, None]


def padding_mask_bias(mask: jax.Array) -> jax.Array:
    """Additive bias from a key padding mask. mask [b, k] (1 keep) -> float32 [b, 1, 1, k]."""
    return jnp.where(mask[:, None, None, :] > 0, 0.0, MASK_VALUE).astype(F32)


def write_at(cache: jax.Array, new: jax.Array, at, axis: int, layer=None) -> jax.Array:
    """``new`` written into ``cache`` from index ``at`` along ``axis`` (a cache's position axis): one index for every
    row (a scalar), or one per row (int [b]: row r at ``at[r]``, the rows on axis 0, as serving's slots decode each
    at its own position). cache [b, ...], new [b, ...] (shorter along ``axis``) -> cache's shape. ``layer``: the cache
    holds every layer, cache [b, L, ...] (``axis`` counted in it), and ``new`` [b, ...] one layer's (no L axis), written
    at layer ``layer`` (a traced index: a scan over the layers writes its own in place)."""
    if layer is not None:
        new = jnp.expand_dims(new, 1)
    if jnp.ndim(at) == 0:
        starts = [0] * cache.ndim
        starts[axis] = at
        if layer is not None:
            starts[1] = layer
        return lax.dynamic_update_slice(cache, new.astype(cache.dtype), starts)

    def row(c, n, a):  # one row: c [...] without the batch axis
        starts = [0] * c.ndim
        starts[axis - 1] = a
        if layer is not None:
            starts[0] = layer
        return lax.dynamic_update_slice(c, n.astype(c.dtype), starts)

    return jax.vmap(row)(cache, new, at)


def layer_of(cache: jax.Array, layer) -> jax.Array:
    """Layer ``layer`` (a traced index) of a cache of every layer [b, L, ...] -> [b, ...]."""
    return lax.dynamic_index_in_dim(cache, layer, axis=1, keepdims=False)


def gather_packed(t: jax.Array, where: jax.Array, axis: int) -> jax.Array:
    """Each prompt's positions out of rows packed several prompts to a row: t [R, ..., W (at ``axis``), ...], where
    int [J, W'] (the flat index r * W + c of each prompt's position, R * W: none, zeros) -> [J, ..., W' (at
    ``axis``), ...]."""
    moved = jnp.moveaxis(t, axis, 1)  # [R, W, ...]
    flat = moved.reshape((-1,) + moved.shape[2:])
    flat = jnp.concatenate([flat, jnp.zeros((1,) + flat.shape[1:], flat.dtype)])
    return jnp.moveaxis(flat[where], 1, axis)


def causal_mask_bias(q_len: int, k_len: int, q_offset=0) -> jax.Array:
    """Additive causal bias -> float32 [1, 1, q, k]; query i sees keys <= i + q_offset."""
    qi = jnp.arange(q_len)[:, None] + q_offset
    ki = jnp.arange(k_len)[None, :]
    return jnp.where(ki <= qi, 0.0, MASK_VALUE).astype(F32)[None, None]


# --------------------------------------------------------------------------- attention


def _in_proj(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [b, l, d] @ w [d, h, kv] -> [b, l, h, kv], as one 2-D matmul.

    Written as reshape + matmul rather than a 4-D einsum: XLA:CPU lowers the einsum's
    backward to slow non-canonical dot products (measured 2x slower training at the
    Flan-T5-small shape); the 2-D form maps onto plain GEMMs forward and backward.
    """
    d, h, k = w.shape
    return dense(x.reshape(-1, d), w).reshape(*x.shape[:-1], h, k)


def project_q(p: dict, x: jax.Array, prefix: str = "") -> jax.Array:
    """x [b, q, d] -> q [b, q, h, kv]."""
    w = p[prefix + "q"]
    return _in_proj(x, w)


def project_kv(p: dict, x: jax.Array, prefix: str = "") -> tuple:
    """x [b, k, d] -> (k, v) each [b, k, h, kv]."""
    wk, wv = p[prefix + "k"], p[prefix + "v"]
    return _in_proj(x, wk), _in_proj(x, wv)


def heads_major_attention() -> bool:
    """Whether ``attend`` moves the heads in front of the positions before its products: on a CPU, where XLA's
    products over [b, h, l, kv] ran the attention of an encoder layer (3 rows of 256, 6 heads of 64) in half the
    time of those over [b, l, h, kv] (and its gradient in 0.84x); elsewhere the products read the heads in place."""
    return jax.default_backend() == "cpu"


def attend(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array,
           dropout_rate: float = 0.0, rng: Optional[jax.Array] = None, scale: float = 1.0) -> jax.Array:
    """Softmax attention; scores scaled by ``scale`` (T5: 1, no 1/sqrt(kv) scaling; GPT-J: 1/sqrt(kv)).

    q [b, q, h, kv], k/v [b, k, h, kv], bias broadcastable to [b, h, q, k]
    (float32) -> [b, q, h, kv] in v's dtype.
    """
    major = heads_major_attention()
    if major:  # [b, h, l, kv]: the same sums (see heads_major_attention)
        q, k, v = (jnp.transpose(t, (0, 2, 1, 3)) for t in (q, k, v))
    scores = einsum_f32("bhqd,bhkd->bhqk" if major else "bqhd,bkhd->bhqk", q, k)
    if scale != 1.0:
        scores = scores * scale
    scores = scores + bias
    probs = jax.nn.softmax(scores, axis=-1)
    probs = dropout(probs, dropout_rate, rng)
    if major:
        return jnp.transpose(jnp.einsum("bhqk,bhkd->bhqd", probs.astype(v.dtype), v), (0, 2, 1, 3))
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(v.dtype), v)


def attend_fused(q: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array,
                 implementation: Optional[str] = "cudnn", scale: float = 1.0) -> jax.Array:
    """attend() as one fused kernel (cuDNN flash attention on a GPU): the [b, h, q, k] scores
    and probabilities are never written to memory. No dropout. The bias (relative positions
    plus padding) is passed in the operands' dtype, broadcast to [b, h, q, k]."""
    b, nq, h, _ = q.shape
    bias = jnp.maximum(jnp.broadcast_to(bias, (b, h, nq, k.shape[1])), jnp.finfo(q.dtype).min).astype(q.dtype)
    return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, implementation=implementation)


def attend_serialised(q, k, v, bias, chunks: int, dropout_rate=0.0, rng=None, impl: str = "xla", scale: float = 1.0):
    """attend() over `chunks` query chunks, each rematerialised on its own (attention serialisation).

    Peak memory of the scores falls from [b, h, q, k] to [b, h, q/chunks, k].
    """
    if impl == "cudnn" and dropout_rate == 0.0 and q.shape[1] == k.shape[1]:
        return attend_fused(q, k, v, bias, scale=scale)  # flash attention needs no query chunking
    if chunks == 1:
        return attend(q, k, v, bias, dropout_rate, rng, scale)
    n = q.shape[1] // chunks
    outs = []
    for i in range(chunks):
        b_i = bias if bias.shape[2] == 1 else lax.slice_in_dim(bias, i * n, (i + 1) * n, axis=2)
        r_i = None if rng is None else jax.random.fold_in(rng, i)
        fn = jax.checkpoint(partial(attend, dropout_rate=dropout_rate, scale=scale))
        outs.append(fn(lax.slice_in_dim(q, i * n, (i + 1) * n, axis=1), k, v, b_i, rng=r_i))
    return jnp.concatenate(outs, axis=1)


def attention_output(p: dict, ctx: jax.Array, tp_axis: Optional[str], prefix: str = "") -> jax.Array:
    """Row-parallel output projection. ctx [b, q, h, kv] -> float32 [b, q, d], summed over tp."""
    w = p[prefix + "o"]
    h, k, d = w.shape
    out = dense(ctx.reshape(-1, h * k), w, f32_out=True, split_axis=tp_axis).reshape(*ctx.shape[:-2], d)
    return identical_grad_inputs(out, tp_axis)


def attention(p: dict, x: jax.Array, kv_x: Optional[jax.Array], bias: jax.Array, tp_axis: Optional[str],
              prefix: str = "", serialisation: int = 1, dropout_rate: float = 0.0,
              rng: Optional[jax.Array] = None, impl: str = "xla") -> jax.Array:
    """Multi-head attention sharded by heads over tp.

    x [b, q, d] (identical over tp), kv_x [b, k, d] or None for self-attention,
    bias broadcastable to [b, h, q, k] -> float32 [b, q, d] identical over tp.
    """
    # Heads are split over tp: q/k/v are column-parallel, o is row-parallel, so one
    # all-reduce per attention (Megatron).
    x = identical_inputs(x, tp_axis)
    src = x if kv_x is None else identical_inputs(kv_x, tp_axis)
    q = project_q(p, x, prefix)
    k, v = project_kv(p, src, prefix)
    ctx = attend_serialised(q, k, v, bias, serialisation, dropout_rate, rng, impl)
    return attention_output(p, ctx, tp_axis, prefix)


# --------------------------------------------------------------------------- feed-forward


# the activation of a feed_forward_proj (config.FEED_FORWARD_PROJ), as HF's T5 applies it: its "gated-gelu" is the
# tanh approximation (gelu_new), a plain "gelu" the exact one
ACTIVATIONS = {
    "gated-gelu": partial(jax.nn.gelu, approximate=True), "gelu": partial(jax.nn.gelu, approximate=False),
    "gated-silu": jax.nn.silu, "silu": jax.nn.silu, "gated-relu": jax.nn.relu, "relu": jax.nn.relu,
}


def feed_forward(p: dict, x: jax.Array, tp_axis: Optional[str], scale_ff: int = 1,
                 dropout_rate: float = 0.0, rng: Optional[jax.Array] = None, *, proj: str) -> jax.Array:
    """The T5 family's feed-forward, sharded by the inner dim over tp: gated (act(x wi_0) * x wi_1, v1.1 / Flan-T5 /
    UL2) when p holds wi_0 and wi_1, else act(x wi) (v1.0); proj is the config's feed_forward_proj.

    x [b, l, d] (identical over tp) -> float32 [b, l, d] identical over tp.
    """
    # wi is column-parallel (the activation is elementwise, so each device applies it to
    # its own columns), wo row-parallel: one all-reduce per feed-forward.
    act = ACTIVATIONS[proj]
    x = identical_inputs(x, tp_axis)
    lead = x.shape[:-1]
    x = x.reshape(-1, x.shape[-1])  # tokens flattened: plain GEMMs forward and backward (see _in_proj)
    # float16 (largest value 65504): the hidden activations are formed in float32 and divided by scale_ff before
    # they are rounded to float16 for the down-projection, whose output is float32 (as the residual stream)
    wide = (p["wi_0"] if "wi_0" in p else p["wi"]).dtype == jnp.float16
    if "wi_0" in p:
        xc = x.astype(p["wi_0"].dtype)
        h = act(dense(xc, p["wi_0"], f32_out=wide)) * dense(xc, p["wi_1"], f32_out=wide)
    else:
        h = act(dense(x, p["wi"], f32_out=wide))
    h = dropout(h, dropout_rate, rng)
    if scale_ff != 1:
        h = h / scale_ff
    out = dense(h, p["wo"], f32_out=True, split_axis=tp_axis)
    if scale_ff != 1:
        out = out * scale_ff
    out = out.reshape(*lead, out.shape[-1])
    return identical_grad_inputs(out, tp_axis)


# --------------------------------------------------------------------------- embedding and head


def embed(table: jax.Array, ids: jax.Array, tp_axis: Optional[str]) -> jax.Array:
    """Vocab-sharded embedding lookup. table [Vl, d], ids int [b, l] -> float32 [b, l, d]."""
    n = table.shape[0]
    local = ids - tp_index(tp_axis) * n
    valid = (local >= 0) & (local < n)
    rows = jnp.take(table, jnp.where(valid, local, 0), axis=0)
    out = jnp.where(valid[..., None], rows.astype(F32), 0.0)
    # each device holds the rows of its vocab slice; the sum over tp completes the lookup
    return identical_grad_inputs(out, tp_axis)


def lm_logits(x: jax.Array, w: jax.Array, tp_axis: Optional[str], vocab_size: int,
              bias: Optional[jax.Array] = None) -> jax.Array:
    """Vocab-sharded LM head. x [b, l, d], w [d, Vl], bias [Vl] or None -> float32 logits [b, l, Vl].

    Columns past vocab_size (tp padding) get MASK_VALUE, so softmax and argmax ignore them.
    """
    x = identical_inputs(x, tp_axis)
    # a 2-D GEMM (see _in_proj); as a 3-D einsum XLA:CPU ran the decode step's head ~1.7x slower
    x2 = x.reshape(-1, x.shape[-1])
    logits = quant_matmul(x2, w) if isinstance(w, Int8) else einsum_f32("nd,dv->nv", x2.astype(w.dtype), w)
    logits = logits.reshape(*x.shape[:-1], w.shape[1])
    if bias is not None:
        logits = logits + bias.astype(F32)
    cols = tp_index(tp_axis) * w.shape[1] + jnp.arange(w.shape[1])
    return jnp.where(cols < vocab_size, logits, MASK_VALUE)


# --------------------------------------------------------------------------- vocab-sharded loss


def _ce_forward(logits, labels, tp_axis):
    n = logits.shape[-1]
    start = tp_index(tp_axis) * n
    m = jnp.max(logits, axis=-1)
    if not trivial(tp_axis):
        m = lax.pmax(m, tp_axis)
    e = jnp.exp(logits - m[..., None])
    s = jnp.sum(e, axis=-1)
    local = labels - start
    in_range = (local >= 0) & (local < n)
    tgt = jnp.take_along_axis(logits, jnp.clip(local, 0, n - 1)[..., None], axis=-1)[..., 0]
    tgt = jnp.where(in_range, tgt, 0.0)
    if not trivial(tp_axis):
        s = lax.psum(s, tp_axis)
        tgt = lax.psum(tgt, tp_axis)
    valid = labels != -100
    loss = jnp.sum(jnp.where(valid, jnp.log(s) + m - tgt, 0.0))
    return loss, (e, s, local, in_range, valid)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _sharded_ce(logits, labels, tp_axis):
    return _ce_forward(logits, labels, tp_axis)[0]


def _sharded_ce_fwd(logits, labels, tp_axis):
    loss, res = _ce_forward(logits, labels, tp_axis)
    return loss, (res, labels)


def _sharded_ce_bwd(tp_axis, saved, g):
    (e, s, local, in_range, valid), labels = saved
    n = e.shape[-1]
    onehot = (jnp.arange(n) == local[..., None]) & in_range[..., None]
    dlogits = (e / s[..., None] - onehot) * (valid[..., None] * g)
    return dlogits, None


_sharded_ce.defvjp(_sharded_ce_fwd, _sharded_ce_bwd)


def cross_entropy_sum(logits: jax.Array, labels: jax.Array, tp_axis: Optional[str]) -> jax.Array:
    """Sum of token cross entropies over vocab-sharded logits; labels -100 are ignored.

    logits float32 [b, l, Vl] (this device's vocab slice), labels int [b, l] -> scalar,
    identical over tp. Only [b, l] statistics cross devices; full logits are never gathered.
    """
    return _sharded_ce(logits, labels, tp_axis)


# --------------------------------------------------------------------------- rotary embeddings and grouped heads


def rotary_tables(positions: jax.Array, rotary_dim: int, base: float = 10000.0) -> tuple:
    """(sin, cos) of a rotary embedding on ``rotary_dim`` dims of each head. positions int [b, l] -> each float32
    [b, l, rotary_dim // 2] (frequency i: base ** (-2i / rotary_dim))."""
    inv_freq = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.sin(angles), jnp.cos(angles)


def _rotated(x: jax.Array, sin: jax.Array, cos: jax.Array, interleaved: bool) -> jax.Array:
    r = 2 * sin.shape[-1]
    rot, rest = x[..., :r].astype(jnp.float32), x[..., r:]
    if interleaved:  # pairs (2i, 2i + 1) rotate together: GPT-J's rotate_every_two
        s, c = (jnp.repeat(t, 2, axis=-1)[:, :, None, :] for t in (sin, cos))
        pairs = rot.reshape(*rot.shape[:-1], r // 2, 2)
        turned = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(rot.shape)
    else:  # dims (i, i + r/2) rotate together: GPT-NeoX's and LLaMA's rotate_half
        s, c = (jnp.concatenate([t, t], axis=-1)[:, :, None, :] for t in (sin, cos))
        turned = jnp.concatenate([-rot[..., r // 2:], rot[..., : r // 2]], axis=-1)
    out = (rot * c + turned * s).astype(x.dtype)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


def rotate_every_two(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotary embedding on the first ``2 * sin.shape[-1]`` dims of each head, pairs (2i, 2i + 1) rotated together
    (GPT-J). x [b, l, h, kv], sin/cos [b, l, r/2] -> [b, l, h, kv] in x's dtype."""
    return _rotated(x, sin, cos, interleaved=True)


def rotate_half(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotary embedding on the first ``2 * sin.shape[-1]`` dims of each head, dims i and i + r/2 rotated together
    (GPT-NeoX, LLaMA). x [b, l, h, kv], sin/cos [b, l, r/2] -> [b, l, h, kv] in x's dtype."""
    return _rotated(x, sin, cos, interleaved=False)


def repeat_heads(x: jax.Array, heads: int, axis: int) -> jax.Array:
    """Grouped key/value heads repeated to ``heads`` along ``axis`` (each group serves heads // groups query heads,
    the groups in order: query head j reads group j // (heads // groups))."""
    groups = x.shape[axis]
    return x if groups == heads else jnp.repeat(x, heads // groups, axis=axis)


def prompt_positions(mask: jax.Array) -> jax.Array:
    """Positions of left-padded prompts: real tokens count from 0, padding is no position (as HF's ``generate``
    derives them from the attention mask). mask [b, k] -> int [b, k]."""
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)
