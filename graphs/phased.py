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

import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from graphs import optim
from graphs import sharding as S
from graphs.graphs import TrainState
from graphs.host_state import HOST, ActivationBuffer, PhasedState, from_rows, row_sharding, to_host, to_rows
from graphs.phase_programs import PhasePrograms
from graphs.phases import context_weights, stack_meta
from graphs.tree import flat_paths, from_flat
from modelling.params import ParamSpec, init_leaf, is_spec, zero_padded_vocab
from utils.bench import live_device_bytes, program_bytes

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


class PhasedExecutor:
    """Runs a training step phase by phase with host-resident weights, optimizer state and activations."""

    name = "phased"

    def __init__(self, graphs):
        g = self.g = graphs
        self.programs = PhasePrograms(g)
        self.mesh, self.depth = g.mesh, g.depths()  # {stack: layers}
        self.tree, self.stacks = g.tree, g.family.stacks
        # device shardings of what the schedule loads: the non-layer weights, one layer, and their optimizer states
        self.rest_dev = self.tree.split_rest(g.param_shardings)
        self.row_dev = {s.name: jax.tree.map(lambda sh: row_sharding(sh, "device"), g.param_shardings[s.name]["layers"])
                        for s in self.stacks}
        opt_dev = g.opt_state_shardings(g.abstract_params())
        self.opt_stacked = opt_dev  # {group: shardings}, layer groups stacked (checkpoint layout)
        self.opt_dev = {k: v for k, v in opt_dev.items() if not self.tree.is_layer_group(k)}
        self.opt_row_dev = {s.name: jax.tree.map(lambda sh: row_sharding(sh, "device"), opt_dev[s.name])
                            for s in self.stacks}
        self.act_dev = NamedSharding(self.mesh, self.programs.act_spec)
        self.act_host = self.act_dev.with_memory_kind(HOST)
        self.memory = None  # set to a PhaseMemory to record device bytes per phase
        # Several processes on CPUs (gloo collectives): XLA:CPU may run two dispatched programs at
        # once, and two programs' collectives can then pair up across processes in different orders
        # and hang. There, each program with collectives finishes before the next is dispatched. GPUs
        # and TPUs run the programs in dispatch order on one stream, so nothing waits there.
        self._serial = jax.process_count() > 1 and self.mesh.devices.flat[0].platform == "cpu"
        self.ops = DeviceOps(self)  # what the schedule runs on: arrays, or placeholders when planning

    # ------------------------------------------------------------------ state

    def init_params(self, seed: int | None = None) -> dict:
        """The fused executor's random weights (same values), created one weight at a time into host memory."""
        g = self.g
        key = jax.random.key(g.cfg.model.seed if seed is None else seed)
        flat = jax.tree_util.tree_flatten_with_path(g.specs, is_leaf=is_spec)[0]
        keys = jax.random.split(key, len(flat))
        host = jax.tree_util.tree_leaves(S.with_memory_kind(g.param_shardings, HOST))
        vocab = g.cfg.model.embedding.vocab_size
        programs, out = {}, []
        for (path, spec), k, sh in zip(flat, keys, host):
            top = path[0].key  # shared / lm_head(_bias) get their padded vocabulary zeroed, as in Graphs.init_params
            padded = top in ("shared", "lm_head", "lm_head_bias")
            sig = (spec.shape, spec.is_norm, top if padded else None, sh)
            if sig not in programs:  # one compilation per distinct weight shape, not per weight

                def make(k, std, spec=spec, top=top, padded=padded):
                    x = init_leaf(ParamSpec(spec.shape, spec.axes, None if spec.is_norm else 1.0, spec.dtype), k)
                    x = x if spec.is_norm else std * x
                    return zero_padded_vocab({top: x}, vocab)[top] if padded else x

                programs[sig] = jax.jit(make, out_shardings=sh)
            out.append(programs[sig](k, jnp.float32(spec.std or 1.0)))
        return jax.tree_util.tree_unflatten(jax.tree.structure(g.specs, is_leaf=is_spec), out)

    def _weights(self, params) -> tuple:
        """Stacked weights (any memory) -> (rest in host memory, {stack: [rows in host memory]})."""
        g = self.g
        rest = to_host(self.tree.split_rest(params), self.rest_dev)
        layers = {s.name: to_rows(params[s.name]["layers"], g.param_shardings[s.name]["layers"]) for s in self.stacks}
        return rest, layers

    def init_state(self, params=None) -> PhasedState:
        """Host-resident state with a fresh optimizer state. params: stacked weights (numpy on the host, or
        arrays in any memory), or None for the random init."""
        if params is None:
            params = self.init_params()
        elif not isinstance(jax.tree.leaves(params)[0], jax.Array):
            params = self.g.shard_params(params, HOST)
        rest, layers = self._weights(params)
        opt = self.g.optimizer

        def init(tree, dev, host):
            return jax.jit(lambda t: optim.init_group(opt, t),
                           out_shardings=S.with_memory_kind(host, HOST))(self.ops.load(tree, dev))

        groups, dev = self.tree.rest_groups(rest), self.tree.rest_groups(self.rest_dev)
        opt_rest = {k: init(groups[k], dev[k], self.opt_dev[k]) for k in groups}
        opt_layers = {s: [init(lp, self.row_dev[s], self.opt_row_dev[s]) for lp in layers[s]] for s in layers}
        return PhasedState(0, rest, layers, opt_rest, opt_layers)

    def from_train_state(self, state: TrainState) -> PhasedState:
        """A stacked TrainState (a checkpoint's layout, any memory) -> the host-resident per-layer state."""
        rest, layers = self._weights(state.params)
        opt_rest = {k: to_host(state.opt_state[k], self.opt_dev[k]) for k in self.opt_dev}
        opt_layers = {s.name: to_rows(state.opt_state[s.name], self.opt_stacked[s.name]) for s in self.stacks}
        return PhasedState(int(state.step), rest, layers, opt_rest, opt_layers)

    def restore(self, directory: str, step: int, optim_state: bool = True):
        """(state, meta) of a checkpoint, restored straight into host memory."""
        from graphs.executor import restore_train_state

        state, meta = restore_train_state(self.g, directory, step, optim_state, HOST)
        if state.opt_state is None:  # saved without optimizer state: start it afresh
            ps = self.init_state(state.params)
            ps.step = int(state.step)
            return ps, meta
        return self.from_train_state(state), meta

    def warm_start(self, directory: str, step: int) -> PhasedState:
        """A new run's host-resident state from a checkpoint's weights: step 0 and a fresh optimizer state."""
        from graphs.executor import restore_train_state

        return self.init_state(restore_train_state(self.g, directory, step, False, HOST)[0].params)

    def to_checkpoint(self, ps: PhasedState) -> TrainState:
        """Host-resident state -> a stacked TrainState in host memory (what checkpoints hold)."""
        g = self.g
        host = S.with_memory_kind(g.param_shardings, HOST)
        layers = {s.name: from_rows(ps.layers[s.name], host[s.name]["layers"]) for s in self.stacks}
        params = self.tree.with_layers(ps.rest, layers)
        opt = dict(ps.opt)
        for s in self.stacks:
            opt[s.name] = from_rows(ps.opt_layers[s.name], S.with_memory_kind(self.opt_stacked[s.name], HOST))
        step = jax.device_put(jnp.asarray(ps.step, jnp.int32), g.replicated)
        return TrainState(step, params, opt)

    # ------------------------------------------------------------------ the step

    def loss_and_grads(self, ps: PhasedState, batch: dict, rng_data, loss_scale=None, update_layer=None):
        """Forward, head and backward phases -> (loss, non-layer gradients on the device,
        {stack: [layer gradients in host memory]}, global gradient norm). The gradients are multiplied by the loss
        scale (``stacked_grads`` divides them); the norm is not.

        ``update_layer(stack, j, weights, gradients, sum of squares)``: called with each layer's weights (on the
        device, a copy it may donate) and gradients right after its backward, in place of storing the gradients
        (``execution.update_in_backward``); the layer gradients returned are then None."""
        ops, prog, depth, stacks = self.ops, self.programs, self.depth, self.stacks
        scale = loss_scale if isinstance(loss_scale, jax.Array) else self.g.loss_scale_input(loss_scale)
        load_act = lambda x: ops.load(x, self.act_dev, label="activations")  # noqa: E731
        store_act = lambda x: ops.store(x, self.act_dev, label="activation rows")  # noqa: E731
        # a stack's buffer: its layers' input rows 0..L-1, then (a stack with an output norm) the norm's input at L
        rows = {s.name: ActivationBuffer(s.buffer, depth[s.name] + (1 if s.output else 0)) for s in stacks}
        meta = {s.name: stack_meta(s, batch) for s in stacks}
        rest, rest_dev = ps.rest, self.rest_dev
        shared = ops.load(rest["shared"], rest_dev["shared"])
        ctx = {s.name: ops.load(context_weights(s, rest[s.name]), context_weights(s, rest_dev[s.name])) for s in stacks}
        out_norm = {s.name: ops.load(rest[s.name][s.output], rest_dev[s.name][s.output]) for s in stacks if s.output}

        # ---- forward
        enc_out = None  # the output of a stack that the next one attends to
        for stack in stacks:
            buf, keys = rows[stack.name], tuple(sorted(meta[stack.name]))
            x = ops.run("embeddings_fwd", prog.embeddings_fwd(stack), shared, batch[stack.ids], rng_data)
            fwd = prog.layer_fwd(stack, keys)
            layer = lambda j, s=stack.name: ops.load(ps.layers[s][j], self.row_dev[s])  # noqa: E731
            for j, lp in prefetch(depth[stack.name], layer):
                buf[j] = store_act(x)  # this layer's input, read again by its backward
                extra = (enc_out,) if stack.cross else ()
                x = ops.run(f"{stack.name}_layer_fwd", fwd, lp, ctx[stack.name], x, *extra, meta[stack.name],
                            rng_data, j)
                del lp
            if stack.output:
                buf[depth[stack.name]] = store_act(x)  # the output norm's input
                enc_out = ops.run(f"{stack.name}_output_fwd", prog.stack_output_fwd(stack), out_norm[stack.name], x,
                                  rng_data)

        # ---- head: loss and its backward
        hp = ops.load(self.tree.head_subtree(rest), self.tree.head_subtree(rest_dev))
        loss, g_head, dy = ops.run("head", prog.head(), hp, x, batch["labels"], rng_data, scale)
        del hp, x
        g_flat = dict(zip(flat_paths(g_head), jax.tree.leaves(g_head)))  # {weight path: gradient} of the rest
        del g_head

        def add_grad(path, g):
            g_flat[path] = g if path not in g_flat else ops.run("add", prog.add, g_flat[path], g)

        sumsq = []  # each phase's sum of squares of its weight gradients
        layer_grads = {s.name: [None] * depth[s.name] for s in stacks}
        d_enc = None  # the gradient of enc_out, summed over the layers that attend to it

        # ---- backward
        for stack in reversed(stacks):
            name, keys, buf = stack.name, tuple(sorted(meta[stack.name])), rows[stack.name]
            if stack.output:  # the output norm, from the summed gradient of its output
                g_norm_w, dy = ops.run(f"{name}_output_bwd", prog.stack_output_bwd(stack), out_norm[name],
                                       load_act(buf.pop(depth[name])), d_enc, rng_data)
                add_grad((name, stack.output), g_norm_w)
                d_enc = None
            if stack.cross:
                d_enc = ops.zeros(enc_out.shape, F32, self.act_dev)
            bwd = prog.layer_bwd(stack, keys)
            g_ctx = None
            copy = update_layer is not None  # the loaded weights are then donated to the layer's update
            layer = lambda j, s=name: ops.load(ps.layers[s][j], self.row_dev[s], copy=copy)  # noqa: E731
            for j, lp in prefetch(depth[name], layer, reverse=True):
                x = load_act(buf.pop(j))
                if stack.cross:
                    g_lp, ss, g_c, dy, d_enc = ops.run(f"{name}_layer_bwd", bwd, lp, ctx[name], x, enc_out,
                                                       meta[name], dy, d_enc, rng_data, j)
                else:
                    g_lp, ss, g_c, dy = ops.run(f"{name}_layer_bwd", bwd, lp, ctx[name], x, meta[name], dy,
                                                rng_data, j)
                if update_layer is None:
                    layer_grads[name][j] = ops.store(g_lp, self.row_dev[name], label="weight gradients")
                else:
                    update_layer(name, j, lp, g_lp, ss)
                sumsq.append(ss)
                if stack.context:
                    g_ctx = g_c if g_ctx is None else ops.run("add", prog.add, g_ctx, g_c)
                del lp, x, g_lp, g_c
            for k in stack.context:
                add_grad((name, k), g_ctx[k])
            add_grad(("shared",), ops.run("embeddings_bwd", prog.embeddings_bwd(stack), shared, batch[stack.ids], dy,
                                          rng_data))
            del g_ctx, dy
            if stack.cross:
                enc_out = None
        del shared, ctx, out_norm
        g_rest = from_flat(rest, g_flat)  # the rest tree's structure
        sumsq.append(ops.run("sum_of_squares", prog.rest_sum_of_squares(), g_rest))
        g_norm = ops.run("global_norm", prog.global_norm, sumsq, scale)
        return loss, g_rest, layer_grads, g_norm

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
        if rng_data is None:
            rng_data = jax.random.key_data(jax.random.fold_in(jax.random.key(self.g.cfg.model.seed), ps.step))
        scale = self.g.loss_scale_input(loss_scale)
        ops, prog = self.ops, self.programs
        in_backward = self.g.cfg.execution.update_in_backward
        layers, opt_layers = ({s.name: [None] * self.depth[s.name] for s in self.stacks} for _ in range(2))
        stale = self.g.clip_norm_input(clip_norm)  # the previous step's norm under update_in_backward, else None

        def update_layer(s, j, p, gr, ss):
            """Layer j of stack s, right after its backward: its weights are on the device already."""
            st = ops.load(ps.opt_layers[s][j], self.opt_row_dev[s], copy=True)
            ps.layers[s][j] = ps.opt_layers[s][j] = None
            # (the step's norm is not known yet: the update clips with the previous one, and the driver stops a run
            # whose norm turns out not finite before anything of the step is saved)
            p, st = ops.run("optimizer", prog.optimizer(s, layer=True), p, st, gr, stale, rng_data, scale, j, stale)
            layers[s][j] = ops.store(p, self.row_dev[s], label="weights")
            opt_layers[s][j] = ops.store(st, self.opt_row_dev[s], label="optimizer state")

        loss, g_rest, layer_grads, g_norm = self.loss_and_grads(ps, batch, rng_data, scale,
                                                                update_layer if in_backward else None)
        if not in_backward and not ops.is_finite(g_norm):
            # an overflow (or a diverged step): no optimizer program runs, every weight and state stays as it was.
            # Reading the norm here waits for the backward; the optimizer phase needed the norm first anyway.
            return PhasedState(ps.step + 1, ps.rest, ps.layers, ps.opt, ps.opt_layers), {"loss": loss, "grad_norm": g_norm}
        # ---- optimizer phases: the embedding, the LM head, the small rest, then one layer at a time
        tree = self.tree
        params_g, grads_g, dev = tree.rest_groups(ps.rest), tree.rest_groups(g_rest), tree.rest_groups(self.rest_dev)
        ps.rest = None
        del g_rest
        new_params, new_opt = {}, {}
        for name in list(params_g):
            p, s = ops.run("optimizer", prog.optimizer(name), ops.load(params_g.pop(name), dev[name], copy=True),
                           ops.load(ps.opt[name], self.opt_dev[name], copy=True), grads_g.pop(name), g_norm,
                           rng_data, scale, None, stale)
            ps.opt[name] = None
            new_params[name] = ops.store(p, dev[name], label="weights")
            new_opt[name] = ops.store(s, self.opt_dev[name], label="optimizer state")
            del p, s
        for stack in self.stacks if not in_backward else ():
            s = stack.name
            update = prog.optimizer(s, layer=True)

            def load(j, s=s):
                out = (ops.load(ps.layers[s][j], self.row_dev[s], copy=True),
                       ops.load(ps.opt_layers[s][j], self.opt_row_dev[s], copy=True),
                       ops.load(layer_grads[s][j], self.row_dev[s]))
                ps.layers[s][j] = ps.opt_layers[s][j] = layer_grads[s][j] = None
                return out

            for j, (p, st, gr) in prefetch(self.depth[s], load):
                p, st = ops.run("optimizer", update, p, st, gr, g_norm, rng_data, scale, j)
                layers[s][j] = ops.store(p, self.row_dev[s], label="weights")
                opt_layers[s][j] = ops.store(st, self.opt_row_dev[s], label="optimizer state")
                del p, st, gr
        metrics = {"loss": loss, "grad_norm": g_norm}
        return PhasedState(ps.step + 1, tree.rest_from_groups(new_params), layers, new_opt, opt_layers), metrics

    def plan(self, exact: bool = False):
        """The memory plan (graphs/plan.py): this step's own schedule run once on placeholders."""
        from graphs.plan import plan_phased

        return plan_phased(self, exact)

    def memory_report(self, state: PhasedState, batch: dict) -> tuple:
        """(state after one more step, device bytes at the step's peak, {phase: bytes}): one step with every phase
        program's live arrays, temporaries and outputs recorded (``PhaseMemory``)."""
        self.memory = PhaseMemory()
        try:
            state, _ = self.train_step(state, batch)
            return state, self.memory.peak, self.memory.by_phase
        finally:
            self.memory = None

    def timing_report(self, state: PhasedState, batch: dict) -> tuple:
        """(state after one more step, {load_s, store_s, compute_s, serial_step_s}): one step in which every
        transfer and every phase program is waited for on its own and timed, so their sums say what the step
        spends on transfers and on compute (the real step overlaps them; its time minus compute_s is about what
        it waits on transfers)."""
        import time

        saved, self.ops = self.ops, TimingOps(self)
        t0 = time.perf_counter()
        try:
            state, metrics = self.train_step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times = dict(self.ops.seconds, serial_step_s=time.perf_counter() - t0)
        finally:
            self.ops = saved
        return state, times

    def stacked_grads(self, g_rest, layer_grads, loss_scale: float | None = None) -> dict:
        """Gradients (``loss_and_grads``'s, divided by its loss scale) in the fused executor's (stacked) tree, as
        float32 numpy, for comparisons."""
        import numpy as np

        scale = np.float32(self.g.cfg.initial_loss_scale if loss_scale is None else loss_scale)
        as_np = lambda x: np.asarray(jax.device_get(x), np.float32) / scale  # noqa: E731
        stacked = {s: jax.tree.map(lambda *r: np.stack([as_np(x) for x in r]), *layer_grads[s]) for s in layer_grads}
        return self.tree.with_layers(jax.tree.map(as_np, g_rest), stacked)


