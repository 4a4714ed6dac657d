"""The T5 family (T5 v1.0 / v1.1, Flan-T5, mT5, UMT5, UL2): the encoder-decoder built from the per-phase
functions of the original app, its decoding with a KV cache and its Hugging Face mapping.

Phases: ``embeddings`` -> ``t5_block`` x layers (encoder) -> ``encoder_head``
-> ``embeddings`` -> ``t5_block`` x layers (decoder, with cross-attention)
-> ``head`` (final norm, LM head, vocab-sharded loss). The same functions run
on one device (``tp_axis=None``) and inside ``shard_map`` with tensor
parallelism; the graphs/ package composes them into programs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from config.fields import spec
from config.schema import ModelConfig
from modelling import decoding
from modelling import family as fam
from modelling import layers as L
from modelling import lora_stack
from modelling.family import Family, HFMapping, ModelOptions, Stack
from modelling.hf_weights import kept_as, state_dict_reader, vocab_padder
from modelling.params import ParamSpec, padded_vocab
from modelling.rows import Seq2SeqRows
from modelling.tp import tp_index
from utils.errors import CheckpointError, ConfigError

# feed_forward_proj values: "gated-ACT" (two input projections, one through ACT) or "ACT", as HF's T5Config
FEED_FORWARD_PROJ = ("gated-gelu", "gated-silu", "gated-relu", "relu", "gelu", "silu")

F32 = jnp.float32
DTYPES = fam.DTYPES


@dataclass(frozen=True)
class T5Attention:
    """T5's own attention fields (config section ``model.attention``): its relative position buckets."""

    section: ClassVar[str] = "model.attention"

    relative_attention_num_buckets: int = spec(32, minimum=1, shape=True)
    """T5: number of buckets of the relative position encoding."""

    relative_attention_max_distance: int = spec(128, shape=True)
    """T5: largest distance told apart by the relative position encoding."""


@dataclass(frozen=True)
class T5Model:
    """T5's own model fields (config section ``model``): its feed-forward kind and its tied, rescaled head."""

    section: ClassVar[str] = "model"

    feed_forward_proj: str = spec("gated-gelu", shape=True)
    """T5: feed-forward kind, as HF's T5 config names it: gated-gelu (T5 v1.1, Flan-T5, mT5, UMT5), gated-silu
    (UL2, Flan-UL2), relu (T5 v1.0), or gated-relu, gelu, silu."""

    tie_word_embeddings: bool = spec(False, shape=True)
    """T5: share the embedding with the LM head and rescale by hidden_size**-0.5 (T5 v1.0); Flan-T5 unties them."""


@dataclass(frozen=True)
class T5Options(ModelOptions, T5Attention, T5Model):
    """What T5's model functions read: ModelOptions and T5's own fields."""


def keeps_f32(name: str) -> bool:
    """Norms and the relative-position tables stay float32 in the compute copy of the weights."""
    return name.endswith("norm") or name == "relpos"


def cast_params(params: dict, dtype) -> dict:
    """Casts matmul weights to the compute dtype; norms and relative bias stay float32."""
    return fam.cast_params(params, dtype, keeps_f32)


# Random streams: the dropout keys of each part of the model, derived from one key per micro-batch
# as fold_in(key, stream) (and then the layer index). Both executors and the model below use these,
# so a phased step draws exactly the fused step's dropout masks.
ENC_EMBED, ENC_LAYERS, ENC_HEAD = 10, 11, 12
DEC_EMBED, DEC_LAYERS, HEAD = 20, 21, 30
TP_SHARD = 1000  # added to the tp index for dropout on tp-sharded activations (a key per shard)
# inside a block (after the layer index): attention probabilities and output, cross-attention's, feed-forward's
ATTN_PROBS, ATTN_OUT, CROSS_PROBS, CROSS_OUT, FF_HIDDEN, FF_OUT = 1, 2, 3, 4, 5, 6


_rng = fam.rng


def _sharded_rng(rng, tp_axis, *data):
    """A key that differs per tp shard, for dropout on tp-sharded activations."""
    return None if rng is None else _rng(rng, *data, tp_index(tp_axis) + TP_SHARD)


# --------------------------------------------------------------------------- phases


def embeddings(shared: jax.Array, ids: jax.Array, opts: T5Options, tp_axis: Optional[str],
               rng=None) -> jax.Array:
    """Embedding phase. shared [Vl, d], ids int [b, l] -> float32 [b, l, d] identical over tp."""
    return L.dropout(L.embed(shared, ids, tp_axis), opts.dropout_prob, rng)


def per_layer_bias(opts: T5Options) -> bool:
    """Whether every layer has its own relative-position table (UMT5) rather than one per stack (T5)."""
    return opts.family == "umt5"


def self_masks(decoder: bool, length: int, opts: T5Options, mask: Optional[jax.Array] = None,
               positions: Optional[jax.Array] = None) -> tuple:
    """The weight-free part of a stack's self-attention bias: (relative-position buckets int32 [1 or b, l, l],
    mask bias float32 broadcastable to [b, 1, l, l]).

    mask int [b, l]: 1 (or a segment id) for tokens, 0 for padding (the decoder's may be None); positions int
    [b, l] for packed rows (positions restarting at 0 in each segment; mask then holds the segment ids).
    The encoder's buckets are bidirectional and it masks padding; the decoder's are causal and it masks the future.
    """
    if positions is None:
        pos = jnp.arange(length, dtype=jnp.int32)
        rel = (pos[None, :] - pos[:, None])[None]
    else:
        pos = positions.astype(jnp.int32)
        rel = pos[:, None, :] - pos[:, :, None]
    buckets = L.relative_position_bucket(rel, not decoder, opts.relative_attention_num_buckets, opts.relative_attention_max_distance)
    if positions is not None:
        masks = L.segment_mask_bias(mask, mask)
    elif mask is not None:
        masks = L.padding_mask_bias(mask)
    else:
        masks = None
    if decoder:
        causal = L.causal_mask_bias(length, length)
        masks = causal if masks is None else masks + causal
    return buckets, masks


