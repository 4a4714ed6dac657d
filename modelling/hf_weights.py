"""Reading Hugging Face state dicts into our layout, for every family's mapping: typed access to the entries and
the vocabulary padding tensor parallelism needs."""

from __future__ import annotations

from typing import Mapping

import numpy as np

from modelling.params import padded_vocab
from utils.errors import CheckpointError


def kept_as(dtype, keeps_f32):
    """cast(name, w): w in the dtype a family keeps its weight ``name`` in when loaded frozen (LoRA's base): ``dtype``
    (None: float32), float32 for the weights ``keeps_f32`` names. Applied to each layer's tensor before the layers are
    stacked, so that a 16-bit base never exists in float32 as a whole."""
    def cast(name, w):
        return w if dtype is None or keeps_f32(name) else w.astype(dtype)

    return cast


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


def vocab_padder(m, tensor_parallel: int):
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
