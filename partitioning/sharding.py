"""Mesh, logical-axis rules, replica groupings and RTS layouts; the memory kinds of host memory.

The mesh has axes ('dp', 'tp'). Model code names logical axes only; RULES maps
them to mesh axes. Every weight is identical over the mesh axes it is not
sharded on: that is its *replica group* (the original's replica grouping).
With RTS, a weight is stored sharded over its replica group along one more
dimension (its *RTS dim*), so every element lives on exactly one device:
it is all-gathered once per step and its gradient reduce-scattered once.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from modelling.params import ParamSpec, is_spec
from utils.errors import FlanT5Error

DP, TP = "dp", "tp"

# Megatron layout: heads (attention; kv_heads, the grouped key/value heads, with them), mlp (feed-forward inner dim), vocab
# (embedding rows and LM-head columns) and the relative-bias heads split over tp;
# everything else (embed, kv, layers, buckets) is whole on every tp device.
RULES = {"heads": TP, "kv_heads": TP, "mlp": TP, "vocab": TP}
HOST = "pinned_host"  # the host memory weights wait in (the phased executor's state, a streamed encoder's layers)
HOST_KINDS = (HOST, "unpinned_host")  # the memory kinds of host memory


class DeviceCountError(FlanT5Error, RuntimeError):
    """Fewer devices than the preset asks for."""


def make_mesh(data_parallel: int, tensor_parallel: int, devices=None) -> Mesh:
    """A ('dp', 'tp') mesh over the first dp * tp devices (all processes' devices)."""
    devices = jax.devices() if devices is None else devices
    need = data_parallel * tensor_parallel
    if len(devices) < need:
        platform = devices[0].platform if devices else "none"
        raise DeviceCountError(
            f"data_parallel * tensor_parallel = {data_parallel} * {tensor_parallel} = {need} devices are needed "
            f"but {len(devices)} {platform} device(s) are present: lower --data_parallel/--tensor_parallel, or on "
            f"CPU simulate them with XLA_FLAGS=--xla_force_host_platform_device_count={need}")
    if jax.process_count() > 1 and len(devices) != need:
        raise DeviceCountError(
            f"this {jax.process_count()}-process run has {len(devices)} devices but data_parallel * "
            f"tensor_parallel = {need}: a multi-process mesh must use every device of every process, so set "
            f"--data_parallel/--tensor_parallel to multiply to {len(devices)} (or start fewer processes)")
    return Mesh(np.asarray(devices[:need]).reshape(data_parallel, tensor_parallel), (DP, TP))


@dataclass(frozen=True)
class Layout:
    """Where one weight lives: tp spec, replica group and RTS dim."""

    tp_spec: tuple  # mesh axis (or None) per dim, from the logical axes
    group: tuple  # mesh axes the weight is identical over (its replica grouping)
    rts_dim: Optional[int]  # dim sharded over `group` when stored (None: stored replicated)

    @property
    def storage_spec(self) -> P:
        spec = list(self.tp_spec)
        if self.rts_dim is not None:
            spec[self.rts_dim] = self.group if len(self.group) > 1 else self.group[0]
        return P(*spec)

    @property
    def compute_spec(self) -> P:
        return P(*self.tp_spec)

    def row(self) -> "Layout":
        """The layout of one row of a stacked [layers, ...] weight."""
        return Layout(self.tp_spec[1:], self.group, None if self.rts_dim is None else self.rts_dim - 1)


def _layout(spec: ParamSpec, mesh: Mesh, rts: bool) -> Layout:
    tp_spec = tuple(RULES.get(a) for a in spec.axes)
    sizes = dict(mesh.shape)
    group = tuple(a for a in (DP, TP) if a not in tp_spec and sizes[a] > 1)
    rts_dim = None
    if rts and group:
        n = int(np.prod([sizes[a] for a in group]))
        # the largest unsharded dim that divides evenly over the group; never the stacked
        # `layers` dim, which the phased executor streams one row at a time
        candidates = [i for i, (s, t, a) in enumerate(zip(spec.shape, tp_spec, spec.axes))
                      if t is None and s % n == 0 and a != "layers"]
        if candidates:
            rts_dim = max(candidates, key=lambda i: spec.shape[i])
    return Layout(tp_spec, group, rts_dim)


def layouts(specs: dict, mesh: Mesh, rts: bool = True) -> dict:
    """Layout tree of a spec tree on a mesh."""
    return jax.tree.map(lambda s: _layout(s, mesh, rts), specs, is_leaf=is_spec)


def is_layout(x) -> bool:
    return isinstance(x, Layout)


def storage_shardings(lay: dict, mesh: Mesh) -> dict:
    return jax.tree.map(lambda l: NamedSharding(mesh, l.storage_spec), lay, is_leaf=is_layout)


def storage_specs(lay: dict) -> dict:
    return jax.tree.map(lambda l: l.storage_spec, lay, is_leaf=is_layout)


def follow_params(abstract_state, params, param_shardings, default):
    """Shardings for an optimizer-state tree: a leaf shaped like a weight, whose tree path ends with that
    weight's path (optax keeps its moments as copies of the parameter tree), gets that weight's sharding;
    any other leaf (step counts, factored moments) ``default``."""
    by_path = {tuple(p): (x.shape, s) for (p, x), s in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_leaves(param_shardings))}

    def pick(path, leaf):
        for k in range(len(path)):
            shape, s = by_path.get(tuple(path[k:]), (None, None))
            if shape is not None and leaf.shape == shape:
                return s
        return default

    return jax.tree_util.tree_map_with_path(pick, abstract_state)


