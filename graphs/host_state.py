"""Host-resident state of the phased executor: the original's remote buffers.

Weights and optimizer state live in host memory (JAX's ``pinned_host`` memory kind), in their
RTS layout: the non-layer weights as one tree, and one entry per layer. A layer's entry has the
tree of one row of the stacked weights, so converting to and from the stacked layout that
checkpoints hold (and the fused executor trains) is a stack or unstack of every leaf, done shard
by shard on each process's own devices: the whole model never passes through one device.

Activation buffers hold one row per phase output, each [GA, batch, length, d], sharded over dp
on the batch and over tp on d (RTS on activations).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P, SingleDeviceSharding

from partitioning.sharding import HOST, put_global


@dataclass
class PhasedState:
    """The train state in host memory.

    rest: the weights outside the layers (shared, lm_head, relative biases, final norms: the
    TreeStructure's ``split_rest``), with their whole-tree paths; layers: {stack: [one weight tree per layer]}; opt: the optimizer
    state of the non-layer weight groups {shared, lm_head, small}; opt_layers: {stack: [one
    optimizer state per layer]}; copy_rest, copy_layers: the weights' compute-dtype copies, shaped as rest and
    layers with None where a weight is read from its master (None: no copies kept, execution.compute_copy).
    """

    step: int
    rest: Any
    layers: dict
    opt: dict
    opt_layers: dict
    copy_rest: Any = None
    copy_layers: Optional[dict] = None


def row_sharding(stacked: NamedSharding, memory_kind: str | None = None) -> NamedSharding:
    """The sharding of one row of a stacked array (the stacked axis is never sharded)."""
    spec = tuple(stacked.spec)[1:]
    return NamedSharding(stacked.mesh, P(*spec), memory_kind=memory_kind or stacked.memory_kind)


def _shard_data(x: jax.Array) -> dict:
    return {s.device: s.data for s in x.addressable_shards}


def unstack_rows(x: jax.Array, sharding: NamedSharding) -> list:
    """A stacked [rows, ...] array -> one array per row, in ``sharding`` (that of one row)."""
    kind = sharding.memory_kind
    shards = {d: np.asarray(a) for d, a in _shard_data(x).items()}
    out = []
    for i in range(x.shape[0]):
        arrays = [jax.device_put(shards[d][i], SingleDeviceSharding(d, memory_kind=kind))
                  for d in sharding.addressable_devices]
        out.append(jax.make_array_from_single_device_arrays(x.shape[1:], sharding, arrays))
    return out


def stack_rows(rows: list, sharding: NamedSharding) -> jax.Array:
    """The inverse of ``unstack_rows``: rows -> one [rows, ...] array in ``sharding``."""
    kind = sharding.memory_kind
    data = [_shard_data(r) for r in rows]
    arrays = [jax.device_put(np.stack([np.asarray(d[dev]) for d in data]), SingleDeviceSharding(dev, memory_kind=kind))
              for dev in sharding.addressable_devices]
    return jax.make_array_from_single_device_arrays((len(rows),) + rows[0].shape, sharding, arrays)


def to_rows(stacked_tree, stacked_shardings) -> list:
    """A tree of stacked leaves -> one tree per row (in host memory), leaf by leaf."""
    leaves, treedef = jax.tree.flatten(stacked_tree)
    shardings = treedef.flatten_up_to(stacked_shardings)
    per_leaf = [unstack_rows(x, row_sharding(s, HOST)) for x, s in zip(leaves, shardings)]
    n = len(per_leaf[0])
    return [jax.tree.unflatten(treedef, [rows[i] for rows in per_leaf]) for i in range(n)]


def rows_taken(leaves: list, stacked_shardings: list) -> list:
    """``to_rows`` of flat stacked leaves (numpy arrays every process holds alike, or arrays in any memory) that the
    caller gives up: each list entry is dropped as soon as its rows exist in host memory, so the weights pass through
    host memory about once (plus one leaf) instead of twice. -> per leaf, its rows."""
    out = []
    for i, s in enumerate(stacked_shardings):
        x, leaves[i] = leaves[i], None
        row = row_sharding(s, HOST)
        out.append(unstack_rows(x, row) if isinstance(x, jax.Array) else [put_global(x[r], row)
                                                                           for r in range(x.shape[0])])
        del x
    return out


def from_rows(rows: list, stacked_shardings):
    """The inverse of ``to_rows``: one tree per row -> a tree of stacked leaves in ``stacked_shardings``."""
    treedef = jax.tree.structure(rows[0])
    per_row = [treedef.flatten_up_to(r) for r in rows]
    shardings = treedef.flatten_up_to(stacked_shardings)
    return jax.tree.unflatten(treedef, [stack_rows([r[i] for r in per_row], s) for i, s in enumerate(shardings)])


def to_host(tree, shardings):
    """A tree in any memory -> host memory in ``shardings``' layout."""
    return jax.tree.map(lambda x, s: jax.device_put(x, s.with_memory_kind(HOST)), tree, shardings)


class ActivationBuffer:
    """Rows of host-resident activations, each [GA, batch, length, d]. A row is dropped once its last
    reader has run (``pop``), so only the rows still needed are kept alive."""

    def __init__(self, name: str, rows: int):
        self.name = name
        self.rows: list = [None] * rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if self.rows[i] is None:
            raise KeyError(f"{self.name} row {i} has not been written or was already freed")
        return self.rows[i]

    def __setitem__(self, i, value):
        self.rows[i] = value

    def pop(self, i):
        """Row i, which no later phase reads: the buffer lets go of it."""
        row = self[i]
        self.rows[i] = None
        return row
