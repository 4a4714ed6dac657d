"""Run logging: a metrics JSONL file and a loss-curve PNG in the run directory, and W&B."""

from __future__ import annotations

import json
import os
from typing import Optional


def library_versions() -> dict:
    import importlib.metadata as md

    out = {}
    for name in ("jax", "jaxlib", "optax", "orbax-checkpoint", "transformers", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


class Tracker:
    """Writes metrics.jsonl (one JSON per step) and, optionally, to Weights & Biases.

    ``enabled=False`` (every process but the first of a multi-process run) writes nothing.
    """

    def __init__(self, run_dir: str, config: dict, use_wandb: bool = False, wandb_name: Optional[str] = None,
                 resume: bool = False, enabled: bool = True):
        self.run_dir, self.enabled = run_dir, enabled
        self.wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self._file = open(self.path, "a" if resume else "w")
        if use_wandb:
            import wandb

            self.wandb = wandb.init(project="flan-t5-jax", name=wandb_name, dir=run_dir,
                                    config={"config": config, "versions": library_versions()})

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        plot_loss_curve(self.path, os.path.join(self.run_dir, "loss_curve.png"))
        if self.wandb is not None:
            self.wandb.finish()


def plot_loss_curve(metrics_path: str, png_path: str) -> None:
    """Loss against step from a metrics.jsonl, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    rows = [r for r in rows if "loss" in r]
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
