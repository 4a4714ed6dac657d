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

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from config.schema import ModelConfig
from modelling import family as fam
from modelling import layers as L
from modelling.causal import CausalLM, CausalOptions, sharded_rng
from modelling.hf_weights import kept_as, state_dict_reader, vocab_padder
from modelling.params import ParamSpec, padded_vocab
from modelling.tp import identical_grad_inputs, identical_inputs
from utils.errors import CheckpointError, ConfigError

F32 = jnp.float32
ATTN_PROBS, ATTN_OUT, FF_OUT = 1, 2, 6  # dropout streams inside a layer, after the layer index
DENSE = ("q", "k", "v", "o", "fc_in", "fc_out")


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


# --------------------------------------------------------------------------- the layer


def mlp(p: dict, h: jax.Array, tp_axis: Optional[str], scale_ff: int = 1, dropout_rate: float = 0.0,
        rng=None) -> jax.Array:
    """gelu_new(h W_in + b_in) W_out + b_out, inner dim split over tp. h [b, l, d] -> float32 [b, l, d]."""
    h = identical_inputs(h, tp_axis)
    lead = h.shape[:-1]
    x = h.reshape(-1, h.shape[-1])
    a = jax.nn.gelu(L.dense(x, p["fc_in"]) + p["fc_in_bias"].astype(p["fc_in"].dtype), approximate=True)
    if scale_ff != 1:
        a = a / scale_ff
    out = L.dense(a, p["fc_out"], f32_out=True, split_axis=tp_axis)
    if scale_ff != 1:
        out = out * scale_ff
    out = identical_grad_inputs(out.reshape(*lead, out.shape[-1]), tp_axis)
    return L.dropout(out + p["fc_out_bias"].astype(F32), dropout_rate, rng)  # the bias once, after the all-reduce


def layer(p: dict, x: jax.Array, attn, opts: CausalOptions, tp_axis: Optional[str], rng=None) -> jax.Array:
    """One GPT-J layer: x + attn(ln(x)) + mlp(ln(x)). x float32 [b, l, d] -> float32 [b, l, d], identical over tp;
    ``attn``: modelling/causal.py's attention (rotary, mask, cache)."""
    rate, dt = opts.dropout_prob, opts.compute_dtype
    h = L.layer_norm(x, p["norm"], p["norm_bias"], opts.eps).astype(dt)
    hq = identical_inputs(h, tp_axis)
    q, (k, v) = L.project_q(p, hq), L.project_kv(p, hq)
    a = attn(q, k, v, sharded_rng(rng, tp_axis, ATTN_PROBS))
    a = L.dropout(L.attention_output(p, a, tp_axis), rate, fam.rng(rng, ATTN_OUT))
    f = mlp(p, h, tp_axis, opts.scale_ff, rate, fam.rng(rng, FF_OUT))
    return x + a + f


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


def hf_layer_keys(stack: str, i: int, m) -> dict:
    """{our weight name: HF key} of layer i (GPT-J has one stack)."""
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

    per_layer = [hf_layer_keys("decoder", i, m) for i in range(m.layers)]
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
        for name, key in hf_layer_keys("decoder", i, m).items():
            sd[key] = np.ascontiguousarray(theirs(name, g(dec["layers"][name][i])))
    return sd


# --------------------------------------------------------------------------- the family


class GPTJFamily(CausalLM):
    """GPT-J: a decoder-only LM (modelling/causal.py) with parallel attention and MLP, interleaved rotary pairs,
    LayerNorm with biases and a head with a bias; what differs from the base is written here."""

    name = "gptj"
    hf = dataclasses.replace(CausalLM.hf, model_types=("gptj",), model_config=config_from_hf,
                             config_dict=hf_config_dict, params=params_from_hf, state_dict=hf_state_dict,
                             layer_keys=hf_layer_keys)
    rotate = staticmethod(L.rotate_every_two)
    dense = DENSE
    head_weights = ("final_norm", "final_norm_bias")
    head_bias = True
    residual_outputs = ("o", "fc_out")
    shape_fields = ("family", "layers", "hidden_size", "d_ff", "vocab_size", "heads", "d_kv", "rotary_dim",
                    "rotary_positional_embeddings_base", "eps")
    param_specs = staticmethod(param_specs)
    layer = staticmethod(layer)

    def final_norm(self, dec, x, opts):
        return L.layer_norm(x, dec["final_norm"], dec["final_norm_bias"], opts.eps)

    def validate_config(self, cfg) -> None:
        super().validate_config(cfg)
        m, a = cfg.model, cfg.model.attention
        if a.heads * a.d_kv != m.hidden_size:
            raise ConfigError(f"GPT-J needs heads * d_kv = hidden_size, got {a.heads} * {a.d_kv} != {m.hidden_size}: "
                              f"pass --d_kv {m.hidden_size // a.heads}")
        if a.kv_heads not in (0, a.heads):
            raise ConfigError(f"kv_heads={a.kv_heads}: GPT-J's keys and values have every head: pass --kv_heads 0")
