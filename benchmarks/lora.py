"""LoRA against full fine-tuning, in both executors, and what a LoRA checkpoint holds.

    python3 benchmarks/lora.py --json benchmarks/results/cpu/lora.json      # ~10 min on a 2-core CPU
    python3 benchmarks/lora.py --config xxl_pod16 --phased_only -- --tensor_parallel 1 --micro_batch_size 4 ...

Each variant is one ``finetuning.py`` run on generated data (same preset, shape, seed and steps), in its own
process; the variants run in turn, ``--repeats`` times over, so that a slow spell of a shared machine falls on all of
them. The report holds each run's median step time, device bytes (live arrays + XLA's temporaries), planned device
and host peaks and trained weights, and the ratios LoRA / full of the same executor measured in this invocation.

It also counts, from shapes alone (nothing allocated), what a checkpoint of each LoRA preset holds (the adapters
and their AdamW moments, float32) against a full checkpoint of the same model with the preset's full fine-tuning
optimizer (AdamW: two moments; Adafactor: factored rows and columns). Arguments after ``--`` go to finetuning.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.bench import run_script, split_passthrough, write_json  # noqa: E402

LORA_PRESETS = ("gptj_lora_1gpu", "xxl_lora_1gpu", "ul2_lora_1gpu")
SHAPE = ["--sequence_length", "128", "--global_batch_size", "8", "--micro_batch_size", "4", "--data_parallel", "1",
         "--tensor_parallel", "1", "--precision", "float32", "--lengths", "uniform", "--packing", "false"]


def variants(rank: int, phased_only: bool) -> dict:
    """{name: finetuning.py flags}."""
    out = {}
    for phased in ((True,) if phased_only else (False, True)):
        ex = "phased" if phased else "fused"
        out[f"{ex}, full fine-tuning"] = ["--phased", str(phased).lower(), "--lora_rank", "0"]
        out[f"{ex}, LoRA rank {rank}"] = ["--phased", str(phased).lower(), "--lora_rank", str(rank)]
    return out


def one_run(flags: list, args, extra: list, tmp: str, i: int) -> dict:
    out = os.path.join(tmp, f"run{i}.json")
    run_script(["finetuning.py", "--config", args.config, "--steps", str(args.steps), "--json", out]
               + SHAPE + flags + extra)
    with open(out) as f:
        r = json.load(f)
    return {k: r[k] for k in ("median_step_s", "device_bytes_estimate", "plan_device_bytes", "plan_host_bytes",
                              "parameters", "losses")}


def checkpoint_sizes() -> dict:
    """{preset: adapters' checkpoint bytes, a full checkpoint's bytes (weights + the full run's optimizer state)}."""
    from app.runtime import ensure_host_devices

    ensure_host_devices(1)
    from config.presets import load_config
    from graphs.graphs import Graphs
    from modelling.params import count_params

    out = {}
    for name in LORA_PRESETS:
        cfg = load_config("finetuning", name)
        g = Graphs(cfg)
        adapters, base = count_params(g.specs), count_params(g.base_specs)
        full = load_config("finetuning", name, {"lora_rank": 0})
        fg = Graphs(full)
        import jax

        opt = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(
            jax.eval_shape(lambda p: fg.updater.init_state(p, fg.tree), fg.abstract_params())))
        out[name] = {"trained_weights": adapters, "base_weights": base,
                     "lora_checkpoint_bytes": 3 * 4 * adapters,  # float32 adapters and AdamW's two moments
                     "full_checkpoint_bytes": 4 * base + opt, "full_optimizer": full.training.optimizer.name}
        out[name]["ratio"] = out[name]["lora_checkpoint_bytes"] / out[name]["full_checkpoint_bytes"]
    return out


def main(argv=None) -> dict:
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--phased_only", action="store_true", help="the phased executor alone (a model too large to fuse)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runs = {name: [] for name in variants(args.rank, args.phased_only)}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for i, (name, flags) in enumerate(variants(args.rank, args.phased_only).items()):
                runs[name].append(one_run(flags, args, extra, tmp, i))
                print(f"{name:28s} run {rep + 1}: step {runs[name][-1]['median_step_s'] * 1e3:.0f} ms", flush=True)
    summary = {}
    for name, rs in runs.items():
        step = statistics.median(r["median_step_s"] for r in rs)
        summary[name] = {**rs[0], "median_step_s": step, "step_s_each_run": [r["median_step_s"] for r in rs]}
    ratios = {}
    for ex in ("fused", "phased"):
        full, lo = summary.get(f"{ex}, full fine-tuning"), summary.get(f"{ex}, LoRA rank {args.rank}")
        if full and lo:
            ratios[ex] = {k: lo[k] / full[k] for k in ("median_step_s", "device_bytes_estimate", "plan_device_bytes")}
            ratios[ex]["plan_host_bytes"] = lo["plan_host_bytes"] / full["plan_host_bytes"] if full["plan_host_bytes"] \
                else None
            print(f"{ex}: LoRA / full step time {ratios[ex]['median_step_s']:.2f}x, device bytes "
                  f"{ratios[ex]['device_bytes_estimate']:.2f}x", flush=True)
    sizes = checkpoint_sizes()
    for name, s in sizes.items():
        print(f"{name}: checkpoint {s['lora_checkpoint_bytes'] / 1e6:.0f} MB against {s['full_checkpoint_bytes'] / 1e9:.1f}"
              f" GB for full fine-tuning ({s['full_optimizer']})", flush=True)
    import jax

    out = {"command": "python3 benchmarks/lora.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "args": {"config": args.config, "steps": args.steps, "rank": args.rank, "repeats": args.repeats,
                    "shape": SHAPE, "extra": extra},
           "device_kind": jax.devices()[0].device_kind, "runs": summary, "lora_over_full": ratios,
           "checkpoints": sizes}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
