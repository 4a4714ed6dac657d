"""The phased executor: the original app's execution scheme, for models larger than device memory.

The state lives in host memory (graphs/host_state.py); a training step is a schedule of phase
programs (graphs/phase_programs.py), each loading its weights once and running every
micro-batch:

    forward    for each stack of the family (T5: encoder, then decoder; GPT-J: its one stack):
               embeddings, layers 0..L-1 (then the stack's output norm, for a stack that feeds
               the next one: T5's encoder)
    head       final norm + LM head + loss, and its backward, in one phase
    backward   for each stack in reverse: layers L-1..0, each recomputing its forward from its
               stored input (the output norm first, for a stack that has one), then the
               embeddings
    optimizer  the embedding, the LM head, the small weights, then one layer at a time:
               load weights, optimizer state and gradients, clip with the global norm, update, store

Transfers overlap compute: while layer j's program runs, layer j+1's weights are already
being loaded (``prefetch``), and layer j's gradients go back to host memory while layer j-1
computes (JAX dispatches both asynchronously; on a GPU copies run beside the compute stream).
The host runs at most one program ahead (``DeviceOps``): a load waits for the last program
dispatched, so no more than the two layers the plan counts are ever on the device.

What a step moves over the host link is counted as it moves (graphs/transfers.py) and equals the
floor of its layout: the forward and the backward read each weight in the compute dtype (a copy
kept beside the float32 master, written by each update: ``execution.compute_copy``), the update
reads and writes the master and the optimizer state once, and under ``update_in_backward`` the
backward reads the master it updates and no layer gradient goes to host memory.

Activation buffers, in host memory, one per stack, each row [GA, batch, length, d] sharded over
dp and over tp on d (RTS on activations); for T5:

    x_buffer       0: encoder embeddings, 1..L: encoder layer outputs (L+1, the encoder
                   output, stays on the device while the decoder needs it)
    x_dec_buffer   0: decoder embeddings, 1..L-1: decoder layer outputs (L goes to the head)

A row is freed once its layer's backward has read it. Gradients of activations never leave
the device: each is read only by the next phase of the backward (the original stored them in
remote buffers because an IPU held far less); the gradient of the encoder output is summed over
the decoder layers on the device. What stays float32: the activation rows (the residual stream:
the backward recomputes each layer from exactly the forward's input) and the gradients of
activations (the residual path sums every layer's contribution). Weight gradients are summed
over micro-batches in float32 on the device, their squares summed there for the global norm,
and stored in the compute dtype (bfloat16 halves their host memory and transfers).

Device memory then holds about two layers' weights (one computing, one arriving), one phase's
activations and the small non-layer gradients. The per-layer programs are compiled once and
reused by every layer. Numerically the result equals the fused executor (tests/graphs/test_phased.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from graphs import phased_reports
from graphs.host_state import ActivationBuffer, PhasedState, row_sharding
from graphs.phase_ops import DeviceOps, prefetch, serial_collectives
from graphs.phase_programs import PhasePrograms
from graphs.phased_state import PhasedStates
from graphs.phases import context_weights, stack_meta
from graphs.plan import TrainingPlan
from graphs.state import step_key
from modelling import lora
from modelling.family import leaf_name
from partitioning.tree import flat_paths, from_flat

F32 = jnp.float32


@dataclass
class _Step:
    """What one step's forward and backward phases share: the state, the batch and each stack's metadata, the
    weights the forward loaded (``w``: the embedding, each stack's context weights and output norm), the step's key
    and loss scale, and what the backward gathers: the non-layer gradients by weight path (``g_flat``), each
    layer's sum of squares, the layers' gradients stored in host memory, or each layer updated in their place
    (``update_layer``)."""

    ps: PhasedState
    batch: dict
    meta: dict
    rng_data: Any
    scale: Any
    update_layer: Optional[Callable] = None
    w: dict = field(default_factory=dict)
    g_flat: dict = field(default_factory=dict)
    sumsq: list = field(default_factory=list)
    layer_grads: dict = field(default_factory=dict)


@dataclass
class _Update:
    """What a step's optimizer phases share: the gradient norm to clip with, the key, the loss scale, the norm
    given to a layer's update as its clip (``update_in_backward``: the previous step's; else None) and the updated
    layers, their optimizer states and compute copies ({"layers"|"opt"|"copy": {stack: [tree]}})."""

    g_norm: Any
    rng_data: Any
    scale: Any
    clip_norm: Any
    new: dict


class PhasedExecutor(PhasedStates):
    """Runs a training step phase by phase with host-resident weights, optimizer state and activations. Its jobs
    apart: the state's lifecycle and LoRA's frozen base (``PhasedStates``, graphs/phased_state.py), the step's
    schedule (here: each step's phases share a ``_Step``, its optimizer phases an ``_Update``), and its plan and
    reports (graphs/phased_reports.py).

    ``ops``: what the schedule runs on: ``DeviceOps`` (arrays; the default), ``TimingOps`` (each transfer and
    program waited for and timed), or graphs/plan.py's ``PlanOps`` (placeholders: the memory plan)."""

    name = "phased"

    def __init__(self, graphs, ops=None):
        g = self.g = graphs
        self.programs = PhasePrograms(g)
        self.mesh, self.depth = g.mesh, g.depths()  # {stack: layers}
        self.tree, self.stacks = g.tree, g.family.stacks  # tree: the trained weights' (LoRA: the adapters')
        self.lora = g.lora
        rows = lambda tree: jax.tree.map(lambda sh: row_sharding(sh, "device"), tree)  # noqa: E731
        # device shardings of what the schedule loads: the trained non-layer weights, one layer, their optimizer
        # states, and (LoRA) the frozen base's non-layer weights and layers, which the forward reads
        self.rest_dev = self.tree.split_rest(g.param_shardings)
        self.row_dev = {s: rows(g.param_shardings[s]["layers"]) for s in self.tree.stacks}
        if self.lora:
            self.read_rest_dev = g.model_tree.split_rest(g.base_shardings)
            self.base_row_dev = {s.name: rows(g.base_shardings[s.name]["layers"]) for s in self.stacks}
        else:
            self.read_rest_dev = self.rest_dev
        # LoRA: the frozen base in host memory ({non-layer weights}, {stack: [one tree per layer]}): set_base; it is
        # read by every forward and backward and never written; ``base``: its source and fingerprint
        self.frozen_rest = self.frozen_layers = self.base = None
        opt_dev = g.opt_state_shardings(g.abstract_params())
        self.opt_stacked = opt_dev  # {group: shardings}, layer groups stacked (checkpoint layout)
        self.opt_dev = {k: v for k, v in opt_dev.items() if not self.tree.is_layer_group(k)}
        self.opt_row_dev = {s: rows(opt_dev[s]) for s in self.tree.stacks}
        self.act_dev = NamedSharding(self.mesh, self.programs.act_spec)
        # the compute copy (execution.compute_copy): where the master dtype is not the compute dtype, each weight the
        # compute dtype changes (the family keeps its norms and tables float32) has a copy in it in host memory, which
        # the forward and the backward read; None marks a weight read from its master
        self.copy = self.programs.copy
        self.copy_rest_dev = self._copied(self.rest_dev)
        self.copy_row_dev = {s: self._copied(self.row_dev[s]) for s in self.tree.stacks}
        self.ops = ops if ops is not None else DeviceOps(serial_collectives(self.mesh))

    def _copied(self, shardings):
        """The shardings of the weights that have a compute copy (None where a weight is read from its master)."""
        keep = self.g.family.keeps_f32
        return jax.tree_util.tree_map_with_path(lambda p, s: None if keep(leaf_name(p)) else s, shardings)

    @staticmethod
    def _compute(master, copy):
        """The weights the forward and the backward read: each weight's compute copy, or its master where it has none
        (``copy`` None: no copies kept)."""
        return master if copy is None else jax.tree.map(lambda m, c: m if c is None else c, master, copy)

    def with_ops(self, ops) -> "PhasedExecutor":
        """This executor (its compiled programs and shardings shared) running its schedule on other ops."""
        other = copy.copy(self)
        other.ops = ops
        return other

    # ------------------------------------------------------------------ the step

    def loss_and_grads(self, ps: PhasedState, batch: dict, rng_data=None, loss_scale=None):
        """(mean token loss, float32 gradients in the stacked layout as numpy, unscaled) of one global batch; the
        state is not changed (the executor interface's, graphs/executor.py)."""
        rng_data = step_key(self.g.steps.seed, ps.step) if rng_data is None else rng_data
        scale = self.g.loss_scale_input(loss_scale)
        loss, g_rest, layer_grads, _ = self._forward_backward(ps, batch, rng_data, scale)
        as_np = lambda x: np.asarray(jax.device_get(x), np.float32) / np.float32(jax.device_get(scale))  # noqa: E731
        stacked = {s: jax.tree.map(lambda *r: np.stack([as_np(x) for x in r]), *layer_grads[s]) for s in layer_grads}
        return loss, self.tree.with_layers(jax.tree.map(as_np, g_rest), stacked)

    def _forward_backward(self, ps: PhasedState, batch: dict, rng_data, scale, update_layer=None):
        """Forward, head and backward phases -> (loss, non-layer gradients on the device, {stack: [layer gradients
        in host memory]}, global gradient norm). The gradients are multiplied by the loss scale ``scale`` (a float32
        scalar on the mesh), the norm is not.

        ``update_layer(stack, j, weights, gradients, sum of squares)``: when given, each layer is updated (weights on
        the device, a copy it may donate) right after its backward, in place of storing its gradients
        (``execution.update_in_backward``); the layer gradients returned are then None."""
        ops = self.ops
        ops.moved.phase = "forward"
        st = _Step(ps, batch, {s.name: stack_meta(s, batch) for s in self.stacks}, rng_data, scale, update_layer)
        # what the forward reads: the frozen base (LoRA), else the compute copies of the weights
        rest = self.frozen_rest if self.lora else self._compute(ps.rest, ps.copy_rest)
        rest_dev, label = self.read_rest_dev, "frozen base weights" if self.lora else "weights"
        st.w = {"shared": ops.load(rest["shared"], rest_dev["shared"], label=label),
                "ctx": {s.name: ops.load(context_weights(s, rest[s.name]), context_weights(s, rest_dev[s.name]),
                                         label=label) for s in self.stacks},
                "out": {s.name: ops.load(rest[s.name][s.output], rest_dev[s.name][s.output], label=label)
                        for s in self.stacks if s.output}}
        rows, x, enc_out = self._forward(st)
        ops.moved.phase = "head"
        hp = self._head_weights(rest, st.w, label)
        loss, g_head, dy = ops.run("head", self.programs.head(), hp, x, batch["labels"], rng_data, scale)
        del hp, x
        ops.moved.phase = "backward"
        st.g_flat = dict(zip(flat_paths(g_head), jax.tree.leaves(g_head)))  # {weight path: gradient} of the rest
        del g_head
        st.layer_grads = {s: [None] * self.depth[s] for s in self.tree.stacks}
        carry = {"dy": dy}  # the gradient flowing back, handed from phase to phase (no frame keeps an old one alive)
        del dy
        for stack in reversed(self.stacks):
            self._backward(st, stack, rows[stack.name], carry, enc_out)
            if stack.cross:
                enc_out = None
        st.w = None
        g_rest = from_flat(ps.rest, st.g_flat)  # the trained rest tree's structure
        if jax.tree.leaves(g_rest):  # (LoRA's adapters have no weights outside the layers)
            st.sumsq.append(ops.run("sum_of_squares", self.programs.rest_sum_of_squares(), g_rest))
        g_norm = ops.run("global_norm", self.programs.global_norm, st.sumsq, scale)
        return loss, g_rest, st.layer_grads, g_norm

    def _head_weights(self, rest, w: dict, label: str) -> dict:
        """The head phase's weights on the devices: those the forward loaded already (a head tied to the embedding
        reads ``shared``) as they are, the others loaded."""
        tree = self.g.model_tree
        on_device = {("shared",): w["shared"], **{(s, k): v for s, ctx in w["ctx"].items() for k, v in ctx.items()},
                     **{(s.name, s.output): w["out"][s.name] for s in self.stacks if s.output}}
        host, dev = tree.head_subtree(rest), tree.head_subtree(self.read_rest_dev)
        paths = flat_paths(host)
        load = [p for p in paths if p not in on_device]
        loaded = dict(zip(load, jax.tree.leaves(self.ops.load(
            [_leaf_at(host, p) for p in load], [_leaf_at(dev, p) for p in load], label=label))))
        return from_flat(host, {p: on_device[p] if p in on_device else loaded[p] for p in paths})

    def _forward(self, st: _Step) -> tuple:
        """Every stack forward, storing each layer's input row -> (activation buffers, the last stack's output,
        the output the cross-attending stack reads)."""
        ops, prog, depth = self.ops, self.programs, self.depth
        ps, batch, meta, w, rng_data = st.ps, st.batch, st.meta, st.w, st.rng_data
        rows = {s.name: ActivationBuffer(s.buffer, depth[s.name] + (1 if s.output else 0)) for s in self.stacks}
        enc_out = x = None  # the output of a stack that the next one attends to
        for stack in self.stacks:
            buf, keys = rows[stack.name], tuple(sorted(meta[stack.name]))
            x = ops.run("embeddings_fwd", prog.embeddings_fwd(stack), w["shared"], batch[stack.ids], rng_data)
            fwd = prog.layer_fwd(stack, keys)
            layer = lambda j, s=stack.name: self._load_layer(ps, s, j)  # noqa: E731
            for j, lp in prefetch(depth[stack.name], layer):
                buf[j] = self._store_act(x)  # this layer's input, read again by its backward
                extra = (enc_out,) if stack.cross else ()
                x = ops.run(f"{stack.name}_layer_fwd", fwd, lp, w["ctx"][stack.name], x, *extra, meta[stack.name],
                            rng_data, j)
                del lp
            if stack.output:
                buf[depth[stack.name]] = self._store_act(x)  # the output norm's input
                enc_out = ops.run(f"{stack.name}_output_fwd", prog.stack_output_fwd(stack), w["out"][stack.name], x,
                                  rng_data)
        return rows, x, enc_out

    def _backward(self, st: _Step, stack, buf, carry, enc_out) -> None:
        """One stack backward, its layers in reverse, from its activation rows ``buf``. ``carry``: {"dy": the
        gradient of the stack's output (its last layer's, or for a stack with an output norm that norm's), "d_enc":
        the gradient of the output a cross-attending stack read, summed over its layers on the device}; the
        non-layer gradients are added into ``st.g_flat``, the layers' stored (or each layer updated:
        ``st.update_layer``)."""
        ops, prog, name = self.ops, self.programs, stack.name
        ps, batch, meta, w, rng_data, g_flat = st.ps, st.batch, st.meta, st.w, st.rng_data, st.g_flat
        sumsq, layer_grads, update_layer = st.sumsq, st.layer_grads, st.update_layer
        depth, keys = self.depth[name], tuple(sorted(meta[name]))

        def add_grad(path, g):
            g_flat[path] = g if path not in g_flat else ops.run("add", prog.add, g_flat[path], g)

        if stack.output:  # the output norm, from the gradient of its output summed over the layers reading it
            g_norm_w, carry["dy"] = ops.run(f"{name}_output_bwd", prog.stack_output_bwd(stack), w["out"][name],
                                            self._load_act(buf.pop(depth)), carry.pop("d_enc"), rng_data)
            if not self.lora:  # (LoRA: the norm is frozen)
                add_grad((name, stack.output), g_norm_w)
        if stack.cross:
            carry["d_enc"] = ops.zeros(enc_out.shape, F32, self.act_dev)
        bwd, g_ctx = prog.layer_bwd(stack, keys), None
        # under update_in_backward each layer's master is loaded (and donated to its update), not its compute copy
        master = update_layer is not None
        layer = lambda j: self._load_layer(ps, name, j, master)  # noqa: E731
        for j, lp in prefetch(depth, layer, reverse=True):
            x = self._load_act(buf.pop(j))
            if stack.cross:
                g_lp, ss, g_c, carry["dy"], carry["d_enc"] = ops.run(
                    f"{name}_layer_bwd", bwd, lp, w["ctx"][name], x, enc_out, meta[name], carry.pop("dy"),
                    carry.pop("d_enc"), rng_data, j)
            else:
                g_lp, ss, g_c, carry["dy"] = ops.run(f"{name}_layer_bwd", bwd, lp, w["ctx"][name], x, meta[name],
                                                     carry.pop("dy"), rng_data, j)
            if name not in layer_grads:  # LoRA: a stack without adapters
                pass
            elif update_layer is None:
                layer_grads[name][j] = ops.store(g_lp, self.row_dev[name], label="weight gradients")
            else:
                update_layer(name, j, self._trained(lp), g_lp, ss)
            sumsq.append(ss)
            if stack.context and not self.lora:
                g_ctx = g_c if g_ctx is None else ops.run("add", prog.add, g_ctx, g_c)
            del lp, x, g_lp, g_c
        if self.lora:  # the context weights and the embedding are frozen: the gradient stops here
            del carry["dy"]
            return
        for k in stack.context:
            add_grad((name, k), g_ctx[k])
        add_grad(("shared",), ops.run("embeddings_bwd", prog.embeddings_bwd(stack), w["shared"], batch[stack.ids],
                                      carry.pop("dy"), rng_data))

    def _load_layer(self, ps, s: str, j: int, master: bool = False) -> dict:
        """Layer j of stack s on the device as the forward and the backward read it: its compute copy where one is
        kept, else its master; with ``master`` its master, to be donated to its update (update_in_backward). Under
        LoRA the frozen base's layer beside its adapters."""
        ops = self.ops
        if not self.lora:
            if master or not self.copy:
                return ops.load(ps.layers[s][j], self.row_dev[s], copy=master,
                                label="master weights" if master else "weights")
            return ops.load(self._compute(ps.layers[s][j], ps.copy_layers[s][j]), self.row_dev[s], label="weights")
        out = dict(ops.load(self.frozen_layers[s][j], self.base_row_dev[s], label="frozen base weights"))
        if s in ps.layers:
            out.update(ops.load(ps.layers[s][j], self.row_dev[s], copy=master,
                                label="master weights" if master else "weights"))
        return out

    def _trained(self, lp: dict) -> dict:
        """The trained part of a loaded layer (LoRA: its adapters)."""
        return {k: v for k, v in lp.items() if lora.is_adapter(k)} if self.lora else lp

    def _store_act(self, x):
        return self.ops.store(x, self.act_dev, label="activations")

    def _load_act(self, x):
        return self.ops.load(x, self.act_dev, label="activations")

    def train_step(self, ps: PhasedState, batch: dict, rng_data=None, loss_scale=None, clip_norm=None):
        """One optimizer step on one global batch, phase by phase -> (state, metrics). ``loss_scale``: this step's
        (the config's static scale when None). A step whose gradients overflow (a non-finite norm) leaves every
        weight and optimizer state as it was (``optim.update_group``). Under ``execution.update_in_backward`` each
        layer is updated right after its backward and clipped with ``clip_norm`` (the previous step's norm; None or
        0: no clipping), the rest of the weights at the end with the same norm.

        The input state is consumed (as the fused step donates its state): each layer's old
        weights and optimizer state are let go of as soon as their update is stored, so host
        memory never holds two copies of the model.
        """
        rng_data = step_key(self.g.steps.seed, ps.step) if rng_data is None else rng_data
        scale, stale = self.g.loss_scale_input(loss_scale), self.g.clip_norm_input(clip_norm)
        in_backward = self.g.steps.update_in_backward
        self.ops.moved.reset()
        # the updated layers: {stack: [weights]}, their optimizer states and compute copies
        new = {k: {s: [None] * self.depth[s] for s in self.tree.stacks} for k in ("layers", "opt", "copy")}
        in_step = _Update(stale, rng_data, scale, stale, new)  # (each layer clipped with the previous step's norm)

        def update_layer(s, j, p, gr, ss):
            """Layer j of stack s, right after its backward: its weights are on the device already. (The step's norm
            is not known yet: the update clips with the previous one, and the driver stops a run whose norm turns
            out not finite before anything of the step is saved.)"""
            st = self.ops.load(ps.opt_layers[s][j], self.opt_row_dev[s], copy=True, label="optimizer state")
            ps.layers[s][j] = ps.opt_layers[s][j] = None
            if ps.copy_layers is not None:
                ps.copy_layers[s][j] = None
            self._update_layer(in_step, s, j, p, st, gr)

        loss, g_rest, layer_grads, g_norm = self._forward_backward(ps, batch, rng_data, scale,
                                                                   update_layer if in_backward else None)
        metrics = {"loss": loss, "grad_norm": g_norm}
        if not in_backward and not self.ops.is_finite(g_norm):
            # an overflow (or a diverged step): no optimizer program runs, every weight and state stays as it was.
            # Reading the norm here waits for the backward; the optimizer phase needed the norm first anyway.
            return PhasedState(ps.step + 1, ps.rest, ps.layers, ps.opt, ps.opt_layers, ps.copy_rest,
                               ps.copy_layers), metrics
        self.ops.moved.phase = "optimizer"
        u = _Update(g_norm, rng_data, scale, None, new)
        new_rest, new_opt, new_copy = self._update_rest(ps, g_rest, u, stale)
        del g_rest
        if not in_backward:
            self._update_layers(ps, layer_grads, u)
        return PhasedState(ps.step + 1, new_rest, new["layers"], new_opt, new["opt"], new_copy,
                           new["copy"] if self.copy else None), metrics

    def _update_rest(self, ps, g_rest, u: _Update, stale) -> tuple:
        """The optimizer phases of the embedding, the LM head and the small rest (clipped with ``u.g_norm``, the
        norm under ``update_in_backward`` ``stale``) -> (rest weights, their states, their compute copies or None)."""
        ops, tree = self.ops, self.tree
        params_g, grads_g, dev = tree.rest_groups(ps.rest), tree.rest_groups(g_rest), tree.rest_groups(self.rest_dev)
        copy_dev = tree.rest_groups(self.copy_rest_dev)
        ps.rest = ps.copy_rest = None
        new_params, new_opt, new_copy = {}, {}, {}
        for name in list(params_g):
            if not jax.tree.leaves(params_g[name]):  # a group with no weights (LoRA's adapters have no "small")
                new_params[name], new_opt[name] = params_g.pop(name), ps.opt[name]
                new_copy[name] = jax.tree.map(lambda _: None, new_params[name])
                grads_g.pop(name)
                continue
            out = ops.run("optimizer", self.programs.optimizer(name),
                          ops.load(params_g.pop(name), dev[name], copy=True, label="master weights"),
                          ops.load(ps.opt[name], self.opt_dev[name], copy=True, label="optimizer state"),
                          grads_g.pop(name), u.g_norm, u.rng_data, u.scale, None, stale)
            ps.opt[name] = None
            new_params[name] = ops.store(out[0], dev[name], label="master weights")
            new_opt[name] = ops.store(out[1], self.opt_dev[name], label="optimizer state")
            if self.copy:
                new_copy[name] = ops.store(out[2], copy_dev[name], label="compute copy")
            del out
        copies = tree.rest_from_groups(new_copy) if self.copy else None
        return tree.rest_from_groups(new_params), new_opt, copies

    def _update_layers(self, ps, layer_grads, u: _Update) -> None:
        """The optimizer phases of the layers, one at a time: master weights, state and gradients loaded, the next
        layer's prefetched."""
        ops = self.ops
        for s in self.tree.stacks:

            def load(j, s=s):
                out = (ops.load(ps.layers[s][j], self.row_dev[s], copy=True, label="master weights"),
                       ops.load(ps.opt_layers[s][j], self.opt_row_dev[s], copy=True, label="optimizer state"),
                       ops.load(layer_grads[s][j], self.row_dev[s], label="weight gradients"))
                ps.layers[s][j] = ps.opt_layers[s][j] = layer_grads[s][j] = None
                if ps.copy_layers is not None:
                    ps.copy_layers[s][j] = None
                return out

            for j, (p, st, gr) in prefetch(self.depth[s], load):
                self._update_layer(u, s, j, p, st, gr)
                del p, st, gr

    def _update_layer(self, u: _Update, s, j, p, st, gr) -> None:
        """Layer j of stack s updated from its weights ``p``, optimizer state ``st`` and gradients ``gr``; its
        master, state (and compute copy) stored into ``u.new``."""
        update, new = self.programs.optimizer(s, layer=True), u.new
        args = (p, st, gr, u.g_norm, u.rng_data, u.scale, j) + ((u.clip_norm,) if u.clip_norm is not None else ())
        out = self.ops.run("optimizer", update, *args)
        new["layers"][s][j] = self.ops.store(out[0], self.row_dev[s], label="master weights")
        new["opt"][s][j] = self.ops.store(out[1], self.opt_row_dev[s], label="optimizer state")
        if self.copy:
            new["copy"][s][j] = self.ops.store(out[2], self.copy_row_dev[s], label="compute copy")

    # ------------------------------------------------------------------ plans and reports (graphs/phased_reports.py)

    def plan(self, exact: bool = False) -> TrainingPlan:
        """The memory plan (graphs/plan.py): this step's own schedule run once on placeholders."""
        return phased_reports.plan(self, exact)

    def transfer_floor(self) -> dict:
        """What one step of this state layout must move over the host link, per device, from shapes alone."""
        return phased_reports.transfer_floor(self)

    def memory_report(self, state: PhasedState, batch: dict) -> tuple:
        """(state after one more step, device bytes at the step's peak, {phase: bytes})."""
        return phased_reports.memory_report(self, state, batch)

    def timing_report(self, state: PhasedState, batch: dict) -> tuple:
        """(state after one more step, {load_s, store_s, compute_s, serial_step_s})."""
        return phased_reports.timing_report(self, state, batch)


def _leaf_at(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree
