"""The Graphs builder: a training config resolved, once, into what the engine runs on: its placement
(partitioning/placement.py: the model family and its options, the mesh, weight layouts and shardings), the updater
(optimizer, clipping, stochastic rounding), the step options and the batches' layout.

The executors (graphs/fused.py, graphs/phased.py) read these objects, never the config itself:
``graphs.executor.make_executor(graphs)`` picks the fused executor (every phase in one compiled step) or the
phased one (weights, optimizer state and activations in host memory, one phase program at a time). Decoding is
decoder/'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from graphs import optim
from partitioning import sharding as S
from partitioning.placement import Placement

@dataclass(frozen=True)
class StepOptions:
    """What a training step needs of the config beside the model and the updater."""

    seed: int  # of the initial weights and of every step's key (graphs/state.step_key)
    loss_scale: float  # the static loss scale, or the first one under dynamic scaling
    update_in_backward: bool  # phased: each layer updated right after its backward, clipped with the previous norm
    compute_copy: bool  # phased: forward and backward read a compute-dtype copy of the weights kept in host memory
    batch: tuple  # (gradient accumulation, rows per micro-batch) of a global batch
    batch_lengths: tuple  # ((batch key, row length), ...) as the loader builds a batch


class Graphs(Placement):
    """A training config resolved into the engine's objects (see the module docstring)."""

    def __init__(self, cfg, mesh=None):
        super().__init__(cfg, mesh)
        ex = cfg.execution
        # batches are [gradient_accumulation, data_parallel * micro_batch_size, length]
        self.batch_sharding = NamedSharding(self.mesh, P(None, S.DP, None))
        training = not cfg.model.eval
        self.updater = optim.Updater.of_config(cfg.training, self.family.decays) if training else None
        # 16-bit master weights under stochastic rounding (every update rounded stochastically), else float32
        self.master_dtype = self.opts.compute_dtype if training and cfg.training.stochastic_rounding else np.float32
        ga = max(cfg.gradient_accumulation, 1)
        self.steps = StepOptions(cfg.model.seed, cfg.initial_loss_scale, ex.update_in_backward and training,
                                 ex.compute_copy and training,
                                 (ga, cfg.training.global_batch_size // ga),
                                 tuple(self.family.batch_lengths(cfg).items()))
        self.phased = ex.phased

    def opt_state_shardings(self, params, param_shardings=None) -> dict:
        """Shardings of the optimizer state ({group: state}): a leaf shaped like a weight follows that
        weight; any other leaf (step counts, Adafactor's factored moments) is replicated."""
        param_shardings = self.param_shardings if param_shardings is None else param_shardings
        abstract = jax.eval_shape(partial(self.updater.init_state, tree=self.tree), params)
        pg, sg = self.tree.split_groups(params), self.tree.split_groups(param_shardings)
        default = NamedSharding(self.mesh, P(), memory_kind=jax.tree.leaves(param_shardings)[0].memory_kind)
        return {name: S.follow_params(state, pg[name], sg[name], default) for name, state in abstract.items()}

    # ------------------------------------------------------------------ batches and step inputs

    def shard_batch(self, batch: dict) -> dict:
        """Host batch {key: [GA, dp*mb, len]} -> device arrays split over dp.

        With several processes each one reads the same global batch (same seed and
        position) and places only the rows of its own devices.
        """
        return {k: S.put_global(v, self.batch_sharding) for k, v in batch.items() if k in self.family.batch_keys}

    def abstract_batch(self) -> dict:
        """ShapeDtypeStructs of one global batch as the loader builds it (packed rows carry positions)."""
        shape = self.steps.batch
        return {k: jax.ShapeDtypeStruct(shape + (n,), jnp.int32, sharding=self.batch_sharding)
                for k, n in self.steps.batch_lengths}

    def loss_scale_input(self, loss_scale: float | None = None) -> jax.Array:
        """A step's loss scale as the step programs take it: a float32 scalar replicated over the mesh (an input, so
        that a new scale compiles nothing); the config's static scale when None."""
        value = self.steps.loss_scale if loss_scale is None else loss_scale
        return jax.device_put(jnp.asarray(value, jnp.float32), self.replicated)

    def clip_norm_input(self, clip_norm: float | None) -> jax.Array | None:
        """The norm a step clips with in place of its own: under ``execution.update_in_backward`` the previous
        step's (None or 0: no clipping), as a replicated float32 scalar; otherwise None (the step's own norm)."""
        if not self.steps.update_in_backward:
            return None
        return jax.device_put(jnp.asarray(clip_norm or 0.0, jnp.float32), self.replicated)

    def learning_rate(self, step: int) -> float:
        return self.updater.learning_rate(step)

