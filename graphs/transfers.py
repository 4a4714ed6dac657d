"""What a phased step moves over the host link, and the least its state layout allows.

``Transfers`` counts the bytes each load (host -> device) and store (device -> host) of the phased schedule moves,
per device (each accelerator has its own link), by phase (forward, head, backward, optimizer) and by what moved
(weights in the compute dtype, master weights, optimizer state, weight gradients, activation rows, the frozen base).
The schedule's own operations count as they move (graphs/phase_ops.py's DeviceOps, and graphs/plan.py's PlanOps, which
runs the same schedule on placeholders: the count of a step is known from shapes alone, before any allocation).

``floor`` is what one step of a layout must move: each weight read once for the forward and once for the backward
in the compute dtype (the weights outside the layers, which stay on the device for the whole step, once), the
master weights and optimizer state read and written once by their update, the layers' gradients written and read
once where they wait in host memory for the optimizer phase, the compute-dtype copy written once where it is kept
apart from the master, and every activation row written once and read once.

    layout                          loads per layer weight            stores per layer weight
    optimizer phase                 2 C + M + S + G                   G + M + S + C'
    update_in_backward              C + M + S                         M + S + C'

C: the weight in the compute dtype, M: its master, S: its optimizer state, G: its gradient (compute dtype), C': the
compute copy where it is kept apart from the master (bfloat16 compute over float32 masters), else 0. LoRA: the
trained weights are the adapters (C = M: they compute in float32), and the frozen base is read in the forward and
the backward of each layer (2 B).
"""

from __future__ import annotations

import jax

from partitioning.sharding import shard_bytes


def tree_bytes(tree, shardings) -> int:
    """Bytes of one device's shards of a tree of arrays (or placeholders, ShapeDtypeStructs) laid out in
    ``shardings`` (a tree of shardings, or one sharding for every leaf); None leaves hold nothing."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return 0
    shards = treedef.flatten_up_to(shardings) if isinstance(shardings, (dict, list, tuple)) else [shardings] * len(
        leaves)
    return sum(shard_bytes(x.shape, x.dtype, s) for x, s in zip(leaves, shards))


class Transfers:
    """Bytes moved per device, by (direction, phase, what); ``phase`` is set by the schedule as it goes."""

    def __init__(self):
        self.bytes: dict = {}
        self.phase = "forward"

    def reset(self) -> None:
        self.bytes = {}

    def add(self, direction: str, label: str, tree, shardings) -> None:
        key = (direction, self.phase, label or "other")
        self.bytes[key] = self.bytes.get(key, 0) + tree_bytes(tree, shardings)

    def total(self, direction: str) -> int:
        return sum(n for (d, _, _), n in self.bytes.items() if d == direction)

    def summary(self) -> dict:
        """{load_bytes, store_bytes, by_phase: {phase: {load, store}}, by_what: {what: {load, store}}}."""
        by_phase: dict = {}
        by_what: dict = {}
        for (d, phase, what), n in self.bytes.items():
            by_phase.setdefault(phase, {"load": 0, "store": 0})[d] += n
            by_what.setdefault(what, {"load": 0, "store": 0})[d] += n
        return {"load_bytes": self.total("load"), "store_bytes": self.total("store"), "by_phase": by_phase,
                "by_what": by_what}


def weight_costs(master: int, compute: int, state: int, grad: int, copy: int) -> dict:
    """Per-device bytes of one group of weights: {M, C, S, G, C'} (``copy``: of the compute copy kept apart from
    the master, 0 where none is)."""
    return {"M": master, "C": compute, "S": state, "G": grad, "C'": copy}


def floor(layers: list, rest: list, frozen_layers: int, frozen_rest: int, activations: int,
          in_backward: bool) -> dict:
    """The least a step of a layout moves (see the module docstring): ``layers`` and ``rest``: ``weight_costs`` of
    every layer's and of every non-layer weight group; ``frozen_*``: bytes of LoRA's frozen base (its layers, the
    rest); ``activations``: bytes of every activation row a step writes (and reads back) ->
    {load_bytes, store_bytes, items: {what: {load, store}}}."""
    items = {"weights": {"load": 0, "store": 0}, "master weights": {"load": 0, "store": 0},
             "optimizer state": {"load": 0, "store": 0}, "weight gradients": {"load": 0, "store": 0},
             "compute copy": {"load": 0, "store": 0}, "frozen base weights": {"load": 0, "store": 0},
             "activations": {"load": activations, "store": activations}}

    def add(what, load=0, store=0):
        items[what]["load"] += load
        items[what]["store"] += store

    for w in layers:
        add("weights", load=(1 if in_backward else 2) * w["C"])
        add("master weights", load=w["M"], store=w["M"])
        add("optimizer state", load=w["S"], store=w["S"])
        if not in_backward:
            add("weight gradients", load=w["G"], store=w["G"])
        add("compute copy", store=w["C'"])
    for w in rest:  # on the device from the forward to the backward; their gradients never leave it
        add("weights", load=w["C"])
        add("master weights", load=w["M"], store=w["M"])
        add("optimizer state", load=w["S"], store=w["S"])
        add("compute copy", store=w["C'"])
    add("frozen base weights", load=2 * frozen_layers + frozen_rest)
    items = {k: v for k, v in items.items() if v["load"] or v["store"]}
    return {"load_bytes": sum(v["load"] for v in items.values()), "store_bytes": sum(v["store"] for v in items.values()),
            "items": items}


def link_seconds(load_bytes: int, store_bytes: int, gb_per_s: float) -> float:
    """Seconds a step waits on a link of ``gb_per_s`` GB/s each way (loads and stores at once: PCIe is full
    duplex), when nothing hides it: the larger direction over the bandwidth."""
    return max(load_bytes, store_bytes) / (gb_per_s * 1e9)


def format_bytes_table(counted: dict, floor_: dict, gb_per_s: float | None = None) -> str:
    """A few lines: what a step moves by phase and by what, against its floor (and the link-bound time)."""
    gb = lambda n: f"{n / 1e9:.3f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"  # noqa: E731
    lines = [f"host link per step (per device): loads {gb(counted['load_bytes'])}, stores "
             f"{gb(counted['store_bytes'])}; floor of this layout: loads {gb(floor_['load_bytes'])}, stores "
             f"{gb(floor_['store_bytes'])} ({counted['load_bytes'] / max(floor_['load_bytes'], 1):.2f}x, "
             f"{counted['store_bytes'] / max(floor_['store_bytes'], 1):.2f}x)"]
    lines.append("  by phase: " + ", ".join(f"{p} {gb(v['load'])} in / {gb(v['store'])} out"
                                            for p, v in counted["by_phase"].items()))
    lines.append("  by what:  " + ", ".join(f"{w} {gb(v['load'])} in / {gb(v['store'])} out"
                                            for w, v in sorted(counted["by_what"].items())))
    if gb_per_s:
        lines.append(f"  at {gb_per_s:g} GB/s each way: {link_seconds(counted['load_bytes'], counted['store_bytes'], gb_per_s):.3f} s "
                     f"a step on the link (floor {link_seconds(floor_['load_bytes'], floor_['store_bytes'], gb_per_s):.3f} s)")
    return "\n".join(lines)


