"""The fused executor: every phase of a training step composed into one compiled program.

Weights, optimizer state and activations stay on the devices. Per device (``shard_map``): the
RTS all-gather of every weight, once; the cast to the compute dtype, once; then batch
serialisation, a ``lax.scan`` over the micro-batches, each running the phase library's
composition of the model (``PhaseBodies.loss``: embeddings, layers, encoder head, head with the
loss) and its gradient, accumulated in float32 (the layers' matmul weights inside their
weight-gradient GEMMs, ``phases.with_accumulators``); then one reduce-scatter of the gradients into
their storage layout. The optimizer phase follows in the same program, one weight group at a
time (``optim.update_group``, vmapped over the layers of a stack).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from graphs.phases import PhaseBodies, accumulate, micro_key
from graphs.plan import TrainingPlan
from graphs.state import TrainState, restore_train_state, step_key
from modelling import lora
from modelling.params import init_params
from partitioning import sharding as S
from partitioning.base import base_record, device_base, fingerprint, restore_base
from partitioning.memory import live_device_bytes, program_bytes
from partitioning.sharding import shard_bytes


class FusedExecutor:
    """All phases in one compiled step (fastest when the model fits on the devices)."""

    name = "fused"

    def __init__(self, graphs):
        self.g = graphs
        self.bodies = PhaseBodies(graphs.opts, S.TP, graphs.family, graphs.model_tree)
        self._step = None
        self._loss_and_grads = None
        self.frozen = None  # LoRA: the frozen base weights (compute dtype, RTS layout), an input of every step
        self.base = None  # LoRA: where the base comes from and its fingerprint (partitioning/base.py), as checkpoints say

    def set_base(self, params=None) -> None:
        """LoRA: the frozen base weights: None (the family's random init), host (numpy) weights, or arrays in the
        full model's layout (cast to the frozen dtypes and placed on the devices)."""
        g = self.g
        if params is not None and params is self.frozen:
            return
        if params is None:
            self.frozen = g.init_base()
        elif not isinstance(jax.tree.leaves(params)[0], jax.Array):
            self.frozen = g.shard_base(params)
        else:
            self.frozen = jax.jit(g.frozen, out_shardings=g.base_shardings)(params)

    def base_fingerprint(self) -> str:
        """LoRA: partitioning/base.py's ``fingerprint`` of the frozen base."""
        return fingerprint(self.frozen)

    def use_base(self, source: dict) -> None:
        """LoRA: the frozen base a ``base_source`` names (partitioning/base.py) on the devices, and ``base``, its record."""
        self.set_base(device_base(self.g, source))
        self.base = base_record(source, self.base_fingerprint())

    # ------------------------------------------------------------------ state

    def init_state(self, params=None) -> TrainState:
        """Weights (None: the random init; numpy on the host; or arrays in their layout) with a fresh
        optimizer state. LoRA: params are the base's (None: the base already set, or the random init), and the
        trained weights new adapters."""
        g = self.g
        if g.lora:
            if params is not None or self.frozen is None:
                self.set_base(params)
            params = None
        if params is None:
            params = g.init_params()
        elif not isinstance(jax.tree.leaves(params)[0], jax.Array):
            params = g.shard_params(params)
        return TrainState(jax.device_put(jnp.zeros((), jnp.int32), g.replicated), params, self._fresh_opt(params))

    def _fresh_opt(self, params):
        g = self.g
        return jax.jit(lambda p: g.updater.init_state(p, g.tree), out_shardings=g.opt_state_shardings(params))(params)

    def restore(self, directory: str, step: int, optim_state: bool = True):
        """(state, meta) of a checkpoint, restored into this executor's layout (LoRA: its adapters; the base is
        ``set_base``'s)."""
        state, meta = restore_train_state(self.g, directory, step, optim_state)
        if state.opt_state is None:  # saved without optimizer state: start it afresh
            return TrainState(jax.device_put(jnp.asarray(meta["step"], jnp.int32), self.g.replicated),
                              state.params, self._fresh_opt(state.params)), meta
        return state, meta

    def warm_start(self, directory: str, step: int) -> TrainState:
        """A new run's state from a checkpoint's weights: step 0 and a fresh optimizer state (LoRA: new adapters on
        the checkpoint's weights, frozen)."""
        if self.g.lora:
            return self.init_state(restore_base(self.g, directory, step))
        return self.init_state(restore_train_state(self.g, directory, step, optim_state=False)[0].params)

    def weights(self, state: TrainState) -> dict:
        """The model's weights as a decoding program reads them (stacked; LoRA: the adapters merged into the base)."""
        if not self.g.lora:
            return state.params
        merge = lambda b, a: lora.merged(b, a, self.g.opts)  # noqa: E731
        return jax.jit(merge, out_shardings=self.g.base_shardings)(self.frozen, state.params)

    def to_checkpoint(self, state: TrainState) -> TrainState:
        return state

    def state_shardings(self, state: TrainState) -> TrainState:
        g = self.g
        return TrainState(g.replicated, g.param_shardings, g.opt_state_shardings(state.params))

    # ------------------------------------------------------------------ the step

    def _local_loss_and_grads(self, params, batch, rng_data, scale, frozen=None):
        """Per-device body: gather weights, scan micro-batches, reduce-scatter gradients. ``scale``: the loss scale
        (a float32 scalar: changing it compiles nothing). LoRA: ``params`` are the adapters, ``frozen`` the base."""
        lay, opts = self.g.layouts, self.g.opts
        full = S.gather_all(params, lay)
        count = jax.lax.psum(jnp.sum(batch["labels"] != -100), S.DP).astype(jnp.float32)
        if self.g.lora:
            return self._local_lora(full, S.gather_all(frozen, self.g.base_layouts), batch, rng_data, scale, count)
        base = None
        if opts.dropout_prob > 0:
            # same key on every tp device (identical activations), distinct per dp replica
            base = jax.random.fold_in(jax.random.wrap_key_data(rng_data), jax.lax.axis_index(S.DP))

        # Weights are cast to the compute dtype once per step, not once per micro-batch; the
        # gradient of each micro-batch is taken with respect to that copy (the same values as
        # through the cast) and accumulated in float32.
        compute = self.bodies.cast(full)
        tree = self.g.tree
        zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), full)  # float32 whatever the master dtype
        if opts.unroll_layers:
            # Unrolled layers get their weights and accumulators as one buffer per layer, split once per
            # step: slicing layer i out of the stacked weights in every micro-batch copies it, and the
            # layers' gradients would be concatenated into the stacked tree in every micro-batch.
            compute, zeros = tree.unstack_layers(compute), tree.unstack_layers(zeros)

        def micro(acc, inputs):
            mb, i = inputs
            # the layers' matmul gradients are added to their accumulators inside the weight-gradient
            # GEMMs; the rest (norms, embeddings, relative positions) after
            loss, grads = jax.value_and_grad(
                lambda p: self.bodies.loss(p, mb, micro_key(base, i)) * (scale / count))(
                    self.bodies.accumulating_layers(compute, acc))
            return accumulate(acc, grads), loss

        n = batch["labels"].shape[0]
        grads, losses = jax.lax.scan(micro, zeros, (batch, jnp.arange(n)))
        if opts.unroll_layers:
            grads = tree.stack_layers(grads)
        grads = jax.tree.map(lambda g, l: S.reduce_gradient(g, l) / scale, grads, lay)
        loss = jax.lax.psum(jnp.sum(losses), S.DP) / scale
        return loss, grads

    def _local_lora(self, adapters, base, batch, rng_data, scale, count):
        """LoRA's body: the gradient of the adapters alone (the base, frozen, is a constant of the loss: no gradient
        of it is formed), accumulated over the micro-batches in float32, reduce-scattered like any weight's."""
        opts, lay = self.g.opts, self.g.layouts
        key = None
        if opts.dropout_prob > 0 or opts.lora_dropout > 0:
            key = jax.random.fold_in(jax.random.wrap_key_data(rng_data), jax.lax.axis_index(S.DP))

        def micro(acc, inputs):
            mb, i = inputs
            loss, grads = jax.value_and_grad(
                lambda a: self.bodies.loss(lora.combine(base, a), mb, micro_key(key, i)) * (scale / count))(adapters)
            return accumulate(acc, grads), loss

        zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), adapters)
        grads, losses = jax.lax.scan(micro, zeros, (batch, jnp.arange(batch["labels"].shape[0])))
        grads = jax.tree.map(lambda g, l: S.reduce_gradient(g, l) / scale, grads, lay)
        return jax.lax.psum(jnp.sum(losses), S.DP) / scale, grads

    def _sharded_loss_and_grads(self, batch_keys):
        specs = S.storage_specs(self.g.layouts)
        batch_spec = {k: P(None, S.DP, None) for k in batch_keys}
        lora_on = self.g.lora
        frozen = (S.storage_specs(self.g.base_layouts),) if lora_on else ()
        fn = jax.shard_map(self._local_loss_and_grads, mesh=self.g.mesh,
                           in_specs=(specs, batch_spec, P(), P(), *frozen), out_specs=(P(), specs), check_vma=False)
        return lambda p, b, r, s, f=None: fn(p, b, r, s, *((f,) if lora_on else ()))  # f: LoRA's frozen base

    def loss_and_grads(self, state: TrainState, batch, rng_data=None, loss_scale=None):
        """(mean token loss, float32 gradients in the stacked RTS layout, unscaled) of one global batch; the state is
        not changed. ``rng_data``: the step's key data (``step_key`` of the state's step when None)."""
        rng_data = step_key(self.g.steps.seed, state.step) if rng_data is None else rng_data
        if self._loss_and_grads is None:
            self._loss_and_grads = jax.jit(
                lambda p, b, r, s, f: self._sharded_loss_and_grads(tuple(b))(p, b, r, s, f))
        return self._loss_and_grads(state.params, batch, rng_data, self.g.loss_scale_input(loss_scale), self.frozen)

    def update(self, params, opt_state, grads, rng_data=None, clip_norm=None):
        """The optimizer phase: every weight group clipped with the global norm (or ``clip_norm``: the previous
        step's under ``execution.update_in_backward``) and updated -> (params, state, norm). With stochastic
        rounding, rng_data (the step's key data) seeds each group's rounding."""
        g_norm = optax.global_norm(grads)
        tree, updater = self.g.tree, self.g.updater
        pg, gg = tree.split_groups(params), tree.split_groups(grads)
        new_p, new_s = {}, {}
        for name in pg:
            if not jax.tree.leaves(pg[name]):  # a group with no weights (LoRA's adapters have no "small" group)
                new_p[name], new_s[name] = pg[name], opt_state[name]
                continue
            new_p[name], new_s[name] = updater.update(name, pg[name], opt_state[name], gg[name], g_norm, rng_data,
                                                      stacked=tree.is_layer_group(name), clip_norm=clip_norm)
        return tree.merge_groups(new_p), new_s, g_norm

    def _step_fn(self, state: TrainState, batch, rng_data, loss_scale, clip_norm=None, frozen=None):
        loss, grads = self._sharded_loss_and_grads(tuple(batch))(state.params, batch, rng_data, loss_scale, frozen)
        params, opt_state, g_norm = self.update(state.params, state.opt_state, grads, rng_data, clip_norm)
        return TrainState(state.step + 1, params, opt_state), {"loss": loss, "grad_norm": g_norm}

    def train_step_program(self, state: TrainState):
        """The fused step as a jitted function (state, batch, rng_data, loss scale) -> (state, metrics); the state is
        donated. ``.lower(...)`` on it gives XLA's cost and memory analyses. A step whose gradients overflow (a
        non-finite norm) leaves the weights and optimizer state as they were (``optim.update_group``)."""
        if self._step is None:
            self._step = jax.jit(self._step_fn, donate_argnums=(0,),
                                 out_shardings=(self.state_shardings(state), self.g.replicated))
        return self._step

    def plan(self, exact: bool = False) -> TrainingPlan:
        """The memory plan of this executor's runs (graphs/plan.py): the step's state and batch, and with ``exact``
        XLA's count of its temporaries (the step compiled from shapes); else a lower bound (state, gradient
        accumulator, weights cast to the compute dtype)."""
        g = self.g
        params = g.abstract_params()
        opt = jax.eval_shape(lambda p: g.updater.init_state(p, g.tree), params)
        opt_sh = g.opt_state_shardings(params)
        batch = g.abstract_batch()
        items = {"weights": _per_device(params, g.param_shardings), "optimizer state": _per_device(opt, opt_sh),
                 "batch": sum(shard_bytes(b.shape, b.dtype, b.sharding) for b in batch.values())}
        frozen = None
        if g.lora:  # the frozen base, in the compute dtype, beside the adapters ("weights")
            frozen = jax.eval_shape(lambda k: g.frozen(init_params(g.base_specs, k)), jax.random.key(0))
            frozen = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), frozen,
                                  g.base_shardings)
            items["frozen base weights"] = _per_device(frozen, g.base_shardings)
        notes = []
        if exact:
            struct = lambda t, sh: jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),  # noqa: E731
                                                t, sh)
            state = TrainState(jax.ShapeDtypeStruct((), jnp.int32, sharding=g.replicated),
                               struct(params, g.param_shardings), struct(opt, opt_sh))
            rng = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=g.replicated)
            scale = jax.ShapeDtypeStruct((), jnp.float32, sharding=g.replicated)
            analysis = self.train_step_program(state).lower(state, batch, rng, scale, g.clip_norm_input(None),
                                                            frozen).compile().memory_analysis()
            items["step temporaries (gradients, activations)"] = analysis.temp_size_in_bytes
            items["step outputs"] = max(analysis.output_size_in_bytes - analysis.alias_size_in_bytes, 0)
        else:
            # the float32 gradient accumulator and the compute-dtype copy of the weights, both tp-sharded
            tp_bytes = sum(shard_bytes(x.shape, x.dtype, NamedSharding(g.mesh, lay.compute_spec))
                           for x, lay in zip(jax.tree.leaves(params), jax.tree.leaves(g.layouts, is_leaf=S.is_layout)))
            items["gradient accumulator"] = tp_bytes
            if g.opts.compute_dtype != jnp.float32:
                items["weights in the compute dtype"] = tp_bytes // 2
            notes.append("activations not counted: --plan compiles the step and counts them")
        return TrainingPlan("fused", sum(items.values()), "training step", items, 0, "no host-resident state", {}, exact,
                          notes)

    def memory_report(self, state: TrainState, batch: dict) -> tuple:
        """(state, device bytes of the step: live device arrays plus the compiled step's temporaries and outputs
        (XLA's memory analysis), None); nothing is run."""
        rng = jax.random.key_data(jax.random.key(0))
        analysis = self.train_step_program(state).lower(state, batch, rng, self.g.loss_scale_input(),
                                                        self.g.clip_norm_input(None), self.frozen).compile().memory_analysis()
        return state, program_bytes(analysis, max(live_device_bytes().values() or [0])), None

    def timing_report(self, state: TrainState, batch: dict) -> tuple:
        """(state, None): one program, nothing to time apart (the profiler splits it: finetuning.py --profile)."""
        return state, None

    def train_step(self, state: TrainState, batch: dict, rng_data=None, loss_scale=None, clip_norm=None):
        """One optimizer step on one global batch -> (state, metrics). ``loss_scale``: this step's (the config's
        static scale when None). ``clip_norm``: under ``execution.update_in_backward``, the norm to clip with (the
        previous step's; None or 0: no clipping), as the phased executor does; otherwise ignored."""
        if rng_data is None:
            rng_data = step_key(self.g.steps.seed, state.step)
        return self.train_step_program(state)(state, batch, rng_data, self.g.loss_scale_input(loss_scale),
                                              self.g.clip_norm_input(clip_norm), self.frozen)



def _per_device(tree, shardings) -> int:
    return sum(shard_bytes(x.shape, x.dtype, s) for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)))
