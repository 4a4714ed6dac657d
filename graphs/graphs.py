"""The Graphs builder: mesh, layouts and the compiled programs of one config.

Programs (all run under ``shard_map`` over the ('dp', 'tp') mesh, with the
Megatron collectives of modelling/tp.py written explicitly):

- ``loss_and_grads``: RTS all-gather of the weights once, then batch
  serialisation (``lax.scan`` over ``gradient_accumulation`` micro-batches,
  gradients accumulated inside), then one reduce-scatter of the gradients.
- ``train_step`` (the fused executor): ``loss_and_grads`` + the optimizer
  phase (optax on the RTS shards) in one compiled step.
- per-phase programs ``embeddings``, ``t5_block``, ``encoder_head`` and
  ``head`` (loss and its gradient): one micro-batch, gathered weights; the
  phased executor (graphs/phased.py) builds its programs from the same phase
  functions of modelling/t5.py, with the RTS gathers and batch serialisation
  inside each phase.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from graphs import sharding as S
from graphs.optim import learning_rate_schedule, make_optimizer
from modelling import t5
from modelling.decoding import generate, generate_uncached
from modelling.params import init_params, param_specs, zero_padded_vocab

BATCH_KEYS = ("input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "labels")


@jax.tree_util.register_dataclass
@dataclass
class TrainState:
    """Everything a step changes: step counter, weights and optimizer state (RTS-sharded)."""

    step: jax.Array
    params: Any
    opt_state: Any


class Graphs:
    """Builds the mesh, the weight layouts and the programs of a config."""

    def __init__(self, cfg, mesh=None):
        self.cfg = cfg
        ex = cfg.execution
        self.dp, self.tp = ex.data_parallel, ex.tensor_parallel
        self.mesh = mesh if mesh is not None else S.make_mesh(self.dp, self.tp)
        self.opts = t5.ModelOptions.from_config(cfg)
        self.specs = param_specs(cfg.model, self.tp)
        self.layouts = S.layouts(self.specs, self.mesh, ex.rts)
        self.param_shardings = S.storage_shardings(self.layouts, self.mesh)
        self.replicated = NamedSharding(self.mesh, P())
        # batches are [gradient_accumulation, data_parallel * micro_batch_size, length]
        self.batch_sharding = NamedSharding(self.mesh, P(None, S.DP, None))
        # inference rows [dp * micro_batch_size, length]
        self.row_sharding = NamedSharding(self.mesh, P(S.DP, None))
        self.optimizer = None if cfg.model.eval else make_optimizer(cfg.training)
        self._train_step = None
        self._loss_and_grads = None
        self.phased = None  # a graphs.phased.PhasedExecutor when the driver runs phased (execution.phased)

    # ------------------------------------------------------------------ weights

    def init_params(self, seed: int | None = None) -> dict:
        """Random weights, created directly in their RTS layout."""
        key = jax.random.key(self.cfg.model.seed if seed is None else seed)
        vocab = self.cfg.model.embedding.vocab_size
        fn = jax.jit(lambda k: zero_padded_vocab(init_params(self.specs, k), vocab), out_shardings=self.param_shardings)
        return fn(key)

    def shard_params(self, host_params: dict, memory_kind: str | None = None) -> dict:
        """Places host (numpy) weights in their RTS layout (in host memory with ``memory_kind="pinned_host"``)."""
        shardings = self.param_shardings if memory_kind is None else S.with_memory_kind(self.param_shardings, memory_kind)
        return jax.tree.map(lambda x, s: S.put_global(np.asarray(x, np.float32), s), host_params, shardings)

    def opt_state_shardings(self, params) -> Any:
        """Shardings of the optimizer state: a leaf shaped like a weight follows that weight."""
        abstract = jax.eval_shape(self.optimizer.init, params)
        return S.follow_params(abstract, params, self.param_shardings, self.replicated)

    def init_state(self, params: dict) -> TrainState:
        opt_state = jax.jit(self.optimizer.init, out_shardings=self.opt_state_shardings(params))(params)
        return TrainState(jax.device_put(jnp.zeros((), jnp.int32), self.replicated), params, opt_state)

    def state_shardings(self, state: TrainState) -> TrainState:
        return TrainState(self.replicated, self.param_shardings, self.opt_state_shardings(state.params))

    # ------------------------------------------------------------------ batches

    def shard_batch(self, batch: dict) -> dict:
        """Host batch {key: [GA, dp*mb, len]} -> device arrays split over dp.

        With several processes each one reads the same global batch (same seed and
        position) and places only the rows of its own devices.
        """
        return {k: S.put_global(v, self.batch_sharding) for k, v in batch.items() if k in BATCH_KEYS}

    # ------------------------------------------------------------------ programs

    def _local_loss_and_grads(self, params, batch, rng_data):
        """Per-device body: gather weights, scan micro-batches, reduce-scatter gradients."""
        lay = self.layouts
        full = S.gather_all(params, lay)
        count = jax.lax.psum(jnp.sum(batch["labels"] != -100), S.DP).astype(jnp.float32)
        scale = self.cfg.execution.loss_scaling
        rng = None
        if self.opts.dropout_prob > 0:
            # same key on every tp device (identical activations), distinct per dp replica
            rng = jax.random.fold_in(jax.random.wrap_key_data(rng_data), jax.lax.axis_index(S.DP))

        # Weights are cast to the compute dtype once per step, not once per micro-batch; the
        # gradient of each micro-batch is taken with respect to that copy (the same values as
        # through the cast) and accumulated in float32.
        compute = t5.cast_params(full, self.opts.compute_dtype)

        def micro(acc, inputs):
            mb, i = inputs
            r = None if rng is None else jax.random.fold_in(rng, i)
            loss, g = jax.value_and_grad(
                lambda p: t5.loss_sum(p, mb, self.opts, S.TP, r) * (scale / count))(compute)
            return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g), loss

        zeros = jax.tree.map(jnp.zeros_like, full)
        n = batch["labels"].shape[0]
        grads, losses = jax.lax.scan(micro, zeros, (batch, jnp.arange(n)))
        grads = jax.tree.map(lambda g, l: S.reduce_gradient(g, l) / scale, grads, lay)
        loss = jax.lax.psum(jnp.sum(losses), S.DP) / scale
        return loss, grads

    def _sharded_loss_and_grads(self, batch_keys):
        specs = S.storage_specs(self.layouts)
        batch_spec = {k: P(None, S.DP, None) for k in batch_keys}
        return jax.shard_map(self._local_loss_and_grads, mesh=self.mesh,
                             in_specs=(specs, batch_spec, P()), out_specs=(P(), specs), check_vma=False)

    def loss_and_grads(self, params, batch, rng_data=None):
        """(mean token loss, gradients in the RTS layout) of one global batch."""
        rng_data = jax.random.key_data(jax.random.key(0)) if rng_data is None else rng_data
        if self._loss_and_grads is None:
            self._loss_and_grads = jax.jit(
                lambda p, b, r: self._sharded_loss_and_grads(tuple(b))(p, b, r))
        return self._loss_and_grads(params, batch, rng_data)

    def _optimizer(self, params, opt_state, grads):
        """Optimizer phase body: optax on the RTS shards (elementwise, so each device updates its own)."""
        updates, opt_state = self.optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    def optimizer_phase(self):
        """The optimizer phase as its own program: (params, opt_state, grads) -> (params, opt_state)."""
        return jax.jit(self._optimizer)

    def _step(self, state: TrainState, batch, rng_data):
        loss, grads = self._sharded_loss_and_grads(tuple(batch))(state.params, batch, rng_data)
        params, opt_state = self._optimizer(state.params, state.opt_state, grads)
        metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
        return TrainState(state.step + 1, params, opt_state), metrics

    def train_step_program(self, state: TrainState):
        """The fused step as a jitted function (state, batch, rng_data) -> (state, metrics); the state is
        donated. ``.lower(...)`` on it gives XLA's cost and memory analyses."""
        if self._train_step is None:
            shardings = self.state_shardings(state)
            self._train_step = jax.jit(self._step, donate_argnums=(0,),
                                       out_shardings=(shardings, self.replicated))
        return self._train_step

    def train_step(self, state: TrainState, batch: dict, rng_data=None):
        """Fused executor: one optimizer step on one global batch -> (state, metrics)."""
        if rng_data is None:
            rng_data = jax.random.key_data(jax.random.fold_in(jax.random.key(self.cfg.model.seed), state.step))
        return self.train_step_program(state)(state, batch, rng_data)

    def learning_rate(self, step: int) -> float:
        o = self.cfg.training.optimizer
        return float(learning_rate_schedule(o.learning_rate.maximum, o.learning_rate.warmup_steps)(step))

    # ------------------------------------------------------------------ per-phase programs

    def phase(self, fn, in_specs, out_specs):
        """Compiles a per-device phase function under shard_map on this mesh."""
        return jax.jit(jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    def compute_specs(self) -> dict:
        """tp-only specs of the weights (after the RTS gather)."""
        return jax.tree.map(lambda l: l.compute_spec, self.layouts, is_leaf=S.is_layout)

    def gather_params(self, params: dict) -> dict:
        """RTS all-gather of all weights (the phase-program inputs)."""
        specs, cspecs = S.storage_specs(self.layouts), self.compute_specs()
        fn = self.phase(lambda p: S.gather_all(p, self.layouts), (specs,), cspecs)
        return fn(params)

    def embeddings_phase(self):
        """shared [V, d] (tp over V), ids [B, l] (dp) -> float32 [B, l, d] (dp)."""
        opts = self.opts
        return self.phase(lambda w, ids: t5.embeddings(w, ids, opts, S.TP),
                          (P(S.TP, None), P(S.DP, None)), P(S.DP, None, None))

    def t5_block_phase(self, decoder: bool):
        """One layer's weights (tp specs), x, bias, [enc_out, cross_bias] -> x: t5_block under shard_map."""
        opts = self.opts
        lspecs = jax.tree.map(lambda l: P(*l.tp_spec[1:]), self.layouts["decoder" if decoder else "encoder"]["layers"],
                              is_leaf=S.is_layout)
        act, bias = P(S.DP, None, None), P(S.DP, S.TP, None, None)
        if decoder:
            # self bias [1, h, l, l] (heads over tp); cross bias [b, 1, 1, k] (padding only)
            return self.phase(lambda p, x, b, e, cb: t5.t5_block(p, x, b, opts, S.TP, e, cb),
                              (lspecs, act, P(None, S.TP, None, None), act, P(S.DP, None, None, None)), act)
        return self.phase(lambda p, x, b: t5.t5_block(p, x, b, opts, S.TP), (lspecs, act, bias), act)

    def encoder_head_phase(self):
        opts = self.opts
        return self.phase(lambda w, x: t5.encoder_head(w, x, opts), (P(), P(S.DP, None, None)), P(S.DP, None, None))

    def generate_phase(self, max_new_tokens: int, eos_id: int = 1, cached: bool = True):
        """Greedy decoding: (gathered weights, ids [B, k], mask [B, k]) -> tokens [B, max_new_tokens].

        Rows split over dp, weights over tp; ``cached=False`` runs the uncached reference.
        """
        opts, fn = self.opts, generate if cached else generate_uncached
        return self.phase(lambda p, ids, mask: fn(p, ids, mask, opts, max_new_tokens, S.TP, eos_id=eos_id),
                          (self.compute_specs(), P(S.DP, None), P(S.DP, None)), P(S.DP, None))

    def head_phase(self):
        """Final norm + LM head + vocab-sharded loss and its gradient w.r.t. the head weights and input."""
        opts = self.opts
        hspecs = {"decoder": {"final_norm": P()}}
        if "lm_head" in self.specs:
            hspecs["lm_head"] = P(None, S.TP)
        else:
            hspecs["shared"] = P(S.TP, None)

        def fn(hp, x, labels):
            loss, (g_hp, g_x) = jax.value_and_grad(
                lambda hp, x: t5.head(hp, x, labels, opts, S.TP), argnums=(0, 1))(hp, x)
            # the weight gradient sums over the dp replicas' rows; g_x stays per-row
            return jax.lax.psum(loss, S.DP), jax.tree.map(lambda g: jax.lax.psum(g, S.DP), g_hp), g_x

        return self.phase(fn, (hspecs, P(S.DP, None, None), P(S.DP, None)), (P(), hspecs, P(S.DP, None, None)))
