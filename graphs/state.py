"""What a training step changes, below both executors: the state, the per-step random key, and a checkpoint
restored into a layout (graphs/fused.py and graphs/phased.py both restore through here)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from graphs import sharding as S
from modelling.hf_mapping import load_hf_model
from modelling.params import init_params
from utils import checkpoint as ckpt


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything a step changes: step counter, weights and optimizer state (RTS-sharded)."""

    step: jax.Array
    params: Any
    opt_state: Any


def step_key(seed: int, step) -> jax.Array:
    """The key data of a training step: dropout and stochastic rounding of step ``step`` of a run seeded ``seed``
    (the one place it is derived: the driver, both executors and a resumed run draw the same bits)."""
    return jax.random.key_data(jax.random.fold_in(jax.random.key(seed), step))


def restore_train_state(graphs, directory: str, step: int, optim_state: bool = True,
                        memory_kind: str | None = None) -> tuple:
    """(stacked TrainState, meta) of a checkpoint, restored into the weights' layout (in ``memory_kind``, e.g. host
    memory); opt_state is None when not asked for or not saved. Targets come from shapes alone: no random weights
    are materialised first."""
    abstract = graphs.abstract_params()
    shardings = graphs.param_shardings if memory_kind is None else S.with_memory_kind(graphs.param_shardings,
                                                                                      memory_kind)
    opt_target = None
    if optim_state and ckpt.has_item(directory, step, "opt_state"):
        opt_abstract = jax.eval_shape(lambda p: graphs.updater.init_state(p, graphs.tree), abstract)
        opt_target = ckpt.abstract_like(opt_abstract, graphs.opt_state_shardings(abstract, shardings))
    params, opt_state, meta = ckpt.load(directory, step, ckpt.abstract_like(abstract, shardings), opt_target,
                                        graphs.shape_hint)
    step_arr = jax.device_put(jnp.asarray(meta["step"], jnp.int32), graphs.replicated)
    return TrainState(step_arr, params, opt_state), meta


def restore_base(graphs, directory: str, step: int) -> dict:
    """LoRA: a full checkpoint's weights (--init_from of a run without adapters) as frozen base weights, in the
    compute dtype and their RTS layout."""
    abstract = jax.eval_shape(lambda k: init_params(graphs.base_specs, k), jax.random.key(0))
    params, _, _ = ckpt.load(directory, step, ckpt.abstract_like(abstract, graphs.base_shardings), None,
                             graphs.shape_hint)
    return jax.jit(graphs.frozen, out_shardings=graphs.base_shardings)(params)


def describe_base(source: dict) -> str:
    if "init_from" in source:
        return "the weights of {}/{}".format(*source["init_from"])
    if "hf_model" in source:
        return source["hf_model"]
    return f"a random init (seed {source['random_init_seed']})"


def load_base(graphs, source: dict) -> dict:
    """LoRA: the frozen base weights a ``base_source`` names, in the compute dtype and their RTS layout."""
    if "init_from" in source:
        return restore_base(graphs, *source["init_from"])
    if "hf_model" in source:
        _, host = load_hf_model(source["hf_model"], graphs.tp, expect=graphs.model_config)
        return graphs.shard_base(host)
    return graphs.init_base(source["random_init_seed"])


def fingerprint(frozen: dict) -> str:
    """A short digest of base weights: 256 fixed entries of each weight (a stride through it), rounded to bfloat16,
    hashed. Exact (no reduction whose order a layout could change) and the same whatever dtype or layout the
    weights are kept in: adapters resumed or loaded onto other weights are refused."""
    def sample(x):
        flat = x.reshape(-1)
        return flat[:: max(1, flat.size // 256)][:256].astype(jnp.bfloat16).astype(jnp.float32)

    values = jax.jit(lambda t: [sample(x) for x in jax.tree.leaves(t)])(frozen)
    digest = hashlib.sha256()
    for v in values:
        digest.update(np.asarray(v, np.float32).tobytes())
    return digest.hexdigest()[:16]
