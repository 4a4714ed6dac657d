"""The T5 encoder-decoder built from the per-phase functions of the original app.

Phases: ``embeddings`` -> ``t5_block`` x layers (encoder) -> ``encoder_head``
-> ``embeddings`` -> ``t5_block`` x layers (decoder, with cross-attention)
-> ``head`` (final norm, LM head, vocab-sharded loss). The same functions run
on one device (``tp_axis=None``) and inside ``shard_map`` with tensor
parallelism; the graphs/ package composes them into programs.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from jax import lax

from modelling import family as fam
from modelling import layers as L
from modelling.family import ModelOptions, Stack
from modelling.params import ParamSpec, padded_vocab
from modelling.tp import tp_index

F32 = jnp.float32
DTYPES = fam.DTYPES


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


def embeddings(shared: jax.Array, ids: jax.Array, opts: ModelOptions, tp_axis: Optional[str],
               rng=None) -> jax.Array:
    """Embedding phase. shared [Vl, d], ids int [b, l] -> float32 [b, l, d] identical over tp."""
    return L.dropout(L.embed(shared, ids, tp_axis), opts.dropout_prob, rng)


def per_layer_bias(opts: ModelOptions) -> bool:
    """Whether every layer has its own relative-position table (UMT5) rather than one per stack (T5)."""
    return opts.family == "umt5"


def self_masks(decoder: bool, length: int, opts: ModelOptions, mask: Optional[jax.Array] = None,
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
    buckets = L.relative_position_bucket(rel, not decoder, opts.num_buckets, opts.max_distance)
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


def self_context(relpos: Optional[jax.Array], decoder: bool, length: int, opts: ModelOptions,
                 mask: Optional[jax.Array] = None, positions: Optional[jax.Array] = None):
    """What a stack's blocks need for self-attention: the whole bias float32 [1 or b, h, l, l] from the stack's
    table (T5), or ``self_masks`` for blocks that read their own tables (UMT5: relpos None)."""
    buckets, masks = self_masks(decoder, length, opts, mask, positions)
    return (buckets, masks) if relpos is None else bucket_bias(relpos, buckets) + masks


def encoder_self_bias(relpos: jax.Array, mask: jax.Array, opts: ModelOptions,
                      positions: Optional[jax.Array] = None) -> jax.Array:
    """Encoder self-attention bias of one table [buckets, h] -> float32 [b, h, l, l] (relative positions +
    padding, or + segments when packed)."""
    return self_context(relpos, False, mask.shape[1], opts, mask, positions)


def decoder_self_bias(relpos: jax.Array, length: int, opts: ModelOptions, mask: Optional[jax.Array] = None,
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
    f = L.feed_forward(p, h, tp_axis, opts.scale_ff, rate, _sharded_rng(rng, tp_axis, FF_HIDDEN),
                       proj=opts.feed_forward_proj)
    return x + L.dropout(f, rate, _rng(rng, FF_OUT))


def umt5_block(p: dict, x: jax.Array, self_ctx: tuple, opts: ModelOptions, tp_axis: Optional[str],
               enc_out: Optional[jax.Array] = None, cross_bias: Optional[jax.Array] = None,
               rng=None) -> jax.Array:
    """A UMT5 block: t5_block with the self-attention bias from the layer's own table p["relpos"] [buckets, h]
    and the stack's ``self_masks`` (cross-attention has no position bias, as in T5)."""
    buckets, masks = self_ctx
    return t5_block(p, x, bucket_bias(p["relpos"], buckets) + masks, opts, tp_axis, enc_out, cross_bias, rng)


def block_fn(opts: ModelOptions):
    """The block of the model's variant: umt5_block (a table per layer) or t5_block."""
    return umt5_block if per_layer_bias(opts) else t5_block


