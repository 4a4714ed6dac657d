"""The phased executor's programs: each phase body of graphs/phases.py over all micro-batches.

A program loads nothing itself: its arguments are the RTS shards of its weights (already moved
from host memory by the schedule) and its activation rows. Inside (one ``shard_map``), it
all-gathers the weights once, casts them to the compute dtype once, gathers the activation rows
(RTS on activations), runs the body on every micro-batch (batch serialisation, ``lax.scan``),
and returns its outputs sliced again over tp, and its weight gradients reduce-scattered into
their storage layout with the sum of their squares (for global-norm clipping).

Gradients stay multiplied by the loss scale until the optimizer phase divides them (float16 gradients
kept in host memory would otherwise underflow); the head phase, where the scale enters, takes it as an
input, so a dynamic scale compiles nothing new.

Each program is compiled once and reused by every layer of its kind.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from graphs.host_state import row_sharding
from graphs.phases import PhaseBodies, accumulate, micro_key, stream_key
from modelling import lora
from modelling.family import Stack, leaf_name
from partitioning import sharding as S

F32 = jnp.float32
MICRO = P(None, S.DP, None)  # [GA, dp * micro_batch, length] token-level inputs


class PhasePrograms:
    """Compiled per-phase programs of one config (see the module docstring)."""

    def __init__(self, graphs):
        g = self.g = graphs
        self.opts = g.opts
        self.bodies = PhaseBodies(g.opts, S.TP, g.family, g.model_tree)
        # LoRA (modelling/lora.py): the weights the programs read are the frozen base's, each layer's with its
        # adapters beside them; gradients are the adapters' alone (``grad_layouts``)
        self.lora = g.lora
        model = g.base_layouts if g.lora else g.layouts
        row = lambda layers: jax.tree.map(lambda l: l.row(), layers, is_leaf=S.is_layout)  # noqa: E731
        self.rest_layouts = g.model_tree.split_rest(model)
        self.grad_layouts = {s: row(g.layouts[s]["layers"]) if s in g.tree.stacks else {}
                             for s in g.model_tree.stacks}
        self.row_layouts = {s: {**row(model[s]["layers"]), **self.grad_layouts[s]} if g.lora else self.grad_layouts[s]
                            for s in g.model_tree.stacks}
        self.rest_specs = S.storage_specs(self.rest_layouts)
        self.row_specs = {s: S.storage_specs(lay) for s, lay in self.row_layouts.items()}
        self.grad_specs = {s: S.storage_specs(lay) for s, lay in self.grad_layouts.items()}
        # RTS on activations: rows stored split over tp along d, gathered after loading
        self.act_tp = g.tp > 1 and g.opts.hidden_size % g.tp == 0
        self.act_spec = P(None, S.DP, None, S.TP if self.act_tp else None)
        # weight gradients leave the device in the compute dtype (they were summed over the
        # micro-batches in float32, and their norm taken, before that)
        self.grad_dtype = g.opts.compute_dtype
        # a compute-dtype copy of the trained weights beside their masters (graphs/phased.py): where they differ
        self.copy = (g.steps.compute_copy and not g.lora and g.updater is not None
                     and jnp.dtype(g.master_dtype) != jnp.dtype(g.opts.compute_dtype))
        self._cache: dict = {}

    # ------------------------------------------------------------------ helpers inside shard_map

    def _gather_act(self, x):
        return lax.all_gather(x, S.TP, axis=x.ndim - 1, tiled=True) if self.act_tp else x

    def _slice_act(self, y):
        if not self.act_tp:
            return y
        n = y.shape[-1] // lax.axis_size(S.TP)
        return lax.dynamic_slice_in_dim(y, lax.axis_index(S.TP) * n, n, axis=y.ndim - 1)

    def _base_key(self, rng_data):
        """Dropout key of this dp replica (the fused step's), or None without dropout."""
        if self.opts.dropout_prob <= 0 and not (self.lora and self.opts.lora_dropout > 0):
            return None
        return jax.random.fold_in(jax.random.wrap_key_data(rng_data), lax.axis_index(S.DP))

    def _reduce(self, grads, layouts):
        """Micro-batch sums of gradients -> storage layout (reduce-scatter over dp), still loss-scaled."""
        return jax.tree.map(lambda g, l: S.reduce_gradient(g, l), grads, layouts)

    def _cast(self, tree):
        return self.bodies.cast(tree)

    def _layer_weights(self, lp, row_lay):
        """One layer's weights as its body reads them: gathered (RTS) and cast to the compute dtype; LoRA's
        frozen base is kept in it already and its adapters compute in float32, as in the fused executor."""
        p = S.gather_all(lp, row_lay)
        return p if self.lora else self._cast(p)

    def _ctx(self, tree, stack: Stack) -> dict:
        """The stack's context weights (``{}`` for none) of a rest-shaped tree (layouts, specs)."""
        return {k: tree[stack.name][k] for k in stack.context}

    def _program(self, key, fn, in_specs, out_specs, donate=()):
        if key not in self._cache:
            self._cache[key] = jax.jit(jax.shard_map(fn, mesh=self.g.mesh, in_specs=in_specs, out_specs=out_specs,
                                                     check_vma=False), donate_argnums=donate)
        return self._cache[key]

    def _meta_specs(self, keys):
        return {k: MICRO for k in keys}

    # ------------------------------------------------------------------ embeddings

    def embeddings_fwd(self, stack: Stack):
        """(shared shards, ids [GA, B, l], rng) -> activation row [GA, B, l, d]."""
        lay = self.rest_layouts["shared"]

        def fn(shared, ids, rng_data):
            w, base = S.gather_weight(shared, lay).astype(self.opts.compute_dtype), self._base_key(rng_data)

            def body(_, inp):
                ids_i, i = inp
                y = self.bodies.embeddings(w, ids_i, stream_key(micro_key(base, i), stack.embed_stream))
                return None, self._slice_act(y)

            return lax.scan(body, None, (ids, jnp.arange(ids.shape[0])))[1]

        return self._program(("embeddings_fwd", stack.name), fn, (self.rest_specs["shared"], MICRO, P()),
                             self.act_spec)

    def embeddings_bwd(self, stack: Stack):
        """(shared shards, ids, dy row, rng) -> gradient of shared (storage layout)."""
        lay = self.rest_layouts["shared"]

        def fn(shared, ids, dy, rng_data):
            w = S.gather_weight(shared, lay).astype(self.opts.compute_dtype)
            dy, base = self._gather_act(dy), self._base_key(rng_data)

            def body(acc, inp):
                ids_i, dy_i, i = inp
                r = stream_key(micro_key(base, i), stack.embed_stream)
                _, vjp = jax.vjp(lambda w_: self.bodies.embeddings(w_, ids_i, r), w)
                return acc + vjp(dy_i)[0].astype(F32), None

            g = lax.scan(body, jnp.zeros(w.shape, F32), (ids, dy, jnp.arange(ids.shape[0])))[0]
            return self._reduce(g, lay)

        spec = self.rest_specs["shared"]
        return self._program(("embeddings_bwd", stack.name), fn, (spec, MICRO, self.act_spec, P()), spec)

    # ------------------------------------------------------------------ layers

    def _layer_inputs(self, stack: Stack, meta_keys):
        specs = [self.row_specs[stack.name], self._ctx(self.rest_specs, stack), self.act_spec]
        if stack.cross:
            specs.append(self.act_spec)  # the previous stack's output row
        return specs + [self._meta_specs(meta_keys)]

    def layer_fwd(self, stack: Stack, meta_keys: tuple):
        """(layer shards, context weight shards, x row[, previous stack's output row], meta, rng, j) -> the layer's
        output row."""
        row_lay, ctx_lay = self.row_layouts[stack.name], self._ctx(self.rest_layouts, stack)

        def fn(lp, ctx_w, x, *rest):
            enc, meta, rng_data, j = rest if stack.cross else (None, *rest)
            p, ctx_w = self._layer_weights(lp, row_lay), S.gather_all(ctx_w, ctx_lay)
            x, base = self._gather_act(x), self._base_key(rng_data)
            enc = None if enc is None else self._gather_act(enc)

            def body(_, inp):
                x_i, e_i, m_i, i = inp
                sc, cc = self.bodies.context(stack, ctx_w, m_i, x_i.shape[1])
                r = stream_key(micro_key(base, i), stack.layers_stream, j)
                return None, self._slice_act(self.bodies.block(stack, p, x_i, sc, cc, e_i, r))

            n = x.shape[0]
            return lax.scan(body, None, (x, enc if stack.cross else jnp.zeros((n,)), meta, jnp.arange(n)))[1]

        return self._program(("layer_fwd", stack.name, meta_keys), fn,
                             tuple(self._layer_inputs(stack, meta_keys) + [P(), P()]), self.act_spec)

    def layer_bwd(self, stack: Stack, meta_keys: tuple):
        """Backward of one layer over all micro-batches, recomputing its forward from its input row.

        no cross-attention: (layer, ctx, x, meta, dy, rng, j) -> (layer grads, their sum of squares, ctx grads, dx)
        cross-attention: (layer, ctx, x, enc, meta, dy, d_enc, rng, j) -> (..., dx, d_enc + this layer's part)
        where d_enc, the gradient of the previous stack's output, is summed over the layers on the device.
        """
        cross, frozen = stack.cross, self.lora
        row_lay, ctx_lay = self.row_layouts[stack.name], self._ctx(self.rest_layouts, stack)
        grad_lay = self.grad_layouts[stack.name]
        # LoRA: only the adapters are differentiated (block_backward), the frozen context weights get no gradient
        ctx_grad_lay = {} if frozen else ctx_lay

        def fn(lp, ctx_w, x, *rest):
            if cross:
                enc, meta, dy, d_enc, rng_data, j = rest
            else:
                (meta, dy, rng_data, j), enc, d_enc = rest, None, None
            p, ctx_w = self._layer_weights(lp, row_lay), S.gather_all(ctx_w, ctx_lay)
            x, dy, base = self._gather_act(x), self._gather_act(dy), self._base_key(rng_data)
            enc = None if enc is None else self._gather_act(enc)
            n = x.shape[0]
            trained = {k: p[k] for k in grad_lay} if frozen else p
            zeros = jax.tree.map(lambda w: jnp.zeros(w.shape, F32), (trained, {} if frozen else ctx_w))
            (g_p, g_ctx), (dx, de) = lax.scan(self._micro_backward(stack, p, ctx_w, base, j), zeros,
                                              (x, enc if cross else jnp.zeros((n,)), meta, dy, jnp.arange(n)))
            (g_p, sumsq), g_ctx = self._layer_grads(g_p, grad_lay), self._reduce(g_ctx, ctx_grad_lay)
            if cross:
                return g_p, sumsq, g_ctx, dx, d_enc + de.astype(d_enc.dtype)
            return g_p, sumsq, g_ctx, dx

        ins = self._layer_inputs(stack, meta_keys) + [self.act_spec]
        outs = [self.grad_specs[stack.name], P(), {} if self.lora else self._ctx(self.rest_specs, stack), self.act_spec]
        donate = ()
        if cross:
            ins.append(self.act_spec)
            outs.append(self.act_spec)
            donate = (6,)  # the running d_enc sum is updated in place
        return self._program(("layer_bwd", stack.name, meta_keys), fn, tuple(ins + [P(), P()]), tuple(outs), donate)

    def _micro_backward(self, stack: Stack, p: dict, ctx_w: dict, base, j):
        """``layer_bwd``'s scan body: one micro-batch's backward from the layer's input, its weight gradients added to
        the accumulators (layer, context weights; LoRA: the adapters' alone) -> (accumulators, (dx, d_enc part))."""
        cross, frozen = stack.cross, self.lora

        def body(acc, inp):
            x_i, e_i, m_i, dy_i, i = inp
            length = x_i.shape[1]
            # (self context, its vjp to the context weights, cross context): the cross context does not depend on
            # the context weights
            if frozen:
                (sc, cc), ctx_vjp = self.bodies.context(stack, ctx_w, m_i, length), None
            else:
                sc, ctx_vjp, cc = jax.vjp(lambda w_: self.bodies.context(stack, w_, m_i, length), ctx_w, has_aux=True)
            r = stream_key(micro_key(base, i), stack.layers_stream, j)
            acc_p, acc_ctx = acc
            if frozen:  # the adapters' gradients (the frozen weights' are None: never formed)
                g_p, dx, _, g_e = self.bodies.block_backward(stack, p, x_i, sc, cc, e_i, r, dy_i)
                acc = ({k: a + g_p[k].astype(F32) for k, a in acc_p.items()}, acc_ctx)
                return acc, (self._slice_act(dx), self._slice_act(g_e) if cross else jnp.zeros(()))
            # the matmul weights' gradients are added to acc_p inside their weight-gradient GEMMs
            g_p, dx, g_sc, g_e = self.bodies.block_backward(stack, self.bodies.with_accumulators(p, acc_p), x_i, sc,
                                                            cc, e_i, r, dy_i)
            if g_sc is not None:
                acc_ctx = jax.tree.map(lambda a, g: a + g.astype(F32), acc_ctx, ctx_vjp(g_sc)[0])
            return (accumulate(acc_p, g_p), acc_ctx), (self._slice_act(dx),
                                                       self._slice_act(g_e) if cross else jnp.zeros(()))

        return body

    def _layer_grads(self, g_p: dict, grad_lay: dict) -> tuple:
        """A layer's accumulated gradients -> (reduced over dp (RTS: scattered) in the gradient dtype, their sum of
        squares; inf when a float16 gradient overflowed as it was stored)."""
        g_p = self._reduce(g_p, grad_lay)
        sumsq = S.sum_of_squares(g_p, grad_lay) if g_p else jnp.zeros((), F32)
        g_p = jax.tree.map(lambda g: g.astype(self.grad_dtype), g_p)
        if self.grad_dtype == jnp.float16:  # a scaled gradient past 65504 is inf once stored: an overflow
            sumsq = sumsq + jnp.where(lax.psum(sum(jnp.sum(~jnp.isfinite(g)) for g in jax.tree.leaves(g_p)),
                                               (S.DP, S.TP)) > 0, jnp.inf, 0.0)
        return g_p, sumsq

    # ------------------------------------------------------------------ stack output and head

    def stack_output_fwd(self, stack: Stack):
        """(output norm shards, x row, rng) -> the stack's output row (T5: the encoder's final norm)."""
        lay, spec = self.rest_layouts[stack.name][stack.output], self.rest_specs[stack.name][stack.output]

        def fn(w, x, rng_data):
            w, x, base = S.gather_weight(w, lay), self._gather_act(x), self._base_key(rng_data)

            def body(_, inp):
                x_i, i = inp
                r = stream_key(micro_key(base, i), stack.output_stream)
                return None, self._slice_act(self.bodies.stack_output(stack, w, x_i, r))

            return lax.scan(body, None, (x, jnp.arange(x.shape[0])))[1]

        return self._program(("stack_output_fwd", stack.name), fn, (spec, self.act_spec, P()), self.act_spec)

    def stack_output_bwd(self, stack: Stack):
        """(output norm shards, x row, dy row, rng) -> (gradient of the norm, dx row)."""
        lay, spec = self.rest_layouts[stack.name][stack.output], self.rest_specs[stack.name][stack.output]

        def fn(w, x, dy, rng_data):
            w, x, dy, base = S.gather_weight(w, lay), self._gather_act(x), self._gather_act(dy), self._base_key(rng_data)

            def body(acc, inp):
                x_i, dy_i, i = inp
                r = stream_key(micro_key(base, i), stack.output_stream)
                _, vjp = jax.vjp(lambda w_, x_: self.bodies.stack_output(stack, w_, x_, r), w, x_i)
                g_w, dx = vjp(dy_i)
                return acc + g_w, self._slice_act(dx)

            g, dx = lax.scan(body, jnp.zeros_like(w), (x, dy, jnp.arange(x.shape[0])))
            return self._reduce(g, lay), dx

        return self._program(("stack_output_bwd", stack.name), fn, (spec, self.act_spec, self.act_spec, P()),
                             (spec, self.act_spec))

    def head(self):
        """Final norm + LM head + loss and its backward, in one phase as in the original:
        (head weights, x row, labels, rng, loss scale) -> (mean loss, head gradients, dx row), the gradients
        multiplied by the loss scale."""
        lay = self.g.model_tree.head_subtree(self.rest_layouts)
        specs = self.g.model_tree.head_subtree(self.rest_specs)
        stream = self.g.family.head_stream

        frozen = self.lora  # LoRA: the head's weights are frozen: the gradient of its input alone

        def fn(hp, x, labels, rng_data, scale):
            hp, x, base = self._cast(S.gather_all(hp, lay)), self._gather_act(x), self._base_key(rng_data)
            count = lax.psum(jnp.sum(labels != -100), S.DP).astype(F32)

            def body(acc, inp):
                x_i, lab_i, i = inp
                r = stream_key(micro_key(base, i), stream)
                if frozen:
                    loss, dx = jax.value_and_grad(
                        lambda x_: self.bodies.head_loss(hp, x_, lab_i, r) * (scale / count))(x_i)
                    return (acc[0], acc[1] + loss), self._slice_act(dx)
                loss, (g_hp, dx) = jax.value_and_grad(
                    lambda hp_, x_: self.bodies.head_loss(hp_, x_, lab_i, r) * (scale / count), argnums=(0, 1))(hp, x_i)
                acc_g, acc_l = acc
                return (jax.tree.map(lambda a, b: a + b.astype(F32), acc_g, g_hp), acc_l + loss), self._slice_act(dx)

            zeros = ({} if frozen else jax.tree.map(lambda w: jnp.zeros(w.shape, F32), hp), jnp.zeros((), F32))
            (g, loss), dx = lax.scan(body, zeros, (x, labels, jnp.arange(x.shape[0])))
            return lax.psum(loss, S.DP) / scale, self._reduce(g, {} if frozen else lay), dx

        return self._program(("head",), fn, (specs, self.act_spec, MICRO, P(), P()),
                             (P(), {} if frozen else specs, self.act_spec))

    # ------------------------------------------------------------------ optimizer

    def compute_copy(self, tree):
        """A tree of master weights -> their compute copy: each weight in the compute dtype, None where the family
        keeps it float32 (read from its master). As the programs cast: the same values as a cast on the device."""
        keep, dt = self.g.family.keeps_f32, self.opts.compute_dtype
        return jax.tree_util.tree_map_with_path(lambda p, x: None if keep(leaf_name(p)) else x.astype(dt), tree)

    def copy_program(self):
        """(master weights on the devices) -> their compute copy (``compute_copy``): made once, when a state is built
        or restored; each update writes the next one itself."""
        if "copy" not in self._cache:
            self._cache["copy"] = jax.jit(self.compute_copy)
        return self._cache["copy"]

    def optimizer(self, group: str, layer: bool = False):
        """(params, optimizer state, gradients, global norm, rng data, loss scale[, layer index j]) of one weight
        group (of one layer of a stack's group with ``layer``[, clip norm]) -> (params, state[, their compute copy,
        where one is kept: ``copy``]). The gradients arrive
        loss-scaled, the norm not; the clip norm, when given, replaces the norm for clipping
        (``execution.update_in_backward``). With stochastic rounding the key is the fused step's: ``optim.group_key``
        of the group, folded with j for a layer (``optim.Updater.update``). Weights and state are donated: their updated values take their place on the device."""
        key = ("optimizer", group, layer)
        if key not in self._cache:
            updater = self.g.updater

            def update(p, s, g, g_norm, rng_data, scale, j=None, clip_norm=None):
                # the schedule runs no optimizer program in a step whose norm is not finite (PhasedExecutor.train_step)
                p, s = updater.update(group, p, s, g, g_norm, rng_data, layer=j if layer else None, loss_scale=scale,
                                      clip_norm=clip_norm, skip_non_finite=False)
                return (p, s, self.compute_copy(p)) if self.copy else (p, s)

            self._cache[key] = jax.jit(update, donate_argnums=(0, 1))
        return self._cache[key]

    def merged_row(self, stack: str):
        """LoRA: (one layer's frozen weights beside its adapters, on the devices) -> its weights with the adapters
        folded in (``lora.merged``), in the base's layout: for decoding, one layer at a time."""
        key = ("merged_row", stack)
        if key not in self._cache:
            opts = self.g.opts
            out = jax.tree.map(lambda sh: row_sharding(sh, "device"), self.g.base_shardings[stack]["layers"])

            def merge(lp):
                one = lambda adapters: {stack: {"layers": {k: v[None] for k, v in lp.items()  # noqa: E731
                                                           if lora.is_adapter(k) == adapters}}}
                merged = lora.merged(one(False), one(True), opts)[stack]["layers"]
                return {k: v[0] for k, v in merged.items()}

            self._cache[key] = jax.jit(merge, out_shardings=out)
        return self._cache[key]

    @staticmethod
    @jax.jit
    def add(a, b):
        return jax.tree.map(jnp.add, a, b)

    @staticmethod
    @jax.jit
    def global_norm(sums_of_squares, scale):
        """The global gradient norm (unscaled) from every phase's sum of squares of loss-scaled gradients."""
        return jnp.sqrt(sum(sums_of_squares)) / scale

    def rest_sum_of_squares(self):
        """(non-layer gradients in their storage layout) -> their sum of squares over the whole mesh."""
        lay = self.rest_layouts
        return self._program(("rest_sum_of_squares",), lambda g: S.sum_of_squares(g, lay), (self.rest_specs,), P())


__all__ = ["PhasePrograms"]
