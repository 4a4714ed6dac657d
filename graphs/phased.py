"""The phased executor: the original app's execution scheme, for models larger than device memory.

Weights and optimizer state live in host memory ("remote buffers", JAX's
``pinned_host`` memory kind), one entry per layer, in their RTS layout. A
training step runs the phases one after another; each loads its weights once,
all-gathers the RTS shards, runs every micro-batch (batch serialisation, a
``lax.scan``) and stores its outputs back to host memory:

    forward    embeddings -> encoder layer 0..L-1 -> encoder head
               -> decoder embeddings -> decoder layer 0..L-1
    head       final norm + LM head + loss, and its backward, in one phase
    backward   decoder layer L-1..0 -> decoder embeddings -> sum of dx_enc rows
               -> encoder head -> encoder layer L-1..0 -> embeddings
               (each layer recomputes its forward from its stored input)
    optimizer  each layer's shards: load, clip with the global norm, update, store

Activation buffers, one row per phase output, each row [GA, batch, length, d]
stored sharded over tp on d (RTS on activations) and gathered after loading:

    x_buffer       0: encoder embeddings, 1..L: encoder layer outputs, L+1: encoder head output
    dx_buffer      gradients of the x_buffer rows; row L+1 is the sum of dx_enc_buffer
    x_dec_buffer   0: decoder embeddings, 1..L: decoder layer outputs
    dx_dec_buffer  gradients of the x_dec_buffer rows
    dx_enc_buffer  L rows: the gradient of the encoder output from each decoder layer

Device memory then holds one layer's weights, gradients and optimizer state plus
one phase's activations, and the small embedding/relative-bias gradient sums.
The per-layer programs are compiled once and reused by every layer. Numerically
the result equals the fused executor (tests/test_phased.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from graphs import sharding as S
from graphs.graphs import TrainState
from graphs.optim import clip_by_norm, make_optimizer
from modelling import layers as L
from modelling import t5
from modelling.params import ParamSpec, init_leaf, is_spec, zero_padded_vocab
from utils.bench import live_device_bytes, program_bytes

HOST = "pinned_host"
STACKS = ("encoder", "decoder")
F32 = jnp.float32


# the non-layer weights' optimizer phases: embedding, LM head, and the small rest (relative
# biases and final norms); each a subtree with the same paths as in the whole tree
REST_GROUPS = (("shared",), ("lm_head",), STACKS)


def rest_groups(rest: dict) -> list:
    return [{k: rest[k] for k in keys} for keys in REST_GROUPS if keys[0] in rest]


def split_rest(tree: dict) -> dict:
    """Everything but the stacked layers: shared, lm_head, relpos and final norms (same paths)."""
    out = {k: v for k, v in tree.items() if k not in STACKS}
    for s in STACKS:
        out[s] = {k: v for k, v in tree[s].items() if k != "layers"}
    return out


# --------------------------------------------------------------------------- host <-> rows


def _shard_data(x: jax.Array) -> dict:
    return {s.device: s.data for s in x.addressable_shards}


def unstack_rows(x: jax.Array, row_sharding: NamedSharding) -> list:
    """A stacked [rows, ...] array -> one array per row, in ``row_sharding``.

    Works shard by shard on each process's own devices (the stacked dim is never
    sharded), so a model bigger than one device never passes through one.
    """
    kind = row_sharding.memory_kind
    shards = {d: np.asarray(a) for d, a in _shard_data(x).items()}
    out = []
    for i in range(x.shape[0]):
        arrays = [jax.device_put(shards[d][i], SingleDeviceSharding(d, memory_kind=kind))
                  for d in row_sharding.addressable_devices]
        out.append(jax.make_array_from_single_device_arrays(x.shape[1:], row_sharding, arrays))
    return out


def stack_rows(rows: list, sharding: NamedSharding) -> jax.Array:
    """The inverse of ``unstack_rows``: rows -> one [rows, ...] array in ``sharding``."""
    kind = sharding.memory_kind
    data = [_shard_data(r) for r in rows]
    arrays = [jax.device_put(np.stack([np.asarray(d[dev]) for d in data]), SingleDeviceSharding(dev, memory_kind=kind))
              for dev in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays((len(rows),) + rows[0].shape, sharding, arrays)


def _flat(tree) -> dict:
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


# --------------------------------------------------------------------------- state and buffers


@dataclass
class PhasedState:
    """Host-resident train state: the non-layer weights, one entry per layer, and their optimizer states."""

    step: int
    rest: Any  # split_rest(params)
    layers: dict  # {"encoder": [layer params], "decoder": [...]}
    opt_rest: list  # one optimizer state per rest_groups(rest)
    opt_layers: dict  # {"encoder": [layer optimizer states], ...}


class ActivationBuffer:
    """Rows of host-resident activations, each [GA, batch, length, d] sharded over dp (batch) and tp (d)."""

    def __init__(self, name: str, rows: int):
        self.name = name
        self.rows: list = [None] * rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.rows[i] is None:
            raise KeyError(f"{self.name} row {i} has not been written")
        return self.rows[i]

    def __setitem__(self, i, value):
        self.rows[i] = value

    def numpy(self) -> np.ndarray:
        """All rows gathered to one host array [rows, GA, batch, length, d] (for tests and inspection)."""
        return np.stack([np.asarray(jax.device_get(r)) for r in self.rows])


class PhasedExecutor:
    """Runs a training step phase by phase with host-resident weights, optimizer state and activations."""

    def __init__(self, graphs):
        g = self.g = graphs
        cfg = g.cfg
        self.opts, self.mesh = g.opts, g.mesh
        self.layers = cfg.model.layers
        self.scale = cfg.execution.loss_scaling
        self.max_norm = cfg.training.optimizer.gradient_clipping
        self.optimizer = make_optimizer(cfg.training, clip=False)
        self.rest_layouts = split_rest(g.layouts)
        self.row_layouts = {s: jax.tree.map(lambda l: l.row(), g.layouts[s]["layers"], is_leaf=S.is_layout)
                            for s in STACKS}
        self.rest_specs = S.storage_specs(self.rest_layouts)
        self.row_specs = {s: S.storage_specs(self.row_layouts[s]) for s in STACKS}
        dev = lambda specs: jax.tree.map(lambda p: NamedSharding(self.mesh, p), specs)  # noqa: E731
        self.rest_dev = dev(self.rest_specs)
        self.row_dev = {s: dev(self.row_specs[s]) for s in STACKS}
        self.rest_host = S.with_memory_kind(self.rest_dev, HOST)
        self.row_host = {s: S.with_memory_kind(self.row_dev[s], HOST) for s in STACKS}
        # RTS on activations: rows stored split over tp along d, gathered after loading
        self.act_tp = g.tp > 1 and cfg.model.hidden_size % g.tp == 0
        self.act_spec = P(None, S.DP, None, S.TP if self.act_tp else None)
        self.act_dev = NamedSharding(self.mesh, self.act_spec)
        self.act_host = self.act_dev.with_memory_kind(HOST)
        self.memory = None  # set to a PhaseMemory to record device bytes per phase
        # Several processes on CPUs (gloo collectives): XLA:CPU may run two dispatched programs at
        # once, and two programs' collectives can then pair up across processes in different orders
        # and hang. There, each program with collectives finishes before the next is dispatched. GPUs
        # and TPUs run the programs in dispatch order on one stream, so nothing waits there.
        self._serial = jax.process_count() > 1 and self.mesh.devices.flat[0].platform == "cpu"
        self._programs = {}
        self._opt_shardings = {}
        self.last_buffers = {}

    # ------------------------------------------------------------------ state

    def opt_shardings(self, name: str, params, shardings):
        if name not in self._opt_shardings:
            abstract = jax.eval_shape(self.optimizer.init, params)
            self._opt_shardings[name] = S.follow_params(abstract, params, shardings,
                                                        NamedSharding(self.mesh, P()))
        return self._opt_shardings[name]

    def _init_opt(self, name, params_host, dev_shardings):
        host = S.with_memory_kind(self.opt_shardings(name, params_host, dev_shardings), HOST)
        return jax.jit(self.optimizer.init, out_shardings=host)(self.load(params_host, dev_shardings))

    def _split(self, params) -> tuple:
        """Stacked params (any memory) -> (rest in host memory, {stack: [rows in host memory]})."""
        rest = jax.tree.map(lambda x, s: jax.device_put(x, s), split_rest(params), self.rest_host)
        layers = {}
        for s in STACKS:
            leaves = jax.tree.map(lambda x, sh: unstack_rows(x, sh), params[s]["layers"], self.row_host[s])
            treedef = jax.tree.structure(self.row_host[s])
            per_leaf = treedef.flatten_up_to(leaves)
            layers[s] = [jax.tree.unflatten(treedef, [rows[i] for rows in per_leaf]) for i in range(self.layers)]
        return rest, layers

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
            top = path[0].key  # shared / lm_head get their padded vocabulary zeroed, as in Graphs.init_params
            padded = top in ("shared", "lm_head")
            sig = (spec.shape, spec.is_norm, top if padded else None, sh)
            if sig not in programs:  # one compilation per distinct weight shape, not per weight

                def make(k, std, spec=spec, top=top, padded=padded):
                    x = init_leaf(ParamSpec(spec.shape, spec.axes, None if spec.is_norm else 1.0, spec.dtype), k)
                    x = x if spec.is_norm else std * x
                    return zero_padded_vocab({top: x}, vocab)[top] if padded else x

                programs[sig] = jax.jit(make, out_shardings=sh)
            out.append(programs[sig](k, jnp.float32(spec.std or 1.0)))
        return jax.tree_util.tree_unflatten(jax.tree.structure(g.specs, is_leaf=is_spec), out)

    def init_state(self, params) -> PhasedState:
        """Host-resident state from stacked weights (host or device), with a fresh optimizer state."""
        rest, layers = self._split(params)
        opt_rest = [self._init_opt(f"rest{i}", grp, sh)
                    for i, (grp, sh) in enumerate(zip(rest_groups(rest), rest_groups(self.rest_dev)))]
        opt_layers = {s: [self._init_opt(s, lp, self.row_dev[s]) for lp in layers[s]] for s in STACKS}
        return PhasedState(0, rest, layers, opt_rest, opt_layers)

    def from_train_state(self, state: TrainState) -> PhasedState:
        """A (stacked) TrainState, e.g. restored from a checkpoint, -> host-resident per-layer state."""
        rest, layers = self._split(state.params)
        fused = _flat(state.opt_state)
        opt_rest = []
        for i, (grp, sh) in enumerate(zip(rest_groups(rest), rest_groups(self.rest_dev))):
            opt_rest.append(jax.tree_util.tree_map_with_path(
                lambda p, s: jax.device_put(fused[jax.tree_util.keystr(p)], s.with_memory_kind(HOST)),
                self.opt_shardings(f"rest{i}", grp, sh)))
        opt_layers = {}
        for s in STACKS:
            shard = self.opt_shardings(s, layers[s][0], self.row_dev[s])
            rows = {}
            for path, sh in jax.tree_util.tree_flatten_with_path(shard)[0]:
                key = jax.tree_util.keystr(path)
                stacked_key = self._stacked_key(key, s, layers[s][0])
                host = sh.with_memory_kind(HOST)
                if stacked_key is None:  # step counts: the same for every layer
                    rows[key] = [jax.device_put(fused[key], host)] * self.layers
                else:
                    rows[key] = unstack_rows(fused[stacked_key], host)
            treedef = jax.tree.structure(shard)
            keys = list(_flat(shard))
            opt_layers[s] = [jax.tree.unflatten(treedef, [rows[k][i] for k in keys]) for i in range(self.layers)]
        return PhasedState(int(state.step), rest, layers, opt_rest, opt_layers)

    def _stacked_key(self, key: str, stack: str, layer_params) -> str | None:
        """Optimizer-state path of a layer leaf -> the path of its stacked leaf in the fused state."""
        for wpath in _flat(layer_params):
            if key.endswith(wpath):
                return key[: len(key) - len(wpath)] + f"['{stack}']['layers']" + wpath
        return None

    def to_train_state(self, ps: PhasedState) -> TrainState:
        """Host-resident state -> a stacked TrainState in host memory (what checkpoints hold)."""
        g = self.g
        host = S.with_memory_kind(g.param_shardings, HOST)
        params = {}
        flat_rest = _flat(ps.rest)
        for path, sh in jax.tree_util.tree_flatten_with_path(host)[0]:
            key = jax.tree_util.keystr(path)
            for s in STACKS:
                prefix = f"['{s}']['layers']"
                if key.startswith(prefix):
                    sub = key[len(prefix):]
                    value = stack_rows([_flat(lp)[sub] for lp in ps.layers[s]], sh)
                    break
            else:
                value = flat_rest[key]
            params[key] = value
        treedef = jax.tree.structure(host)
        params = jax.tree.unflatten(treedef, [params[k] for k in _flat(host)])
        fused_sh = S.with_memory_kind(g.opt_state_shardings(params), HOST)
        flat_opt_rest = {}
        for o in ps.opt_rest:  # step counts appear in every group, equal
            flat_opt_rest.update(_flat(o))
        opt = []
        for path, sh in jax.tree_util.tree_flatten_with_path(fused_sh)[0]:
            key = jax.tree_util.keystr(path)
            for s in STACKS:
                marker = f"['{s}']['layers']"
                if marker in key:
                    sub = key.replace(marker, "")
                    opt.append(stack_rows([_flat(o)[sub] for o in ps.opt_layers[s]], sh))
                    break
            else:
                opt.append(flat_opt_rest[key])
        opt_state = jax.tree.unflatten(jax.tree.structure(fused_sh), opt)
        step = jax.device_put(jnp.asarray(ps.step, jnp.int32), g.replicated)
        return TrainState(step, params, opt_state)

    # ------------------------------------------------------------------ loading and storing

    def load(self, tree, shardings, copy: bool = False):
        """Remote buffer -> device: one transfer per weight (RTS shards stay shards).

        ``copy``: never alias the host buffer (on CPU host and device memory are one RAM), so the
        loaded arrays can be donated to the program that updates them.
        """
        return jax.device_put(tree, shardings, may_alias=False if copy else None)

    def store(self, tree, shardings):
        return jax.device_put(tree, S.with_memory_kind(shardings, HOST))

    def _load_act(self, x):
        return jax.device_put(x, self.act_dev)

    def _store_act(self, x):
        return jax.device_put(x, self.act_host)

    # ------------------------------------------------------------------ per-device helpers

    def _gather_act(self, x):
        return lax.all_gather(x, S.TP, axis=x.ndim - 1, tiled=True) if self.act_tp else x

    def _slice_act(self, y):
        if not self.act_tp:
            return y
        n = y.shape[-1] // lax.axis_size(S.TP)
        return lax.dynamic_slice_in_dim(y, lax.axis_index(S.TP) * n, n, axis=y.ndim - 1)

    def _base_rng(self, rng_data):
        if self.opts.dropout_prob <= 0:
            return None
        return jax.random.fold_in(jax.random.wrap_key_data(rng_data), lax.axis_index(S.DP))

    @staticmethod
    def _micro_rng(rng, i, *streams):
        """The fused executor's key for micro-batch i and a model stream (10 encoder embeddings, ...)."""
        return None if rng is None else t5._rng(jax.random.fold_in(rng, i), *streams)

    def _reduce(self, grads, layouts):
        return jax.tree.map(lambda g, l: S.reduce_gradient(g, l) / self.scale, grads, layouts)

    def _cast(self, tree):
        return t5.cast_params(tree, self.opts.compute_dtype)

    def _layer_fn(self, decoder: bool, masks: dict, r):
        """One block as a function of (layer weights, relpos, x[, enc_out]) for one micro-batch."""
        opts = self.opts

        def f(lp, relpos, x, enc=None):
            p = self._cast(lp)
            if decoder:
                bias = t5.decoder_self_bias(relpos, x.shape[1], opts, masks.get("decoder_attention_mask"))
                cross = L.padding_mask_bias(masks["attention_mask"])
                return t5.t5_block(p, x, bias, opts, S.TP, enc, cross, r)
            return t5.t5_block(p, x, t5.encoder_self_bias(relpos, masks["attention_mask"], opts), opts, S.TP, rng=r)

        return f

    # ------------------------------------------------------------------ phase programs

    def _program(self, name, fn, in_specs, out_specs):
        if name not in self._programs:
            self._programs[name] = self.g.phase(fn, in_specs, out_specs)
        return self._programs[name]

    def _run(self, name, program, *args):
        if self.memory is not None:
            self.memory.record(name, program, args)
        return self._settle(program(*args))

    def _settle(self, out):
        """``out``, finished first when programs must not overlap (see ``_serial``)."""
        return jax.block_until_ready(out) if self._serial else out

    def embeddings_fwd(self, stream: int):
        lay = self.rest_layouts["shared"]

        def fn(shared, ids, rng_data):
            w = S.gather_weight(shared, lay).astype(self.opts.compute_dtype)
            rng = self._base_rng(rng_data)

            def body(_, inp):
                ids_i, i = inp
                return None, self._slice_act(t5.embeddings(w, ids_i, self.opts, S.TP, self._micro_rng(rng, i, stream)))

            return lax.scan(body, None, (ids, jnp.arange(ids.shape[0])))[1]

        return self._program(f"embeddings_fwd{stream}", fn,
                             (self.rest_specs["shared"], P(None, S.DP, None), P()), self.act_spec)

    def embeddings_bwd(self, stream: int):
        lay = self.rest_layouts["shared"]

        def fn(shared, ids, dy, rng_data):
            w = S.gather_weight(shared, lay)
            dy = self._gather_act(dy)
            rng = self._base_rng(rng_data)

            def body(acc, inp):
                ids_i, dy_i, i = inp
                r = self._micro_rng(rng, i, stream)
                _, vjp = jax.vjp(lambda w: t5.embeddings(w.astype(self.opts.compute_dtype), ids_i, self.opts, S.TP, r), w)
                return acc + vjp(dy_i)[0], None

            g = lax.scan(body, jnp.zeros_like(w), (ids, dy, jnp.arange(ids.shape[0])))[0]
            return self._reduce(g, lay)

        return self._program(f"embeddings_bwd{stream}", fn,
                             (self.rest_specs["shared"], P(None, S.DP, None), self.act_spec, P()),
                             self.rest_specs["shared"])

    def _mask_specs(self, masks):
        return {k: P(None, S.DP, None) for k in masks}

    def layer_fwd(self, stack: str, masks: dict):
        decoder = stack == "decoder"
        row_lay, rel_lay = self.row_layouts[stack], self.rest_layouts[stack]["relpos"]
        stream = 21 if decoder else 11

        def fn(lp, relpos, x, enc, masks, rng_data, j):
            lp, relpos = S.gather_all(lp, row_lay), S.gather_weight(relpos, rel_lay)
            x = self._gather_act(x)
            enc = self._gather_act(enc) if decoder else x
            rng = self._base_rng(rng_data)

            def body(_, inp):
                x_i, e_i, m_i, i = inp
                f = self._layer_fn(decoder, m_i, self._micro_rng(rng, i, stream, j))
                y = f(lp, relpos, x_i, e_i) if decoder else f(lp, relpos, x_i)
                return None, self._slice_act(y)

            return lax.scan(body, None, (x, enc, masks, jnp.arange(x.shape[0])))[1]

        key = f"{stack}_layer_fwd_{'-'.join(sorted(masks))}"
        return self._program(key, fn, (self.row_specs[stack], self.rest_specs[stack]["relpos"], self.act_spec,
                                       self.act_spec, self._mask_specs(masks), P(), P()), self.act_spec)

    def layer_bwd(self, stack: str, masks: dict):
        """Recompute one layer's forward from its stored input and run its backward over all micro-batches."""
        decoder = stack == "decoder"
        row_lay, rel_lay = self.row_layouts[stack], self.rest_layouts[stack]["relpos"]
        stream = 21 if decoder else 11

        def fn(lp, relpos, x, enc, dy, masks, rng_data, j):
            lp, relpos = S.gather_all(lp, row_lay), S.gather_weight(relpos, rel_lay)
            x, dy = self._gather_act(x), self._gather_act(dy)
            enc = self._gather_act(enc) if decoder else x
            rng = self._base_rng(rng_data)

            def body(acc, inp):
                x_i, e_i, dy_i, m_i, i = inp
                f = self._layer_fn(decoder, m_i, self._micro_rng(rng, i, stream, j))
                if decoder:
                    _, vjp = jax.vjp(f, lp, relpos, x_i, e_i)
                    g_lp, g_rel, dx, de = vjp(dy_i)
                else:
                    _, vjp = jax.vjp(f, lp, relpos, x_i)
                    (g_lp, g_rel, dx), de = vjp(dy_i), jnp.zeros((), x_i.dtype)
                acc = jax.tree.map(jnp.add, acc, (g_lp, g_rel))
                return acc, (self._slice_act(dx), self._slice_act(de) if decoder else de)

            zeros = jax.tree.map(jnp.zeros_like, (lp, relpos))
            (g_lp, g_rel), (dx, de) = lax.scan(body, zeros, (x, enc, dy, masks, jnp.arange(x.shape[0])))
            return self._reduce(g_lp, row_lay), self._reduce(g_rel, rel_lay), dx, de

        key = f"{stack}_layer_bwd_{'-'.join(sorted(masks))}"
        de_spec = self.act_spec if decoder else P()
        return self._program(key, fn, (self.row_specs[stack], self.rest_specs[stack]["relpos"], self.act_spec,
                                       self.act_spec, self.act_spec, self._mask_specs(masks), P(), P()),
                             (self.row_specs[stack], self.rest_specs[stack]["relpos"], self.act_spec, de_spec))

    def encoder_head_fwd(self):
        lay = self.rest_layouts["encoder"]["final_norm"]

        def fn(w, x, rng_data):
            w, x, rng = S.gather_weight(w, lay), self._gather_act(x), self._base_rng(rng_data)

            def body(_, inp):
                x_i, i = inp
                return None, self._slice_act(t5.encoder_head(w, x_i, self.opts, self._micro_rng(rng, i, 12)))

            return lax.scan(body, None, (x, jnp.arange(x.shape[0])))[1]

        return self._program("encoder_head_fwd", fn, (self.rest_specs["encoder"]["final_norm"], self.act_spec, P()),
                             self.act_spec)

    def encoder_head_bwd(self):
        lay = self.rest_layouts["encoder"]["final_norm"]

        def fn(w, x, dy, rng_data):
            w, x, dy, rng = S.gather_weight(w, lay), self._gather_act(x), self._gather_act(dy), self._base_rng(rng_data)

            def body(acc, inp):
                x_i, dy_i, i = inp
                r = self._micro_rng(rng, i, 12)
                _, vjp = jax.vjp(lambda w, x: t5.encoder_head(w, x, self.opts, r), w, x_i)
                g_w, dx = vjp(dy_i)
                return acc + g_w, self._slice_act(dx)

            g, dx = lax.scan(body, jnp.zeros_like(w), (x, dy, jnp.arange(x.shape[0])))
            return self._reduce(g, lay), dx

        spec = self.rest_specs["encoder"]["final_norm"]
        return self._program("encoder_head_bwd", fn, (spec, self.act_spec, self.act_spec, P()), (spec, self.act_spec))

    def _head_keys(self):
        return ("shared",) if self.opts.tie_word_embeddings else ("lm_head",)

    def head_subtree(self, rest):
        out = {"decoder": {"final_norm": rest["decoder"]["final_norm"]}}
        for k in self._head_keys():
            out[k] = rest[k]
        return out

    def head(self):
        """Final norm + LM head + loss and its gradient, in one phase as in the original."""
        lay = self.head_subtree(self.rest_layouts)
        specs = self.head_subtree(self.rest_specs)
        scale = self.scale

        def fn(hp, x, labels, rng_data):
            hp, x, rng = S.gather_all(hp, lay), self._gather_act(x), self._base_rng(rng_data)
            count = lax.psum(jnp.sum(labels != -100), S.DP).astype(F32)

            def body(acc, inp):
                x_i, lab_i, i = inp
                r = self._micro_rng(rng, i, 30)
                loss, (g_hp, dx) = jax.value_and_grad(
                    lambda hp, x: t5.head(self._cast(hp), x, lab_i, self.opts, S.TP, r) * (scale / count),
                    argnums=(0, 1))(hp, x_i)
                acc_g, acc_l = acc
                return (jax.tree.map(jnp.add, acc_g, g_hp), acc_l + loss), self._slice_act(dx)

            zeros = (jax.tree.map(jnp.zeros_like, hp), jnp.zeros((), F32))
            (g, loss), dx = lax.scan(body, zeros, (x, labels, jnp.arange(x.shape[0])))
            return lax.psum(loss, S.DP) / scale, self._reduce(g, lay), dx

        return self._program("head", fn, (specs, self.act_spec, P(None, S.DP, None), P()), (P(), specs, self.act_spec))

    @staticmethod
    @jax.jit
    def _add(a, b):
        return jax.tree.map(jnp.add, a, b)

    @staticmethod
    @jax.jit
    def _sum_squares(tree):
        return sum(jnp.sum(jnp.square(x.astype(F32))) for x in jax.tree.leaves(tree))

    def optimizer_phase(self, name: str, shardings):
        """(params, opt_state, grads, global norm) of one layer (or the rest) -> (params, opt_state)."""
        if f"opt_{name}" not in self._programs:
            max_norm = self.max_norm

            def fn(params, opt_state, grads, g_norm):
                grads = clip_by_norm(grads, g_norm, max_norm)
                updates, opt_state = self.optimizer.update(grads, opt_state, params)
                return optax.apply_updates(params, updates), opt_state

            # weights and optimizer state are loaded as copies (load(copy=True)) and donated: the
            # updated ones take their place on the device
            self._programs[f"opt_{name}"] = jax.jit(fn, donate_argnums=(0, 1))
        return self._programs[f"opt_{name}"]

    # ------------------------------------------------------------------ the step

    def loss_and_grads(self, ps: PhasedState, batch: dict, rng_data):
        """Forward, head and backward phases -> (loss, rest grads on device, {stack: [layer grads on host]}, sum of squares)."""
        L_ = self.layers
        masks_enc = {"attention_mask": batch["attention_mask"]}
        masks_dec = dict(masks_enc)
        if "decoder_attention_mask" in batch:
            masks_dec["decoder_attention_mask"] = batch["decoder_attention_mask"]
        x_buf, dx_buf = ActivationBuffer("x_buffer", L_ + 2), ActivationBuffer("dx_buffer", L_ + 2)
        x_dec, dx_dec = ActivationBuffer("x_dec_buffer", L_ + 1), ActivationBuffer("dx_dec_buffer", L_ + 1)
        dx_enc = ActivationBuffer("dx_enc_buffer", L_)
        self.last_buffers = {b.name: b for b in (x_buf, dx_buf, x_dec, dx_dec, dx_enc)}
        rest_dev = self.rest_dev
        load_act, store_act = self._load_act, self._store_act

        # ---- forward
        shared = self.load(ps.rest["shared"], rest_dev["shared"])
        x_buf[0] = store_act(self._run("embeddings_fwd", self.embeddings_fwd(10), shared, batch["input_ids"], rng_data))
        del shared
        relpos = self.load(ps.rest["encoder"]["relpos"], rest_dev["encoder"]["relpos"])
        fwd = self.layer_fwd("encoder", masks_enc)
        for j in range(L_):
            lp = self.load(ps.layers["encoder"][j], self.row_dev["encoder"])
            x = load_act(x_buf[j])
            x_buf[j + 1] = store_act(self._run("encoder_layer_fwd", fwd, lp, relpos, x, x, masks_enc, rng_data, j))
            del lp, x
        norm = self.load(ps.rest["encoder"]["final_norm"], rest_dev["encoder"]["final_norm"])
        x_buf[L_ + 1] = store_act(self._run("encoder_head_fwd", self.encoder_head_fwd(), norm, load_act(x_buf[L_]),
                                            rng_data))
        shared = self.load(ps.rest["shared"], rest_dev["shared"])
        x_dec[0] = store_act(self._run("embeddings_fwd", self.embeddings_fwd(20), shared, batch["decoder_input_ids"],
                                       rng_data))
        del shared
        relpos = self.load(ps.rest["decoder"]["relpos"], rest_dev["decoder"]["relpos"])
        fwd = self.layer_fwd("decoder", masks_dec)
        for j in range(L_):
            lp = self.load(ps.layers["decoder"][j], self.row_dev["decoder"])
            x, enc = load_act(x_dec[j]), load_act(x_buf[L_ + 1])
            x_dec[j + 1] = store_act(self._run("decoder_layer_fwd", fwd, lp, relpos, x, enc, masks_dec, rng_data, j))
            del lp, x, enc

        # ---- head: loss and its backward
        hp = self.load(self.head_subtree(ps.rest), self.head_subtree(rest_dev))
        loss, g_head, dy = self._run("head", self.head(), hp, load_act(x_dec[L_]), batch["labels"], rng_data)
        dx_dec[L_] = store_act(dy)
        del hp, dy
        rest_grads = {k: None for k in _flat(ps.rest)}

        def accumulate(subtree_grads, prefix=""):
            for k, v in _flat(subtree_grads).items():
                k = prefix + k
                rest_grads[k] = v if rest_grads[k] is None else self._add(rest_grads[k], v)

        accumulate(g_head)
        sumsq = jnp.zeros((), F32)
        layer_grads = {s: [None] * L_ for s in STACKS}

        # ---- backward, decoder
        bwd = self.layer_bwd("decoder", masks_dec)
        for j in reversed(range(L_)):
            lp = self.load(ps.layers["decoder"][j], self.row_dev["decoder"])
            g_lp, g_rel, dx, de = self._run("decoder_layer_bwd", bwd, lp, relpos, load_act(x_dec[j]),
                                            load_act(x_buf[L_ + 1]), load_act(dx_dec[j + 1]), masks_dec, rng_data, j)
            dx_dec[j], dx_enc[j] = store_act(dx), store_act(de)
            sumsq = sumsq + self._settle(self._sum_squares(g_lp))
            layer_grads["decoder"][j] = self.store(g_lp, self.row_dev["decoder"])
            accumulate(g_rel, "['decoder']['relpos']")
            del lp, g_lp, dx, de
        # after the first decoder layer's backward: the encoder output's gradient is the sum of the rows
        total = load_act(dx_enc[0])
        for j in range(1, L_):
            total = self._add(total, load_act(dx_enc[j]))
        dx_buf[L_ + 1] = store_act(total)
        del total
        shared = self.load(ps.rest["shared"], rest_dev["shared"])
        accumulate(self._run("embeddings_bwd", self.embeddings_bwd(20), shared, batch["decoder_input_ids"],
                             load_act(dx_dec[0]), rng_data), "['shared']")
        del shared

        # ---- backward, encoder
        g_norm, dx = self._run("encoder_head_bwd", self.encoder_head_bwd(), norm, load_act(x_buf[L_]),
                               load_act(dx_buf[L_ + 1]), rng_data)
        dx_buf[L_] = store_act(dx)
        accumulate(g_norm, "['encoder']['final_norm']")
        del norm, dx
        relpos = self.load(ps.rest["encoder"]["relpos"], rest_dev["encoder"]["relpos"])
        bwd = self.layer_bwd("encoder", masks_enc)
        for j in reversed(range(L_)):
            lp = self.load(ps.layers["encoder"][j], self.row_dev["encoder"])
            x = load_act(x_buf[j])
            g_lp, g_rel, dx, _ = self._run("encoder_layer_bwd", bwd, lp, relpos, x, x, load_act(dx_buf[j + 1]),
                                           masks_enc, rng_data, j)
            dx_buf[j] = store_act(dx)
            sumsq = sumsq + self._settle(self._sum_squares(g_lp))
            layer_grads["encoder"][j] = self.store(g_lp, self.row_dev["encoder"])
            accumulate(g_rel, "['encoder']['relpos']")
            del lp, x, g_lp, dx
        shared = self.load(ps.rest["shared"], rest_dev["shared"])
        accumulate(self._run("embeddings_bwd", self.embeddings_bwd(10), shared, batch["input_ids"],
                             load_act(dx_buf[0]), rng_data), "['shared']")
        del shared

        treedef = jax.tree.structure(ps.rest)
        missing = [k for k, v in rest_grads.items() if v is None]
        if missing:  # e.g. lm_head when tied: no phase touched it
            raise RuntimeError(f"no gradient for {missing}")
        g_rest = jax.tree.unflatten(treedef, [rest_grads[k] for k in _flat(ps.rest)])
        sumsq = sumsq + self._settle(self._sum_squares(g_rest))
        return loss, g_rest, layer_grads, sumsq

    def train_step(self, ps: PhasedState, batch: dict, rng_data=None):
        """One optimizer step on one global batch, phase by phase -> (state, metrics)."""
        if rng_data is None:
            rng_data = jax.random.key_data(jax.random.fold_in(jax.random.key(self.g.cfg.model.seed), ps.step))
        loss, g_rest, layer_grads, sumsq = self.loss_and_grads(ps, batch, rng_data)
        g_norm = jnp.sqrt(sumsq)
        # ---- optimizer phases: the embedding, the LM head, the small rest, then one layer at a time
        groups = []
        for i, (grp, sh, state, g_grp) in enumerate(zip(rest_groups(ps.rest), rest_groups(self.rest_dev), ps.opt_rest,
                                                         rest_groups(g_rest))):
            osh = self.opt_shardings(f"rest{i}", grp, sh)
            params, state = self._run("optimizer", self.optimizer_phase(f"rest{i}", sh), self.load(grp, sh, copy=True),
                                      self.load(state, osh, copy=True), g_grp, g_norm)
            groups.append((self.store(params, sh), self.store(state, osh)))
            del params, state
        rest = {k: v for grp, _ in groups for k, v in grp.items()}
        rest = {k: rest[k] for k in ps.rest}
        opt_rest = [o for _, o in groups]
        del g_rest
        layers, opt_layers = {}, {}
        for s in STACKS:
            opt = self.optimizer_phase(s, self.row_dev[s])
            osh = self.opt_shardings(s, ps.layers[s][0], self.row_dev[s])
            layers[s], opt_layers[s] = [], []
            for j in range(self.layers):
                params, state = self._run("optimizer", opt, self.load(ps.layers[s][j], self.row_dev[s], copy=True),
                                          self.load(ps.opt_layers[s][j], osh, copy=True),
                                          self.load(layer_grads[s][j], self.row_dev[s]), g_norm)
                layers[s].append(self.store(params, self.row_dev[s]))
                opt_layers[s].append(self.store(state, osh))
                layer_grads[s][j] = None
        metrics = {"loss": loss, "grad_norm": g_norm}
        return PhasedState(ps.step + 1, rest, layers, opt_rest, opt_layers), metrics

    def stacked_grads(self, g_rest, layer_grads) -> dict:
        """Gradients in the fused executor's (stacked) tree, for comparisons."""
        out = dict(g_rest)
        for s in STACKS:
            rows = layer_grads[s]
            out[s] = dict(out[s])
            out[s]["layers"] = jax.tree.map(lambda *r: np.stack([np.asarray(jax.device_get(x)) for x in r]), *rows)
        return out


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
