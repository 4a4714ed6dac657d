"""The README's figures in imgs/, each drawn from a result file that a named command writes.

    python3 benchmarks/figures.py              # all of them, from the files in benchmarks/results/
    python3 benchmarks/figures.py loss-curve ckpt/tiny/metrics.jsonl    # -> ckpt/tiny/quickstart_loss_curve.png
    python3 benchmarks/figures.py memory benchmarks/results/cpu/phased_memory.json
    python3 benchmarks/figures.py throughput benchmarks/results/cpu/compare_mnli.json
    python3 benchmarks/figures.py precision benchmarks/results/cpu/precision.json

- loss-curve: the quickstart's loss (raw and smoothed) and learning rate, from the metrics.jsonl of
  ``python3 run_finetuning.py --config tiny --save ckpt/tiny``;
- memory: device bytes of the fused and the phased executor as the model deepens, from
  ``python3 benchmarks/phased_memory.py --json benchmarks/results/cpu/phased_memory.json``;
- throughput: training examples/s of ours packed and unpacked against HF PyTorch eager and compiled,
  from ``python3 benchmarks/compare.py --only train --lengths mnli ... --json benchmarks/results/cpu/compare_mnli.json``;
- precision: the tiny run's loss curves and validation accuracy in float32, bfloat16, bfloat16 weights with
  stochastic rounding and float16 with dynamic loss scaling, from
  ``python3 benchmarks/precision.py --json benchmarks/results/cpu/precision.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
RESULTS = os.path.join(ROOT, "benchmarks", "results")
IMGS = os.path.join(ROOT, "imgs")
GIB = 2 ** 30


def _figure(size):
    from matplotlib.figure import Figure  # no pyplot: nothing global is switched

    fig = Figure(figsize=size)
    return fig, fig.subplots()


def loss_curve(metrics: str, out: str) -> str:
    """imgs/quickstart_loss_curve.png from a run's metrics.jsonl (the run's own loss_curve.png drawing)."""
    from app.tracking import plot_loss_curve

    plot_loss_curve(metrics, out, "tiny preset, offline quickstart")
    return out


def memory(report: str, out: str) -> str:
    """Device GiB against layers per stack, fused and phased (benchmarks/phased_memory.py's JSON)."""
    with open(report) as f:
        data = json.load(f)
    rows = data["rows"]
    layers = [r["layers"] for r in rows]
    fig, ax = _figure((6.5, 3.8))
    ax.plot(layers, [r["fused_device_bytes"] / GIB for r in rows], "o-", label="fused: all weights and state on device")
    ax.plot(layers, [r["phased_device_bytes"] / GIB for r in rows], "s-", label="phased: one layer at a time")
    for r in rows:
        ax.annotate(f"{r['parameters'] / 1e6:.0f}M", (r["layers"], r["fused_device_bytes"] / GIB),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    ax.set_xlabel("layers per stack")
    ax.set_ylabel("device memory (GiB)")
    ax.set_xticks(layers)
    ax.set_ylim(0, max(r["fused_device_bytes"] for r in rows) / GIB * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    kind = rows[0].get("device_kind", "")
    ax.set_title(f"Device memory, {data['config']} shape ({kind}): live arrays + XLA temporaries", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def throughput(report: str, out: str) -> str:
    """Training examples/s of every run of a compare.py --lengths mnli JSON, as bars."""
    with open(report) as f:
        data = json.load(f)
    training = data["training"]
    names = [n for n in training if training[n]["examples_per_s"]]
    values = [training[n]["examples_per_s"] for n in names]
    colours = ["tab:blue" if n.startswith("ours packed") else "tab:cyan" if n.startswith("ours") else "tab:gray"
               for n in names]
    fig, ax = _figure((6.5, 3.9))
    bars = ax.bar(names, values, color=colours)
    for b, v in zip(bars, values):
        ax.annotate(f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), textcoords="offset points", xytext=(0, 3),
                    ha="center", fontsize=8)
    a = data["args"]
    ax.set_ylabel("training examples / s")
    kind = next((r.get("device_kind") for rs in data["runs"].values() for r in rs if r and r.get("device_kind")), "")
    ax.set_title(f"Fine-tuning throughput ({kind}): {a['config']} shape, MNLI-like prompt lengths,\n"
                 f"rows of {a['sequence_length']} tokens, batch {a['batch']} rows, {a['precision']}; ours packed or "
                 "one example a row;\nHF padded to the longest prompt of each micro-batch", fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def precision(report: str, out: str) -> str:
    """Loss curves (smoothed) of every run of a benchmarks/precision.py JSON, with validation accuracy, skipped
    steps and time against float32 in the legend."""
    import numpy as np

    from app.tracking import smooth

    with open(report) as f:
        data = json.load(f)
    fig, ax = _figure((6.5, 4.0))
    colours = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for (name, r), colour in zip(data["runs"].items(), colours):
        steps = [i + 1 for i, v in enumerate(r["loss"]) if v is not None]
        loss = [v for v in r["loss"] if v is not None]
        weight = min(0.98, max(0.0, 1 - 25 / max(len(loss), 1)))
        label = f"{name}: accuracy {r['accuracy']:.1%}"
        if r.get("skipped_steps"):
            label += f", {r['skipped_steps']} steps skipped"
        if r.get("time_vs_float32"):
            label += f", time {r['time_vs_float32']:.2f}x float32's"
        ax.plot(steps, np.exp(smooth(list(np.log(loss)), weight)), color=colour, linewidth=1.6, label=label)
    a = data["args"]
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (token mean, smoothed)")
    ax.set_title(f"Precisions on the {a['config']} preset ({a['steps']} steps, {data['device_kind']}): "
                 "same seed and data;\naccuracy on its validation split (run_validation.py)", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7.5, loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("figure", nargs="?", choices=("all", "loss-curve", "memory", "throughput", "precision"), default="all")
    p.add_argument("source", nargs="?", default=None, help="the result file (default: the committed one)")
    p.add_argument("--out_dir", default=None,
                   help="where the figures go (default: beside SOURCE when one is given; the tracked imgs/ only "
                        "when redrawing the committed figures from the committed results)")
    a = p.parse_args(argv)
    if a.out_dir is None:
        a.out_dir = os.path.dirname(os.path.abspath(a.source)) if a.source else IMGS
    os.makedirs(a.out_dir, exist_ok=True)
    jobs = {
        "loss-curve": (loss_curve, os.path.join(RESULTS, "cpu", "quickstart_metrics.jsonl"), "quickstart_loss_curve.png"),
        "memory": (memory, os.path.join(RESULTS, "cpu", "phased_memory.json"), "phased_memory.png"),
        "throughput": (throughput, os.path.join(RESULTS, "cpu", "compare_mnli.json"), "throughput.png"),
        "precision": (precision, os.path.join(RESULTS, "cpu", "precision.json"), "precision.png"),
    }
    chosen = list(jobs) if a.figure == "all" else [a.figure]
    made = []
    for name in chosen:
        fn, default, file = jobs[name]
        source = a.source if a.source and a.figure != "all" else default
        if not os.path.exists(source):
            sys.exit(f"error: {source} does not exist: run the command in this script's docstring to make it")
        made.append(fn(source, os.path.join(a.out_dir, file)))
        print(f"{name}: {source} -> {made[-1]}")
    return made


if __name__ == "__main__":
    main()
