"""The frozen base of LoRA: where it comes from (a checkpoint, an HF model, a random init), read into a layout,
and its identity (``fingerprint``: a digest a LoRA checkpoint records, so that adapters resumed or decoded over
other weights are refused). Training's executors (graphs/) and the decoder's weights (decoder/weights.py) both
read a base through here."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np

from modelling.hf_mapping import load_hf_model
from utils import checkpoint as ckpt


def restore_base(graphs, directory: str, step: int, memory_kind: str | None = None) -> dict:
    """LoRA: a full checkpoint's weights (--init_from of a run without adapters) as frozen base weights, read
    straight into the compute dtype (rounded to nearest even, as XLA casts) and their RTS layout, in ``memory_kind``
    (host memory for the phased executor)."""
    params, _, _ = ckpt.load(directory, step, graphs.abstract_base(memory_kind), None, graphs.shape_hint)
    return params


def describe_base(source: dict) -> str:
    if "init_from" in source:
        return "the weights of {}/{}".format(*source["init_from"])
    if "hf_model" in source:
        return source["hf_model"]
    return f"a random init (seed {source['random_init_seed']})"


def load_base(graphs, source: dict, memory_kind: str | None = None) -> dict:
    """LoRA: the frozen base weights a ``base_source`` names, in the frozen dtypes (``Graphs.frozen_dtype``): a
    checkpoint's or the random init as arrays in their RTS layout in ``memory_kind`` (None: the devices'; the phased
    executor's host memory: never the whole base on a device), an HF model's as numpy arrays read tensor by tensor
    (host memory holds the base once; an executor's ``set_base`` places them)."""
    if "init_from" in source:
        return restore_base(graphs, *source["init_from"], memory_kind)
    if "hf_model" in source:
        return load_hf_model(source["hf_model"], graphs.tp, expect=graphs.model_config,
                             dtype=graphs.opts.compute_dtype)[1]
    return graphs.init_base(source["random_init_seed"], memory_kind)


def device_base(graphs, source: dict) -> dict:
    """LoRA: ``load_base`` on the devices, in the frozen dtypes and their RTS layout."""
    base = load_base(graphs, source)
    return base if isinstance(jax.tree.leaves(base)[0], jax.Array) else graphs.shard_base(base)


def base_record(source: dict, fingerprint_: str) -> dict:
    """What a LoRA checkpoint's meta says of its base (``lora_base``): where it comes from and its fingerprint."""
    return {"source": source, "fingerprint": fingerprint_}


SAMPLES = 256  # entries of each weight a fingerprint reads


def _sample_at(size: int) -> np.ndarray:
    return np.arange(0, size, max(1, size // SAMPLES))[:SAMPLES]


def fingerprint(frozen: dict) -> str:
    """A short digest of base weights: 256 fixed entries of each weight (a stride through it), rounded to bfloat16,
    hashed. Exact (no reduction whose order a layout could change) and the same whatever dtype or layout the
    weights are kept in: adapters resumed or loaded onto other weights are refused."""
    def sample(x):
        flat = x.reshape(-1)
        return flat[:: max(1, flat.size // SAMPLES)][:SAMPLES].astype(jnp.bfloat16).astype(jnp.float32)

    values = jax.jit(lambda t: [sample(x) for x in jax.tree.leaves(t)])(frozen)
    return _digest(np.asarray(v, np.float32) for v in values)


def fingerprint_rows(leaves: list) -> str:
    """``fingerprint`` of weights given leaf by leaf (in ``jax.tree.leaves`` order of the stacked tree) as lists of
    rows (a stacked leaf as its rows, any other as ``[leaf]``), read row by row in host memory (the phased
    executor's: the whole base is never gathered in one place). The same digest as ``fingerprint``."""
    def values(rows):
        m = rows[0].size
        at = _sample_at(m * len(rows))
        out = []
        for i, row in enumerate(rows):
            local = at[(at >= i * m) & (at < (i + 1) * m)] - i * m
            if local.size:
                out.append(_host_values(row).reshape(-1)[local])
        return np.concatenate(out).astype(jnp.bfloat16).astype(np.float32)

    return _digest(values(rows) for rows in leaves)


def _host_values(x) -> np.ndarray:
    if not isinstance(x, jax.Array) or x.is_fully_addressable:  # (numpy: an HF model's weights as read)
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _digest(values) -> str:
    digest = hashlib.sha256()
    for v in values:
        digest.update(np.asarray(v, np.float32).tobytes())
    return digest.hexdigest()[:16]
