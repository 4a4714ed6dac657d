"""Training precisions side by side: float32, bfloat16 (float32 master weights), bfloat16 master weights with
stochastic rounding, and float16 with dynamic loss scaling, on the same run.

    python3 benchmarks/precision.py --json benchmarks/results/cpu/precision.json     # the tiny preset, ~6 min on CPU
    python3 benchmarks/figures.py precision benchmarks/results/cpu/precision.json

Each variant is one ``run_finetuning.py`` run (same preset, seed, data and steps) followed by ``run_validation.py``
on its last checkpoint, each in its own process. The report holds every run's loss per step, validation accuracy,
skipped steps and wall time, and each run's time as a ratio against the float32 run measured in the same
invocation. Arguments after ``--`` go to run_finetuning.py unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.bench import run_script, split_passthrough, write_json  # noqa: E402

VARIANTS = {  # name -> run_finetuning.py flags
    "float32": ["--precision", "float32"],
    "bfloat16": ["--precision", "bfloat16"],
    "bfloat16 + stochastic rounding": ["--precision", "bfloat16", "--stochastic_rounding", "true"],
    "float16 + dynamic loss scaling": ["--precision", "float16"],
}


def run_variant(name: str, flags: list, args, extra: list, tmp: str) -> dict:
    save = os.path.join(tmp, name.replace(" ", "_").replace("+", "and"))
    train_s = run_script(["run_finetuning.py", "--config", args.config, "--steps", str(args.steps), "--save", save,
                    "--checkpoint_steps", "0"] + flags + extra)
    run_script(["run_validation.py", "--load", save])
    rows = [json.loads(line) for line in open(os.path.join(save, "metrics.jsonl"))]
    (report,) = [f for f in os.listdir(save) if f.startswith("validation") and f.endswith(".json")]
    with open(os.path.join(save, report)) as f:
        accuracy = json.load(f)["accuracy"]
    return {"flags": flags, "accuracy": accuracy, "train_s": train_s,
            "loss": [r.get("loss") for r in rows], "skipped_steps": rows[-1].get("skipped_steps", 0),
            "final_loss_scale": rows[-1].get("loss_scale")}


def main(argv=None) -> dict:
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--only", nargs="+", choices=list(VARIANTS), default=list(VARIANTS), metavar="VARIANT")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only:
            runs[name] = run_variant(name, VARIANTS[name], args, extra, tmp)
            r = runs[name]
            print(f"{name:34s} accuracy {r['accuracy']:.2%}  last loss {r['loss'][-1]:.4f}  skipped steps "
                  f"{r['skipped_steps']}  {r['train_s']:.0f} s", flush=True)
    base = runs.get("float32")
    for r in runs.values():
        r["time_vs_float32"] = r["train_s"] / base["train_s"] if base else None
    import jax

    out = {"args": {"config": args.config, "steps": args.steps, "extra": extra},
           "device_kind": jax.devices()[0].device_kind, "runs": runs}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
