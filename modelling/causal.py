"""Decoder-only language models: what every one of them shares, so that a family module holds only what differs.

``CausalLM`` is a ``Family`` (modelling/family.py) with one causal stack (``decoder``): the prompt and its target are
one sequence (``prompt`` + `` TARGET<|endoftext|>``, the loss on the next token), training rows are causal rows
(modelling/rows.py), decoding continues left-padded prompts with a KV cache. A family built on it writes:

    param_specs(m, tp)          its weights with logical axes: ``shared`` [V, d], ``decoder`` {``layers`` {...},
                                its final norm's weights}, ``lm_head`` [d, V] (and ``lm_head_bias``)
    layer(p, x, attn, opts, tp_axis, rng)
                                one layer: x float32 [b, l, d] -> [b, l, d]; it projects q [b, l, h, kv] and k, v
                                [b, l, g, kv] (g key/value heads, g dividing h) and calls ``attn(q, k, v, rng)``,
                                which applies the rotary embedding, the mask and (in decoding) the cache
    final_norm(dec, x, opts)    the stack's output norm, from the decoder's non-layer weights
    rotate                      its rotary embedding: layers.rotate_every_two (GPT-J) or rotate_half (LLaMA)
    dense, head_weights, shape_fields, name (and hf, where it maps to a Hugging Face model)

and inherits the rest: embeddings, attention context, head and loss, the reference forward, the text format,
greedy / beam / sampling decoding's start and step (also one position per row, for serving's slots), FLOPs, the
config checks. The same ``layer`` runs training, prefill and every decoding step: only the attention it is handed
differs (``SelfAttention`` for a batch of rows, ``Prefill`` and ``CachedStep`` for decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from config.fields import spec
from modelling import decoding
from modelling import family as fam
from modelling import layers as L
from modelling import lora_stack
from modelling.family import Family, HFMapping, ModelOptions, Stack
from modelling.rows import CausalRows
from modelling.tp import tp_index
from utils.errors import ConfigError

EMBED, LAYERS, HEAD = 10, 11, 30  # dropout streams (modelling/family.py's convention)
TP_SHARD = 1000  # folded in with a device's tp index: dropout of its own heads
STACK = Stack("decoder", "input_ids", ("attention_mask", "positions"), EMBED, LAYERS, "x_buffer")


@dataclass(frozen=True)
class CausalAttention:
    """A causal family's own attention fields (config section ``model.attention``): its rotary embedding and its
    key/value heads."""

    section: ClassVar[str] = "model.attention"

    kv_heads: int = spec(0, minimum=0, shape=True)
    """Key/value heads of a decoder-only family with grouped-query attention: each serves heads // kv_heads query
    heads (0: as many as heads, as GPT-J has)."""

    rotary_dim: int = spec(0, shape=True)
    """Dimensions of each head that get the rotary position embedding (0: all; GPT-J's in interleaved pairs)."""

    rotary_positional_embeddings_base: float = spec(10000.0, shape=True)
    """Base of the rotary embedding's frequencies."""


@dataclass(frozen=True)
class CausalOptions(ModelOptions, CausalAttention):
    """What a causal family's model functions read: ModelOptions and the causal attention fields."""


def sharded_rng(rng, tp_axis, *data):
    """A key for what each tp device holds its own share of (its heads' attention probabilities)."""
    return None if rng is None else fam.rng(rng, *data, tp_index(tp_axis) + TP_SHARD)


@dataclass(frozen=True)
class SelfAttention:
    """Causal self-attention over a batch of rows, as a layer calls it: ``attn(q, k, v, rng)``. bias float32
    [b, 1, l, l] (causal, within a segment), sin/cos [b, l, r/2] (the rotary tables of each token's position).
    A pytree (its arrays are leaves), so that it rides through the phase programs' loops."""

    bias: jax.Array
    sin: jax.Array
    cos: jax.Array
    rotate: Callable = field(metadata={"static": True})
    chunks: int = field(default=1, metadata={"static": True})
    impl: str = field(default="xla", metadata={"static": True})
    rate: float = field(default=0.0, metadata={"static": True})

    def __call__(self, q, k, v, rng=None):
        """q [b, l, h, kv], k/v [b, l, g, kv] -> [b, l, h, kv]."""
        q, k = self.rotate(q, self.sin, self.cos), self.rotate(k, self.sin, self.cos)
        k, v = L.repeat_heads(k, q.shape[2], 2), L.repeat_heads(v, q.shape[2], 2)
        return L.attend_serialised(q, k, v, self.bias, self.chunks, self.rate, rng, self.impl,
                                   scale=q.shape[-1] ** -0.5)


jax.tree_util.register_dataclass(SelfAttention, data_fields=["bias", "sin", "cos"],
                                 meta_fields=["rotate", "chunks", "impl", "rate"])


class Prefill:
    """Decoding's first call: the left-padded prompts attend as in training (no dropout), and the layer's keys and
    values are kept, heads-major and with room for ``room`` new tokens (``kv``)."""

    def __init__(self, bias, sin, cos, rotate, room: int):
        self.bias, self.sin, self.cos, self.rotate, self.room, self.kv = bias, sin, cos, rotate, room, None

    def __call__(self, q, k, v, rng=None):
        q, k = self.rotate(q, self.sin, self.cos), self.rotate(k, self.sin, self.cos)
        pad = ((0, 0), (0, 0), (0, self.room), (0, 0))
        self.kv = (jnp.pad(decoding.heads_major(k), pad), jnp.pad(decoding.heads_major(v), pad))
        h = q.shape[2]
        return L.attend(q, L.repeat_heads(k, h, 2), L.repeat_heads(v, h, 2), self.bias, scale=q.shape[-1] ** -0.5)


class CachedStep:
    """One new token of each row, written into layer ``layer`` of the cache of every layer (``kv``: keys and values
    [b, layers, g, K, kv]) at column ``col`` (one for the batch, or int [b]: one per row), attending to every cached
    key of that layer the mask allows (``kv``: the cache after the write)."""

    def __init__(self, bias, sin, cos, rotate, col, kv, layer):
        self.bias, self.sin, self.cos, self.rotate, self.col, self.kv, self.layer = bias, sin, cos, rotate, col, kv, layer

    def __call__(self, q, k, v, rng=None):
        q, k = self.rotate(q, self.sin, self.cos), self.rotate(k, self.sin, self.cos)
        k_all, v_all = self.kv
        k_all = L.write_at(k_all, decoding.heads_major(k), self.col, axis=3, layer=self.layer)
        v_all = L.write_at(v_all, decoding.heads_major(v), self.col, axis=3, layer=self.layer)
        self.kv = (k_all, v_all)
        h = q.shape[2]
        k_c, v_c = L.layer_of(k_all, self.layer), L.layer_of(v_all, self.layer)
        return decoding.attend_cached(q, L.repeat_heads(k_c, h, 1), L.repeat_heads(v_c, h, 1), self.bias,
                                      scale=q.shape[-1] ** -0.5)


def hf_train_inputs(rows: dict, trim: bool = False) -> dict:
    """A causal LM's padded rows as HF trains on them: the row's own tokens (HF shifts the labels itself), -100 on
    padding; ``trim``: cut to the longest row."""
    ids, mask = rows["input_ids"], rows["attention_mask"]
    out = {"input_ids": ids, "attention_mask": mask, "labels": np.where(mask > 0, ids, -100)}
    n = int(mask.sum(1).max()) if trim else ids.shape[1]
    return {k: v[:, :n] for k, v in out.items()}


def hf_new_tokens(out: np.ndarray, prompt_width: int) -> np.ndarray:
    """HF ``generate``'s output of a causal LM continues its prompt: the columns after it."""
    return out[:, prompt_width:]


class CausalLM(Family):
    """A decoder-only language model (see the module docstring): a family subclasses it and writes what differs;
    its HF mapping (``hf``) starts from this base's, ``dataclasses.replace(CausalLM.hf, model_types=..., ...)``."""

    causal = True
    left_pad_prompts = True  # decoding continues each prompt from its last token: prompts are right-aligned
    scores_prompts = True  # its logits at each prompt position are the next prompt token's
    rows = CausalRows()
    stacks = (STACK,)
    head_stream = HEAD
    batch_keys = ("input_ids", "attention_mask", "positions", "labels")
    config_options = (CausalAttention,)
    options = CausalOptions
    rotate: Callable = staticmethod(L.rotate_every_two)
    dense: tuple = ()  # the layer weights that are matmul weights (their gradients accumulate in their GEMMs)
    head_weights: tuple = ("final_norm",)  # the decoder's non-layer weights the head reads (its output norm)
    head_bias: bool = False  # the LM head has a bias (``lm_head_bias``)
    lora_targets = ("q", "v")
    residual_outputs = ("o",)
    hf = HFMapping(train_inputs=hf_train_inputs, new_tokens=hf_new_tokens)  # what every causal LM's HF model shares

    # ------------------------------------------------------------------ what a family writes

    def layer(self, p: dict, x, attn, opts, tp_axis, rng=None):
        """One layer (see the module docstring)."""
        raise NotImplementedError(f"the {self.name} family has no layer")

    def final_norm(self, dec: dict, x, opts):
        """The stack's output norm. dec: the decoder's non-layer weights; x float32 [b, l, d] -> float32."""
        raise NotImplementedError(f"the {self.name} family has no final norm")

    # ------------------------------------------------------------------ parameters and config

    def keeps_f32(self, name: str) -> bool:
        """Norm weights and biases stay float32 in the compute copy."""
        return name.endswith("norm") or name.endswith("norm_bias")

    def decays(self, name: str) -> bool:
        """Weight decay on matmul weights and the embedding: not on norms or biases."""
        return not (self.keeps_f32(name) or name.endswith("_bias"))

    def is_dense(self, name: str) -> bool:
        return name in self.dense

    def head_paths(self, opts) -> tuple:
        paths = tuple(("decoder", k) for k in self.head_weights) + (("lm_head",),)
        return paths + ((("lm_head_bias",),) if self.head_bias else ())

    def batch_lengths(self, cfg) -> dict:
        """{batch key: row length} of a training batch: one sequence of sequence_length tokens."""
        return {k: cfg.model.sequence_length for k in self.batch_keys}

    def validate_config(self, cfg) -> None:
        m, a, tp = cfg.model, cfg.model.attention, cfg.execution.tensor_parallel
        if m.decoder_layers:
            raise ConfigError(f"decoder_layers={m.decoder_layers}: a {self.name} model has one stack of layers "
                              "(--layers): pass --decoder_layers 0")
        if a.rotary_dim < 0 or a.rotary_dim > a.d_kv or a.rotary_dim % 2:
            raise ConfigError(f"rotary_dim={a.rotary_dim} must be even and at most d_kv={a.d_kv} (0: all of d_kv): "
                              f"pass --rotary_dim {min(a.d_kv, 64)}")
        groups = self.kv_heads(m)
        if a.heads % groups or groups % tp:
            raise ConfigError(f"kv_heads={groups} must divide heads={a.heads} and be divisible by tensor_parallel="
                              f"{tp}: pass --kv_heads {a.heads} (or a divisor of it that tensor_parallel divides)")

    @staticmethod
    def kv_heads(m) -> int:
        """Key/value heads (grouped-query attention): attention.kv_heads, 0 meaning as many as query heads."""
        return m.attention.kv_heads or m.attention.heads

    def forward_flops(self, m, encoder_length: int, decoder_length: int = 0) -> int:
        """Matmul FLOPs of one sample's forward pass over ``encoder_length`` tokens: every matmul weight of every
        layer once a token, scores and context, and the head."""
        specs = self.param_specs(m, 1)["decoder"]["layers"]
        dense = sum(int(np.prod(s.shape[1:])) for k, s in specs.items() if self.is_dense(k))
        n, hk = encoder_length, m.attention.heads * m.attention.d_kv
        return m.layers * (2 * n * dense + 4 * n * n * hk) + 2 * n * m.hidden_size * m.embedding.vocab_size

    def decode_step_flops(self, m) -> int:
        """The stack's forward over the new token."""
        return self.forward_flops(m, 1)

    # ------------------------------------------------------------------ per-device bodies

    def embeddings(self, shared, ids, opts, tp_axis, rng=None):
        """shared [Vl, d], ids int [b, l] -> float32 [b, l, d] identical over tp (then embedding dropout)."""
        return L.dropout(L.embed(shared, ids, tp_axis), opts.dropout_prob, rng)

    def rotary(self, positions, opts) -> tuple:
        """(sin, cos) [b, l, r/2] of token positions int [b, l]."""
        return L.rotary_tables(positions, opts.rotary_dim or opts.d_kv, opts.rotary_positional_embeddings_base)

    def context(self, stack, ctx_w, meta, length, opts):
        """(the stack's self-attention over the rows of a micro-batch, no cross context). meta: attention_mask int
        [b, l] (segment ids, 0 padding) and positions int [b, l] (arange where absent)."""
        mask = meta["attention_mask"]
        positions = meta.get("positions")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(length), mask.shape)
        bias = L.causal_mask_bias(length, length) + L.segment_mask_bias(mask, mask)
        sin, cos = self.rotary(positions, opts)
        return SelfAttention(bias, sin, cos, self.rotate, opts.attention_serialisation, opts.attention_impl,
                             opts.dropout_prob), None

    def block(self, stack, p, x, self_ctx, cross_ctx, enc, opts, tp_axis, rng=None):
        return self.layer(p, x, self_ctx, opts, tp_axis, rng)

    def head_logits(self, params: dict, x, opts, tp_axis):
        """Final norm + LM head (+ its bias). x float32 [b, l, d] -> float32 logits [b, l, Vl] (vocab-sharded)."""
        h = self.final_norm(params["decoder"], x, opts)
        return L.lm_logits(h.astype(opts.compute_dtype), params["lm_head"], tp_axis, opts.vocab_size,
                           params.get("lm_head_bias"))

    def head_loss(self, head_p, x, labels, opts, tp_axis, rng=None):
        """Sum of token cross entropies (labels: the next token at each position, -100 ignored)."""
        return L.cross_entropy_sum(self.head_logits(head_p, x, opts, tp_axis), labels, tp_axis)

    # ------------------------------------------------------------------ the whole model (reference composition)

    def hidden(self, p: dict, batch: dict, opts, tp_axis=None, rng=None):
        """Every layer on a batch -> float32 [b, l, d] (before the final norm). p: in the compute dtype."""
        ids = batch["input_ids"]
        x = self.embeddings(p["shared"], ids, opts, tp_axis, fam.rng(rng, EMBED))
        attn, _ = self.context(STACK, {}, {k: batch[k] for k in STACK.meta if k in batch}, ids.shape[1], opts)
        r_layers = fam.rng(rng, LAYERS)

        def body(x, inputs):
            lp, i = inputs
            return self.layer(lp, x, attn, opts, tp_axis, None if r_layers is None else jax.random.fold_in(
                r_layers, i)), None

        layers = p["decoder"]["layers"]
        return jax.lax.scan(body, x, (layers, jnp.arange(jax.tree.leaves(layers)[0].shape[0])))[0]

    def forward(self, params, batch, opts, tp_axis=None, rng=None):
        """The whole model -> float32 logits [b, l, Vl] (this device's vocab slice)."""
        p = self.compute_params(params, opts)
        return self.head_logits(p, self.hidden(p, batch, opts, tp_axis, rng), opts, tp_axis)

    def loss_sum(self, params, batch, opts, tp_axis=None, rng=None):
        """The reference loss: the sum of token cross entropies of a batch (labels: the next token at each
        position, -100 ignored)."""
        p = self.compute_params(params, opts)
        return self.head_loss(p, self.hidden(p, batch, opts, tp_axis, rng), batch["labels"], opts, tp_axis,
                              fam.rng(rng, HEAD))

    # ------------------------------------------------------------------ text: prompt, then `` TARGET<|endoftext|>``

    def prompt(self, text: str) -> str:
        """``... target:``, which the model continues with `` TARGET<|endoftext|>`` (the original GPT-J app's)."""
        return f"{text} target:"

    def encode_inputs(self, tokenizer, texts: list) -> list:
        """The prompt's tokens, no special tokens."""
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []

    def encode_targets(self, tokenizer, texts: list) -> list:
        """`` TARGET`` (a space first: it follows ``target:``) and the end-of-text token."""
        if not texts:
            return []
        ids = tokenizer([" " + t for t in texts], add_special_tokens=False)["input_ids"]
        return [x + [tokenizer.eos_token_id] for x in ids]

    # ------------------------------------------------------------------ decoding with a KV cache
    #
    # Prompts are left-padded (as for HF ``generate`` of a decoder-only model). The prompt runs once (prefill),
    # filling a [b, layers, g, k + max_new_tokens, kv] cache of every layer; each new token then attends to the
    # cache. Rotary positions count real tokens only (padding is not a position), as HF's ``generate`` derives them.
    # Every layer loop is a scan over the stacked weights, so a program's size does not grow with depth.

    def decode_start(self, p, input_ids, attention_mask, opts, max_new_tokens, tp_axis=None):
        """The prefill of left-padded prompts ids/mask [b, k] -> (logits [b, Vl] of the first new token, cache)."""
        b, k = input_ids.shape
        mask = attention_mask.astype(jnp.int32)
        x, kv = self._prefill(p, input_ids, mask, opts, max_new_tokens, tp_axis)
        cache = {"kv": kv,  # keys: the prompt's real tokens, then the generated ones as they come
                 "key_ok": jnp.concatenate([mask > 0, jnp.zeros((b, max_new_tokens), bool)], axis=1),
                 "next_pos": L.prompt_positions(mask)[:, -1] + 1, "start": jnp.full((b,), k, jnp.int32)}
        return self.head_logits(p, x[:, -1:], opts, tp_axis)[:, 0], cache

    def _prefill(self, p, input_ids, attention_mask, opts, room: int, tp_axis=None) -> tuple:
        """Every layer on left-padded prompts -> (x float32 [b, k, d] before the final norm, the keys and values of
        every layer [b, layers, g, k + room, kv] with ``room`` columns for new tokens)."""
        k = input_ids.shape[1]
        mask = attention_mask.astype(jnp.int32)
        sin, cos = self.rotary(L.prompt_positions(mask), opts)
        bias = L.causal_mask_bias(k, k) + jnp.where(mask[:, None, None, :] > 0, 0.0, L.MASK_VALUE)
        return self._prefill_rows(p, input_ids, bias, sin, cos, opts, room, tp_axis)

    def _prefill_rows(self, p, input_ids, bias, sin, cos, opts, room: int, tp_axis=None) -> tuple:
        """Every layer on rows ids [b, k] with their attention bias and rotary tables -> (x, keys and values of every
        layer), as ``_prefill``."""
        def body(x, lp):
            attn = Prefill(bias, sin, cos, self.rotate, room)
            x = self.layer(lp, x, attn, opts, tp_axis)
            return x, attn.kv

        x = self.embeddings(p["shared"], input_ids, opts, tp_axis)
        x, (k_all, v_all) = jax.lax.scan(body, x, p["decoder"]["layers"])
        return x, (jnp.moveaxis(k_all, 0, 1), jnp.moveaxis(v_all, 0, 1))  # [L, b, ...] -> [b, L, ...]

    def decode_step(self, p, token, i, cache, opts, tp_axis=None):
        """New token i (one index for the batch, or int [b]: one per row, serving's slots each at its own position
        and prompt width), at cache column start + i -> (logits [b, Vl] of the next, cache)."""
        b = token.shape[0]
        col = cache["start"][0] + i if jnp.ndim(i) == 0 else cache["start"] + i
        key_ok = L.write_at(cache["key_ok"], jnp.ones((b, 1), bool), col, axis=1)
        bias = jnp.where(key_ok, 0.0, L.MASK_VALUE)[:, None, None, :]
        sin, cos = self.rotary((cache["next_pos"] + i)[:, None], opts)

        def body(carry, inputs):
            y, kv = carry[0], carry[1:]
            lp, layer = inputs
            attn = CachedStep(bias, sin, cos, self.rotate, col, kv, layer)
            return (self.layer(lp, y, attn, opts, tp_axis),) + attn.kv, None

        k_all, v_all = cache["kv"]
        y = self.embeddings(p["shared"], token[:, None], opts, tp_axis)
        (y, k_all, v_all), _ = jax.lax.scan(body, (y, k_all, v_all), (p["decoder"]["layers"],
                                                                      jnp.arange(k_all.shape[1])))
        return self.head_logits(p, y, opts, tp_axis)[:, 0], {**cache, "kv": (k_all, v_all), "key_ok": key_ok}

    def decode_start_packed(self, p, ids, segments, positions, where, lengths, opts, max_new_tokens, tp_axis=None):
        """``decode_start`` of prompts packed several to a row (serving's inserts): the prefill of the packed rows
        ids/segments/positions [R, W] (causal within each prompt, rotary positions restarting at 0 in each), each
        prompt's keys and values gathered out (``where`` int [J, W]: its positions in the rows flattened, R * W past
        its ``lengths`` [J]) into columns 0 .. length - 1 of its cache row, new tokens from column ``length`` on ->
        (logits [J, Vl] after each prompt's last token, the cache of J rows of W + max_new_tokens columns). Adapters
        served side by side (modelling/lora_stack.py: ``p`` bound with one index a prompt): each packed token reads its
        prompt's."""
        r, w = ids.shape
        sin, cos = self.rotary(positions, opts)
        bias = L.causal_mask_bias(w, w) + L.segment_mask_bias(segments, segments)
        x, kv = self._prefill_rows(lora_stack.per_token(p, where, ids.size), ids, bias, sin, cos, opts, 0, tp_axis)
        room = ((0, 0), (0, 0), (0, 0), (0, max_new_tokens), (0, 0))
        kv = tuple(jnp.pad(L.gather_packed(t, where, 3), room) for t in kv)
        last = jnp.take_along_axis(where, (lengths - 1)[:, None], axis=1)  # each prompt's last token, flat [J, 1]
        logits = self.head_logits(p, L.gather_packed(x, last, 1), opts, tp_axis)[:, 0]
        cache = {"kv": kv, "key_ok": jnp.arange(w + max_new_tokens)[None] < lengths[:, None],
                 "next_pos": lengths, "start": lengths}
        return logits, cache

    def cache_positions(self, cache):
        """The keys and values along axis 3 (after the batch and the layers), their mask along axis 1; the rows'
        positions and starts whole."""
        return {"kv": (3, 3), "key_ok": 1, "next_pos": -1, "start": -1}

    def first_token_column(self, prompt_length: int) -> int:
        """After the prompt's tokens (a packed prompt's cache row holds them from column 0: ``start``)."""
        return prompt_length

    def decode_uncached(self, params, input_ids, attention_mask, tokens, opts, tp_axis=None):
        """Logits [b, Vl] of the next token after the left-padded prompts and ``tokens`` int [b, n], the whole
        sequence run again. params: in the compute dtype."""
        ids = jnp.concatenate([input_ids, tokens.astype(input_ids.dtype)], axis=1)
        mask = jnp.concatenate([attention_mask.astype(jnp.int32), jnp.ones(tokens.shape, jnp.int32)], axis=1)
        x = self.hidden(params, {"input_ids": ids, "attention_mask": mask, "positions": L.prompt_positions(mask)},
                        opts, tp_axis)
        return self.head_logits(params, x[:, -1:], opts, tp_axis)[:, 0]

    def prompt_logits(self, p, input_ids, attention_mask, opts, tp_axis=None):
        """Logits [b, k, Vl] of the token after each position of the left-padded prompts ids/mask [b, k], as the
        prefill reads them (p: ``decoding_params``)."""
        x, _ = self._prefill(p, input_ids, attention_mask, opts, 1, tp_axis)
        return self.head_logits(p, x, opts, tp_axis)
