"""Parameter spec tree: every weight's shape, logical axes and initialiser.

The tree mirrors the parameter tree. Layers of a stack are stacked on a
leading ``layers`` axis (scanned over in the fused executor; streamed one row
at a time by the phased executor, like the original's remote buffers).

Logical axes: ``layers``, ``embed``, ``heads``, ``kv``, ``mlp``, ``vocab``,
``relpos_buckets``. ``partitioning/sharding.py`` maps them to mesh axes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np



@dataclass(frozen=True)
class ParamSpec:
    """One weight: global shape, logical axes, init std (None: ones), dtype."""

    shape: tuple
    axes: tuple
    std: Any = None
    dtype: Any = jnp.float32

    @property
    def is_norm(self) -> bool:
        return self.std is None


def padded_vocab(vocab_size: int, tensor_parallel: int) -> int:
    """Vocab rounded up to a multiple of tensor_parallel (extra rows are masked out of the logits)."""
    return -(-vocab_size // tensor_parallel) * tensor_parallel


def is_spec(x) -> bool:
    return isinstance(x, ParamSpec)


def init_params(specs: dict, key: jax.Array) -> dict:
    """Random parameters for a spec tree (float32). Padded vocab rows are zero."""
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=is_spec)
    keys = jax.random.split(key, len(leaves))
    return jax.tree_util.tree_unflatten(treedef, [init_leaf(spec, k) for spec, k in zip(leaves, keys)])


def init_leaf(spec: ParamSpec, key: jax.Array) -> jax.Array:
    """One weight of ``init_params`` (from its own key: the i-th of ``split(key, leaves)``)."""
    if spec.is_norm:
        return jnp.ones(spec.shape, spec.dtype)
    return spec.std * jax.random.normal(key, spec.shape, spec.dtype)


def zero_padded_vocab(params: dict, vocab_size: int) -> dict:
    """Zeroes the rows (shared) / columns (lm_head, lm_head_bias) of the padded vocabulary (beyond vocab_size).

    Either weight may be absent (the phased executor passes one weight at a time).
    """
    params = dict(params)
    if "shared" in params:
        params["shared"] = params["shared"].at[vocab_size:].set(0.0)
    if "lm_head" in params:
        params["lm_head"] = params["lm_head"].at[:, vocab_size:].set(0.0)
    if "lm_head_bias" in params:
        params["lm_head_bias"] = params["lm_head_bias"].at[vocab_size:].set(0.0)
    return params


def count_params(specs: dict) -> int:
    """Number of weights in a spec tree."""
    return int(sum(np.prod(s.shape) for s in jax.tree_util.tree_leaves(specs, is_leaf=is_spec)))
