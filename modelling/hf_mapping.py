"""Hugging Face model directories <-> this project's parameter trees, for any family: reading and writing
``save_pretrained`` directories (config.json + safetensors), downloads, and the dispatch to the family whose
mapping applies (the family comes from config.json's ``model_type``, or from our config's ``model.family``).
Each family's weight mapping lives with its layers (modelling/t5.py, modelling/gptj.py).

Reading a ``save_pretrained`` directory uses safetensors' NumPy API: no torch.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Mapping, Optional

import numpy as np

from config.schema import ModelConfig
from modelling import registry
from utils.errors import CheckpointError
from utils.hub import fetch


def model_config_from_hf(hf: Mapping) -> ModelConfig:
    """Our ModelConfig from an HF config of any supported family (dict form)."""
    return registry.of_hf_config(hf).hf.model_config(hf)


def hf_config_dict(m: ModelConfig) -> dict:
    """The HF config dict (config.json) of our ModelConfig, for its family."""
    return registry.get(m.family).hf.config_dict(m)


def params_from_hf_state_dict(sd: Mapping, m: ModelConfig, tensor_parallel: int = 1, dtype=None) -> dict:
    """Our parameter tree from an HF state dict (numpy arrays or torch tensors), by m's family: float32, or with
    ``dtype`` every weight its family does not keep in float32 cast to it as it is read."""
    return registry.get(m.family).hf.params(sd, m, tensor_parallel, dtype)


def hf_state_dict_from_params(params: dict, m: ModelConfig) -> dict:
    """An HF state dict (numpy float32) from our parameter tree, by m's family; padded vocab is stripped."""
    return registry.get(m.family).hf.state_dict(params, m)


class SafetensorsDir(Mapping):
    """The tensors of a save_pretrained directory (single or sharded safetensors), read one at a time as a key is
    looked up (memory-mapped files): a model is never held whole in host memory in its stored dtype beside the
    tree built from it."""

    def __init__(self, path: str):
        from safetensors import safe_open

        files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
        if not files:
            raise CheckpointError(
                f"no *.safetensors weights in {path}: save the model with "
                "model.save_pretrained(dir, safe_serialization=True)")
        self.handles, self.file_of = {}, {}
        for f in files:
            try:
                self.handles[f] = safe_open(f, framework="numpy")
                self.file_of.update((k, f) for k in self.handles[f].keys())
            except Exception as e:  # safetensors raises several error types for a corrupt file
                raise CheckpointError(f"cannot read {f} ({e}): the file is corrupt or truncated; download it "
                                      "again") from e

    def __getitem__(self, key: str) -> np.ndarray:
        f = self.file_of[key]
        try:
            return self.handles[f].get_tensor(key)
        except Exception as e:
            raise CheckpointError(f"cannot read {key} from {f} ({e}): the file is corrupt or truncated; download it "
                                  "again") from e

    def __contains__(self, key) -> bool:
        return key in self.file_of

    def __iter__(self):
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


def read_safetensors_dir(path: str) -> SafetensorsDir:
    """The tensors of a save_pretrained directory as a mapping {key: numpy array}, each read when looked up."""
    return SafetensorsDir(path)


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


def load_hf_model(name_or_dir: str, tensor_parallel: int = 1, expect: Optional[ModelConfig] = None, dtype=None):
    """(ModelConfig, params) from an HF model name or save_pretrained directory: float32 weights, or with ``dtype``
    (LoRA's frozen base) those the family does not keep in float32 read into it tensor by tensor, so that host
    memory holds the model once in ``dtype``."""
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
    return m, params_from_hf_state_dict(read_safetensors_dir(path), m, tensor_parallel, dtype)


def save_hf_model(params: dict, m: ModelConfig, path: str, special_tokens: Optional[dict] = None) -> None:
    """Writes config.json + model.safetensors that transformers' from_pretrained loads. ``special_tokens``: the
    tokenizer's ids ({"eos_token_id": ..., "pad_token_id": ..., "bos_token_id": ...}), written over the family's
    defaults so that ``generate`` stops where the model was trained to (None values are left out)."""
    from safetensors.numpy import save_file

    os.makedirs(path, exist_ok=True)
    sd = hf_state_dict_from_params(params, m)
    if m.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    # safetensors refuses aliased buffers; each tensor gets its own copy
    save_file({k: np.array(v, copy=True) for k, v in sd.items()}, os.path.join(path, "model.safetensors"),
              metadata={"format": "pt"})
    config = hf_config_dict(m)
    config.update({k: v for k, v in (special_tokens or {}).items() if v is not None})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
