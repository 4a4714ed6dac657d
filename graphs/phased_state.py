"""The phased executor's state and frozen base (graphs/phased.py): host-resident weights and optimizer state, one tree
per layer, made from a random init, a stacked state or a checkpoint, and turned back into the stacked layout that
checkpoints and decoding read; under LoRA the frozen base, in host memory, read by every step and never written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from graphs.host_state import PhasedState, from_rows, rows_taken, to_host, to_rows
from graphs.state import TrainState, restore_train_state
from partitioning import sharding as S
from partitioning.base import base_record, fingerprint_rows, load_base, restore_base
from partitioning.sharding import HOST


class PhasedStates:
    """The state's lifecycle; the executor (graphs/phased.py's ``PhasedExecutor``) sets what it reads: ``g`` (the
    Graphs), ``tree``, ``stacks``, ``depth``, ``lora``, ``ops``, ``programs``, ``copy`` and the shardings
    (``rest_dev``, ``row_dev``, ``read_rest_dev``, ``base_row_dev``, ``opt_dev``, ``opt_row_dev``, ``opt_stacked``,
    ``copy_rest_dev``, ``copy_row_dev``)."""


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
        """LoRA: partitioning/base.py's ``fingerprint`` of the frozen base, read row by row from host memory."""
        rows = {s: jax.tree.map(lambda *r: _Rows(r), *self.frozen_layers[s]) for s in self.frozen_layers}
        tree = self.g.model_tree.with_layers(jax.tree.map(lambda x: _Rows([x]), self.frozen_rest), rows)
        return fingerprint_rows([r.rows for r in jax.tree.leaves(tree)])

    def use_base(self, source: dict) -> None:
        """LoRA: the frozen base a ``base_source`` names (partitioning/base.py) in host memory, and ``base``, its record."""
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


class _Rows:
    """A stacked weight given as its rows (not a pytree: a leaf of the tree it is placed in)."""

    def __init__(self, rows):
        self.rows = list(rows)
