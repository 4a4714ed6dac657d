"""GPT-J as a model family: one causal stack, as Hugging Face's ``GPTJForCausalLM`` defines it.

    x = wte[ids]                                      (shared [V, d]; no position embedding)
    layer:  h = LayerNorm(x);  x = x + attn(h) + mlp(h)          (attention and MLP in parallel)
        attn: q, k, v = h W_q, h W_k, h W_v (no biases); rotary position embedding on the first
              ``rotary_dim`` dims of each head of q and k, in interleaved pairs (GPT-J's
              rotate_every_two); softmax(q k^T / sqrt(d_kv) + causal mask) v, in float32; W_o
        mlp:  gelu_new(h W_in + b_in) W_out + b_out
    head:   LayerNorm (final_norm) -> lm_head [d, V] + bias -> logits (float32)

Tensor parallelism (Megatron, as T5's): heads split over tp (q/k/v column-parallel, o row-parallel),
the MLP's inner dim split (fc_in and its bias column-parallel, fc_out row-parallel, its bias added
once after the all-reduce), the vocabulary split (embedding rows, LM-head columns and bias);
rotary embeddings act within a head, so each device applies them to its own heads unchanged.

Batches hold ``input_ids``, ``attention_mask`` (segment ids: 1, 2, ... per example of a packed row,
0 padding), ``positions`` (restarting at 0 per example; rotary positions), and ``labels`` (the next
token at each position, -100 where no loss is taken). Attention never crosses a segment; the
original's "concat" rows are one segment of consecutive positions.

Parameter tree (modelling/family.py's common top level): ``shared``, ``lm_head``, ``lm_head_bias``,
``decoder`` {``layers`` {norm, norm_bias, q, k, v, o, fc_in, fc_in_bias, fc_out, fc_out_bias},
``final_norm``, ``final_norm_bias``}.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from config.schema import ModelConfig
from modelling import decoding
from modelling import family as fam
from modelling import layers as L
from modelling.family import Family, ModelOptions, Stack
from modelling.hf_weights import kept_as, state_dict_reader, vocab_padder
from modelling.params import ParamSpec, padded_vocab
from modelling.rows import CausalRows
from modelling.tp import identical_grad_inputs, identical_inputs, tp_index
from utils.errors import CheckpointError, ConfigError

F32 = jnp.float32
EMBED, LAYERS, HEAD = 10, 11, 30  # dropout streams (modelling/family.py's convention)
ATTN_PROBS, ATTN_OUT, FF_OUT = 1, 2, 6  # inside a block, after the layer index
TP_SHARD = 1000
DENSE = ("q", "k", "v", "o", "fc_in", "fc_out")

STACK = Stack("decoder", "input_ids", ("attention_mask", "positions"), EMBED, LAYERS, "x_buffer")


def keeps_f32(name: str) -> bool:
    """LayerNorm weights and biases stay float32 in the compute copy of the weights."""
    return name.endswith("norm") or name.endswith("norm_bias")


# --------------------------------------------------------------------------- parameter specs


def param_specs(m, tensor_parallel: int = 1) -> dict:
    """The spec tree of a GPT-J model (initialisers: normal(0.02), biases 0, norms 1, as HF's)."""
    V = padded_vocab(m.embedding.vocab_size, tensor_parallel)
    L_, d, f = m.layers, m.hidden_size, m.d_ff
    h, kv = m.attention.heads, m.attention.d_kv
    std = 0.02
    layers = {
        "norm": ParamSpec((L_, d), ("layers", "embed")),
        "norm_bias": ParamSpec((L_, d), ("layers", "embed"), 0.0),
        "q": ParamSpec((L_, d, h, kv), ("layers", "embed", "heads", "kv"), std),
        "k": ParamSpec((L_, d, h, kv), ("layers", "embed", "heads", "kv"), std),
        "v": ParamSpec((L_, d, h, kv), ("layers", "embed", "heads", "kv"), std),
        "o": ParamSpec((L_, h, kv, d), ("layers", "heads", "kv", "embed"), std),
        "fc_in": ParamSpec((L_, d, f), ("layers", "embed", "mlp"), std),
        "fc_in_bias": ParamSpec((L_, f), ("layers", "mlp"), 0.0),
        "fc_out": ParamSpec((L_, f, d), ("layers", "mlp", "embed"), std),
        "fc_out_bias": ParamSpec((L_, d), ("layers", "embed"), 0.0),
    }
    return {
        "shared": ParamSpec((V, d), ("vocab", "embed"), std),
        "decoder": {"layers": layers, "final_norm": ParamSpec((d,), ("embed",)),
                    "final_norm_bias": ParamSpec((d,), ("embed",), 0.0)},
        "lm_head": ParamSpec((d, V), ("embed", "vocab"), std),
        "lm_head_bias": ParamSpec((V,), ("vocab",), 0.0),
    }


# --------------------------------------------------------------------------- rotary position embedding


def rotary_tables(positions: jax.Array, rotary_dim: int, base: float = 10000.0) -> tuple:
    """(sin, cos) of GPT-J's rotary embedding. positions int [b, l] -> each float32 [b, l, rotary_dim // 2]."""
    inv_freq = 1.0 / (base ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim))
    angles = positions.astype(F32)[..., None] * jnp.asarray(inv_freq, F32)
    return jnp.sin(angles), jnp.cos(angles)


