"""One interface, two executors: the driver picks one once, from ``execution.phased``.

    init_state(params=None)           -> state     fresh optimizer state; random weights when None
    restore(directory, step, optim)   -> (state, checkpoint meta)
    warm_start(directory, step)       -> state at step 0 from a checkpoint's weights, fresh optimizer state
    train_step(state, batch, rng, loss_scale, clip_norm) -> (state, {"loss", "grad_norm"})
    loss_and_grads(state, batch, rng, loss_scale)        -> (mean token loss, float32 gradients in the stacked
                                                            layout, unscaled); the state is not changed
    to_checkpoint(state)              -> TrainState in the stacked layout that checkpoints hold
    plan(exact=False)                 -> TrainingPlan from shapes alone (graphs/plan.py), nothing allocated
    memory_report(state, batch)       -> (state, device bytes at the step's peak, {phase: bytes} or None)
    timing_report(state, batch)       -> (state, {load_s, store_s, compute_s, serial_step_s} or None)
    weights(state)                    -> the model's weights, stacked, as decoding reads them (LoRA: merged)

LoRA (modelling/lora.py): the trained weights are the adapters; the frozen base is the executor's own, kept where it
reads it (fused: on the devices; phased: in host memory, streamed in a layer at a time):

    use_base(source)                  the base a ``base_source`` names (partitioning/base.py), and ``base``: its record
                                      (source and fingerprint) for checkpoints
    set_base(params=None)             the base from weights (None: the random init)
    base_fingerprint()                -> partitioning/base.py's fingerprint of the base

Both executors read and write the same checkpoints (stacked weights, optimizer state per
weight group), so a run may switch executors on ``--load``.
"""

from __future__ import annotations

from typing import Any, Protocol

from graphs.fused import FusedExecutor
from graphs.graphs import Graphs
from graphs.phased import PhasedExecutor
from graphs.state import TrainState


class Executor(Protocol):
    name: str
    g: Graphs

    def init_state(self, params=None) -> Any: ...

    def restore(self, directory: str, step: int, optim_state: bool = True) -> tuple: ...

    def warm_start(self, directory: str, step: int) -> Any: ...

    def train_step(self, state, batch: dict, rng_data=None, loss_scale=None, clip_norm=None) -> tuple: ...

    def loss_and_grads(self, state, batch: dict, rng_data=None, loss_scale=None) -> tuple: ...

    def to_checkpoint(self, state) -> TrainState: ...

    def plan(self, exact: bool = False): ...

    def memory_report(self, state, batch: dict) -> tuple: ...

    def timing_report(self, state, batch: dict) -> tuple: ...

    def weights(self, state) -> dict: ...

    base: dict | None

    def use_base(self, source: dict) -> None: ...

    def set_base(self, params=None) -> None: ...

    def base_fingerprint(self) -> str: ...


def make_executor(graphs: Graphs) -> Executor:
    """The fused executor, or the phased one when ``execution.phased``."""
    return PhasedExecutor(graphs) if graphs.phased else FusedExecutor(graphs)
