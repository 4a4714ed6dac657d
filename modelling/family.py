"""Model families: what the engine (graphs/) needs to know about a model, and the registry.

A family is one module of ``modelling/`` (``t5``, ``gptj``) exposing ``FAMILY``, an object with (a module
serving variants, as t5 serves umt5, also maps their names to objects in ``FAMILIES``):

- ``stacks``: its layer stacks as data (``Stack``): T5 an encoder and a causal decoder with
  cross-attention, GPT-J one causal stack;
- ``param_specs(model_cfg, tensor_parallel)``: its weights, with logical axes (graphs/sharding.py
  maps them to mesh axes, so a family needs no sharding code);
- the per-device bodies of a training step (``embeddings``, ``context``, ``block``,
  ``stack_output``, ``head_loss``) that graphs/phases.py composes for both executors;
- ``head_paths``, ``keeps_f32``, ``decays``, ``is_dense``: which weights the head phase reads,
  which stay float32 in the compute copy, which get weight decay, which are matmul weights whose
  gradient accumulates inside the weight-gradient GEMM;
- ``generate``: greedy decoding with a KV cache;
- the Hugging Face mapping (``model_config_from_hf``, ``params_from_hf``, ``hf_state_dict``,
  ``hf_config_dict``).

The parameter tree of every family has the same top level: ``shared`` (the token embedding),
the head weights, and one subtree per stack holding ``layers`` (stacked on a leading axis) and
the stack's own small weights. graphs/tree.py owns that structure; nothing under graphs/ names a
family: ``get(name)`` resolves one from ``model.family``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from config.config import ConfigError

# family name -> module (imported on first use)
MODULES = {"t5": "modelling.t5", "umt5": "modelling.t5", "gptj": "modelling.gptj"}

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclass(frozen=True)
class Stack:
    """One stack of layers, as the engine sees it."""

    name: str  # key of the stack in the parameter tree
    ids: str  # batch key of the stack's token ids
    meta: tuple  # batch keys its attention context reads (segment ids, positions)
    embed_stream: int  # dropout stream of its embedding
    layers_stream: int  # dropout stream of its layers (then folded with the layer index)
    buffer: str  # name of its activation buffer in the phased executor
    context: tuple = ()  # its own non-layer weights that the attention context reads (T5: relpos)
    cross: bool = False  # its layers attend to the previous stack's output (T5's decoder)
    output: Optional[str] = None  # its final-norm weight, whose output the next stack reads (T5's encoder)
    output_stream: int = 0  # dropout stream of that output


@dataclass(frozen=True)
class ModelOptions:
    """The fields of the config that the model functions need (hashable, static under jit)."""

    family: str = "t5"
    eps: float = 1e-6
    dropout_prob: float = 0.0
    num_buckets: int = 32
    max_distance: int = 128
    scale_ff: int = 1
    vocab_size: int = 32128
    hidden_size: int = 512
    d_kv: int = 64
    tie_word_embeddings: bool = False
    feed_forward_proj: str = "gated-gelu"  # T5 family: "gated-ACT" or "ACT" (config.FEED_FORWARD_PROJ)
    rotary_dim: int = 0  # GPT-J: rotary dimensions of each head (0: the whole head)
    rotary_base: float = 10000.0
    attention_serialisation: int = 1
    recompute: bool = False
    remat_policy: str = "full"  # with recompute: full or save_dots
    unroll_layers: bool = False
    dtype: str = "float32"
    attention_impl: str = "xla"  # resolved: xla or cudnn

    @classmethod
    def from_config(cls, cfg) -> "ModelOptions":
        m, ex = cfg.model, cfg.execution
        dropout = 0.0 if m.eval else m.dropout_prob
        return cls(
            family=m.family, eps=m.eps, dropout_prob=dropout,
            num_buckets=m.attention.relative_attention_num_buckets,
            max_distance=m.attention.relative_attention_max_distance, scale_ff=m.scale_ff,
            vocab_size=m.embedding.vocab_size, hidden_size=m.hidden_size, d_kv=m.attention.d_kv,
            tie_word_embeddings=m.tie_word_embeddings, feed_forward_proj=m.feed_forward_proj, rotary_dim=m.attention.rotary_dim,
            rotary_base=m.attention.rotary_positional_embeddings_base,
            attention_serialisation=ex.attention_serialisation,
            recompute=ex.recompute, remat_policy=ex.remat_policy, unroll_layers=ex.unroll_layers, dtype=m.precision,
            attention_impl=resolve_attention_impl(ex.attention_impl, m.precision, dropout),
        )

    @property
    def compute_dtype(self):
        return DTYPES[self.dtype]


def resolve_attention_impl(requested: str, precision: str, dropout_prob: float) -> str:
    """'auto' -> 'cudnn' on a GPU in bfloat16/float16 without dropout, else 'xla'; an explicit
    'cudnn' where it cannot run is a ConfigError naming the fix."""
    usable = jax.default_backend() == "gpu" and precision in ("bfloat16", "float16")
    if requested == "cudnn":
        if not usable:
            raise ConfigError(f"attention_impl=cudnn needs a GPU and precision bfloat16 or float16 (backend "
                             f"{jax.default_backend()}, precision {precision}): pass --attention_impl auto or xla")
        if dropout_prob > 0:
            raise ConfigError(f"attention_impl=cudnn has no attention dropout (dropout_prob={dropout_prob}): "
                             "pass --attention_impl xla, or --dropout_prob 0")
        return "cudnn"
    if requested == "auto":
        return "cudnn" if usable and dropout_prob == 0 else "xla"
    return "xla"


def leaf_name(path) -> str:
    """The last key of a tree path (the weight's own name)."""
    return str(getattr(path[-1], "key", path[-1]))


def cast_params(params: dict, dtype, keeps_f32) -> dict:
    """Casts the weights to the compute dtype, except those ``keeps_f32(name)`` keeps float32 (norms...)."""
    return jax.tree_util.tree_map_with_path(lambda p, x: x if keeps_f32(leaf_name(p)) else x.astype(dtype), params)


def rng(key, *data):
    """A key folded with streams (and a layer index); None stays None (no dropout)."""
    if key is None:
        return None
    for d in data:
        key = jax.random.fold_in(key, d)
    return key


def get(name: str):
    """The ``FAMILY`` object of a family name (``model.family``)."""
    if name not in MODULES:
        raise ConfigError(f"unknown model family {name!r}: choose one of {', '.join(MODULES)} (--family)")
    module = importlib.import_module(MODULES[name])
    return getattr(module, "FAMILIES", {}).get(name) or module.FAMILY


def of_config(cfg):
    """The family of a config."""
    return get(cfg.model.family)
