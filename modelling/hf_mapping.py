"""Hugging Face checkpoints <-> this project's parameter trees: reading and writing model directories (any
family: the family comes from config.json's ``model_type``), and the T5 weight mapping (GPT-J's is in
modelling/gptj.py, next to its layers).

HF Linear weights are [out, in]; ours are [in, ...] with heads split out:
q/k/v [d, h, kv] = W.T.reshape(d, h, kv); o [h, kv, d] = W.T.reshape(h, kv, d);
wi [d, f] = W.T; wo [f, d] = W.T; lm_head [d, V] = W.T. Layers are stacked.

Reading a ``save_pretrained`` directory uses safetensors' NumPy API: no torch.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Mapping, Optional

import numpy as np

from config.config import ModelConfig
from modelling.params import padded_vocab
from utils.errors import FlanT5Error

_ATTN = {"q": "q", "k": "k", "v": "v", "o": "o"}


class CheckpointError(FlanT5Error, RuntimeError):
    """A missing or unreadable model checkpoint; the message says how to fix it."""


# --------------------------------------------------------------------------- config


# config.json model_type -> our family
MODEL_TYPES = {"t5": "t5", "mt5": "t5", "umt5": "umt5", "gptj": "gptj"}


def family_of_hf(hf: Mapping) -> str:
    """Our family name of an HF config (dict form); CheckpointError naming the supported types."""
    kind = hf.get("model_type")
    if kind not in MODEL_TYPES:
        raise CheckpointError(f"model_type {kind!r} is not supported: this project runs "
                              f"{', '.join(sorted(MODEL_TYPES))} checkpoints (config.json's model_type)")
    return MODEL_TYPES[kind]


def _family(name: str):
    from modelling import family

    return family.get(name)


def model_config_from_hf(hf: Mapping) -> ModelConfig:
    """Our ModelConfig from an HF config of any supported family (dict form)."""
    m = _family(family_of_hf(hf)).model_config_from_hf(hf)
    return m


def hf_config_dict(m: ModelConfig) -> dict:
    """The HF config dict (config.json) of our ModelConfig, for its family."""
    return _family(m.family).hf_config_dict(m)


def t5_config_from_hf(hf: Mapping) -> ModelConfig:
    """Our ModelConfig from an HF T5, mT5 or UMT5 config (dict form): T5 v1.0 / v1.1, Flan-T5, mT5, UMT5, UL2."""
    from config.config import FEED_FORWARD_PROJ

    m = ModelConfig()
    m.family = "umt5" if hf.get("model_type") == "umt5" else "t5"
    m.layers = hf["num_layers"]
    decoder = hf.get("num_decoder_layers")
    m.decoder_layers = decoder if decoder not in (None, m.layers) else 0
    m.hidden_size = hf["d_model"]
    m.d_ff = hf["d_ff"]
    m.attention.heads = hf["num_heads"]
    m.attention.d_kv = hf["d_kv"]
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


def t5_hf_config_dict(m: ModelConfig) -> dict:
    """An HF T5 (or UMT5) config dict for our ModelConfig (what config.json holds)."""
    act = m.feed_forward_proj.split("-")[-1]
    umt5 = m.family == "umt5"
    return {
        "architectures": ["UMT5ForConditionalGeneration" if umt5 else "T5ForConditionalGeneration"],
        "model_type": "umt5" if umt5 else "t5",
        "d_model": m.hidden_size,
        "d_ff": m.d_ff,
        "d_kv": m.attention.d_kv,
        "num_heads": m.attention.heads,
        "num_layers": m.layers,
        "num_decoder_layers": m.decoder_depth,
        "vocab_size": m.embedding.vocab_size,
        "relative_attention_num_buckets": m.attention.relative_attention_num_buckets,
        "relative_attention_max_distance": m.attention.relative_attention_max_distance,
        "layer_norm_epsilon": m.eps,
        "feed_forward_proj": m.feed_forward_proj,
        "dense_act_fn": "gelu_new" if m.feed_forward_proj == "gated-gelu" else act,
        "is_gated_act": m.feed_forward_proj.startswith("gated-"),
        "tie_word_embeddings": m.tie_word_embeddings,
        "scale_decoder_outputs": m.tie_word_embeddings,
        "dropout_rate": m.dropout_prob,
        "decoder_start_token_id": 0,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
    }


# --------------------------------------------------------------------------- names


def _relpos_key(stack: str, i: int = 0) -> str:
    return f"{stack}.block.{i}.layer.0.SelfAttention.relative_attention_bias.weight"


def _layer_keys(i: int, decoder: bool, m: ModelConfig) -> dict:
    """Our per-layer name -> HF name, for layer i of a stack."""
    stack = "decoder" if decoder else "encoder"
    s = f"{stack}.block.{i}.layer"
    keys = {"attn_norm": f"{s}.0.layer_norm.weight"}
    keys.update({k: f"{s}.0.SelfAttention.{v}.weight" for k, v in _ATTN.items()})
    if m.family == "umt5":  # every layer has its own table
        keys["relpos"] = _relpos_key(stack, i)
    ff = 1
    if decoder:
        keys["cross_norm"] = f"{s}.1.layer_norm.weight"
        keys.update({"c" + k: f"{s}.1.EncDecAttention.{v}.weight" for k, v in _ATTN.items()})
        ff = 2
    keys["ff_norm"] = f"{s}.{ff}.layer_norm.weight"
    for w in (("wi_0", "wi_1") if m.feed_forward_proj.startswith("gated-") else ("wi",)) + ("wo",):
        keys[w] = f"{s}.{ff}.DenseReluDense.{w}.weight"
    return keys


def _to_ours(name: str, w: np.ndarray, h: int, kv: int) -> np.ndarray:
    base = name.lstrip("c") if name in ("cq", "ck", "cv", "co") else name
    if base in ("q", "k", "v"):
        return w.T.reshape(w.shape[1], h, kv)
    if base == "o":
        return w.T.reshape(h, kv, w.shape[0])
    if name in ("wi", "wi_0", "wi_1", "wo"):
        return w.T
    return w


def _to_hf(name: str, w: np.ndarray) -> np.ndarray:
    base = name.lstrip("c") if name in ("cq", "ck", "cv", "co") else name
    if base in ("q", "k", "v"):
        return w.reshape(w.shape[0], -1).T
    if base == "o":
        return w.reshape(-1, w.shape[-1]).T
    if name in ("wi", "wi_0", "wi_1", "wo"):
        return w.T
    return w


# --------------------------------------------------------------------------- import / export


def state_dict_reader(sd: Mapping, family: str):
    """get(key) -> an HF state dict's entry (numpy or torch) as float32 numpy; a missing key is a CheckpointError."""

    def get(key):
        if key not in sd:
            raise CheckpointError(f"weight {key} is missing from the checkpoint: is it a {family} checkpoint of this "
                                  "size?")
        v = sd[key]
        if hasattr(v, "detach"):
            v = v.detach().float().cpu().numpy()
        return np.asarray(v, dtype=np.float32)

    return get