def bucket_bias(table: jax.Array, buckets: jax.Array) -> jax.Array:
    """Relative-position bias of a table [buckets, h] at bucket ids int [B, q, k] -> float32 [B, h, q, k]."""
    return jnp.transpose(jnp.take(table.astype(F32), buckets, axis=0), (0, 3, 1, 2))


def self_context(relpos: Optional[jax.Array], decoder: bool, length: int, opts: T5Options,
                 mask: Optional[jax.Array] = None, positions: Optional[jax.Array] = None):
    """What a stack's blocks need for self-attention: the whole bias float32 [1 or b, h, l, l] from the stack's
    table (T5), or ``self_masks`` for blocks that read their own tables (UMT5: relpos None)."""
    buckets, masks = self_masks(decoder, length, opts, mask, positions)
    return (buckets, masks) if relpos is None else bucket_bias(relpos, buckets) + masks


def encoder_self_bias(relpos: jax.Array, mask: jax.Array, opts: T5Options,
                      positions: Optional[jax.Array] = None) -> jax.Array:
    """Encoder self-attention bias of one table [buckets, h] -> float32 [b, h, l, l] (relative positions +
    padding, or + segments when packed)."""
    return self_context(relpos, False, mask.shape[1], opts, mask, positions)


def decoder_self_bias(relpos: jax.Array, length: int, opts: T5Options, mask: Optional[jax.Array] = None,
                      positions: Optional[jax.Array] = None) -> jax.Array:
    """Decoder (causal) self-attention bias of one table -> float32 [1 or b, h, l, l].

    mask int [b, l] (1 or segment id, 0 padding) or None; positions int [b, l] for packed rows (then
    mask holds the segment ids and is required).
    """
    return self_context(relpos, True, length, opts, mask, positions)


def cross_bias(mask: jax.Array, decoder_mask: Optional[jax.Array] = None, packed: bool = False) -> jax.Array:
    """Cross-attention bias: encoder padding [b, 1, 1, k]; for packed rows, each decoder segment sees
    only its own example's encoder tokens [b, 1, q, k] (decoder_mask holds the decoder segment ids)."""
    if not packed:
        return L.padding_mask_bias(mask)
    return L.segment_mask_bias(decoder_mask, mask)


def is_packed(batch: dict) -> bool:
    """Whether a batch holds packed rows (it then carries per-segment positions)."""
    return "positions" in batch


def t5_block(p: dict, x: jax.Array, self_bias: jax.Array, opts: T5Options, tp_axis: Optional[str],
             enc_out: Optional[jax.Array] = None, cross_bias: Optional[jax.Array] = None,
             rng=None) -> jax.Array:
    """One encoder block, or a decoder block when ``enc_out`` is given.

    p: one layer's parameters (no ``layers`` axis); x float32 [b, l, d];
    enc_out [b, k, d]; biases float32 broadcastable to [b, h, l, l] / [b, h, l, k].
    -> float32 [b, l, d], identical over tp.
    """
    rate, chunks, dt = opts.dropout_prob, opts.attention_serialisation, opts.compute_dtype
    h = L.rms_norm(x, p["attn_norm"], opts.eps).astype(dt)
    a = L.attention(p, h, None, self_bias, tp_axis, "", chunks, rate, _sharded_rng(rng, tp_axis, ATTN_PROBS),
                    opts.attention_impl)
    x = x + L.dropout(a, rate, _rng(rng, ATTN_OUT))
    if enc_out is not None:
        h = L.rms_norm(x, p["cross_norm"], opts.eps).astype(dt)
        a = L.attention(p, h, enc_out.astype(dt), cross_bias, tp_axis, "c", chunks, rate,
                        _sharded_rng(rng, tp_axis, CROSS_PROBS))
        x = x + L.dropout(a, rate, _rng(rng, CROSS_OUT))
    h = L.rms_norm(x, p["ff_norm"], opts.eps).astype(dt)
    f = L.feed_forward(p, h, tp_axis, opts.scale_ff, rate, _sharded_rng(rng, tp_axis, FF_HIDDEN),
                       proj=opts.feed_forward_proj)
    return x + L.dropout(f, rate, _rng(rng, FF_OUT))


def umt5_block(p: dict, x: jax.Array, self_ctx: tuple, opts: T5Options, tp_axis: Optional[str],
               enc_out: Optional[jax.Array] = None, cross_bias: Optional[jax.Array] = None,
               rng=None) -> jax.Array:
    """A UMT5 block: t5_block with the self-attention bias from the layer's own table p["relpos"] [buckets, h]
    and the stack's ``self_masks`` (cross-attention has no position bias, as in T5)."""
    buckets, masks = self_ctx
    return t5_block(p, x, bucket_bias(p["relpos"], buckets) + masks, opts, tp_axis, enc_out, cross_bias, rng)


def block_fn(opts: T5Options):
    """The block of the model's variant: umt5_block (a table per layer) or t5_block."""
    return umt5_block if per_layer_bias(opts) else t5_block


def run_stack(layers_p: dict, x: jax.Array, self_ctx, opts: T5Options,
              tp_axis: Optional[str], enc_out=None, cross_bias=None, rng=None) -> jax.Array:
    """The variant's block over the stacked layers (leading axis), scanned; layer i's dropout key is
    fold_in(rng, i). self_ctx: ``self_context``.

    The reference composition (validation, decoding, tests); training runs the layers through the
    phase library (graphs/phases.py), which adds recomputation and unrolling."""
    block = block_fn(opts)

    def body(x, inputs):
        p, i = inputs
        r = None if rng is None else jax.random.fold_in(rng, i)
        return block(p, x, self_ctx, opts, tp_axis, enc_out, cross_bias, r), None

    n = jax.tree_util.tree_leaves(layers_p)[0].shape[0]
    x, _ = lax.scan(body, x, (layers_p, jnp.arange(n)))
    return x


