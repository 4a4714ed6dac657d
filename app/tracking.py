"""Run logging: a metrics JSONL file and a loss-curve PNG in the run directory, and W&B."""

from __future__ import annotations

import importlib.metadata as md
import json
import netrc
import os
from typing import Optional

import numpy as np

from utils.errors import FlanT5Error


def library_versions() -> dict:
    out = {}
    for name in ("jax", "jaxlib", "optax", "orbax-checkpoint", "transformers", "numpy"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def check_wandb() -> None:
    """--wandb needs a login unless W&B runs offline or disabled: fail before any work, with the fixes."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise FlanT5Error("--wandb needs the wandb package: pip install wandb, or drop --wandb") from None
    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        if netrc.netrc().authenticators(host):
            return
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        pass
    raise FlanT5Error("--wandb: W&B has no login on this machine: run `wandb login`, set WANDB_API_KEY, or set "
                      "WANDB_MODE=offline (sync later with `wandb sync`)")


class Tracker:
    """Writes metrics.jsonl (one JSON per step) and, optionally, to Weights & Biases.

    ``resume_step``: a resumed run keeps the lines up to its checkpoint's step and drops the later
    ones (an interrupted run logged steps past its last checkpoint; they are trained again).
    ``enabled=False`` (every process but the first of a multi-process run) writes nothing.
    """

    def __init__(self, run_dir: str, config: dict, use_wandb: bool = False, wandb_name: Optional[str] = None,
                 resume_step: int = 0, enabled: bool = True, name: Optional[str] = None):
        self.run_dir, self.enabled, self.name = run_dir, enabled, name or os.path.basename(os.path.abspath(run_dir))
        self.wandb = None
        if not enabled:
            return
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, "metrics.jsonl")
        kept = []
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= resume_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        self._file = open(self.path, "a")
        if use_wandb:
            import wandb

            try:
                self.wandb = wandb.init(project="flan-t5-jax", name=wandb_name, dir=run_dir,
                                        config={"config": config, "versions": library_versions()})
            except Exception as e:  # wandb raises its own types for login and network failures
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise FlanT5Error(f"--wandb: W&B could not start ({type(e).__name__}: {first}): check `wandb login`, "
                                  "or set WANDB_MODE=offline") from None

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps({"step": step, **metrics}) + "\n")
        self._file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)

    def close(self) -> None:
        if not self.enabled or self._file.closed:
            return
        self._file.close()
        plot_loss_curve(self.path, os.path.join(self.run_dir, "loss_curve.png"), self.name)
        if self.wandb is not None:
            self.wandb.finish()


def smooth(values: list, weight: float) -> list:
    """Exponential moving average with bias correction (TensorBoard's smoothing)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, start=1):
        avg = weight * avg + (1 - weight) * v
        out.append(avg / (1 - weight ** i))
    return out


def plot_loss_curve(metrics_path: str, png_path: str, title: Optional[str] = None) -> Optional[dict]:
    """Training loss against step (raw, and smoothed), with the learning rate on a second axis, and below it the
    task's scores of --eval_every where there are any, as a PNG. Returns what was drawn: {"title", "curves":
    [labels]} (None when there is nothing to plot)."""
    from matplotlib.figure import Figure  # no pyplot: the caller's backend (a notebook's) is left alone

    rows = [json.loads(line) for line in open(metrics_path) if line.strip()]
    evals = [r for r in rows if any(k.startswith("eval_") for k in r)]
    rows = [r for r in rows if "loss" in r]
    if not rows:
        return
    fig = Figure(figsize=(7, 6 if evals else 4))
    axes = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1)) if evals else [fig.subplots()]
    lines, labels = _plot_loss(axes[0], rows)
    if evals:
        more = _plot_scores(axes[1], evals)
        lines, labels = lines + more[0], labels + more[1]
    steps, loss = [r["step"] for r in rows], [r["loss"] for r in rows]
    heading = (f"fine-tuning: {title or os.path.basename(os.path.dirname(os.path.abspath(metrics_path)))}"
               f" ({steps[-1]} steps, last loss {loss[-1]:.4f})")
    axes[0].set_title(heading, fontsize=10)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    return {"title": heading, "curves": labels}


def _plot_loss(ax, rows: list) -> tuple:
    steps, loss = [r["step"] for r in rows], [r["loss"] for r in rows]
    ax.plot(steps, loss, color="tab:blue", alpha=0.3, linewidth=0.8, label="loss")
    weight = min(0.98, max(0.0, 1 - 50 / max(len(loss), 1)))  # a window of about a fiftieth of the run
    log = min(loss) > 0
    smoothed = np.exp(smooth(list(np.log(loss)), weight)) if log else smooth(loss, weight)  # geometric on a log axis
    ax.plot(steps, smoothed, color="tab:blue", linewidth=2, label="loss, smoothed")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (token mean)")
    if log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    lines, labels = ax.get_legend_handles_labels()
    if any("learning_rate" in r for r in rows):
        lr_ax = ax.twinx()
        lr_ax.plot(steps, [r.get("learning_rate", float("nan")) for r in rows], color="tab:orange", linewidth=1.2,
                   label="learning rate")
        lr_ax.set_ylabel("learning rate", color="tab:orange")
        lr_ax.tick_params(axis="y", colors="tab:orange")
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
        more = lr_ax.get_legend_handles_labels()
        lines, labels = lines + more[0], labels + more[1]
    ax.legend(lines, labels, loc="lower left", fontsize=8)
    return lines, labels


def _plot_scores(ax, rows: list) -> tuple:
    """The --eval_every scores (eval_accuracy, eval_exact_match, eval_rougeL ...) against step."""
    keys = sorted({k for r in rows for k in r if k.startswith("eval_") and isinstance(r[k], (int, float))})
    for k in keys:
        pts = [(r["step"], r[k]) for r in rows if k in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", linewidth=1.2, label=k)
    ax.set_xlabel("step")
    ax.set_ylabel("held-out score")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    return ax.get_legend_handles_labels()
