"""The T5 encoder-decoder built from the per-phase functions of the original app.

Phases: ``embeddings`` -> ``t5_block`` x layers (encoder) -> ``encoder_head``
-> ``embeddings`` -> ``t5_block`` x layers (decoder, with cross-attention)
-> ``head`` (final norm, LM head, vocab-sharded loss). The same functions run
on one device (``tp_axis=None``) and inside ``shard_map`` with tensor
parallelism; the graphs/ package composes them into programs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from config.config import ConfigError
from modelling import layers as L
from modelling.tp import tp_index

F32 = jnp.float32
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class ModelOptions:
    """The fields of the config that the model functions need (hashable, static under jit)."""

    eps: float = 1e-6
    dropout_prob: float = 0.0
    num_buckets: int = 32
    max_distance: int = 128
    scale_ff: int = 1
    vocab_size: int = 32128
    hidden_size: int = 512
    tie_word_embeddings: bool = False
    attention_serialisation: int = 1
    recompute: bool = False
    remat_policy: str = "full"  # with recompute: full or save_dots
    unroll_layers: bool = False
    dtype: str = "float32"
    attention_impl: str = "xla"  # resolved: xla or cudnn

    @classmethod
    def from_config(cls, cfg) -> "ModelOptions":
        m, ex = cfg.model, cfg.execution
        return cls(
            eps=m.eps, dropout_prob=0.0 if m.eval else m.dropout_prob,
            num_buckets=m.attention.relative_attention_num_buckets,
            max_distance=m.attention.relative_attention_max_distance, scale_ff=m.scale_ff,
            vocab_size=m.embedding.vocab_size, hidden_size=m.hidden_size,
            tie_word_embeddings=m.tie_word_embeddings, attention_serialisation=ex.attention_serialisation,
            recompute=ex.recompute, remat_policy=ex.remat_policy, unroll_layers=ex.unroll_layers, dtype=m.precision,
            attention_impl=resolve_attention_impl(ex.attention_impl, m.precision,
                                                  0.0 if m.eval else m.dropout_prob),
        )

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]


def resolve_attention_impl(requested: str, precision: str, dropout_prob: float) -> str:
    """'auto' -> 'cudnn' on a GPU in bfloat16/float16 without dropout, else 'xla'; an explicit
    'cudnn' where it cannot run is a ConfigError naming the fix."""
    usable = jax.default_backend() == "gpu" and precision in ("bfloat16", "float16")
    if requested == "cudnn":
        if not usable:
            raise ConfigError(f"attention_impl=cudnn needs a GPU and precision bfloat16 or float16 (backend "
                             f"{jax.default_backend()}, precision {precision}): pass --attention_impl auto or xla")
        if dropout_prob > 0:
            raise ConfigError(f"attention_impl=cudnn has no attention dropout (dropout_prob={dropout_prob}): "
                             "pass --attention_impl xla, or --dropout_prob 0")
        return "cudnn"
    if requested == "auto":
        return "cudnn" if usable and dropout_prob == 0 else "xla"
    return "xla"


def _keeps_f32(path) -> bool:
    name = str(path[-1].key) if hasattr(path[-1], "key") else str(path[-1])
    return name.endswith("norm") or name == "relpos"


def cast_params(params: dict, dtype) -> dict:
    """Casts matmul weights to the compute dtype; norms and relative bias stay float32."""
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x if _keeps_f32(p) else x.astype(dtype), params)


# Random streams: the dropout keys of each part of the model, derived from one key per micro-batch
# as fold_in(key, stream) (and then the layer index). Both executors and the model below use these,
# so a phased step draws exactly the fused step's dropout masks.
ENC_EMBED, ENC_LAYERS, ENC_HEAD = 10, 11, 12
DEC_EMBED, DEC_LAYERS, HEAD = 20, 21, 30
TP_SHARD = 1000  # added to the tp index for dropout on tp-sharded activations (a key per shard)
# inside a block (after the layer index): attention probabilities and output, cross-attention's, feed-forward's
ATTN_PROBS, ATTN_OUT, CROSS_PROBS, CROSS_OUT, FF_HIDDEN, FF_OUT = 1, 2, 3, 4, 5, 6


def _rng(rng, *data):
    if rng is None:
        return None
    for d in data:
        rng = jax.random.fold_in(rng, d)
    return rng


def _sharded_rng(rng, tp_axis, *data):
    """A key that differs per tp shard, for dropout on tp-sharded activations."""
    return None if rng is None else _rng(rng, *data, tp_index(tp_axis) + TP_SHARD)


# --------------------------------------------------------------------------- phases


def embeddings(shared: jax.Array, ids: jax.Array, opts: ModelOptions, tp_axis: Optional[str],
               rng=None) -> jax.Array:
    """Embedding phase. shared [Vl, d], ids int [b, l] -> float32 [b, l, d] identical over tp."""
    return L.dropout(L.embed(shared, ids, tp_axis), opts.dropout_prob, rng)


def encoder_self_bias(relpos: jax.Array, mask: jax.Array, opts: ModelOptions,
                      positions: Optional[jax.Array] = None) -> jax.Array:
    """Encoder self-attention bias.

    relpos [buckets, h]; mask int [b, l]: 1 (or a segment id) for tokens, 0 for padding;
    positions int [b, l] for packed rows (positions restarting at 0 in each segment), else None.
    -> float32 [b, h, l, l] (relative positions + padding, or + segments when packed).
    """
    n = mask.shape[1]
    if positions is None:
        bias = L.position_bias(relpos, jnp.arange(n), n, True, opts.num_buckets, opts.max_distance)
        return bias + L.padding_mask_bias(mask)
    bias = L.relative_position_bias(relpos, positions, positions, True, opts.num_buckets, opts.max_distance)
    return bias + L.segment_mask_bias(mask, mask)


def decoder_self_bias(relpos: jax.Array, length: int, opts: ModelOptions, mask: Optional[jax.Array] = None,
                      positions: Optional[jax.Array] = None) -> jax.Array:
    """Decoder (causal) self-attention bias -> float32 [1 or b, h, l, l].

    mask int [b, l] (1 or segment id, 0 padding) or None; positions int [b, l] for packed rows (then
    mask holds the segment ids and is required).
    """
    if positions is None:
        bias = L.position_bias(relpos, jnp.arange(length), length, False, opts.num_buckets, opts.max_distance)
        bias = bias + L.causal_mask_bias(length, length)
        return bias if mask is None else bias + L.padding_mask_bias(mask)
    bias = L.relative_position_bias(relpos, positions, positions, False, opts.num_buckets, opts.max_distance)
    return bias + L.causal_mask_bias(length, length) + L.segment_mask_bias(mask, mask)


def cross_bias(mask: jax.Array, decoder_mask: Optional[jax.Array] = None, packed: bool = False) -> jax.Array:
    """Cross-attention bias: encoder padding [b, 1, 1, k]; for packed rows, each decoder segment sees
    only its own example's encoder tokens [b, 1, q, k] (decoder_mask holds the decoder segment ids)."""
    if not packed:
        return L.padding_mask_bias(mask)
    return L.segment_mask_bias(decoder_mask, mask)