def encoder_head(final_norm: jax.Array, x: jax.Array, opts: T5Options, rng=None) -> jax.Array:
    """Final encoder norm. x float32 [b, l, d] -> float32 [b, l, d]."""
    return L.dropout(L.rms_norm(x, final_norm, opts.eps), opts.dropout_prob, rng)


def head_logits(params: dict, x: jax.Array, opts: T5Options, tp_axis: Optional[str], rng=None) -> jax.Array:
    """Decoder final norm + LM head. x float32 [b, l, d] -> float32 logits [b, l, Vl] (vocab-sharded)."""
    h = L.dropout(L.rms_norm(x, params["decoder"]["final_norm"], opts.eps), opts.dropout_prob, rng)
    if opts.tie_word_embeddings:
        # T5 v1.0 rescales before the tied head
        h = h * opts.hidden_size ** -0.5
        w = params["shared"].T
    else:
        w = params["lm_head"]
    return L.lm_logits(h.astype(opts.compute_dtype), w, tp_axis, opts.vocab_size)


def head(params: dict, x: jax.Array, labels: jax.Array, opts: T5Options, tp_axis: Optional[str],
         rng=None) -> jax.Array:
    """Head phase with the loss: -> sum of token cross entropies (labels -100 ignored)."""
    return L.cross_entropy_sum(head_logits(params, x, opts, tp_axis, rng), labels, tp_axis)


# --------------------------------------------------------------------------- whole model


def encode(params: dict, input_ids, attention_mask, opts: T5Options, tp_axis=None, rng=None,
           positions=None) -> jax.Array:
    """Encoder. ids/mask [b, k] (mask: segment ids when packed, with positions [b, k]) -> float32 [b, k, d]."""
    enc = params["encoder"]
    x = embeddings(params["shared"], input_ids, opts, tp_axis, _rng(rng, ENC_EMBED))
    ctx = self_context(enc.get("relpos"), False, input_ids.shape[1], opts, attention_mask, positions)
    x = run_stack(enc["layers"], x, ctx, opts, tp_axis, rng=_rng(rng, ENC_LAYERS))
    return encoder_head(enc["final_norm"], x, opts, _rng(rng, ENC_HEAD))


def decode(params: dict, enc_out, attention_mask, decoder_input_ids, opts: T5Options, tp_axis=None,
           decoder_attention_mask=None, rng=None, positions=None, decoder_positions=None) -> jax.Array:
    """Decoder stack (no head). -> float32 [b, l, d]. Packed rows pass both positions arrays."""
    dec = params["decoder"]
    y = embeddings(params["shared"], decoder_input_ids, opts, tp_axis, _rng(rng, DEC_EMBED))
    ctx = self_context(dec.get("relpos"), True, decoder_input_ids.shape[1], opts, decoder_attention_mask,
                       decoder_positions)
    xbias = cross_bias(attention_mask, decoder_attention_mask, packed=positions is not None)
    return run_stack(dec["layers"], y, ctx, opts, tp_axis, enc_out, xbias, _rng(rng, DEC_LAYERS))


def _encode_decode(p: dict, batch: dict, opts: T5Options, tp_axis, rng) -> jax.Array:
    enc = encode(p, batch["input_ids"], batch["attention_mask"], opts, tp_axis, rng, batch.get("positions"))
    return decode(p, enc, batch["attention_mask"], batch["decoder_input_ids"], opts, tp_axis,
                  batch.get("decoder_attention_mask"), rng, batch.get("positions"), batch.get("decoder_positions"))


def forward(params: dict, batch: dict, opts: T5Options, tp_axis=None, rng=None) -> jax.Array:
    """Full model -> float32 logits [b, l, Vl] (this device's vocab slice)."""
    p = cast_params(params, opts.compute_dtype)
    return head_logits(p, _encode_decode(p, batch, opts, tp_axis, rng), opts, tp_axis, _rng(rng, HEAD))


def loss_sum(params: dict, batch: dict, opts: T5Options, tp_axis=None, rng=None) -> jax.Array:
    """Sum of token cross entropies of a batch (divide by the token count for the mean)."""
    p = cast_params(params, opts.compute_dtype)
    return head(p, _encode_decode(p, batch, opts, tp_axis, rng), batch["labels"], opts, tp_axis, _rng(rng, HEAD))


def token_count(labels: jax.Array) -> jax.Array:
    """Number of labels that count towards the loss (not -100)."""
    return jnp.sum(labels != -100)


# --------------------------------------------------------------------------- parameter specs


def _attention_specs(L_, d, h, kv, prefix=""):
    # Initialisers as in Hugging Face T5 (_init_weights, initializer_factor 1.0).
    return {
        f"{prefix}q": ParamSpec((L_, d, h, kv), ("layers", "embed", "heads", "kv"), (d * kv) ** -0.5),
        f"{prefix}k": ParamSpec((L_, d, h, kv), ("layers", "embed", "heads", "kv"), d ** -0.5),
        f"{prefix}v": ParamSpec((L_, d, h, kv), ("layers", "embed", "heads", "kv"), d ** -0.5),
        f"{prefix}o": ParamSpec((L_, h, kv, d), ("layers", "heads", "kv", "embed"), (h * kv) ** -0.5),
    }