def vocab_padder(m: ModelConfig, tensor_parallel: int):
    """pad(w, axis) -> w with its vocabulary axis zero-padded to the multiple of tensor_parallel the model uses."""
    V = padded_vocab(m.embedding.vocab_size, tensor_parallel)

    def pad(w, axis):
        extra = V - w.shape[axis]
        if extra < 0:
            raise CheckpointError(f"checkpoint vocab {w.shape[axis]} is larger than vocab_size {m.embedding.vocab_size}")
        widths = [(0, 0)] * w.ndim
        widths[axis] = (0, extra)
        return np.pad(w, widths)

    return pad


def params_from_hf_state_dict(sd: Mapping[str, np.ndarray], m: ModelConfig, tensor_parallel: int = 1) -> dict:
    """Our float32 parameter tree from an HF state dict (values: numpy arrays or torch tensors)."""
    get, pad_rows = state_dict_reader(sd, "UMT5" if m.family == "umt5" else "T5"), vocab_padder(m, tensor_parallel)
    h, kv = m.attention.heads, m.attention.d_kv

    shared_key = "shared.weight" if "shared.weight" in sd else "encoder.embed_tokens.weight"
    params = {"shared": pad_rows(get(shared_key), 0)}
    for stack in ("encoder", "decoder"):
        dec = stack == "decoder"
        per_layer = [_layer_keys(i, dec, m) for i in range(m.decoder_depth if dec else m.layers)]
        layers = {
            name: np.stack([_to_ours(name, get(keys[name]), h, kv) for keys in per_layer])
            for name in per_layer[0]
        }
        own = {} if m.family == "umt5" else {"relpos": get(_relpos_key(stack))}
        params[stack] = {**own, "layers": layers, "final_norm": get(f"{stack}.final_layer_norm.weight")}
    if not m.tie_word_embeddings:
        # transformers >= 5 saves an untied head only as shared.weight (it ties them)
        head_key = "lm_head.weight" if "lm_head.weight" in sd else shared_key
        params["lm_head"] = pad_rows(get(head_key).T, 1)
    return params


