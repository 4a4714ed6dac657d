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
reused by every layer. Numerically the result equals the fused executor (tests/test_phased.py).
"""

from __future__ import annotations

import copy
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from graphs import sharding as S
from graphs.host_state import (HOST, ActivationBuffer, PhasedState, from_rows, row_sharding, rows_taken, to_host,
                               to_rows)
from graphs.memory import live_device_bytes, program_bytes
from graphs.phase_programs import PhasePrograms
from graphs.phases import context_weights, stack_meta
from graphs.plan import MemoryPlan, PlanOps
from graphs.sharding import shard_bytes
from graphs.state import (TrainState, base_record, fingerprint_rows, load_base, restore_base, restore_train_state,
                          step_key)
from graphs.transfers import Transfers, floor, tree_bytes, weight_costs
from graphs.tree import flat_paths, from_flat
from modelling import lora
from modelling.family import leaf_name

F32 = jnp.float32


def prefetch(n: int, load, reverse: bool = False):
    """Yields (j, load(j)) for j over range(n) (or reversed), loading j+1 before the caller runs j."""
    order = list(reversed(range(n))) if reverse else list(range(n))
    if not order:
        return
    nxt = load(order[0])
    for k, j in enumerate(order):
        cur = nxt
        if k + 1 < len(order):
            nxt = load(order[k + 1])
        yield j, cur


def serial_collectives(mesh) -> bool:
    """Several processes on CPUs (gloo collectives): XLA:CPU may run two dispatched programs at once, and two
    programs' collectives can then pair up across processes in different orders and hang. There, each program with
    collectives finishes before the next is dispatched. GPUs and TPUs run the programs in dispatch order on one
    stream, so nothing waits there."""
    return jax.process_count() > 1 and mesh.devices.flat[0].platform == "cpu"


class PhasedExecutor:
    """Runs a training step phase by phase with host-resident weights, optimizer state and activations.

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

    # ------------------------------------------------------------------ state

    def init_params(self, seed: int | None = None) -> dict:
        """The fused executor's random weights (same values; LoRA: the adapters'), created one weight at a time
        into host memory."""
        g = self.g
        return g.init_weights(g.specs, S.with_memory_kind(g.param_shardings, HOST), g.master_dtype_of, seed)

    def set_base(self, params=None) -> None:
        """LoRA: the frozen base weights, into host memory: None (the family's random init, one weight at a time),
        host (numpy) weights, or arrays in the full model's stacked layout (any memory; cast to the frozen dtypes
        when they are not in them)."""
        g = self.g
        if params is None:
            params = g.init_base(memory_kind=HOST)
        elif any(x.dtype != a.dtype for x, a in zip(jax.tree.leaves(params), jax.tree.leaves(g.abstract_base()))):
            params = (g.shard_base(params, HOST) if not isinstance(jax.tree.leaves(params)[0], jax.Array)
                      else jax.jit(g.frozen, out_shardings=g.base_shardings)(params))
        # the layers row by row, each stacked leaf let go as soon as its rows exist (numpy leaves in the frozen dtypes
        # placed straight from the host): when the caller keeps no reference to the tree it gives (the driver's
        # load_base), the base passes through host memory about once
        params = {k: dict(v) if isinstance(v, dict) else v for k, v in params.items()}  # (the caller's tree intact)
        rest = g.model_tree.split_rest(params)
        self.frozen_rest = jax.tree.map(lambda x, s: S.put_global(x, s.with_memory_kind(HOST)) if isinstance(
            x, np.ndarray) else jax.device_put(x, s.with_memory_kind(HOST)), rest, self.read_rest_dev)
        self.frozen_layers = {}
        for s in self.stacks:
            leaves, treedef = jax.tree.flatten(params[s.name]["layers"])
            params[s.name]["layers"] = None
            shardings = treedef.flatten_up_to(g.base_shardings[s.name]["layers"])
            per_leaf = rows_taken(leaves, shardings)
            self.frozen_layers[s.name] = [jax.tree.unflatten(treedef, [rows[i] for rows in per_leaf])
                                          for i in range(self.depth[s.name])]

    def base_fingerprint(self) -> str:
        """LoRA: graphs/state.py's ``fingerprint`` of the frozen base, read row by row from host memory."""
        rows = {s: jax.tree.map(lambda *r: _Rows(r), *self.frozen_layers[s]) for s in self.frozen_layers}
        tree = self.g.model_tree.with_layers(jax.tree.map(lambda x: _Rows([x]), self.frozen_rest), rows)
        return fingerprint_rows([r.rows for r in jax.tree.leaves(tree)])

    def use_base(self, source: dict) -> None:
        """LoRA: the frozen base a ``base_source`` names (graphs/state.py) in host memory, and ``base``, its record."""
        self.set_base(load_base(self.g, source, HOST))
        self.base = base_record(source, self.base_fingerprint())

    def _weights(self, params) -> tuple:
        """Stacked weights (any memory) -> (rest in host memory, {stack: [rows in host memory]})."""
        g = self.g
        rest = to_host(self.tree.split_rest(params), self.rest_dev)
        layers = {s: to_rows(params[s]["layers"], g.param_shardings[s]["layers"]) for s in self.tree.stacks}
        return rest, layers

    def init_state(self, params=None) -> PhasedState:
        """Host-resident state with a fresh optimizer state. params: stacked weights (numpy on the host, or
        arrays in any memory), or None for the random init. LoRA: params are the base's (None: the base already
        set, or the random init), and the trained weights new adapters."""
        if self.lora:
            if params is not None or self.frozen_layers is None:
                self.set_base(params)
            params = None
        return self._fresh_state(self.init_params() if params is None else params)

    def _fresh_state(self, params) -> PhasedState:
        """The state of trained weights (stacked: numpy, or arrays in any memory) with a fresh optimizer state."""
        if not isinstance(jax.tree.leaves(params)[0], jax.Array):
            params = self.g.shard_params(params, HOST)
        rest, layers = self._weights(params)
        updater = self.g.updater

        def init(tree, dev, host):
            return jax.jit(lambda t: updater.init_group(t),
                           out_shardings=S.with_memory_kind(host, HOST))(self.ops.load(tree, dev))

        groups, dev = self.tree.rest_groups(rest), self.tree.rest_groups(self.rest_dev)
        opt_rest = {k: init(groups[k], dev[k], self.opt_dev[k]) for k in groups}
        opt_layers = {s: [init(lp, self.row_dev[s], self.opt_row_dev[s]) for lp in layers[s]] for s in layers}
        return self._with_copies(PhasedState(0, rest, layers, opt_rest, opt_layers))

    def from_train_state(self, state: TrainState) -> PhasedState:
        """A stacked TrainState (a checkpoint's layout, any memory) -> the host-resident per-layer state."""
        rest, layers = self._weights(state.params)
        opt_rest = {k: to_host(state.opt_state[k], self.opt_dev[k]) for k in self.opt_dev}
        opt_layers = {s: to_rows(state.opt_state[s], self.opt_stacked[s]) for s in self.tree.stacks}
        return self._with_copies(PhasedState(int(state.step), rest, layers, opt_rest, opt_layers))

    def _with_copies(self, ps: PhasedState) -> PhasedState:
        """The state with the compute copies of its weights made (one weight group at a time through the devices),
        where copies are kept (``copy``)."""
        if not self.copy:
            return ps
        ops, make = self.ops, self.programs.copy_program()

        def copied(tree, dev, copy_dev):
            return ops.store(make(ops.load(tree, dev, label="master weights")), copy_dev, label="compute copy")

        ps.copy_rest = copied(ps.rest, self.rest_dev, self.copy_rest_dev)
        ps.copy_layers = {s: [copied(lp, self.row_dev[s], self.copy_row_dev[s]) for lp in ps.layers[s]]
                          for s in self.tree.stacks}
        return ps

    def restore(self, directory: str, step: int, optim_state: bool = True):
        """(state, meta) of a checkpoint, restored straight into host memory (LoRA: its adapters; the base is
        ``set_base``'s)."""
        state, meta = restore_train_state(self.g, directory, step, optim_state, HOST)
        if state.opt_state is None:  # saved without optimizer state: start it afresh
            ps = self._fresh_state(state.params)
            ps.step = int(state.step)
            return ps, meta
        return self.from_train_state(state), meta

    def warm_start(self, directory: str, step: int) -> PhasedState:
        """A new run's host-resident state from a checkpoint's weights: step 0 and a fresh optimizer state (LoRA: new
        adapters on the checkpoint's weights, frozen)."""
        if self.lora:
            return self.init_state(restore_base(self.g, directory, step, HOST))
        return self.init_state(restore_train_state(self.g, directory, step, False, HOST)[0].params)

    def weights(self, ps: PhasedState) -> dict:
        """The model's weights, stacked, in host memory (as a decoding program reads them, once placed); LoRA: the
        adapters merged into the base, one layer at a time on the device."""
        if not self.lora:
            return self.to_checkpoint(ps).params
        g, ops = self.g, self.ops
        layers = {}
        for s in self.stacks:
            rows = []
            for j in range(self.depth[s.name]):
                lp = self._load_layer(ps, s.name, j)
                merged = self.programs.merged_row(s.name)(lp) if s.name in ps.layers else lp
                rows.append(ops.store(merged, self.base_row_dev[s.name], label="weights"))
            layers[s.name] = from_rows(rows, S.with_memory_kind(g.base_shardings[s.name]["layers"], HOST))
        return g.model_tree.with_layers(self.frozen_rest, layers)

    def to_checkpoint(self, ps: PhasedState) -> TrainState:
        """Host-resident state -> a stacked TrainState in host memory (what checkpoints hold)."""
        g = self.g
        host = S.with_memory_kind(g.param_shardings, HOST)
        layers = {s: from_rows(ps.layers[s], host[s]["layers"]) for s in self.tree.stacks}
        params = self.tree.with_layers(ps.rest, layers)
        opt = dict(ps.opt)
        for s in self.tree.stacks:
            opt[s] = from_rows(ps.opt_layers[s], S.with_memory_kind(self.opt_stacked[s], HOST))
        step = jax.device_put(jnp.asarray(ps.step, jnp.int32), g.replicated)
        return TrainState(step, params, opt)


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
        meta = {s.name: stack_meta(s, batch) for s in self.stacks}
        # what the forward reads: the frozen base (LoRA), else the compute copies of the weights
        rest = self.frozen_rest if self.lora else self._compute(ps.rest, ps.copy_rest)
        rest_dev, label = self.read_rest_dev, "frozen base weights" if self.lora else "weights"
        w = {"shared": ops.load(rest["shared"], rest_dev["shared"], label=label),
             "ctx": {s.name: ops.load(context_weights(s, rest[s.name]), context_weights(s, rest_dev[s.name]),
                                      label=label) for s in self.stacks},
             "out": {s.name: ops.load(rest[s.name][s.output], rest_dev[s.name][s.output], label=label)
                     for s in self.stacks if s.output}}
        rows, x, enc_out = self._forward(ps, batch, meta, w, rng_data)
        ops.moved.phase = "head"
        hp = self._head_weights(rest, w, label)
        loss, g_head, dy = ops.run("head", self.programs.head(), hp, x, batch["labels"], rng_data, scale)
        del hp, x
        ops.moved.phase = "backward"
        g_flat = dict(zip(flat_paths(g_head), jax.tree.leaves(g_head)))  # {weight path: gradient} of the rest
        del g_head
        sumsq, layer_grads = [], {s: [None] * self.depth[s] for s in self.tree.stacks}
        carry = {"dy": dy}  # the gradient flowing back, handed from phase to phase (no frame keeps an old one alive)
        del dy
        for stack in reversed(self.stacks):
            self._backward(ps, stack, batch, meta, w, rows[stack.name], carry, enc_out, rng_data, g_flat, sumsq,
                           layer_grads, update_layer)
            if stack.cross:
                enc_out = None
        del w
        g_rest = from_flat(ps.rest, g_flat)  # the trained rest tree's structure
        if jax.tree.leaves(g_rest):  # (LoRA's adapters have no weights outside the layers)
            sumsq.append(ops.run("sum_of_squares", self.programs.rest_sum_of_squares(), g_rest))
        g_norm = ops.run("global_norm", self.programs.global_norm, sumsq, scale)
        return loss, g_rest, layer_grads, g_norm

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

    def _forward(self, ps, batch, meta, w, rng_data) -> tuple:
        """Every stack forward, storing each layer's input row -> (activation buffers, the last stack's output,
        the output the cross-attending stack reads)."""
        ops, prog, depth = self.ops, self.programs, self.depth
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

    def _backward(self, ps, stack, batch, meta, w, buf, carry, enc_out, rng_data, g_flat, sumsq, layer_grads,
                  update_layer) -> None:
        """One stack backward, its layers in reverse. ``carry``: {"dy": the gradient of the stack's output (its
        last layer's, or for a stack with an output norm that norm's), "d_enc": the gradient of the output a
        cross-attending stack read, summed over its layers on the device}; the non-layer gradients are added into
        ``g_flat``, the layers' stored (or each layer updated: ``update_layer``)."""
        ops, prog, name = self.ops, self.programs, stack.name
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

        def update_layer(s, j, p, gr, ss):
            """Layer j of stack s, right after its backward: its weights are on the device already. (The step's norm
            is not known yet: the update clips with the previous one, and the driver stops a run whose norm turns
            out not finite before anything of the step is saved.)"""
            st = self.ops.load(ps.opt_layers[s][j], self.opt_row_dev[s], copy=True, label="optimizer state")
            ps.layers[s][j] = ps.opt_layers[s][j] = None
            if ps.copy_layers is not None:
                ps.copy_layers[s][j] = None
            self._update_layer(s, j, p, st, gr, stale, rng_data, scale, stale, new)

        loss, g_rest, layer_grads, g_norm = self._forward_backward(ps, batch, rng_data, scale,
                                                                   update_layer if in_backward else None)
        metrics = {"loss": loss, "grad_norm": g_norm}
        if not in_backward and not self.ops.is_finite(g_norm):
            # an overflow (or a diverged step): no optimizer program runs, every weight and state stays as it was.
            # Reading the norm here waits for the backward; the optimizer phase needed the norm first anyway.
            return PhasedState(ps.step + 1, ps.rest, ps.layers, ps.opt, ps.opt_layers, ps.copy_rest,
                               ps.copy_layers), metrics
        self.ops.moved.phase = "optimizer"
        new_rest, new_opt, new_copy = self._update_rest(ps, g_rest, g_norm, rng_data, scale, stale)
        del g_rest
        if not in_backward:
            self._update_layers(ps, layer_grads, g_norm, rng_data, scale, new)
        return PhasedState(ps.step + 1, new_rest, new["layers"], new_opt, new["opt"], new_copy,
                           new["copy"] if self.copy else None), metrics

    def _update_rest(self, ps, g_rest, g_norm, rng_data, scale, stale) -> tuple:
        """The optimizer phases of the embedding, the LM head and the small rest -> (rest weights, their states,
        their compute copies or None)."""
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
                          grads_g.pop(name), g_norm, rng_data, scale, None, stale)
            ps.opt[name] = None
            new_params[name] = ops.store(out[0], dev[name], label="master weights")
            new_opt[name] = ops.store(out[1], self.opt_dev[name], label="optimizer state")
            if self.copy:
                new_copy[name] = ops.store(out[2], copy_dev[name], label="compute copy")
            del out
        copies = tree.rest_from_groups(new_copy) if self.copy else None
        return tree.rest_from_groups(new_params), new_opt, copies

    def _update_layers(self, ps, layer_grads, g_norm, rng_data, scale, new: dict) -> None:
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
                self._update_layer(s, j, p, st, gr, g_norm, rng_data, scale, None, new)
                del p, st, gr

    def _update_layer(self, s, j, p, st, gr, g_norm, rng_data, scale, clip_norm, new: dict) -> None:
        """Layer j of stack s updated; its master, state (and compute copy) stored into ``new``."""
        update = self.programs.optimizer(s, layer=True)
        args = (p, st, gr, g_norm, rng_data, scale, j) + ((clip_norm,) if clip_norm is not None else ())
        out = self.ops.run("optimizer", update, *args)
        new["layers"][s][j] = self.ops.store(out[0], self.row_dev[s], label="master weights")
        new["opt"][s][j] = self.ops.store(out[1], self.opt_row_dev[s], label="optimizer state")
        if self.copy:
            new["copy"][s][j] = self.ops.store(out[2], self.copy_row_dev[s], label="compute copy")

    # ------------------------------------------------------------------ plans and reports

    def plan(self, exact: bool = False) -> MemoryPlan:
        """The memory plan (graphs/plan.py): this step's own schedule run once on placeholders (``PlanOps``)."""
        g, ops = self.g, PlanOps(exact)
        host = lambda sh: S.with_memory_kind(sh, HOST)  # noqa: E731
        params = g.abstract_params()
        rest = ops.abstract(self.tree.split_rest(params), host(self.rest_dev), "master weights")
        layers, opt_layers = {}, {}
        for s in g.tree.stacks:
            row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params[s]["layers"])
            layers[s] = [ops.abstract(row, host(self.row_dev[s]), "master weights") for _ in range(self.depth[s])]
            opt_row = jax.eval_shape(g.updater.init_group, row)
            opt_layers[s] = [ops.abstract(opt_row, host(self.opt_row_dev[s]), "optimizer state")
                             for _ in range(self.depth[s])]
        opt = {k: ops.abstract(jax.eval_shape(g.updater.init_group, grp), host(self.opt_dev[k]), "optimizer state")
               for k, grp in g.tree.rest_groups(self.tree.split_rest(params)).items()}
        state = PhasedState(0, rest, layers, opt, opt_layers)
        if self.copy:  # the compute copies, beside their masters
            copy_of = lambda tree, sh: ops.abstract(jax.eval_shape(self.programs.compute_copy, tree), host(sh),  # noqa
                                                    "compute copy")
            state.copy_rest = copy_of(self.tree.split_rest(params), self.copy_rest_dev)
            state.copy_layers = {s: [copy_of(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                                                          params[s]["layers"]), self.copy_row_dev[s])
                                     for _ in range(self.depth[s])] for s in g.tree.stacks}
        ex = self.with_ops(ops)
        if self.lora:  # the frozen base in host memory, read by the forward and backward, never written
            base = g.abstract_base()
            ex.frozen_rest = ops.abstract(g.model_tree.split_rest(base), host(self.read_rest_dev), "frozen base weights")
            ex.frozen_layers = {}
            for s in self.stacks:
                row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), base[s.name]["layers"])
                ex.frozen_layers[s.name] = [ops.abstract(row, host(self.base_row_dev[s.name]), "frozen base weights")
                                            for _ in range(self.depth[s.name])]
        batch = {k: ops.new(b.shape, b.dtype, b.sharding, "batch") for k, b in g.abstract_batch().items()}
        rng = ops.new((2,), jnp.uint32, g.replicated, "batch")
        new_state, _ = ex.train_step(state, batch, rng)
        del state, new_state
        out = ops.plan("phased")
        out.transfer_floor = self.transfer_floor()
        return out

    def transfer_floor(self) -> dict:
        """What one step of this state layout must move over the host link, per device (graphs/transfers.py's
        ``floor``), from shapes alone."""
        g, programs = self.g, self.programs
        params = g.abstract_params()
        row = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)  # noqa: E731
        grad = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, programs.grad_dtype), t)  # noqa: E731

        def costs(tree, dev, opt_dev, copy_dev):
            master = tree_bytes(tree, dev)
            state = tree_bytes(jax.eval_shape(g.updater.init_group, tree), opt_dev)
            copy = jax.eval_shape(programs.compute_copy, tree) if self.copy else None
            compute = tree_bytes(self._compute(tree, copy), dev)
            return weight_costs(master, compute, state, tree_bytes(grad(tree), dev),
                                tree_bytes(copy, copy_dev) if self.copy else 0)

        layers = [c for s in self.tree.stacks  # (a stack's layers are alike: counted once, repeated)
                  for c in [costs(jax.tree.map(row, params[s]["layers"]), self.row_dev[s], self.opt_row_dev[s],
                                  self.copy_row_dev[s])] * self.depth[s]]
        groups = self.tree.rest_groups(self.tree.split_rest(params))
        dev, copy_dev = self.tree.rest_groups(self.rest_dev), self.tree.rest_groups(self.copy_rest_dev)
        rest = [costs(groups[k], dev[k], self.opt_dev[k], copy_dev[k]) for k in groups if jax.tree.leaves(groups[k])]
        frozen_layers = frozen_rest = 0
        if self.lora:
            base = g.abstract_base()
            frozen_layers = sum(self.depth[s.name] * tree_bytes(jax.tree.map(row, base[s.name]["layers"]),
                                                                 self.base_row_dev[s.name]) for s in self.stacks)
            frozen_rest = tree_bytes(g.model_tree.split_rest(base), self.read_rest_dev)
        batch, d = g.abstract_batch(), g.opts.hidden_size
        acts = sum((self.depth[s.name] + (1 if s.output else 0))
                   * shard_bytes(batch[s.ids].shape + (d,), F32, self.act_dev) for s in self.stacks)
        return floor(layers, rest, frozen_layers, frozen_rest, acts, g.steps.update_in_backward)

    def memory_report(self, state: PhasedState, batch: dict) -> tuple:
        """(state after one more step, device bytes at the step's peak, {phase: bytes}): one step with every phase
        program's live arrays, temporaries and outputs recorded (``PhaseMemory``)."""
        memory = PhaseMemory()
        state, _ = self.with_ops(DeviceOps(serial_collectives(self.mesh), memory)).train_step(state, batch)
        return state, memory.peak, memory.by_phase

    def timing_report(self, state: PhasedState, batch: dict) -> tuple:
        """(state after one more step, {load_s, store_s, compute_s, serial_step_s}): one step in which every
        transfer and every phase program is waited for on its own and timed, so their sums say what the step
        spends on transfers and on compute (the real step overlaps them; its time minus compute_s is about what
        it waits on transfers)."""
        ops = TimingOps(serial_collectives(self.mesh))
        t0 = time.perf_counter()
        state, metrics = self.with_ops(ops).train_step(state, batch)
        jax.block_until_ready(metrics["loss"])
        return state, dict(ops.seconds, serial_step_s=time.perf_counter() - t0)