def _stack_specs(m, decoder: bool) -> dict:
    L_, d, f = m.decoder_depth if decoder else m.layers, m.hidden_size, m.d_ff
    h, kv, buckets = m.attention.heads, m.attention.d_kv, m.attention.relative_attention_num_buckets
    relpos = ParamSpec((buckets, h), ("relpos_buckets", "heads"), d ** -0.5)
    layers = {"attn_norm": ParamSpec((L_, d), ("layers", "embed"))}
    if m.family == "umt5":  # a table in every layer
        layers["relpos"] = ParamSpec((L_,) + relpos.shape, ("layers",) + relpos.axes, relpos.std)
    layers.update(_attention_specs(L_, d, h, kv))
    if decoder:
        layers["cross_norm"] = ParamSpec((L_, d), ("layers", "embed"))
        layers.update(_attention_specs(L_, d, h, kv, prefix="c"))
    layers["ff_norm"] = ParamSpec((L_, d), ("layers", "embed"))
    if m.feed_forward_proj.startswith("gated-"):
        layers["wi_0"] = ParamSpec((L_, d, f), ("layers", "embed", "mlp"), d ** -0.5)
        layers["wi_1"] = ParamSpec((L_, d, f), ("layers", "embed", "mlp"), d ** -0.5)
    else:
        layers["wi"] = ParamSpec((L_, d, f), ("layers", "embed", "mlp"), d ** -0.5)
    layers["wo"] = ParamSpec((L_, f, d), ("layers", "mlp", "embed"), f ** -0.5)
    stack = {"relpos": relpos} if m.family != "umt5" else {}
    return {**stack, "layers": layers, "final_norm": ParamSpec((d,), ("embed",))}


def param_specs(m, tensor_parallel: int = 1) -> dict:
    """The spec tree of a T5 model; vocab padded to a multiple of tensor_parallel."""
    V = padded_vocab(m.embedding.vocab_size, tensor_parallel)
    d = m.hidden_size
    specs = {
        "shared": ParamSpec((V, d), ("vocab", "embed"), 1.0),
        "encoder": _stack_specs(m, decoder=False),
        "decoder": _stack_specs(m, decoder=True),
    }
    if not m.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((d, V), ("embed", "vocab"), d ** -0.5)
    return specs



# --------------------------------------------------------------------------- decoding with a KV cache
#
# The encoder runs once per batch; cross-attention keys/values are computed once; the decoder's self-attention
# cache [b, layers, h, max_new_tokens, kv] holds every layer and is written in place at each position. Every layer
# loop is a scan over the stacked weights: a decoding program's size and compile time do not grow with depth. Where
# decoding's layout holds the decoder one tree per layer (a shallow model on a CPU: decoder/decoder.py), the step runs
# its layers one after the other instead, each reading its own weights and its own caches ([b, h, ...], a list of
# layers) in place: XLA:CPU copies a scanned layer's slice of every stacked weight and cache before reading it.

# The decoder's start token: every T5 checkpoint's decoder_start_token_id (its pad id there), whatever the
# tokenizer's pad token is; training rows start with it too (data/packing.py's PAD)
DECODER_START = 0


def cross_kv(layers, enc_out: jax.Array):
    """Cross-attention keys/values of every decoder layer, computed once: (k, v) each [b, layers, h, k, kv] of stacked
    layer weights; of one tree per layer (a list), a list of (k, v) each [b, h, k, kv]. enc_out [b, k, d] in the
    compute dtype."""
    def one(p):
        return tuple(decoding.heads_major(t) for t in L.project_kv(p, enc_out, "c"))

    if isinstance(layers, list):
        return [one(p) for p in layers]
    return tuple(jnp.moveaxis(t, 0, 1) for t in lax.map(one, layers))  # a layer at a time: [L, b, ...] -> [b, L, ...]


def empty_self_cache(cross, max_new_tokens: int, dtype):
    """The self-attention keys and values beside ``cross`` (``cross_kv``'s), zeros with room for ``max_new_tokens``
    positions: (k, v) each [b, layers, h, max_new_tokens, kv], or a list of (k, v) each [b, h, max_new_tokens, kv]."""
    if isinstance(cross, list):
        b, h, _, kv = cross[0][0].shape
        return [(jnp.zeros((b, h, max_new_tokens, kv), dtype),) * 2 for _ in cross]
    b, n, h, _, kv = cross[0].shape
    return (jnp.zeros((b, n, h, max_new_tokens, kv), dtype),) * 2


def _layer_step(p, x, self_kv: tuple, cross: tuple, bias, xbias, pos, opts, tp_axis, layer=None) -> tuple:
    """One decoder layer at one position: x float32 [b, 1, d] -> (x, self_kv) with the new key and value written at
    ``pos``. self_kv: (k, v) [b, h, max_len, kv] of this layer alone, or with ``layer`` (a traced index) every
    layer's [b, layers, h, max_len, kv]; cross: this layer's cross-attention (k, v) [b, h, K, kv]."""
    dt, axis = opts.compute_dtype, 2 if layer is None else 3
    k_all, v_all = self_kv
    h = L.identical_inputs(L.rms_norm(x, p["attn_norm"], opts.eps).astype(dt), tp_axis)
    q = L.project_q(p, h)
    k_new, v_new = L.project_kv(p, h)
    k_all = L.write_at(k_all, decoding.heads_major(k_new), pos, axis=axis, layer=layer)
    v_all = L.write_at(v_all, decoding.heads_major(v_new), pos, axis=axis, layer=layer)
    k_c, v_c = (k_all, v_all) if layer is None else (L.layer_of(k_all, layer), L.layer_of(v_all, layer))
    x = x + L.attention_output(p, decoding.attend_cached(q, k_c, v_c, bias), tp_axis)
    h = L.rms_norm(x, p["cross_norm"], opts.eps).astype(dt)
    x = x + L.attention_output(p, decoding.attend_cached(L.project_q(p, h, "c"), *cross, xbias), tp_axis, "c")
    h = L.rms_norm(x, p["ff_norm"], opts.eps).astype(dt)
    return x + L.feed_forward(p, h, tp_axis, opts.scale_ff, proj=opts.feed_forward_proj), (k_all, v_all)


def decoder_step(params, token, pos, cache: dict, opts, tp_axis):
    """One decoder position with the cache. token int [b] at position ``pos`` -> (logits [b, Vl], cache).

    cache["self"]: (k, v) each [b, layers, h, max_len, kv], written in place at ``pos`` (or a list of each layer's
    (k, v) [b, h, max_len, kv], with the decoder's weights one tree per layer); cache["cross"]: cross_kv's output;
    cache["cross_bias"]: the encoder padding. ``pos``: one position for the batch, or one per row (int [b]:
    serving's slots, each at its own)."""
    dec, xbias = params["decoder"], cache["cross_bias"]
    unrolled = isinstance(cache["self"], list)
    max_len = cache["self"][0][0].shape[2] if unrolled else cache["self"][0].shape[3]
    x = embeddings(params["shared"], token[:, None], opts, tp_axis)  # [b, 1, d]
    at = jnp.reshape(pos, (-1, 1))  # [1 or b, 1]
    rel = jnp.arange(max_len, dtype=jnp.int32)[None] - at
    buckets = L.relative_position_bucket(rel, False, opts.relative_attention_num_buckets,
                                         opts.relative_attention_max_distance)[:, None]  # [1 or b, 1, K]
    causal = jnp.where(jnp.arange(max_len)[None] <= at, 0.0, L.MASK_VALUE)[:, None, None]
    per_layer = per_layer_bias(opts)  # UMT5: each layer's own table
    shared_bias = None if per_layer else bucket_bias(dec["relpos"], buckets) + causal

    def bias(p):
        return bucket_bias(p["relpos"], buckets) + causal if per_layer else shared_bias

    if unrolled:  # each layer's weights and caches its own arrays: read in place
        selfs = []
        for p, kv, cross in zip(dec["layers"], cache["self"], cache["cross"]):
            x, kv = _layer_step(p, x, kv, cross, bias(p), xbias, pos, opts, tp_axis)
            selfs.append(kv)
        return head_logits(params, x, opts, tp_axis)[:, 0], {**cache, "self": selfs}
    ck, cv = cache["cross"]

    def body(carry, inputs):
        x, kv = carry
        p, i = inputs
        x, kv = _layer_step(p, x, kv, (L.layer_of(ck, i), L.layer_of(cv, i)), bias(p), xbias, pos, opts, tp_axis, i)
        return (x, kv), None

    (x, kv), _ = lax.scan(body, (x, cache["self"]), (dec["layers"], jnp.arange(ck.shape[1])))
    return head_logits(params, x, opts, tp_axis)[:, 0], {**cache, "self": kv}


def decode_start(p: dict, input_ids, attention_mask, opts, max_new_tokens: int, tp_axis=None):
    """The encoder, the cross-attention keys/values and the decoder's first position (the start token,
    ``DECODER_START``) -> (logits [b, Vl] of the first new token, cache). p: ``decoding_params``."""
    enc = encode(p, input_ids, attention_mask, opts, tp_axis)
    return decode_start_encoded(p, enc, attention_mask, opts, max_new_tokens, tp_axis)


def decode_start_encoded(p: dict, enc, attention_mask, opts, max_new_tokens: int, tp_axis=None):
    """``decode_start`` from the encoder's output enc float32 [b, k, d] (read elsewhere: the encoder streamed from
    host memory, decoder/streaming.py, or over packed prompts) -> (logits [b, Vl] of the first new token, cache)."""
    cross = cross_kv(p["decoder"]["layers"], enc.astype(opts.compute_dtype))
    cache = {"self": empty_self_cache(cross, max_new_tokens, opts.compute_dtype), "cross": cross,
             "cross_bias": L.padding_mask_bias(attention_mask)}
    b = attention_mask.shape[0]
    return decode_step(p, jnp.full((b,), DECODER_START, jnp.int32), -1, cache, opts, tp_axis)


def decode_step(p: dict, token, i, cache: dict, opts, tp_axis=None):
    """New token i (decoder position i + 1) -> (logits [b, Vl] of the next, cache)."""
    return decoder_step(p, token, i + 1, cache, opts, tp_axis)


def decode_start_packed(p: dict, ids, segments, positions, where, lengths, opts, max_new_tokens: int, tp_axis=None):
    """``decode_start`` of prompts packed several to a row (serving's inserts): the encoder over the packed rows
    ids/segments/positions [R, W] (segment ids from 1, positions restarting at 0 in each prompt), the cross-attention
    keys and values of its output, and each prompt's of them gathered out (``where`` int [J, W]: each prompt's
    positions in the rows flattened, R * W past its ``lengths`` [J]) -> (logits [J, Vl], the cache of J rows with room
    for prompts W wide). Adapters served side by side (modelling/lora_stack.py: ``p`` bound with one index a prompt):
    each packed token reads its prompt's."""
    tokens = lora_stack.per_token(p, where, ids.size)
    enc = encode(tokens, ids, segments, opts, tp_axis, positions=positions)
    cross = jax.tree.map(lambda t: L.gather_packed(t, where, t.ndim - 2),  # (their prompt axis: the next to last)
                         cross_kv(tokens["decoder"]["layers"], enc.astype(opts.compute_dtype)))
    mask = jnp.arange(where.shape[1])[None] < lengths[:, None]
    cache = {"self": empty_self_cache(cross, max_new_tokens, opts.compute_dtype), "cross": cross,
             "cross_bias": L.padding_mask_bias(mask)}
    return decode_step(p, jnp.full((where.shape[0],), DECODER_START, jnp.int32), -1, cache, opts, tp_axis)


def cache_positions(cache: dict) -> dict:
    """The decoder's self-attention keys and values along axis 3 (after the batch and the layers; axis 2 of each
    layer's own, one a layer); the cross-attention's (the prompt's) whole."""
    if isinstance(cache["self"], list):
        n = len(cache["self"])
        return {"self": [(2, 2)] * n, "cross": [(-1, -1)] * n, "cross_bias": -1}
    return {"self": (3, 3), "cross": (-1, -1), "cross_bias": -1}


def first_token_column(prompt_length: int) -> int:
    """Position 1: the decoder's start token is at 0, new token i at i + 1, whatever the prompt's length."""
    return 1


