"""What a training step changes, below both executors: the state, the per-step random key, and a checkpoint
restored into a layout (graphs/fused.py and graphs/phased.py both restore through here; LoRA's frozen base through
partitioning/base.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from partitioning import sharding as S
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