def hf_state_dict_from_params(params: dict, m: ModelConfig) -> dict:
    """HF state dict (numpy float32) from our parameter tree; padded vocab is stripped."""
    V = m.embedding.vocab_size
    g = lambda x: np.asarray(x, dtype=np.float32)  # noqa: E731
    shared = g(params["shared"])[:V]
    sd = {"shared.weight": shared, "encoder.embed_tokens.weight": shared, "decoder.embed_tokens.weight": shared}
    for stack in ("encoder", "decoder"):
        p, dec = params[stack], stack == "decoder"
        for i in range(m.decoder_depth if dec else m.layers):
            for name, key in _layer_keys(i, dec, m).items():
                sd[key] = np.ascontiguousarray(_to_hf(name, g(p["layers"][name][i])))
        if "relpos" in p:
            sd[_relpos_key(stack)] = g(p["relpos"])
        sd[f"{stack}.final_layer_norm.weight"] = g(p["final_norm"])
    sd["lm_head.weight"] = np.ascontiguousarray(g(params["lm_head"])[:, :V].T) if "lm_head" in params else shared
    return sd


def read_safetensors_dir(path: str) -> dict:
    """All tensors of a save_pretrained directory (single or sharded safetensors) as numpy."""
    from safetensors.numpy import load_file

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise CheckpointError(
            f"no *.safetensors weights in {path}: save the model with "
            "model.save_pretrained(dir, safe_serialization=True)")
    sd = {}
    for f in files:
        try:
            sd.update(load_file(f))
        except Exception as e:  # safetensors raises several error types for a corrupt file
            raise CheckpointError(f"cannot read {f} ({e}): the file is corrupt or truncated; download it again") from e
    return sd


def read_hf_config(path: str) -> dict:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path} has no config.json: pass a directory written by save_pretrained")
    with open(cfg_path) as f:
        return json.load(f)


def resolve_hf_dir(name_or_dir: str) -> str:
    """A local directory with config.json and safetensors: the path itself, or a hub download.

    With no network and nothing cached, fails with a message saying how to pass a local directory.
    """
    if os.path.isdir(name_or_dir):
        return name_or_dir
    if name_or_dir.startswith((".", "/")) or os.sep in name_or_dir.strip("/").split("/", 1)[-1]:
        raise CheckpointError(f"model directory {name_or_dir} does not exist: pass --hf_model with an existing directory")
    try:
        from huggingface_hub import snapshot_download

        from utils.hub import fetch

        fix = (f"download it elsewhere (huggingface-cli download {name_or_dir} --local-dir DIR), copy DIR here and "
               "pass --hf_model DIR")
        return fetch(lambda **kw: snapshot_download(name_or_dir, allow_patterns=["*.json", "*.safetensors"], **kw),
                     name_or_dir, "model", fix, CheckpointError)
    except CheckpointError:
        raise
    except Exception as e:  # offline, unknown repo, no permission...
        raise CheckpointError(
            f"cannot download {name_or_dir} from the Hugging Face hub ({type(e).__name__}): with no network, "
            f"download it elsewhere (huggingface-cli download {name_or_dir} --local-dir DIR), copy DIR here "
            "and pass --hf_model DIR") from None


def load_hf_model(name_or_dir: str, tensor_parallel: int = 1, expect: Optional[ModelConfig] = None):
    """(ModelConfig, params) from an HF model name or save_pretrained directory."""
    path = resolve_hf_dir(name_or_dir)
    m = model_config_from_hf(read_hf_config(path))
    if expect is not None and expect.family != m.family:
        raise CheckpointError(f"{name_or_dir} is a {m.family} model but the preset is a {expect.family} one: choose "
                              f"a {m.family} preset")
    if expect is not None:
        shape = lambda c: (c.layers, c.decoder_depth, c.hidden_size, c.d_ff, c.attention.heads,  # noqa: E731
                           c.attention.d_kv)
        if shape(expect) != shape(m):
            raise CheckpointError(
                f"{name_or_dir} has (layers, decoder layers, hidden_size, d_ff, heads, d_kv) = {shape(m)} but the "
                f"preset has {shape(expect)}: choose the preset of that model size")
    return m, _family(m.family).params_from_hf(read_safetensors_dir(path), m, tensor_parallel)


def save_hf_model(params: dict, m: ModelConfig, path: str) -> None:
    """Writes config.json + model.safetensors that transformers' from_pretrained loads."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    sd = _family(m.family).hf_state_dict(params, m)
    if m.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    # safetensors refuses aliased buffers; each tensor gets its own copy
    save_file({k: np.array(v, copy=True) for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(m), f, indent=2)
