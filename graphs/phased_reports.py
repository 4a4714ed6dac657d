"""The phased executor's plans and reports (graphs/phased.py): its memory plan, its schedule run once on
placeholders; the least a step of its layout moves over the host link; a step's device bytes per phase, and its
transfers and programs timed one by one. Functions of an executor (``ex``), which offers them as methods."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from graphs.host_state import PhasedState
from graphs.phase_ops import DeviceOps, PhaseMemory, TimingOps, serial_collectives
from graphs.plan import PlanOps, TrainingPlan
from graphs.transfers import floor, tree_bytes, weight_costs
from partitioning import sharding as S
from partitioning.sharding import HOST, shard_bytes

F32 = jnp.float32


def plan(ex, exact: bool = False) -> TrainingPlan:
    """The memory plan (graphs/plan.py): this step's own schedule run once on placeholders (``PlanOps``)."""
    g, ops = ex.g, PlanOps(exact)
    host = lambda sh: S.with_memory_kind(sh, HOST)  # noqa: E731
    params = g.abstract_params()
    rest = ops.abstract(ex.tree.split_rest(params), host(ex.rest_dev), "master weights")
    layers, opt_layers = {}, {}
    for s in g.tree.stacks:
        row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params[s]["layers"])
        layers[s] = [ops.abstract(row, host(ex.row_dev[s]), "master weights") for _ in range(ex.depth[s])]
        opt_row = jax.eval_shape(g.updater.init_group, row)
        opt_layers[s] = [ops.abstract(opt_row, host(ex.opt_row_dev[s]), "optimizer state")
                         for _ in range(ex.depth[s])]
    opt = {k: ops.abstract(jax.eval_shape(g.updater.init_group, grp), host(ex.opt_dev[k]), "optimizer state")
           for k, grp in g.tree.rest_groups(ex.tree.split_rest(params)).items()}
    state = PhasedState(0, rest, layers, opt, opt_layers)
    if ex.copy:  # the compute copies, beside their masters
        copy_of = lambda tree, sh: ops.abstract(jax.eval_shape(ex.programs.compute_copy, tree), host(sh),  # noqa
                                                "compute copy")
        state.copy_rest = copy_of(ex.tree.split_rest(params), ex.copy_rest_dev)
        state.copy_layers = {s: [copy_of(jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype),
                                                      params[s]["layers"]), ex.copy_row_dev[s])
                                 for _ in range(ex.depth[s])] for s in g.tree.stacks}
    run = ex.with_ops(ops)  # (this executor's programs on the placeholders)
    if ex.lora:  # the frozen base in host memory, read by the forward and backward, never written
        base = g.abstract_base()
        run.frozen_rest = ops.abstract(g.model_tree.split_rest(base), host(ex.read_rest_dev), "frozen base weights")
        run.frozen_layers = {}
        for s in ex.stacks:
            row = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), base[s.name]["layers"])
            run.frozen_layers[s.name] = [ops.abstract(row, host(ex.base_row_dev[s.name]), "frozen base weights")
                                         for _ in range(ex.depth[s.name])]
    batch = {k: ops.new(b.shape, b.dtype, b.sharding, "batch") for k, b in g.abstract_batch().items()}
    rng = ops.new((2,), jnp.uint32, g.replicated, "batch")
    new_state, _ = run.train_step(state, batch, rng)
    del state, new_state
    out = ops.plan("phased")
    out.transfer_floor = transfer_floor(ex)
    return out


def transfer_floor(ex) -> dict:
    """What one step of this state layout must move over the host link, per device (graphs/transfers.py's
    ``floor``), from shapes alone."""
    g, programs = ex.g, ex.programs
    params = g.abstract_params()
    row = lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype)  # noqa: E731
    grad = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, programs.grad_dtype), t)  # noqa: E731

    def costs(tree, dev, opt_dev, copy_dev):
        master = tree_bytes(tree, dev)
        state = tree_bytes(jax.eval_shape(g.updater.init_group, tree), opt_dev)
        copy = jax.eval_shape(programs.compute_copy, tree) if ex.copy else None
        compute = tree_bytes(ex._compute(tree, copy), dev)
        return weight_costs(master, compute, state, tree_bytes(grad(tree), dev),
                            tree_bytes(copy, copy_dev) if ex.copy else 0)

    layers = [c for s in ex.tree.stacks  # (a stack's layers are alike: counted once, repeated)
              for c in [costs(jax.tree.map(row, params[s]["layers"]), ex.row_dev[s], ex.opt_row_dev[s],
                              ex.copy_row_dev[s])] * ex.depth[s]]
    groups = ex.tree.rest_groups(ex.tree.split_rest(params))
    dev, copy_dev = ex.tree.rest_groups(ex.rest_dev), ex.tree.rest_groups(ex.copy_rest_dev)
    rest = [costs(groups[k], dev[k], ex.opt_dev[k], copy_dev[k]) for k in groups if jax.tree.leaves(groups[k])]
    frozen_layers = frozen_rest = 0
    if ex.lora:
        base = g.abstract_base()
        frozen_layers = sum(ex.depth[s.name] * tree_bytes(jax.tree.map(row, base[s.name]["layers"]),
                                                             ex.base_row_dev[s.name]) for s in ex.stacks)
        frozen_rest = tree_bytes(g.model_tree.split_rest(base), ex.read_rest_dev)
    batch, d = g.abstract_batch(), g.opts.hidden_size
    acts = sum((ex.depth[s.name] + (1 if s.output else 0))
               * shard_bytes(batch[s.ids].shape + (d,), F32, ex.act_dev) for s in ex.stacks)
    return floor(layers, rest, frozen_layers, frozen_rest, acts, g.steps.update_in_backward)


def memory_report(ex, state: PhasedState, batch: dict) -> tuple:
    """(state after one more step, device bytes at the step's peak, {phase: bytes}): one step with every phase
    program's live arrays, temporaries and outputs recorded (``PhaseMemory``)."""
    memory = PhaseMemory()
    state, _ = ex.with_ops(DeviceOps(serial_collectives(ex.mesh), memory)).train_step(state, batch)
    return state, memory.peak, memory.by_phase


def timing_report(ex, state: PhasedState, batch: dict) -> tuple:
    """(state after one more step, {load_s, store_s, compute_s, serial_step_s}): one step in which every
    transfer and every phase program is waited for on its own and timed, so their sums say what the step
    spends on transfers and on compute (the real step overlaps them; its time minus compute_s is about what
    it waits on transfers)."""
    ops = TimingOps(serial_collectives(ex.mesh))
    t0 = time.perf_counter()
    state, metrics = ex.with_ops(ops).train_step(state, batch)
    jax.block_until_ready(metrics["loss"])
    return state, dict(ops.seconds, serial_step_s=time.perf_counter() - t0)
