"""One interface, two executors: the driver picks one once, from ``execution.phased``.

    init_state(params=None)           -> state     fresh optimizer state; random weights when None
    restore(directory, step, optim)   -> (state, checkpoint meta)
    warm_start(directory, step)       -> state at step 0 from a checkpoint's weights, fresh optimizer state
    train_step(state, batch, rng)     -> (state, {"loss", "grad_norm"})
    to_checkpoint(state)              -> TrainState in the stacked layout that checkpoints hold
    plan(exact=False)                 -> MemoryPlan from shapes alone (graphs/plan.py), nothing allocated
    memory_report(state, batch)       -> (state, device bytes at the step's peak, {phase: bytes} or None)
    timing_report(state, batch)       -> (state, {load_s, store_s, compute_s, serial_step_s} or None)

Both executors read and write the same checkpoints (stacked weights, optimizer state per
weight group), so a run may switch executors on ``--load``.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from graphs import optim
from graphs import sharding as S
from graphs.graphs import Graphs, TrainState


class Executor(Protocol):
    name: str
    g: Graphs

    def init_state(self, params=None) -> Any: ...

    def restore(self, directory: str, step: int, optim_state: bool = True) -> tuple: ...

    def warm_start(self, directory: str, step: int) -> Any: ...

    def train_step(self, state, batch: dict, rng_data=None, loss_scale=None, clip_norm=None) -> tuple: ...

    def to_checkpoint(self, state) -> TrainState: ...

    def plan(self, exact: bool = False): ...

    def memory_report(self, state, batch: dict) -> tuple: ...

    def timing_report(self, state, batch: dict) -> tuple: ...


def make_executor(graphs: Graphs) -> Executor:
    """The fused executor, or the phased one when ``execution.phased``."""
    if graphs.cfg.execution.phased:
        from graphs.phased import PhasedExecutor

        return PhasedExecutor(graphs)
    from graphs.fused import FusedExecutor

    return FusedExecutor(graphs)


def restore_train_state(graphs: Graphs, directory: str, step: int, optim_state: bool = True,
                        memory_kind: str | None = None) -> tuple:
    """(stacked TrainState, meta) of a checkpoint, restored into the weights' layout (in
    ``memory_kind``, e.g. host memory); opt_state is None when not asked for or not saved.
    Targets come from shapes alone: no random weights are materialised first."""
    from utils import checkpoint as ckpt

    abstract = graphs.abstract_params()
    shardings = graphs.param_shardings if memory_kind is None else S.with_memory_kind(graphs.param_shardings,
                                                                                      memory_kind)
    opt_target = None
    if optim_state and ckpt.has_item(directory, step, "opt_state"):
        opt_abstract = jax.eval_shape(lambda p: optim.init_state(graphs.optimizer, p, graphs.tree), abstract)
        opt_target = ckpt.abstract_like(opt_abstract, graphs.opt_state_shardings(abstract, shardings))
    params, opt_state, meta = ckpt.load(directory, step, ckpt.abstract_like(abstract, shardings), opt_target,
                                        graphs.cfg)
    step_arr = jax.device_put(jax.numpy.asarray(meta["step"], jax.numpy.int32), graphs.replicated)
    return TrainState(step_arr, params, opt_state), meta