def with_memory_kind(shardings, kind: str):
    """The same shardings in another memory (``HOST`` for the phased executor's remote buffers)."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings)


def put_global(x, sharding: NamedSharding) -> jax.Array:
    """A host array that every process holds alike -> one global array in ``sharding``.

    Each process places only the shards of its own devices, so this works for any
    mesh over any number of processes (dp across hosts, tp within or across them).
    """
    x = np.asarray(x)
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def fetch(x: jax.Array) -> np.ndarray:
    """The whole value of a (possibly multi-process) array on this host."""
    if x.is_fully_addressable or x.is_fully_replicated:
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


# --------------------------------------------------------------------------- inside shard_map


def gather_weight(x: jax.Array, l: Layout) -> jax.Array:
    """RTS all-gather of one weight over its replica group (inside shard_map)."""
    if l.rts_dim is None:
        return x
    return jax.lax.all_gather(x, l.group, axis=l.rts_dim, tiled=True)


def gather_all(params: dict, lay: dict) -> dict:
    """RTS all-gather of every weight of a tree (inside shard_map)."""
    return jax.tree.map(gather_weight, params, lay)


def reduce_gradient(g: jax.Array, l: Layout) -> jax.Array:
    """Sum of one weight's gradient over dp, as stored (inside shard_map).

    A weight's local gradient is a partial sum over the dp replicas and (by the
    Megatron construction) identical over tp when the weight is not tp-sharded.
    RTS: reduce-scatter over dp; for weights also replicated over tp, each tp
    device then keeps its own slice of the dp-summed shard.
    """
    if l.rts_dim is None:
        return jax.lax.psum(g, DP) if DP in l.group else g
    d = l.rts_dim
    if DP in l.group:
        g = jax.lax.psum_scatter(g, DP, scatter_dimension=d, tiled=True)
    if TP in l.group:
        n = g.shape[d] // jax.lax.axis_size(TP)
        g = jax.lax.dynamic_slice_in_dim(g, jax.lax.axis_index(TP) * n, n, axis=d)
    return g


def storage_axes(l: Layout) -> tuple:
    """The mesh axes a weight's stored shards are split over (each device holds a distinct part)."""
    out = []
    for a in l.storage_spec:
        out += list(a) if isinstance(a, tuple) else ([a] if a is not None else [])
    return tuple(out)


def sum_of_squares(grads, lay) -> jax.Array:
    """Sum of squares of a tree in its storage layout, over the whole mesh (inside shard_map):
    each weight's local sum is added up over the axes its shards are split over, not over the
    axes it is replicated on."""
    total = jnp.zeros((), jnp.float32)
    for g, l in zip(jax.tree.leaves(grads), jax.tree.leaves(lay, is_leaf=is_layout)):
        s = jnp.sum(jnp.square(g.astype(jnp.float32)))
        axes = storage_axes(l)
        total = total + (jax.lax.psum(s, axes) if axes else s)
    return total


# --------------------------------------------------------------------------- reporting


def shard_bytes(shape, dtype, sharding) -> int:
    """Bytes of one device's shard of an array."""
    shard = sharding.shard_shape(tuple(shape)) if sharding is not None else tuple(shape)
    return int(np.prod(shard, dtype=np.int64)) * np.dtype(dtype).itemsize


def per_device_bytes(tree) -> dict:
    """{device: bytes} of the shards of every array in a tree, read from their shardings."""
    out: dict = {}
    for x in jax.tree_util.tree_leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + s.data.nbytes
    return out


def sharding_snapshot(specs: dict, lay: dict) -> dict:
    """{weight: {shape, axes, storage, group}}: the golden-snapshot form of a layout tree."""
    flat_s = jax.tree_util.tree_flatten_with_path(specs, is_leaf=is_spec)[0]
    flat_l = jax.tree_util.tree_leaves(lay, is_leaf=is_layout)
    out = {}
    for (path, s), l in zip(flat_s, flat_l):
        out[jax.tree_util.keystr(path)] = {
            "shape": list(s.shape), "axes": list(s.axes),
            "storage": [list(a) if isinstance(a, tuple) else a for a in l.storage_spec],
            "group": list(l.group),
        }
    return out


def write_snapshot(snapshot: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(snapshot, f, indent=1, sort_keys=True)