def _leaf_at(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


class _Rows:
    """A stacked weight given as its rows (not a pytree: a leaf of the tree it is placed in)."""

    def __init__(self, rows):
        self.rows = list(rows)


class DeviceOps:
    """The schedule's operations on real arrays (graphs/plan.py's PlanOps runs the same schedule on placeholders to
    plan its memory). ``serial``: wait for each program (``serial_collectives``); ``memory``: a PhaseMemory that
    records each program's device bytes.

    The host never runs more than one program ahead of the devices: a load waits for the last program dispatched to
    finish (``pending``) before it allocates its arrays. JAX dispatches asynchronously, and a schedule left to run
    ahead would have loaded layer after layer while the device still computed the first: their buffers all alive at
    once, the device's peak far above the plan's (one layer computing, the next arriving). The load of layer j + 1
    still runs beside layer j's program, which is dispatched right after it."""

    def __init__(self, serial: bool = False, memory=None):
        self.serial, self.memory = serial, memory
        self.moved = Transfers()  # what the schedule moves over the host link (graphs/transfers.py)
        self.pending = None  # an output of the last program dispatched: ready once the program has run

    def wait_for_last_program(self) -> None:
        if self.pending is not None:
            jax.block_until_ready(self.pending)
            self.pending = None

    def load(self, tree, shardings, copy: bool = False, label: str = ""):
        """Remote buffer -> device: one transfer per weight (RTS shards stay shards), once the last program
        dispatched has run (see the class docstring).

        ``copy``: never alias the host buffer (on CPU host and device memory are one RAM), so the
        loaded arrays can be donated to the program that updates them.
        """
        self.wait_for_last_program()
        self.moved.add("load", label, tree, shardings)
        return jax.device_put(tree, shardings, may_alias=False if copy else None)

    def store(self, tree, shardings, label: str = ""):
        self.moved.add("store", label, tree, shardings)
        return jax.device_put(tree, S.with_memory_kind(shardings, HOST))

    def zeros(self, shape, dtype, sharding, label: str = ""):
        return jnp.zeros(shape, dtype, device=sharding)

    def is_finite(self, x) -> bool:
        """Whether a (replicated) scalar on the devices is finite: waits for it."""
        return math.isfinite(float(jax.device_get(x)))

    def run(self, name, program, *args, label: str = ""):
        if self.memory is not None:
            self.memory.record(name, program, args)
        out = program(*args)
        arrays = [x for x in jax.tree.leaves(out) if isinstance(x, jax.Array)]
        # the smallest output stands for the program: every output of one execution is ready at once
        self.pending = min(arrays, key=lambda x: x.size) if arrays else None
        return jax.block_until_ready(out) if self.serial else out


class TimingOps(DeviceOps):
    """DeviceOps that wait for each transfer and program and add up their seconds (``timing_report``)."""

    def __init__(self, serial: bool = False):
        super().__init__(serial)
        self.seconds = {"load_s": 0.0, "store_s": 0.0, "compute_s": 0.0}

    def _timed(self, key, fn, *args, **kw):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args, **kw))
        self.seconds[key] += time.perf_counter() - t0
        return out

    def load(self, tree, shardings, copy: bool = False, label: str = ""):
        return self._timed("load_s", super().load, tree, shardings, copy, label)

    def store(self, tree, shardings, label: str = ""):
        return self._timed("store_s", super().store, tree, shardings, label)

    def run(self, name, program, *args, label: str = ""):
        return self._timed("compute_s", super().run, name, program, *args, label=label)


class PhaseMemory:
    """Device bytes per phase: live device arrays when the phase starts plus the compiled program's
    temporaries and outputs (XLA's memory analysis), on the busiest device; the maximum over a step
    is the step's peak. Works on every backend, CPU included (where no allocator statistics exist)."""

    def __init__(self):
        self.peak = 0
        self.by_phase: dict = {}
        self._analysis: dict = {}

    def record(self, name, program, args):
        key = (name, id(program))
        if key not in self._analysis:
            self._analysis[key] = program.lower(*args).compile().memory_analysis()
        total = program_bytes(self._analysis[key], max(live_device_bytes().values() or [0]))
        self.by_phase[name] = max(self.by_phase.get(name, 0), total)
        self.peak = max(self.peak, total)