def decode_uncached(p, input_ids, attention_mask, tokens, opts, tp_axis=None):
    """Logits [b, Vl] of the next token after ``tokens`` int [b, n], the encoder and the decoder run whole."""
    enc = encode(p, input_ids, attention_mask, opts, tp_axis)
    dec_in = jnp.concatenate([jnp.full((input_ids.shape[0], 1), DECODER_START, jnp.int32), tokens.astype(jnp.int32)],
                             1)
    return head_logits(p, decode(p, enc, attention_mask, dec_in, opts, tp_axis), opts, tp_axis)[:, -1]


# --------------------------------------------------------------------------- Hugging Face mapping
#
# HF Linear weights are [out, in]; ours are [in, ...] with heads split out: q/k/v [d, h, kv] = W.T.reshape(d, h,
# kv); o [h, kv, d] = W.T.reshape(h, kv, d); wi [d, f] = W.T; wo [f, d] = W.T; lm_head [d, V] = W.T. Layers are
# stacked.

_ATTN = ("q", "k", "v", "o")
_DENSE_FF = ("wi", "wi_0", "wi_1", "wo")


def config_from_hf(hf: Mapping) -> ModelConfig:
    """Our ModelConfig from an HF T5, mT5 or UMT5 config (dict form): T5 v1.0 / v1.1, Flan-T5, mT5, UMT5, UL2."""
    m = ModelConfig()
    m.family = "umt5" if hf.get("model_type") == "umt5" else "t5"
    m.layers = hf["num_layers"]
    decoder = hf.get("num_decoder_layers")
    m.decoder_layers = decoder if decoder not in (None, m.layers) else 0
    m.hidden_size, m.d_ff = hf["d_model"], hf["d_ff"]
    m.attention.heads, m.attention.d_kv = hf["num_heads"], hf["d_kv"]
    m.embedding.vocab_size = hf["vocab_size"]
    m.attention.relative_attention_num_buckets = hf.get("relative_attention_num_buckets", 32)
    m.attention.relative_attention_max_distance = hf.get("relative_attention_max_distance", 128)
    m.eps = hf.get("layer_norm_epsilon", 1e-6)
    proj = hf.get("feed_forward_proj", "relu")
    if proj not in FEED_FORWARD_PROJ:
        raise CheckpointError(f"feed_forward_proj {proj!r} is not supported: this project runs "
                              f"{', '.join(FEED_FORWARD_PROJ)}")
    m.feed_forward_proj = proj
    # T5 v1.0 ties the head to the embedding and rescales the decoder output; v1.1, Flan-T5, mT5, UMT5 and UL2
    # do neither. transformers >= 5 writes tie_word_embeddings=True for every T5 and keeps the v1.0/v1.1
    # difference in scale_decoder_outputs (T5 only: its mT5 and UMT5 configs drop it).
    m.tie_word_embeddings = bool(hf.get("scale_decoder_outputs", hf.get("tie_word_embeddings", True)))
    return m


def hf_config_dict(m) -> dict:
    """An HF T5 (or UMT5) config dict for our ModelConfig (what config.json holds)."""
    act = m.feed_forward_proj.split("-")[-1]
    umt5 = m.family == "umt5"
    return {
        "architectures": ["UMT5ForConditionalGeneration" if umt5 else "T5ForConditionalGeneration"],
        "model_type": "umt5" if umt5 else "t5",
        "d_model": m.hidden_size, "d_ff": m.d_ff, "d_kv": m.attention.d_kv, "num_heads": m.attention.heads,
        "num_layers": m.layers, "num_decoder_layers": m.decoder_depth, "vocab_size": m.embedding.vocab_size,
        "relative_attention_num_buckets": m.attention.relative_attention_num_buckets,
        "relative_attention_max_distance": m.attention.relative_attention_max_distance,
        "layer_norm_epsilon": m.eps, "feed_forward_proj": m.feed_forward_proj,
        "dense_act_fn": "gelu_new" if m.feed_forward_proj == "gated-gelu" else act,
        "is_gated_act": m.feed_forward_proj.startswith("gated-"),
        "tie_word_embeddings": m.tie_word_embeddings, "scale_decoder_outputs": m.tie_word_embeddings,
        "dropout_rate": m.dropout_prob, "decoder_start_token_id": DECODER_START, "pad_token_id": 0, "eos_token_id": 1,
        "initializer_factor": 1.0, "is_encoder_decoder": True,
    }


def _relpos_key(stack: str, i: int = 0) -> str:
    return f"{stack}.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight"


def hf_layer_keys(stack: str, i: int, m) -> dict:
    """Our per-layer name -> HF name, for layer i of a stack ("encoder" or "decoder")."""
    decoder = stack == "decoder"
    s = f"{stack}.block.{i}.layer"
    keys = {"attn_norm": f"{s}.0.layer_norm.weight"}
    keys.update({k: f"{s}.0.SelfAttention.{k}.weight" for k in _ATTN})
    if m.family == "umt5":  # every layer has its own table
        keys["relpos"] = _relpos_key(stack, i)
    ff = 1
    if decoder:
        keys["cross_norm"] = f"{s}.1.layer_norm.weight"
        keys.update({"c" + k: f"{s}.1.EncDecAttention.{k}.weight" for k in _ATTN})
        ff = 2
    keys["ff_norm"] = f"{s}.{ff}.layer_norm.weight"
    for w in (("wi_0", "wi_1") if m.feed_forward_proj.startswith("gated-") else ("wi",)) + ("wo",):
        keys[w] = f"{s}.{ff}.DenseReluDense.{w}.weight"
    return keys


def _base(name: str) -> str:
    return name[1:] if name in ("cq", "ck", "cv", "co") else name


def _to_ours(name: str, w: np.ndarray, h: int, kv: int) -> np.ndarray:
    base = _base(name)
    if base in ("q", "k", "v"):
        return w.T.reshape(w.shape[1], h, kv)
    if base == "o":
        return w.T.reshape(h, kv, w.shape[0])
    return w.T if name in _DENSE_FF else w


