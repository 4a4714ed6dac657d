"""Export: a checkpoint back in Hugging Face's formats, the library under run_export.py. A whole model (LoRA adapters
merged into their base) as transformers loads it, or a LoRA checkpoint's adapters alone in PEFT's format, with the
base they were trained on named where PEFT can load it (an HF model), else written beside them."""

from __future__ import annotations

import copy
import json
import os

import jax
import numpy as np
from safetensors.numpy import save_file

from data.tokenizer import pad_id
from modelling import lora
from modelling.hf_mapping import save_hf_model
from partitioning.base import device_base
from utils import checkpoint as ckpt
from utils.errors import FlanT5Error

BASE_DIR = "base"  # where a PEFT export writes a base that no hub name or HF directory holds


def check_output(path: str) -> None:
    """The export never writes into a directory that holds anything."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FlanT5Error(f"--output {path} exists and is not an empty directory: choose a new directory (nothing "
                          "was written)")


def special_tokens(tokenizer) -> dict:
    """The tokenizer's ids that an HF config.json names (a tokenizer without a pad token pads with its
    end-of-text token, as our decoding does: data.tasks.pad_id)."""
    return {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad_id(tokenizer),
            "bos_token_id": getattr(tokenizer, "bos_token_id", None)}


def export_model(params, model_config, tokenizer, family, output: str) -> str:
    """Weights (any memory, stacked) with their tokenizer as an HF model directory -> its architecture's name."""
    save_hf_model(jax.tree.map(np.asarray, params), model_config, output, special_tokens(tokenizer))
    as_read(tokenizer, family).save_pretrained(output)
    return family.hf.config_dict(model_config)["architectures"][0]


PROBE = ["the cat"]  # a text whose ids show what a tokenizer adds around any text


def as_read(tokenizer, family):
    """The tokenizer an export carries: its default encoding (``tokenizer(text)``, what transformers' users and
    pipelines call) gives the ids the family reads a prompt as. A decoder-only family reads a prompt with no special
    tokens, but a tokenizer made for T5's (the synthetic one, a learnt one) appends its end-of-text to every text:
    exported as it was, ``GPTJForCausalLM.generate`` on the export read every prompt with an end-of-text after it and
    answered differently from this project; such a tokenizer is exported without its post-processor."""
    if tokenizer(PROBE)["input_ids"] == family.encode_inputs(tokenizer, PROBE) or \
            getattr(tokenizer, "backend_tokenizer", None) is None:
        return tokenizer
    out = copy.deepcopy(tokenizer)
    out.backend_tokenizer.post_processor = None
    return out


def export_peft(decoder, directory: str, step: int, tokenizer, output: str) -> dict:
    """A LoRA checkpoint's adapters in PEFT's format (modelling/lora.py names them) -> the adapter config. Its
    ``base_model_name_or_path`` is the base's HF name or directory (a directory by its absolute path); a base that is
    no HF model (a random init, a checkpoint of ours: --init_from) is exported beside the adapters, into
    OUTPUT/base, named by its absolute path, so that ``AutoPeftModel...from_pretrained(OUTPUT)`` loads both from any
    directory (PEFT reads the path from the current directory: a relative one loaded only from the directory it was
    exported in). A folder moved since loads with its base named: ``PeftModel.from_pretrained(
    AutoModel...from_pretrained("MOVED/base"), "MOVED")``."""
    saved = ckpt.load_meta(directory, step) if directory else {}
    if not saved.get("lora_base"):
        raise FlanT5Error(f"--peft exports LoRA adapters, but {directory or 'the model'} was not trained with "
                          "--lora_rank: drop --peft to export the whole model")
    lg, adapters, _ = decoder.weights.lora_parts(directory, step, saved, base=False)
    adapters = jax.tree.map(np.asarray, adapters)
    source = saved["lora_base"]["source"]
    os.makedirs(output, exist_ok=True)
    if "hf_model" in source:
        base = source["hf_model"]
        base = os.path.abspath(base) if os.path.isdir(base) else base
    else:  # PEFT loads its base by name: write ours where it can find it
        base = os.path.abspath(os.path.join(output, BASE_DIR))
        frozen = device_base(lg, source)
        export_model(frozen, lg.cfg.model, tokenizer, lg.family, base)
        del frozen
    config = lora.peft_config(lg.family, adapters, lg.cfg.model, lg.opts, base)
    save_file(lora.peft_state_dict(lg.family, adapters, lg.cfg.model), os.path.join(output, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(output, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return config
