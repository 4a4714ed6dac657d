"""Memory plan: the device and host bytes a training run needs, from shapes alone, before any allocation.

Each executor computes its own plan (``plan(exact)``: a ``TrainingPlan``) with what this module provides; what a plan
is and the machine's memory it is checked against are partitioning/plan.py's.

Phased executor: the training step's own schedule runs once on placeholders (``PlanOps``)
instead of arrays. A placeholder has a shape, a dtype and a sharding; its bytes count as live
from its creation until the schedule drops its last reference, exactly as the real arrays'
would (CPython frees on the last reference), so the plan follows whatever the schedule keeps
alive, prefetched layers and held activation rows included. Each phase program is traced
abstractly (``jax.eval_shape``) for its outputs; with ``exact`` it is also compiled from the
abstract arguments for XLA's own count of its temporaries (slower: one compilation per program
kind, about what the run itself compiles).

Fused executor: the state, the batch, and the compiled step's temporaries (``exact``), else a
lower bound (state, gradient accumulator, weights cast to the compute dtype).

Device bytes are per device (the busiest); host bytes per process.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import jax
import numpy as np

from graphs.transfers import Transfers, format_bytes_table
from partitioning import sharding as S
from partitioning.plan import GIB, MemoryPlan, format_items, host_memory_limit, device_memory_limit, human_bytes
from partitioning.sharding import HOST_KINDS, shard_bytes
from utils.errors import FlanT5Error

# the bandwidth at which the plan says how long a step waits on the host link: PCIe 5.0 x16 pinned copies, as
# measured on an H100 machine (~52 GB/s each way); finetuning.py measures the machine's own
LINK_GB_PER_S = 52.0


class PlanError(FlanT5Error, RuntimeError):
    """A run that will not fit; the message names what does not fit and what to change."""


def _kind(sharding) -> str:
    return "host" if getattr(sharding, "memory_kind", None) in HOST_KINDS else "device"


class Ledger:
    """Live bytes by memory ('device' per device, 'host' per process) and by label; records peaks."""

    def __init__(self):
        self.live = {"device": {}, "host": {}}
        self.peak = {"device": (0, "", {}), "host": (0, "", {})}
        self.phase = "state"  # the phase being run (or last run)
        self.quiet = False  # while a program's outputs are created: its own peak was noted already

    def add(self, kind: str, label: str, nbytes: int) -> None:
        self.live[kind][label] = self.live[kind].get(label, 0) + nbytes
        if not self.quiet:
            self.note(kind)

    def free(self, kind: str, label: str, nbytes: int) -> None:
        self.live[kind][label] -= nbytes

    def total(self, kind: str) -> int:
        return sum(self.live[kind].values())

    def note(self, kind: str, extra: dict | None = None) -> None:
        items = {k: v for k, v in self.live[kind].items() if v}
        items.update(extra or {})
        total = sum(items.values())
        if total > self.peak[kind][0]:
            self.peak[kind] = (total, self.phase, items)


class Placeholder:
    """An array that is never allocated: shape, dtype, sharding. Counts in the ledger while referenced."""

    __slots__ = ("shape", "dtype", "sharding", "__weakref__")

    def __init__(self, ledger: Ledger, shape, dtype, sharding, label: str):
        self.shape, self.dtype, self.sharding = tuple(shape), np.dtype(dtype), sharding
        kind = _kind(sharding)
        n = shard_bytes(self.shape, self.dtype, sharding)
        if kind == "host":
            n *= len(sharding.addressable_devices)  # every local device's shard lives in this process's memory
        ledger.add(kind, label, n)
        weakref.finalize(self, ledger.free, kind, label, n)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def struct(self) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(self.shape, self.dtype, sharding=self.sharding)


def _is_placeholder(x) -> bool:
    return isinstance(x, Placeholder)


class PlanOps:
    """The phased schedule's operations on placeholders (graphs/phase_ops.py's DeviceOps on arrays)."""

    def __init__(self, exact: bool = False):
        self.ledger, self.exact = Ledger(), exact
        self.moved = Transfers()  # what the schedule moves over the host link, from shapes
        self._programs: dict = {}

    def new(self, shape, dtype, sharding, label: str) -> Placeholder:
        return Placeholder(self.ledger, shape, dtype, sharding, label)

    def abstract(self, tree, shardings, label: str):
        """Placeholders for a tree of arrays or ShapeDtypeStructs, in ``shardings``."""
        return jax.tree.map(lambda x, s: self.new(x.shape, x.dtype, s, label), tree, shardings)

    def load(self, tree, shardings, copy: bool = False, label: str = "loaded weights and state"):
        self.moved.add("load", label, tree, shardings)
        return jax.tree.map(lambda x, s: self.new(x.shape, x.dtype, s, label), tree, shardings,
                            is_leaf=_is_placeholder)

    def store(self, tree, shardings, label: str = "stored"):
        self.moved.add("store", label, tree, shardings)
        host = S.with_memory_kind(shardings, S.HOST)
        return jax.tree.map(lambda x, s: self.new(x.shape, x.dtype, s, label), tree, host, is_leaf=_is_placeholder)

    def zeros(self, shape, dtype, sharding, label: str = "gradient sums"):
        return self.new(shape, dtype, sharding, label)

    def is_finite(self, x) -> bool:
        return True  # the plan follows a step that updates

    def plan(self, executor: str) -> "TrainingPlan":
        """The plan of the schedule just run on these placeholders: its device and host peaks."""
        dev, host = self.ledger.peak["device"], self.ledger.peak["host"]
        return TrainingPlan(executor, dev[0], dev[1], dev[2], host[0], host[1], host[2], self.exact,
                          transfers=self.moved.summary())

    def run(self, name: str, program, *args, label: str = "phase outputs"):
        structs = jax.tree.map(lambda x: x.struct() if _is_placeholder(x) else x, args, is_leaf=_is_placeholder)
        sig = (id(program), str(jax.tree.map(lambda x: (x.shape, x.dtype, getattr(x, "sharding", None))
                                             if hasattr(x, "shape") else x, structs)))
        if sig not in self._programs:
            out = jax.eval_shape(program, *structs)
            temp = alias = 0
            if self.exact:
                analysis = program.lower(*structs).compile().memory_analysis()
                temp, alias = analysis.temp_size_in_bytes, analysis.alias_size_in_bytes
            self._programs[sig] = (out, temp, alias)
        out, temp, alias = self._programs[sig]
        out_bytes = sum(shard_bytes(o.shape, o.dtype, o.sharding) for o in jax.tree.leaves(out)
                        if _kind(o.sharding) == "device")
        extra = {"program temporaries": temp, "program outputs": max(out_bytes - alias, 0)}
        self.ledger.phase = name
        self.ledger.note("device", extra)  # inputs, temporaries and the outputs that reuse no donated input
        self.ledger.quiet = True
        try:
            return jax.tree.map(lambda o: self.new(o.shape, o.dtype, o.sharding, label), out)
        finally:
            self.ledger.quiet = False


# A phased run as one H100 ran it: Flan-T5-XXL (xxl_1gpu), 16 packed rows at MNLI-like lengths, --plan_exact
# (benchmarks/results/h100/fifteen/2_xxl_pool110_workstation/f15_xxl_1gpu.json, figures.rows16; docs/results.md's
# xxl-1gpu table; tests/graphs/test_plan.py holds these to that file): the allocator's peak over the exact plan's
# device bytes, the process's RSS over the host plan, the step over its floor. A phased plan says them where it
# prints, until a GPU run shows the plan counts what the run holds.
GPU_PHASED_MEASURED = {"device_over_plan": 2.51, "host_rss_over_plan": 1.78, "over_bound": 1.95}


def gpu_phased_note() -> str:
    """The line a phased plan prints: what it under-counts on a GPU, by the measured factors."""
    m = GPU_PHASED_MEASURED
    return (f"on a GPU this plan under-counts a phased run: on one H100 (xxl_1gpu, 16 rows, --plan_exact) the "
            f"allocator's peak was {m['device_over_plan']:.2f}x the exact device plan, the process's RSS "
            f"{m['host_rss_over_plan']:.2f}x the host plan (and the step {m['over_bound']:.2f}x its floor): size the "
            "GPU and the host by those factors (docs/results.md#xxl-1gpu)")


@dataclass
class TrainingPlan(MemoryPlan):
    """A training run's plan (partitioning/plan.py's ``MemoryPlan``), with the phased executor's traffic over the
    host link; it prints the traffic's table and names the knobs of a run that does not fit."""

    transfers: dict | None = None  # phased: what a step moves over the host link (graphs/transfers.py's summary)
    transfer_floor: dict | None = None  # phased: the least a step of its layout moves (graphs/transfers.py's floor)

    def format(self) -> str:
        how = "XLA's count of program temporaries" if self.exact else "program temporaries not counted: --plan counts them"
        lines = [f"memory plan ({self.executor} executor, {how}):",
                 f"  device: {human_bytes(self.device_peak)} per device at its peak ({self.device_phase}): "
                 f"{format_items(self.device_items)}",
                 f"  host:   {human_bytes(self.host_peak)} per process at its peak ({self.host_phase}): "
                 f"{format_items(self.host_items) or 'nothing'}"]
        if self.transfers and self.transfer_floor:
            lines.append(format_bytes_table(self.transfers, self.transfer_floor, LINK_GB_PER_S))
        notes = self.notes + ([gpu_phased_note()] if self.executor == "phased" else [])
        return "\n".join(lines + [f"  {n}" for n in notes])

    def check(self, device_limit: int | None, host_limit: int | None, cfg) -> None:
        """Raises PlanError (one line: what does not fit, and the knobs) if a limit is exceeded."""
        ex, phased = cfg.execution, cfg.execution.phased
        if device_limit and self.device_peak > device_limit:
            knobs = ["--micro_batch_size " + str(max(ex.micro_batch_size // 2, 1))]
            if not ex.recompute:
                knobs.append("--recompute true")
            knobs.append(f"--tensor_parallel {ex.tensor_parallel * 2} (more devices)")
            if not phased:
                knobs.append("--phased true (weights and optimizer state in host memory)")
            raise PlanError(f"the run needs {self.device_peak / GIB:.1f} GiB per device ({self.device_phase}) but a "
                            f"device has {device_limit / GIB:.1f} GiB: try {', '.join(knobs)}")
        if host_limit and self.host_peak > host_limit:
            knobs = []
            state = sum(v for k, v in self.host_items.items()
                        if any(w in k for w in ("weights", "optimizer state", "compute copy")))
            if cfg.training.optimizer.name == "adamw":
                knobs.append("--optimizer adafactor (factored optimizer state)")
            grads = self.host_items.get("weight gradients", 0)
            if phased and grads and not cfg.dynamic_loss_scaling:
                knobs.append(f"--update_in_backward true (no layer gradients in host memory: {human_bytes(grads)} "
                             "less)")
            copies = self.host_items.get("compute copy", 0)
            if copies:
                knobs.append(f"--compute_copy false (the forward and the backward read the float32 masters: "
                             f"{human_bytes(copies)} less, more over the host link)")
            if phased and not cfg.training.stochastic_rounding and cfg.model.precision != "float32":
                knobs.append("--stochastic_rounding true (16-bit master weights: half their bytes)")
            if state > host_limit:  # a smaller batch cannot help: the model's own state does not fit
                knobs.append(f"a machine with more than {human_bytes(state)} of memory (the weights and optimizer "
                             "state alone need that; a smaller batch cannot reduce it)")
            else:
                knobs.append(f"--global_batch_size {max(cfg.training.global_batch_size // 2, 1)} (fewer activation "
                             "rows)")
            if not phased and state <= host_limit:
                knobs = ["fewer or shorter examples"]
            raise PlanError(f"the run needs {human_bytes(self.host_peak)} of host memory ({self.host_phase}: "
                            + format_items(self.host_items)
                            + f") but {human_bytes(host_limit)} is available: try {', '.join(knobs)}")


def plan(executor, exact: bool = False) -> TrainingPlan:
    """The memory plan of a run with this executor (its own ``plan``)."""
    return executor.plan(exact)


def check_fits(executor, cfg) -> TrainingPlan:
    """The plan from shapes (fast: no compilation), checked against this machine: PlanError if the run will
    not fit. On a CPU the devices' memory is host RAM, so both figures count against it."""
    p = plan(executor, exact=False)
    host_limit, device_limit = host_memory_limit(), device_memory_limit()
    if jax.local_devices()[0].platform == "cpu":
        need = p.host_peak + p.device_peak * len(jax.local_devices())
        combined = TrainingPlan(p.executor, 0, p.device_phase, {}, need, "host and simulated devices together",
                              {**{f"host: {k}": v for k, v in p.host_items.items()},
                               "simulated devices": p.device_peak * len(jax.local_devices())}, p.exact)
        combined.check(None, host_limit, cfg)
        return p
    p.check(device_limit, host_limit, cfg)
    return p