def is_packed(batch: dict) -> bool:
    """Whether a batch holds packed rows (it then carries per-segment positions)."""
    return "positions" in batch


def t5_block(p: dict, x: jax.Array, self_bias: jax.Array, opts: ModelOptions, tp_axis: Optional[str],
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
    f = L.feed_forward(p, h, tp_axis, opts.scale_ff, rate, _sharded_rng(rng, tp_axis, FF_HIDDEN))
    return x + L.dropout(f, rate, _rng(rng, FF_OUT))


def run_stack(layers_p: dict, x: jax.Array, self_bias: jax.Array, opts: ModelOptions,
              tp_axis: Optional[str], enc_out=None, cross_bias=None, rng=None) -> jax.Array:
    """t5_block over the stacked layers (leading axis), scanned; layer i's dropout key is fold_in(rng, i).

    The reference composition (validation, decoding, tests); training runs the layers through the
    phase library (graphs/phases.py), which adds recomputation and unrolling."""

    def body(x, inputs):
        p, i = inputs
        r = None if rng is None else jax.random.fold_in(rng, i)
        return t5_block(p, x, self_bias, opts, tp_axis, enc_out, cross_bias, r), None

    n = jax.tree_util.tree_leaves(layers_p)[0].shape[0]
    x, _ = lax.scan(body, x, (layers_p, jnp.arange(n)))
    return x


def encoder_head(final_norm: jax.Array, x: jax.Array, opts: ModelOptions, rng=None) -> jax.Array:
    """Final encoder norm. x float32 [b, l, d] -> float32 [b, l, d]."""
    return L.dropout(L.rms_norm(x, final_norm, opts.eps), opts.dropout_prob, rng)


def head_logits(params: dict, x: jax.Array, opts: ModelOptions, tp_axis: Optional[str], rng=None) -> jax.Array:
    """Decoder final norm + LM head. x float32 [b, l, d] -> float32 logits [b, l, Vl] (vocab-sharded)."""
    h = L.dropout(L.rms_norm(x, params["decoder"]["final_norm"], opts.eps), opts.dropout_prob, rng)
    if opts.tie_word_embeddings:
        # T5 v1.0 rescales before the tied head
        h = h * opts.hidden_size ** -0.5
        w = params["shared"].T
    else:
        w = params["lm_head"]
    return L.lm_logits(h.astype(opts.compute_dtype), w, tp_axis, opts.vocab_size)


def head(params: dict, x: jax.Array, labels: jax.Array, opts: ModelOptions, tp_axis: Optional[str],
         rng=None) -> jax.Array:
    """Head phase with the loss: -> sum of token cross entropies (labels -100 ignored)."""
    return L.cross_entropy_sum(head_logits(params, x, opts, tp_axis, rng), labels, tp_axis)


# --------------------------------------------------------------------------- whole model


def encode(params: dict, input_ids, attention_mask, opts: ModelOptions, tp_axis=None, rng=None,
           positions=None) -> jax.Array:
    """Encoder. ids/mask [b, k] (mask: segment ids when packed, with positions [b, k]) -> float32 [b, k, d]."""
    enc = params["encoder"]
    x = embeddings(params["shared"], input_ids, opts, tp_axis, _rng(rng, ENC_EMBED))
    bias = encoder_self_bias(enc["relpos"], attention_mask, opts, positions)
    x = run_stack(enc["layers"], x, bias, opts, tp_axis, rng=_rng(rng, ENC_LAYERS))
    return encoder_head(enc["final_norm"], x, opts, _rng(rng, ENC_HEAD))


def decode(params: dict, enc_out, attention_mask, decoder_input_ids, opts: ModelOptions, tp_axis=None,
           decoder_attention_mask=None, rng=None, positions=None, decoder_positions=None) -> jax.Array:
    """Decoder stack (no head). -> float32 [b, l, d]. Packed rows pass both positions arrays."""
    dec = params["decoder"]
    y = embeddings(params["shared"], decoder_input_ids, opts, tp_axis, _rng(rng, DEC_EMBED))
    self_bias = decoder_self_bias(dec["relpos"], decoder_input_ids.shape[1], opts, decoder_attention_mask,
                                  decoder_positions)
    xbias = cross_bias(attention_mask, decoder_attention_mask, packed=positions is not None)
    return run_stack(dec["layers"], y, self_bias, opts, tp_axis, enc_out, xbias, _rng(rng, DEC_LAYERS))


def _encode_decode(p: dict, batch: dict, opts: ModelOptions, tp_axis, rng) -> jax.Array:
    enc = encode(p, batch["input_ids"], batch["attention_mask"], opts, tp_axis, rng, batch.get("positions"))
    return decode(p, enc, batch["attention_mask"], batch["decoder_input_ids"], opts, tp_axis,
                  batch.get("decoder_attention_mask"), rng, batch.get("positions"), batch.get("decoder_positions"))


def forward(params: dict, batch: dict, opts: ModelOptions, tp_axis=None, rng=None) -> jax.Array:
    """Full model -> float32 logits [b, l, Vl] (this device's vocab slice)."""
    p = cast_params(params, opts.compute_dtype)
    return head_logits(p, _encode_decode(p, batch, opts, tp_axis, rng), opts, tp_axis, _rng(rng, HEAD))


def loss_sum(params: dict, batch: dict, opts: ModelOptions, tp_axis=None, rng=None) -> jax.Array:
    """Sum of token cross entropies of a batch (divide by the token count for the mean)."""
    p = cast_params(params, opts.compute_dtype)
    return head(p, _encode_decode(p, batch, opts, tp_axis, rng), batch["labels"], opts, tp_axis, _rng(rng, HEAD))


def token_count(labels: jax.Array) -> jax.Array:
    """Number of labels that count towards the loss (not -100)."""
    return jnp.sum(labels != -100)
