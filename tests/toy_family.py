"""A third model family in one module, for tests/modelling/test_family.py: a LLaMA-style decoder that shares no
block with GPT-J (RMSNorm before attention and before the MLP, in sequence; a SwiGLU MLP; rotate-half rotary; fewer key/value
heads than query heads; no biases). Everything else (embeddings, attention context, head and loss, text format,
decoding with a KV cache, serving slots, FLOPs, config checks) is modelling/causal.py's. Registering it is one line:
``registry.add(ToyLlama())``; its config fields (``kv_heads``, the rotary base) are the causal base's own
(modelling/causal.py's ``CausalAttention``), so config/schema.py is not touched.

Its Hugging Face mapping (LlamaForCausalLM's config and weights, read) is here too, so the test can hold it to
transformers' numbers.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from config.schema import ModelConfig
from modelling import family as fam
from modelling import layers as L
from modelling.causal import CausalLM, sharded_rng
from modelling.hf_weights import state_dict_reader, vocab_padder
from modelling.params import ParamSpec, padded_vocab
from modelling.tp import identical_grad_inputs, identical_inputs

ATTN_PROBS, ATTN_OUT, FF_OUT = 1, 2, 6


def param_specs(m, tensor_parallel: int = 1) -> dict:
    V, n, d, f = padded_vocab(m.embedding.vocab_size, tensor_parallel), m.layers, m.hidden_size, m.d_ff
    h, g, kv = m.attention.heads, CausalLM.kv_heads(m), m.attention.d_kv
    std = 0.02
    layers = {
        "attn_norm": ParamSpec((n, d), ("layers", "embed")),
        "q": ParamSpec((n, d, h, kv), ("layers", "embed", "heads", "kv"), std),
        "k": ParamSpec((n, d, g, kv), ("layers", "embed", "kv_heads", "kv"), std),
        "v": ParamSpec((n, d, g, kv), ("layers", "embed", "kv_heads", "kv"), std),
        "o": ParamSpec((n, h, kv, d), ("layers", "heads", "kv", "embed"), std),
        "mlp_norm": ParamSpec((n, d), ("layers", "embed")),
        "gate": ParamSpec((n, d, f), ("layers", "embed", "mlp"), std),
        "up": ParamSpec((n, d, f), ("layers", "embed", "mlp"), std),
        "down": ParamSpec((n, f, d), ("layers", "mlp", "embed"), std),
    }
    return {"shared": ParamSpec((V, d), ("vocab", "embed"), std),
            "decoder": {"layers": layers, "final_norm": ParamSpec((d,), ("embed",))},
            "lm_head": ParamSpec((d, V), ("embed", "vocab"), std)}


def swiglu(p: dict, h, tp_axis, rate: float = 0.0, rng=None):
    """silu(h W_gate) * (h W_up) W_down, the inner dim split over tp. h [b, l, d] -> float32 [b, l, d]."""
    h = identical_inputs(h, tp_axis)
    x = h.reshape(-1, h.shape[-1])
    a = jax.nn.silu(L.dense(x, p["gate"])) * L.dense(x, p["up"])
    out = L.dense(a, p["down"], f32_out=True).reshape(*h.shape[:-1], -1)
    return L.dropout(identical_grad_inputs(out, tp_axis), rate, rng)


def layer(p: dict, x, attn, opts, tp_axis, rng=None):
    """x + attn(rms(x)), then + swiglu(rms(.)): x float32 [b, l, d] -> float32 [b, l, d]."""
    rate, dt = opts.dropout_prob, opts.compute_dtype
    h = identical_inputs(L.rms_norm(x, p["attn_norm"], opts.eps).astype(dt), tp_axis)
    a = attn(L.project_q(p, h), *L.project_kv(p, h), sharded_rng(rng, tp_axis, ATTN_PROBS))
    x = x + L.dropout(L.attention_output(p, a, tp_axis), rate, fam.rng(rng, ATTN_OUT))
    return x + swiglu(p, L.rms_norm(x, p["mlp_norm"], opts.eps).astype(dt), tp_axis, rate, fam.rng(rng, FF_OUT))


# --------------------------------------------------------------------------- Hugging Face: LlamaForCausalLM


def config_from_hf(hf: dict) -> ModelConfig:
    m = ModelConfig(family="toy_llama", layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
                    d_ff=hf["intermediate_size"], eps=hf["rms_norm_eps"])
    m.attention.heads, m.attention.kv_heads = hf["num_attention_heads"], hf["num_key_value_heads"]
    m.attention.d_kv = hf["hidden_size"] // hf["num_attention_heads"]
    m.attention.rotary_positional_embeddings_base = float(hf.get("rope_theta", 10000.0))
    m.embedding.vocab_size = hf["vocab_size"]
    return m


def params_from_hf(sd, m, tensor_parallel: int = 1, dtype=None) -> dict:
    """HF Linear weights are [out, in]: q/k/v [d, heads, kv] = W.T.reshape, o [h, kv, d], the MLP's W.T."""
    get, pad, kv = state_dict_reader(sd, "LLaMA"), vocab_padder(m, tensor_parallel), m.attention.d_kv

    def one(i):
        w = lambda name: get(f"model.layers.{i}.{name}.weight")  # noqa: E731
        return {"attn_norm": w("input_layernorm"), "mlp_norm": w("post_attention_layernorm"),
                "q": w("self_attn.q_proj").T.reshape(m.hidden_size, -1, kv),
                "k": w("self_attn.k_proj").T.reshape(m.hidden_size, -1, kv),
                "v": w("self_attn.v_proj").T.reshape(m.hidden_size, -1, kv),
                "o": w("self_attn.o_proj").T.reshape(-1, kv, m.hidden_size),
                "gate": w("mlp.gate_proj").T, "up": w("mlp.up_proj").T, "down": w("mlp.down_proj").T}

    rows = [one(i) for i in range(m.layers)]
    return {"shared": pad(get("model.embed_tokens.weight"), 0),
            "decoder": {"layers": {k: np.stack([r[k] for r in rows]) for k in rows[0]},
                        "final_norm": get("model.norm.weight")},
            "lm_head": pad(get("lm_head.weight").T, 1)}


class ToyLlama(CausalLM):
    """The third family: what differs from modelling/causal.py's decoder-only base, and nothing else."""

    name = "toy_llama"
    hf = dataclasses.replace(CausalLM.hf, model_types=("llama",), model_config=config_from_hf, params=params_from_hf)
    rotate = staticmethod(L.rotate_half)
    dense = ("q", "k", "v", "o", "gate", "up", "down")
    residual_outputs = ("o", "down")
    shape_fields = ("family", "layers", "hidden_size", "d_ff", "vocab_size", "heads", "kv_heads", "d_kv",
                    "rotary_positional_embeddings_base", "eps")
    param_specs = staticmethod(param_specs)
    layer = staticmethod(layer)

    def final_norm(self, dec, x, opts):
        return L.rms_norm(x, dec["final_norm"], opts.eps)