class DeviceOps:
    """The schedule's operations on real arrays (graphs/plan.py's PlanOps runs the same schedule on
    placeholders to plan its memory)."""

    def __init__(self, executor):
        self.x = executor

    def load(self, tree, shardings, copy: bool = False, label: str = ""):
        """Remote buffer -> device: one transfer per weight (RTS shards stay shards).

        ``copy``: never alias the host buffer (on CPU host and device memory are one RAM), so the
        loaded arrays can be donated to the program that updates them.
        """
        return jax.device_put(tree, shardings, may_alias=False if copy else None)

    def store(self, tree, shardings, label: str = ""):
        return jax.device_put(tree, S.with_memory_kind(shardings, HOST))

    def zeros(self, shape, dtype, sharding, label: str = ""):
        return jnp.zeros(shape, dtype, device=sharding)

    def is_finite(self, x) -> bool:
        """Whether a (replicated) scalar on the devices is finite: waits for it."""
        return math.isfinite(float(jax.device_get(x)))

    def run(self, name, program, *args, label: str = ""):
        if self.x.memory is not None:
            self.x.memory.record(name, program, args)
        out = program(*args)
        # several processes on CPUs: each program with collectives finishes before the next (see _serial)
        return jax.block_until_ready(out) if self.x._serial else out


class TimingOps(DeviceOps):
    """DeviceOps that wait for each transfer and program and add up their seconds (``timing_report``)."""

    def __init__(self, executor):
        super().__init__(executor)
        self.seconds = {"load_s": 0.0, "store_s": 0.0, "compute_s": 0.0}

    def _timed(self, key, fn, *args, **kw):
        import time

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