def apply_rotary(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
    """Rotary embedding on the first ``2 * sin.shape[-1]`` dims of each head, pairs (2i, 2i + 1) rotated
    together (GPT-J's interleaving). x [b, l, h, kv], sin/cos [b, l, r/2] -> [b, l, h, kv] in x's dtype."""
    r = 2 * sin.shape[-1]
    rot, rest = x[..., :r].astype(F32), x[..., r:]
    s = jnp.repeat(sin, 2, axis=-1)[:, :, None, :]
    c = jnp.repeat(cos, 2, axis=-1)[:, :, None, :]
    pairs = rot.reshape(*rot.shape[:-1], r // 2, 2)
    rotated = jnp.stack([-pairs[..., 1], pairs[..., 0]], axis=-1).reshape(rot.shape)  # rotate_every_two
    out = (rot * c + rotated * s).astype(x.dtype)
    return jnp.concatenate([out, rest], axis=-1) if rest.shape[-1] else out


# --------------------------------------------------------------------------- phases


def _sharded_rng(rng, tp_axis, *data):
    return None if rng is None else fam.rng(rng, *data, tp_index(tp_axis) + TP_SHARD)


def embeddings(shared: jax.Array, ids: jax.Array, opts: ModelOptions, tp_axis: Optional[str], rng=None) -> jax.Array:
    """shared [Vl, d], ids int [b, l] -> float32 [b, l, d] identical over tp (wte, then embedding dropout)."""
    return L.dropout(L.embed(shared, ids, tp_axis), opts.dropout_prob, rng)


def context(meta: dict, length: int, opts: ModelOptions) -> tuple:
    """(attention bias float32 [b, 1, l, l]: causal and within a segment, (sin, cos) [b, l, r/2]) of a batch.

    meta: attention_mask int [b, l] (segment ids, 0 padding) and positions int [b, l] (arange if absent)."""
    mask = meta["attention_mask"]
    positions = meta.get("positions")
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(length), mask.shape)
    bias = L.causal_mask_bias(length, length) + L.segment_mask_bias(mask, mask)
    return bias, rotary_tables(positions, opts.rotary_dim or opts.d_kv, opts.rotary_positional_embeddings_base)


def attention_qkv(p: dict, h: jax.Array, rot: tuple, tp_axis: Optional[str]) -> tuple:
    """q, k, v [b, l, h, kv] of a normed input h [b, l, d] (identical over tp), rotary applied to q and k."""
    h = identical_inputs(h, tp_axis)
    q = L.project_q(p, h)
    k, v = L.project_kv(p, h)
    sin, cos = rot
    return apply_rotary(q, sin, cos), apply_rotary(k, sin, cos), v


def mlp(p: dict, h: jax.Array, tp_axis: Optional[str], scale_ff: int = 1, dropout_rate: float = 0.0,
        rng=None) -> jax.Array:
    """gelu_new(h W_in + b_in) W_out + b_out, inner dim split over tp. h [b, l, d] -> float32 [b, l, d]."""
    h = identical_inputs(h, tp_axis)
    lead = h.shape[:-1]
    x = h.reshape(-1, h.shape[-1])
    a = jax.nn.gelu(L.dense(x, p["fc_in"]) + p["fc_in_bias"].astype(p["fc_in"].dtype), approximate=True)
    if scale_ff != 1:
        a = a / scale_ff
    out = L.dense(a, p["fc_out"], f32_out=True)
    if scale_ff != 1:
        out = out * scale_ff
    out = identical_grad_inputs(out.reshape(*lead, out.shape[-1]), tp_axis)
    return L.dropout(out + p["fc_out_bias"].astype(F32), dropout_rate, rng)  # the bias once, after the all-reduce


def block(p: dict, x: jax.Array, ctx: tuple, opts: ModelOptions, tp_axis: Optional[str], rng=None) -> jax.Array:
    """One GPT-J layer. x float32 [b, l, d]; ctx: ``context``'s -> float32 [b, l, d], identical over tp."""
    bias, rot = ctx
    rate, dt = opts.dropout_prob, opts.compute_dtype
    h = L.layer_norm(x, p["norm"], p["norm_bias"], opts.eps).astype(dt)
    q, k, v = attention_qkv(p, h, rot, tp_axis)
    kv = q.shape[-1]
    a = L.attend_serialised(q, k, v, bias, opts.attention_serialisation, rate,
                            _sharded_rng(rng, tp_axis, ATTN_PROBS), opts.attention_impl, scale=kv ** -0.5)
    a = L.dropout(L.attention_output(p, a, tp_axis), rate, fam.rng(rng, ATTN_OUT))
    f = mlp(p, h, tp_axis, opts.scale_ff, rate, fam.rng(rng, FF_OUT))
    return x + a + f


def head_logits(params: dict, x: jax.Array, opts: ModelOptions, tp_axis: Optional[str], rng=None) -> jax.Array:
    """Final LayerNorm + LM head with bias. x float32 [b, l, d] -> float32 logits [b, l, Vl] (vocab-sharded)."""
    dec = params["decoder"]
    h = L.dropout(L.layer_norm(x, dec["final_norm"], dec["final_norm_bias"], opts.eps), 0.0, rng)
    return L.lm_logits(h.astype(opts.compute_dtype), params["lm_head"], tp_axis, opts.vocab_size,
                       params["lm_head_bias"])


def head(params: dict, x, labels, opts: ModelOptions, tp_axis: Optional[str], rng=None) -> jax.Array:
    """Head phase with the loss: -> sum of token cross entropies (labels -100 ignored)."""
    return L.cross_entropy_sum(head_logits(params, x, opts, tp_axis, rng), labels, tp_axis)


def cast_params(params: dict, dtype) -> dict:
    return fam.cast_params(params, dtype, keeps_f32)


# --------------------------------------------------------------------------- whole model (reference composition)


def hidden(params: dict, batch: dict, opts: ModelOptions, tp_axis=None, rng=None) -> jax.Array:
    """Every layer on a batch -> float32 [b, l, d] (before the final norm). params: cast to the compute dtype."""
    dec = params["decoder"]
    ids = batch["input_ids"]
    x = embeddings(params["shared"], ids, opts, tp_axis, fam.rng(rng, EMBED))
    ctx = context({k: batch[k] for k in STACK.meta if k in batch}, ids.shape[1], opts)
    r_layers = fam.rng(rng, LAYERS)

    def body(x, inputs):
        p, i = inputs
        return block(p, x, ctx, opts, tp_axis, None if r_layers is None else jax.random.fold_in(r_layers, i)), None

    n = dec["layers"]["q"].shape[0]
    return lax.scan(body, x, (dec["layers"], jnp.arange(n)))[0]


def forward(params: dict, batch: dict, opts: ModelOptions, tp_axis=None, rng=None) -> jax.Array:
    """Full model -> float32 logits [b, l, Vl] (this device's vocab slice)."""
    p = cast_params(params, opts.compute_dtype)
    return head_logits(p, hidden(p, batch, opts, tp_axis, rng), opts, tp_axis)


def loss_sum(params: dict, batch: dict, opts: ModelOptions, tp_axis=None, rng=None) -> jax.Array:
    """Sum of token cross entropies of a batch (labels: the next token at each position, -100 ignored)."""
    p = cast_params(params, opts.compute_dtype)
    return head(p, hidden(p, batch, opts, tp_axis, rng), batch["labels"], opts, tp_axis, fam.rng(rng, HEAD))


# --------------------------------------------------------------------------- decoding with a KV cache
#
# Prompts are left-padded (as for HF ``generate`` of a decoder-only model). The prompt runs once (prefill), filling
# a [b, h, k + max_new_tokens, kv] cache per layer; each new token then attends to the cache. Rotary positions
# count real tokens only (padding is not a position), as HF's ``generate`` derives them from the attention mask.


def _prompt_positions(mask: jax.Array) -> jax.Array:
    return jnp.maximum(jnp.cumsum(mask, axis=1) - 1, 0)


def decode_start(dp: tuple, input_ids, attention_mask, opts, max_new_tokens: int, tp_axis=None):
    """The prefill of left-padded prompts ids/mask [b, k] -> (logits [b, Vl] of the first new token, cache)."""
    p, rows = dp
    b, k = input_ids.shape
    mask = attention_mask.astype(jnp.int32)
    positions = _prompt_positions(mask)
    head_dim = rows[0]["q"].shape[-1]
    x = embeddings(p["shared"], input_ids, opts, tp_axis)
    bias = L.causal_mask_bias(k, k) + jnp.where(mask[:, None, None, :] > 0, 0.0, L.MASK_VALUE)
    rot = rotary_tables(positions, opts.rotary_dim or head_dim, opts.rotary_positional_embeddings_base)
    caches, pad = [], ((0, 0), (0, 0), (0, max_new_tokens), (0, 0))
    for lp in rows:
        h = L.layer_norm(x, lp["norm"], lp["norm_bias"], opts.eps).astype(opts.compute_dtype)
        q, kk, v = attention_qkv(lp, h, rot, tp_axis)
        a = L.attend(q, kk, v, bias, scale=head_dim ** -0.5)
        x = x + L.attention_output(lp, a, tp_axis) + mlp(lp, h, tp_axis, opts.scale_ff)
        caches.append((jnp.pad(decoding.heads_major(kk), pad), jnp.pad(decoding.heads_major(v), pad)))
    cache = {"kv": caches,  # keys: the prompt's real tokens, then the generated ones as they come
             "key_ok": jnp.concatenate([mask > 0, jnp.zeros((b, max_new_tokens), bool)], axis=1),
             "next_pos": positions[:, -1] + 1, "start": jnp.full((b,), k, jnp.int32)}
    return head_logits(p, x[:, -1:], opts, tp_axis)[:, 0], cache


def decode_step(dp: tuple, token, i, cache: dict, opts, tp_axis=None):
    """New token i, at cache column k + i -> (logits [b, Vl] of the next, cache). ``i``: one index for the batch, or
    one per row (int [b]: serving's slots, each at its own position and prompt width)."""
    p, rows = dp
    b = token.shape[0]
    col = cache["start"][0] + i if jnp.ndim(i) == 0 else cache["start"] + i
    key_ok = L.write_at(cache["key_ok"], jnp.ones((b, 1), bool), col, axis=1)
    bias = jnp.where(key_ok, 0.0, L.MASK_VALUE)[:, None, None, :]
    head_dim = rows[0]["q"].shape[-1]
    rot = rotary_tables((cache["next_pos"] + i)[:, None], opts.rotary_dim or head_dim,
                        opts.rotary_positional_embeddings_base)
    y = embeddings(p["shared"], token[:, None], opts, tp_axis)
    new = []
    for lp, (k_c, v_c) in zip(rows, cache["kv"]):
        h = L.layer_norm(y, lp["norm"], lp["norm_bias"], opts.eps).astype(opts.compute_dtype)
        q, kk, v = attention_qkv(lp, h, rot, tp_axis)
        k_c = L.write_at(k_c, decoding.heads_major(kk).astype(k_c.dtype), col, axis=2)
        v_c = L.write_at(v_c, decoding.heads_major(v).astype(v_c.dtype), col, axis=2)
        a = decoding.attend_cached(q, k_c, v_c, bias, scale=head_dim ** -0.5)
        y = y + L.attention_output(lp, a, tp_axis) + mlp(lp, h, tp_axis, opts.scale_ff)
        new.append((k_c, v_c))
    return head_logits(p, y, opts, tp_axis)[:, 0], {**cache, "kv": new, "key_ok": key_ok}


def widen_cache(cache: dict, prompt_width: int, width: int) -> dict:
    """``decode_start``'s cache of prompts ``prompt_width`` wide with room for prompts ``width`` wide: the key/value
    columns (and their mask) extended by ``width - prompt_width`` unused ones at the end; each row still writes its
    new tokens from its own ``start`` (serving's slots hold the rows of every prompt bucket in one cache)."""
    pad = width - prompt_width
    kv = [tuple(jnp.pad(t, ((0, 0), (0, 0), (0, pad), (0, 0))) for t in layer) for layer in cache["kv"]]
    return {**cache, "kv": kv, "key_ok": jnp.pad(cache["key_ok"], ((0, 0), (0, pad)))}


def decode_uncached(p, input_ids, attention_mask, tokens, opts, tp_axis=None):
    """Logits [b, Vl] of the next token after the left-padded prompts and ``tokens`` int [b, n], the whole
    sequence run again."""
    ids = jnp.concatenate([input_ids, tokens.astype(input_ids.dtype)], axis=1)
    mask = jnp.concatenate([attention_mask.astype(jnp.int32), jnp.ones(tokens.shape, jnp.int32)], axis=1)
    x = hidden(p, {"input_ids": ids, "attention_mask": mask, "positions": _prompt_positions(mask)}, opts, tp_axis)
    return head_logits(p, x[:, -1:], opts, tp_axis)[:, 0]


# --------------------------------------------------------------------------- Hugging Face mapping


def config_from_hf(hf) -> ModelConfig:
    """Our ModelConfig from an HF GPT-J config (dict form)."""
    act = hf.get("activation_function", "gelu_new")
    if act != "gelu_new":
        raise CheckpointError(f"GPT-J activation_function {act!r} is not supported (gelu_new)")
    m = ModelConfig()
    m.family = "gptj"
    m.layers, m.hidden_size = hf["n_layer"], hf["n_embd"]
    m.d_ff = hf.get("n_inner") or 4 * hf["n_embd"]
    m.attention.heads = hf["n_head"]
    m.attention.d_kv = hf["n_embd"] // hf["n_head"]
    m.attention.rotary_dim = hf.get("rotary_dim") or 0
    m.embedding.vocab_size = hf["vocab_size"]
    m.eps = hf.get("layer_norm_epsilon", 1e-5)
    m.tie_word_embeddings = False
    return m


def hf_config_dict(m) -> dict:
    """An HF GPT-J config dict (config.json) for our ModelConfig; its end-of-text id is GPT-J's (50256) where the
    vocabulary holds it, else unset (export_hf_model writes the tokenizer's)."""
    eos = 50256 if m.embedding.vocab_size > 50256 else None
    return {
        "architectures": ["GPTJForCausalLM"], "model_type": "gptj",
        "vocab_size": m.embedding.vocab_size, "n_positions": max(m.sequence_length, 2048), "n_embd": m.hidden_size,
        "n_layer": m.layers, "n_head": m.attention.heads, "rotary_dim": m.attention.rotary_dim or None,
        "n_inner": m.d_ff, "activation_function": "gelu_new", "layer_norm_epsilon": m.eps,
        "resid_pdrop": m.dropout_prob, "embd_pdrop": m.dropout_prob, "attn_pdrop": m.dropout_prob,
        "initializer_range": 0.02, "bos_token_id": eos, "eos_token_id": eos, "tie_word_embeddings": False,
    }


def _layer_keys(i: int) -> dict:
    s = f"transformer.h.{i}"
    return {"norm": f"{s}.ln_1.weight", "norm_bias": f"{s}.ln_1.bias", "q": f"{s}.attn.q_proj.weight",
            "k": f"{s}.attn.k_proj.weight", "v": f"{s}.attn.v_proj.weight", "o": f"{s}.attn.out_proj.weight",
            "fc_in": f"{s}.mlp.fc_in.weight", "fc_in_bias": f"{s}.mlp.fc_in.bias",
            "fc_out": f"{s}.mlp.fc_out.weight", "fc_out_bias": f"{s}.mlp.fc_out.bias"}


def params_from_hf(sd, m, tensor_parallel: int = 1, dtype=None) -> dict:
    """Our GPT-J tree from an HF state dict (numpy arrays or torch tensors): float32, or with ``dtype`` the weights
    not kept float32 (``keeps_f32``) in it, each cast as it is read. HF Linear weights are [out, in]: q/k/v
    [d, h, kv] = W.T.reshape; o [h, kv, d] = W.T.reshape; fc_in/fc_out/lm_head = W.T."""
    get, pad, cast = state_dict_reader(sd, "GPT-J"), vocab_padder(m, tensor_parallel), kept_as(dtype, keeps_f32)
    h, kv = m.attention.heads, m.attention.d_kv

    def ours(name, w):
        if name in ("q", "k", "v"):
            return w.T.reshape(w.shape[1], h, kv)
        if name == "o":
            return w.T.reshape(h, kv, w.shape[0])
        return w.T if name in ("fc_in", "fc_out") else w

    per_layer = [_layer_keys(i) for i in range(m.layers)]
    layers = {n: np.stack([cast(n, ours(n, get(keys[n]))) for keys in per_layer]) for n in per_layer[0]}
    return {
        "shared": cast("shared", pad(get("transformer.wte.weight"), 0)),
        "decoder": {"layers": layers, "final_norm": get("transformer.ln_f.weight"),
                    "final_norm_bias": get("transformer.ln_f.bias")},
        "lm_head": cast("lm_head", pad(get("lm_head.weight").T, 1)),
        "lm_head_bias": cast("lm_head_bias", pad(get("lm_head.bias"), 0)),
    }


def hf_state_dict(params: dict, m) -> dict:
    """HF state dict (numpy float32) from our GPT-J tree; padded vocab is stripped."""
    V = m.embedding.vocab_size
    g = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731
    dec = params["decoder"]

    def theirs(name, w):
        if name in ("q", "k", "v"):
            return w.reshape(w.shape[0], -1).T
        if name == "o":
            return w.reshape(-1, w.shape[-1]).T
        return w.T if name in ("fc_in", "fc_out") else w

    sd = {"transformer.wte.weight": g(params["shared"])[:V], "transformer.ln_f.weight": g(dec["final_norm"]),
          "transformer.ln_f.bias": g(dec["final_norm_bias"]),
          "lm_head.weight": np.ascontiguousarray(g(params["lm_head"])[:, :V].T),
          "lm_head.bias": g(params["lm_head_bias"])[:V]}
    for i in range(m.layers):
        for name, key in _layer_keys(i).items():
            sd[key] = np.ascontiguousarray(theirs(name, g(dec["layers"][name][i])))
    return sd


# --------------------------------------------------------------------------- the family


def forward_flops(m, encoder_length: int, decoder_length: int = 0) -> int:
    """Matmul FLOPs of one sample's forward pass: one causal stack over ``encoder_length`` tokens (q/k/v/o, scores
    and context, the MLP) and the head."""
    d, f, hk, V, L_ = m.hidden_size, m.d_ff, m.attention.heads * m.attention.d_kv, m.embedding.vocab_size, encoder_length
    return m.layers * 2 * (4 * L_ * d * hk + 2 * L_ * L_ * hk + 2 * L_ * d * f) + 2 * L_ * d * V


class GPTJFamily(Family):
    """GPT-J: one causal stack with parallel attention and MLP (modelling/family.py)."""

    name = "gptj"
    hf_model_types = ("gptj",)
    causal = True
    rows = CausalRows()
    lora_targets = ("q", "v")  # PEFT's GPT-J default (q_proj, v_proj)
    residual_outputs = ("o", "fc_out")
    left_pad_prompts = True  # decoding continues the prompt: prompts are right-aligned
    stacks = (STACK,)
    head_stream = HEAD
    batch_keys = ("input_ids", "attention_mask", "positions", "labels")
    shape_fields = ("family", "layers", "hidden_size", "d_ff", "vocab_size", "heads", "d_kv", "rotary_dim",
                    "rotary_positional_embeddings_base", "eps")

    def param_specs(self, m, tensor_parallel: int = 1) -> dict:
        return param_specs(m, tensor_parallel)

    def keeps_f32(self, name: str) -> bool:
        return keeps_f32(name)

    def decays(self, name: str) -> bool:
        """Weight decay on matmul weights and the embedding: not on norms or biases."""
        return not (keeps_f32(name) or name.endswith("_bias"))

    def is_dense(self, name: str) -> bool:
        return name in DENSE

    def head_paths(self, opts) -> tuple:
        return (("decoder", "final_norm"), ("decoder", "final_norm_bias"), ("lm_head",), ("lm_head_bias",))

    def batch_lengths(self, cfg) -> dict:
        """{batch key: row length} of a training batch: one sequence of sequence_length tokens."""
        return {k: cfg.model.sequence_length for k in self.batch_keys}

    def validate_config(self, cfg) -> None:
        m, a = cfg.model, cfg.model.attention
        if m.decoder_layers:
            raise ConfigError(f"decoder_layers={m.decoder_layers}: GPT-J has one stack of layers (--layers): pass "
                              "--decoder_layers 0")
        if a.heads * a.d_kv != m.hidden_size:
            raise ConfigError(f"GPT-J needs heads * d_kv = hidden_size, got {a.heads} * {a.d_kv} != {m.hidden_size}: "
                              f"pass --d_kv {m.hidden_size // a.heads}")
        if a.rotary_dim < 0 or a.rotary_dim > a.d_kv or a.rotary_dim % 2:
            raise ConfigError(f"rotary_dim={a.rotary_dim} must be even and at most d_kv={a.d_kv} (0: all of d_kv): "
                              f"pass --rotary_dim {min(a.d_kv, 64)}")

    def forward_flops(self, m, encoder_length: int, decoder_length: int = 0) -> int:
        return forward_flops(m, encoder_length, decoder_length)

    # ------------------------------------------------------------------ per-device bodies

    def embeddings(self, shared, ids, opts, tp_axis, rng=None):
        return embeddings(shared, ids, opts, tp_axis, rng)

    def context(self, stack, ctx_w, meta, length, opts):
        """(GPT-J's context: attention bias and rotary tables, no cross context); it reads no weights."""
        return context(meta, length, opts), None

    def block(self, stack, p, x, self_ctx, cross_ctx, enc, opts, tp_axis, rng=None):
        return block(p, x, self_ctx, opts, tp_axis, rng)

    def head_loss(self, head_p, x, labels, opts, tp_axis, rng=None):
        return head(head_p, x, labels, opts, tp_axis, rng)

    def forward(self, params, batch, opts, tp_axis=None, rng=None):
        return forward(params, batch, opts, tp_axis, rng)

    # ------------------------------------------------------------------ text: the original's causal-LM format

    def prompt(self, text: str) -> str:
        """``... target:``, which the model continues with `` TARGET<|endoftext|>``."""
        return f"{text} target:"

    def encode_inputs(self, tokenizer, texts: list) -> list:
        """The prompt's tokens, no special tokens (GPT-2's tokenizer adds none anyway)."""
        return tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []

    def encode_targets(self, tokenizer, texts: list) -> list:
        """`` TARGET`` (a space first: it follows ``target:``) and the end-of-text token."""
        if not texts:
            return []
        ids = tokenizer([" " + t for t in texts], add_special_tokens=False)["input_ids"]
        return [x + [tokenizer.eos_token_id] for x in ids]

    # ------------------------------------------------------------------ decoding

    def decoding_params(self, params, opts):
        p = cast_params(params, opts.compute_dtype)
        return p, decoding.layer_rows(p["decoder"]["layers"])

    def decode_start(self, dp, input_ids, attention_mask, opts, max_new_tokens, tp_axis=None):
        return decode_start(dp, input_ids, attention_mask, opts, max_new_tokens, tp_axis)

    def decode_step(self, dp, token, i, cache, opts, tp_axis=None):
        return decode_step(dp, token, i, cache, opts, tp_axis)

    def decode_uncached(self, params, input_ids, attention_mask, tokens, opts, tp_axis=None):
        return decode_uncached(params, input_ids, attention_mask, tokens, opts, tp_axis)

    def widen_cache(self, cache, prompt_width, width):
        return widen_cache(cache, prompt_width, width)

    # ------------------------------------------------------------------ Hugging Face

    def model_config_from_hf(self, hf: dict):
        return config_from_hf(hf)

    def hf_config_dict(self, m) -> dict:
        return hf_config_dict(m)

    def params_from_hf(self, sd, m, tensor_parallel: int = 1, dtype=None) -> dict:
        return params_from_hf(sd, m, tensor_parallel, dtype)

    def hf_state_dict(self, params: dict, m) -> dict:
        return hf_state_dict(params, m)

    def hf_layer_keys(self, stack: str, i: int, m) -> dict:
        return _layer_keys(i)
