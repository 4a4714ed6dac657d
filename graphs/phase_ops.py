"""What the phased schedule (graphs/phased.py) runs on: ``DeviceOps`` on arrays (one program ahead of the devices
at most), ``TimingOps`` (every transfer and program waited for and timed) and ``PhaseMemory`` (each program's device
bytes); graphs/plan.py's ``PlanOps`` runs the same schedule on placeholders. And the schedule's two helpers: loading
the next layer while the current one runs (``prefetch``), and whether programs must run one at a time
(``serial_collectives``)."""

from __future__ import annotations

import math
import time

import jax
import jax.numpy as jnp

from graphs.transfers import Transfers
from partitioning import sharding as S
from partitioning.memory import live_device_bytes, program_bytes
from partitioning.sharding import HOST


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