def _to_hf(name: str, w: np.ndarray) -> np.ndarray:
    base = _base(name)
    if base in ("q", "k", "v"):
        return w.reshape(w.shape[0], -1).T
    if base == "o":
        return w.reshape(-1, w.shape[-1]).T
    return w.T if name in _DENSE_FF else w


def params_from_hf(sd: Mapping, m, tensor_parallel: int = 1, dtype=None) -> dict:
    """Our parameter tree from an HF state dict (values: numpy arrays or torch tensors): float32, or with ``dtype``
    the matmul weights in it (norms and tables float32), each cast as it is read."""
    get, pad_rows = state_dict_reader(sd, "UMT5" if m.family == "umt5" else "T5"), vocab_padder(m, tensor_parallel)
    cast = kept_as(dtype, keeps_f32)
    h, kv = m.attention.heads, m.attention.d_kv
    shared_key = "shared.weight" if "shared.weight" in sd else "encoder.embed_tokens.weight"
    params = {"shared": cast("shared", pad_rows(get(shared_key), 0))}
    for stack in ("encoder", "decoder"):
        dec = stack == "decoder"
        per_layer = [hf_layer_keys(stack, i, m) for i in range(m.decoder_depth if dec else m.layers)]
        layers = {name: np.stack([cast(name, _to_ours(name, get(keys[name]), h, kv)) for keys in per_layer])
                  for name in per_layer[0]}
        own = {} if m.family == "umt5" else {"relpos": get(_relpos_key(stack))}
        params[stack] = {**own, "layers": layers, "final_norm": get(f"{stack}.final_layer_norm.weight")}
    if not m.tie_word_embeddings:
        # transformers >= 5 saves an untied head only as shared.weight (it ties them)
        head_key = "lm_head.weight" if "lm_head.weight" in sd else shared_key
        params["lm_head"] = cast("lm_head", pad_rows(get(head_key).T, 1))
    return params


def hf_state_dict(params: dict, m) -> dict:
    """HF state dict (numpy float32) from our parameter tree; padded vocab is stripped."""
    V = m.embedding.vocab_size
    g = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731
    shared = g(params["shared"])[:V]
    sd = {"shared.weight": shared, "encoder.embed_tokens.weight": shared, "decoder.embed_tokens.weight": shared}
    for stack in ("encoder", "decoder"):
        p, dec = params[stack], stack == "decoder"
        for i in range(m.decoder_depth if dec else m.layers):
            for name, key in hf_layer_keys(stack, i, m).items():
                sd[key] = np.ascontiguousarray(_to_hf(name, g(p["layers"][name][i])))
        if "relpos" in p:
            sd[_relpos_key(stack)] = g(p["relpos"])
        sd[f"{stack}.final_layer_norm.weight"] = g(p["final_norm"])
    sd["lm_head.weight"] = np.ascontiguousarray(g(params["lm_head"])[:, :V].T) if "lm_head" in params else shared
    return sd


def hf_train_inputs(rows: dict, trim: bool = False) -> dict:
    """The encoder's rows and the decoder's (its inputs and labels) as HF trains on them, each cut to its longest
    with ``trim``."""
    out = {k: rows[k] for k in ("input_ids", "attention_mask", "decoder_input_ids", "labels")}
    if trim:  # DataCollatorForSeq2Seq's default: pad to the longest row
        n, t = int(out["attention_mask"].sum(1).max()), int((out["labels"] != -100).sum(1).max())
        out = {k: (v[:, :n] if k in ("input_ids", "attention_mask") else v[:, :t]) for k, v in out.items()}
    return out


def hf_nonpad_tokens(hf_inputs: dict) -> int:
    """The encoder's real tokens and the decoder's."""
    return int(hf_inputs["attention_mask"].sum()) + int((hf_inputs["labels"] != -100).sum())


def hf_new_tokens(out: np.ndarray, prompt_width: int) -> np.ndarray:
    """HF ``generate``'s output of an encoder-decoder starts with the decoder's start token: the columns after it."""
    return out[:, 1:]


HF = HFMapping(model_types=("t5", "mt5"), model_config=config_from_hf, config_dict=hf_config_dict,
               params=params_from_hf, state_dict=hf_state_dict, layer_keys=hf_layer_keys, train_inputs=hf_train_inputs,
               nonpad_tokens=hf_nonpad_tokens, new_tokens=hf_new_tokens,
               generate_kwargs={"decoder_start_token_id": DECODER_START})


# --------------------------------------------------------------------------- the family


def forward_flops(m, encoder_length: int, decoder_length: int) -> int:
    """Matmul FLOPs (2 per multiply-add) of one sample's forward pass.

    Encoder layer: q/k/v/o projections, scores and context over the encoder length, feed-forward. Decoder layer:
    self-attention as above over the decoder length, cross-attention q/o over the decoder length, cross k/v over
    the encoder length, cross scores and context (decoder x encoder), feed-forward. Plus the LM head.
    """
    d, f, hk, V = m.hidden_size, m.d_ff, m.attention.heads * m.attention.d_kv, m.embedding.vocab_size
    ff_mats = 3 if m.feed_forward_proj.startswith("gated-") else 2
    Le, Ld = encoder_length, decoder_length
    enc = 2 * (4 * Le * d * hk + 2 * Le * Le * hk + ff_mats * Le * d * f)
    dec = 2 * (4 * Ld * d * hk + 2 * Ld * Ld * hk  # self-attention
               + 2 * Ld * d * hk + 2 * Le * d * hk + 2 * Ld * Le * hk  # cross-attention
               + ff_mats * Ld * d * f)
    return m.layers * enc + m.decoder_depth * dec + 2 * Ld * d * V


ENCODER = Stack("encoder", "input_ids", ("attention_mask", "positions"), ENC_EMBED, ENC_LAYERS, "x_buffer",
                context=("relpos",), output="final_norm", output_stream=ENC_HEAD)
DECODER = Stack("decoder", "decoder_input_ids",
                ("attention_mask", "positions", "decoder_attention_mask", "decoder_positions"), DEC_EMBED, DEC_LAYERS,
                "x_dec_buffer", context=("relpos",), cross=True)