def run_stack(layers_p: dict, x: jax.Array, self_ctx, opts: ModelOptions,
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
    ctx = self_context(enc.get("relpos"), False, input_ids.shape[1], opts, attention_mask, positions)
    x = run_stack(enc["layers"], x, ctx, opts, tp_axis, rng=_rng(rng, ENC_LAYERS))
    return encoder_head(enc["final_norm"], x, opts, _rng(rng, ENC_HEAD))


def decode(params: dict, enc_out, attention_mask, decoder_input_ids, opts: ModelOptions, tp_axis=None,
           decoder_attention_mask=None, rng=None, positions=None, decoder_positions=None) -> jax.Array:
    """Decoder stack (no head). -> float32 [b, l, d]. Packed rows pass both positions arrays."""
    dec = params["decoder"]
    y = embeddings(params["shared"], decoder_input_ids, opts, tp_axis, _rng(rng, DEC_EMBED))
    ctx = self_context(dec.get("relpos"), True, decoder_input_ids.shape[1], opts, decoder_attention_mask,
                       decoder_positions)
    xbias = cross_bias(attention_mask, decoder_attention_mask, packed=positions is not None)
    return run_stack(dec["layers"], y, ctx, opts, tp_axis, enc_out, xbias, _rng(rng, DEC_LAYERS))


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


# --------------------------------------------------------------------------- the family, as the engine sees it

ENCODER = Stack("encoder", "input_ids", ("attention_mask", "positions"), ENC_EMBED, ENC_LAYERS, "x_buffer",
                context=("relpos",), output="final_norm", output_stream=ENC_HEAD)
DECODER = Stack("decoder", "decoder_input_ids",
                ("attention_mask", "positions", "decoder_attention_mask", "decoder_positions"), DEC_EMBED, DEC_LAYERS,
                "x_dec_buffer", context=("relpos",), cross=True)


class T5Family:
    """T5 v1.0 / v1.1 / Flan-T5 / mT5 / UL2: an encoder and a causal decoder with cross-attention
    (modelling/family.py)."""

    name = "t5"
    stacks = (ENCODER, DECODER)
    head_stream = HEAD
    batch_keys = ("input_ids", "attention_mask", "positions", "decoder_input_ids", "decoder_attention_mask",
                  "decoder_positions", "labels")

    param_specs = staticmethod(param_specs)
    keeps_f32 = staticmethod(keeps_f32)

    @staticmethod
    def batch_lengths(cfg) -> dict:
        """{batch key: row length} of a training batch as the loader builds it (packed rows carry positions)."""
        L, D = cfg.model.sequence_length, cfg.decoder_row_length
        keys = {"input_ids": L, "attention_mask": L, "decoder_input_ids": D, "decoder_attention_mask": D, "labels": D}
        if cfg.data.packing:
            keys.update(positions=L, decoder_positions=D)
        return keys

    @staticmethod
    def decays(name: str) -> bool:
        """Weight decay applies to every matmul weight: not to norms, not to the relative-position tables."""
        return not keeps_f32(name)

    @staticmethod
    def is_dense(name: str) -> bool:
        """Matmul weights (their gradient can accumulate inside the weight-gradient GEMM): not norms, not tables."""
        return not keeps_f32(name)

    @staticmethod
    def head_paths(opts: ModelOptions) -> tuple:
        return (("decoder", "final_norm"), ("shared",) if opts.tie_word_embeddings else ("lm_head",))

    # ------------------------------------------------------------------ per-device bodies

    @staticmethod
    def embeddings(shared, ids, opts, tp_axis, rng=None):
        return embeddings(shared, ids, opts, tp_axis, rng)

    @staticmethod
    def context(stack: Stack, ctx_w: dict, meta: dict, length: int, opts) -> tuple:
        """(self-attention context, cross-attention bias or None) of a micro-batch: the self context is the
        whole bias [1 or b, h, l, l] from the stack's table, or for UMT5 (no stack table) ``self_masks``."""
        ids = "decoder_" if stack.cross else ""
        self_ctx = self_context(ctx_w.get("relpos"), stack.cross, length, opts, meta.get(f"{ids}attention_mask"),
                                meta.get(f"{ids}positions"))
        if not stack.cross:
            return self_ctx, None
        return self_ctx, cross_bias(meta["attention_mask"], meta.get("decoder_attention_mask"), is_packed(meta))

    @staticmethod
    def block(stack: Stack, p, x, self_ctx, cross_ctx, enc, opts, tp_axis, rng=None):
        return block_fn(opts)(p, x, self_ctx, opts, tp_axis, enc if stack.cross else None, cross_ctx, rng)

    @staticmethod
    def stack_output(stack: Stack, w, x, opts, rng=None):
        return encoder_head(w, x, opts, rng)

    @staticmethod
    def head_loss(head_p, x, labels, opts, tp_axis, rng=None):
        return head(head_p, x, labels, opts, tp_axis, rng)

    # ------------------------------------------------------------------ decoding and Hugging Face

    @staticmethod
    def generate(params, input_ids, attention_mask, opts, max_new_tokens, tp_axis=None, eos_id=1, pad_id=0,
                 cached=True):
        from modelling import decoding

        fn = decoding.generate if cached else decoding.generate_uncached
        return fn(params, input_ids, attention_mask, opts, max_new_tokens, tp_axis, eos_id=eos_id, pad_id=pad_id)

    @staticmethod
    def model_config_from_hf(hf):
        from modelling import hf_mapping

        return hf_mapping.t5_config_from_hf(hf)

    @staticmethod
    def params_from_hf(sd, m, tensor_parallel=1):
        from modelling import hf_mapping

        return hf_mapping.params_from_hf_state_dict(sd, m, tensor_parallel)

    @staticmethod
    def hf_state_dict(params, m):
        from modelling import hf_mapping

        return hf_mapping.hf_state_dict_from_params(params, m)

    @staticmethod
    def hf_config_dict(m):
        from modelling import hf_mapping

        return hf_mapping.t5_hf_config_dict(m)


class UMT5Family(T5Family):
    """UMT5: T5 v1.1 with a relative-position table in every layer's self-attention (``relpos`` among the layer
    weights) instead of one per stack; the stacks' attention context then has no weights of its own."""

    name = "umt5"
    stacks = (dataclasses.replace(ENCODER, context=()), dataclasses.replace(DECODER, context=()))


FAMILY = T5Family()
FAMILIES = {"t5": FAMILY, "umt5": UMT5Family()}
