"""Loss scaling, static or dynamic, decided on the host from each step's gradient norm.

A step multiplies its loss by the scale and divides the gradients by it (the scale is an input of the step
programs, so changing it compiles nothing). The step itself skips its update when the global gradient norm is not
finite (``optim.update_group``): the weights and the optimizer state stay as they were. This object then follows
what happened, step by step, as PyTorch's GradScaler and DeepSpeed's dynamic scaler do:

- an overflow (a non-finite norm) halves the scale and counts a skipped step;
- ``window`` good steps in a row double it;
- ``max_skipped`` skipped steps in a row mean the run is broken (every step overflows whatever the scale, e.g. a
  forward pass that overflows): the driver then stops as for any non-finite run.

Its state (a few numbers) goes into every checkpoint's metadata, so a resumed run continues with the same scale.
With a static scale nothing changes, and the first non-finite step stops the run. It also keeps the last applied
step's gradient norm, which ``execution.update_in_backward`` clips the next step with.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LossScale:
    scale: float = 1.0
    dynamic: bool = False
    window: int = 1000
    max_skipped: int = 16
    good_steps: int = 0  # good steps in a row since the last change of the scale
    skipped_in_a_row: int = 0
    skipped_total: int = 0
    last_norm: float = 0.0  # the global gradient norm of the last applied step (0: none yet)

    @classmethod
    def of_config(cls, cfg) -> "LossScale":
        ex = cfg.execution
        return cls(scale=cfg.initial_loss_scale, dynamic=cfg.dynamic_loss_scaling, window=ex.loss_scale_window,
                   max_skipped=ex.max_skipped_steps)

    def update(self, grad_norm: float) -> bool:
        """Follows one step whose global gradient norm was ``grad_norm``; -> whether the step was applied (False: it
        overflowed and the step program skipped its update)."""
        if math.isfinite(grad_norm):
            self.skipped_in_a_row, self.last_norm = 0, float(grad_norm)
            if self.dynamic:
                self.good_steps += 1
                if self.good_steps >= self.window:
                    self.scale, self.good_steps = self.scale * 2.0, 0
            return True
        self.skipped_in_a_row += 1
        self.skipped_total += 1
        if self.dynamic:
            self.scale, self.good_steps = self.scale / 2.0, 0
        return False

    @property
    def gave_up(self) -> bool:
        """Whether the run must stop: any non-finite step without dynamic scaling, else ``max_skipped`` in a row."""
        return self.skipped_in_a_row >= (self.max_skipped if self.dynamic else 1)

    def state(self) -> dict:
        """What a checkpoint records (its metadata)."""
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped_in_a_row": self.skipped_in_a_row,
                "skipped_total": self.skipped_total, "last_norm": self.last_norm}

    def restore(self, state: dict | None) -> None:
        """Continues from a checkpoint's ``state()``; a checkpoint without one (static scaling, or written before
        dynamic scaling existed) keeps the configured start. A dynamic run keeps its scale; a static one its own."""
        if not state:
            return
        self.last_norm = float(state.get("last_norm", 0.0))
        if not self.dynamic:
            return
        self.scale = float(state["scale"])
        self.good_steps = int(state.get("good_steps", 0))
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.skipped_total = int(state.get("skipped_total", 0))