class T5Family(Family):
    """T5 v1.0 / v1.1 / Flan-T5 / mT5 / UL2: an encoder and a causal decoder with cross-attention."""

    name = "t5"
    hf = HF
    causal = False
    decoder_start = DECODER_START
    rows = Seq2SeqRows()
    lora_targets = ("q", "v", "cq", "cv")  # PEFT's T5 default ("q", "v") matches the cross-attention's too
    residual_outputs = ("o", "co", "wo")
    stacks = (ENCODER, DECODER)
    head_stream = HEAD
    config_options = (T5Model, T5Attention)
    options = T5Options
    batch_keys = ("input_ids", "attention_mask", "positions", "decoder_input_ids", "decoder_attention_mask",
                  "decoder_positions", "labels")
    shape_fields = ("family", "layers", "decoder_layers", "hidden_size", "d_ff", "vocab_size", "heads", "d_kv",
                    "relative_attention_num_buckets", "relative_attention_max_distance", "feed_forward_proj",
                    "tie_word_embeddings", "eps")
    # (decays and is_dense: the base's, every weight the compute dtype changes: not norms, not the position tables)
    param_specs = staticmethod(param_specs)
    keeps_f32 = staticmethod(keeps_f32)
    forward_flops = staticmethod(forward_flops)

    def decode_step_flops(self, m) -> int:
        """The decoder's forward over the new token (the encoder's states, and the cross-attention's keys and values
        of them, were made when the prompt joined; its scores over them are not counted: ``Family``'s)."""
        return forward_flops(m, 0, 1)

    def head_paths(self, opts) -> tuple:
        return (("decoder", "final_norm"), ("shared",) if opts.tie_word_embeddings else ("lm_head",))

    def batch_lengths(self, cfg) -> dict:
        """{batch key: row length} of a training batch as the loader builds it (packed rows carry positions)."""
        L_, D = cfg.model.sequence_length, cfg.decoder_row_length
        keys = {"input_ids": L_, "attention_mask": L_, "decoder_input_ids": D, "decoder_attention_mask": D,
                "labels": D}
        if cfg.data.packing:
            keys.update(positions=L_, decoder_positions=D)
        return keys

    def validate_config(self, cfg) -> None:
        proj = cfg.model.feed_forward_proj
        if proj not in FEED_FORWARD_PROJ:
            raise ConfigError(f"feed_forward_proj={proj!r} is not one of {', '.join(FEED_FORWARD_PROJ)}: pass "
                              "--feed_forward_proj with one of them")
        if cfg.model.attention.kv_heads not in (0, cfg.model.attention.heads):
            raise ConfigError(f"kv_heads={cfg.model.attention.kv_heads}: T5's keys and values have every head: pass "
                              "--kv_heads 0")

    # ------------------------------------------------------------------ per-device bodies

    embeddings = staticmethod(embeddings)
    head_loss = staticmethod(head)
    forward = staticmethod(forward)

    def context(self, stack: Stack, ctx_w: dict, meta: dict, length: int, opts) -> tuple:
        """(self-attention context, cross-attention bias or None) of a micro-batch: the self context is the
        whole bias [1 or b, h, l, l] from the stack's table, or for UMT5 (no stack table) ``self_masks``."""
        ids = "decoder_" if stack.cross else ""
        self_ctx = self_context(ctx_w.get("relpos"), stack.cross, length, opts, meta.get(f"{ids}attention_mask"),
                                meta.get(f"{ids}positions"))
        if not stack.cross:
            return self_ctx, None
        return self_ctx, cross_bias(meta["attention_mask"], meta.get("decoder_attention_mask"), is_packed(meta))

    def block(self, stack: Stack, p, x, self_ctx, cross_ctx, enc, opts, tp_axis, rng=None):
        return block_fn(opts)(p, x, self_ctx, opts, tp_axis, enc if stack.cross else None, cross_ctx, rng)

    def stack_output(self, stack: Stack, w, x, opts, rng=None):
        return encoder_head(w, x, opts, rng)

    # ------------------------------------------------------------------ text: the input to the encoder, the target
    # to the decoder, each ending with the tokenizer's end-of-text (its special tokens), where decoding stops

    def encode_inputs(self, tokenizer, texts: list) -> list:
        return tokenizer(list(texts), add_special_tokens=True)["input_ids"] if texts else []

    encode_targets = encode_inputs

    # ------------------------------------------------------------------ decoding

    decode_start = staticmethod(decode_start)
    decode_start_encoded = staticmethod(decode_start_encoded)
    packs_prompts = True

    def encode_packed(self, params, ids, segments, positions, opts, tp_axis=None):
        """The encoder over packed prompts (segment ids and per-prompt positions: training's packed rows)."""
        return encode(params, ids, segments, opts, tp_axis, positions=positions)
    decode_step = staticmethod(decode_step)
    unrolls_decoding = True
    decode_uncached = staticmethod(decode_uncached)
    decode_start_packed = staticmethod(decode_start_packed)
    cache_positions = staticmethod(cache_positions)
    first_token_column = staticmethod(first_token_column)

    def reorder_beams(self, cache, rows):
        """Only the decoder's self-attention cache follows the beams: the encoder's cross-attention keys, values and
        mask are the prompt's, the same for each of its beams (moving them was most of a beam step's memory
        traffic at encoder lengths above the new tokens')."""
        return {**cache, "self": jax.tree.map(lambda x: jnp.take(x, rows, axis=0), cache["self"])}


class UMT5Family(T5Family):
    """UMT5: T5 v1.1 with a relative-position table in every layer's self-attention (``relpos`` among the layer
    weights) instead of one per stack; the stacks' attention context then has no weights of its own."""

    name = "umt5"
    hf = dataclasses.replace(T5Family.hf, model_types=("umt5",))
    stacks = (dataclasses.replace(ENCODER, context=()), dataclasses.replace(DECODER, context=()))
