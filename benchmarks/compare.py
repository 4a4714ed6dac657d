"""Ours against Hugging Face PyTorch (eager and torch.compile), same workloads and shapes, each run in its own
process, one after the other.

    python3 benchmarks/compare.py                      # Flan-T5-small shape, float32, CPU, equal work
    python3 benchmarks/compare.py --only train --lengths mnli --sequence_length 512 --batch 8 --micro_batch 4
    python3 benchmarks/compare.py --config xl_pod8 --inference_config xl --precision bfloat16 \\
        --sequence_length 512 --batch 64 --micro_batch 8 --json runs/xl.json     # e.g. on a GPU

Training, two workloads (``--lengths``):
- ``uniform`` (default): prompts of L/2..L tokens, ours one example per row (--packing false) and HF
  padded to the full length: equal work, the same rows;
- ``mnli``: MultiNLI-like prompt lengths (about 52 tokens on average), what users train on: ours packed
  (several examples per row) and ours unpacked (--packing false), HF padded to the longest prompt of each
  micro-batch (DataCollatorForSeq2Seq's default).
HF runs eager and under torch.compile with fused AdamW (``--hf``). Every figure names its peer; ratios are
ours over the peer in examples/s (the same as samples/s when rows hold one example each).

Decoding: greedy, ours against HF ``generate`` (eager). ``--repeats N`` alternates the runs N times and
reports medians (this shared CPU moves by ~20% from run to run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def run(cmd: list, out: str, timeout: float | None) -> dict | None:
    """One benchmark process; None (and a line saying why) when it fails or times out, so that
    the other figures of a long GPU session still come back."""
    if os.path.exists(out):
        os.remove(out)
    try:
        p = subprocess.run([sys.executable] + cmd + ["--json", out], cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"FAILED (timed out after {timeout:.0f} s): {' '.join(cmd)}", flush=True)
        return None
    if p.returncode != 0 or not os.path.exists(out):
        print(f"FAILED (exit {p.returncode}): {' '.join(cmd)}", flush=True)
        return None
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small", help="preset of config/finetuning.yml (training)")
    p.add_argument("--inference_config", default=None,
                   help="preset of config/inference.yml for decoding (default: --config; e.g. xl for xl_pod8)")
    p.add_argument("--sequence_length", default="128")
    p.add_argument("--decoder_sequence_length", default="8")
    p.add_argument("--batch", default="8", help="training: global batch (rows); decoding: batch")
    p.add_argument("--micro_batch", default=None, help="training micro-batch (gradient accumulation); "
                   "default: --batch")
    p.add_argument("--precision", default="float32")
    p.add_argument("--steps", default="7", help="training steps (2 warm-up)")
    p.add_argument("--lengths", choices=("uniform", "mnli"), default="uniform",
                   help="training prompt lengths: uniform (equal work) or mnli (ours packed and unpacked)")
    p.add_argument("--hf", choices=("eager", "compiled", "both"), default="both",
                   help="which HF training baselines to run")
    p.add_argument("--ours_flags", default="--recompute false --unroll_layers true",
                   help="extra flags for our training run: by default no block recomputation (HF's baseline "
                        "recomputes nothing: equal work) and unrolled layers (faster on CPU)")
    p.add_argument("--repeats", type=int, default=1, help="alternate the runs this many times; medians reported")
    p.add_argument("--only", choices=("train", "decode"), default=None, help="run one workload only")
    p.add_argument("--output_length", default=None, help="decoding: tokens generated (default: "
                   "--decoder_sequence_length)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per benchmark process")
    p.add_argument("--json", default=None, help="write the figures and every run's report here")
    a = p.parse_args(argv)
    shape = ["--config", a.config, "--sequence_length", a.sequence_length, "--precision", a.precision]
    train = shape + ["--decoder_sequence_length", a.decoder_sequence_length, "--global_batch_size", a.batch,
                     "--micro_batch_size", a.micro_batch or a.batch, "--data_parallel", "1", "--tensor_parallel", "1",
                     "--lengths", a.lengths]
    ours = train + a.ours_flags.split()
    trainers = {}  # name -> command
    if a.lengths == "mnli":
        trainers["ours packed"] = ["finetuning.py"] + ours + ["--packing", "true"]
        trainers["ours unpacked"] = ["finetuning.py"] + ours + ["--packing", "false"]
        hf_padding = ["--padding", "longest"]
    else:
        trainers["ours"] = ["finetuning.py"] + ours + ["--packing", "false"]
        hf_padding = ["--padding", "max_length"]
    hf = ["benchmarks/hf_baseline.py", "train"] + train + hf_padding + ["--iterations", str(int(a.steps) - 2)]
    if a.hf in ("eager", "both"):
        trainers["HF eager"] = hf
    if a.hf in ("compiled", "both"):
        trainers["HF torch.compile"] = hf + ["--compile"]
    gen = (["--config", a.inference_config or a.config] + shape[2:]
           + ["--micro_batch_size", a.batch, "--output_length", a.output_length or a.decoder_sequence_length,
              "--tensor_parallel", "1"])
    from statistics import median

    runs = {k: [] for k in list(trainers) + ["ours_g", "theirs_g"]}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeats):
            if a.only != "decode":
                for i, (name, cmd) in enumerate(trainers.items()):
                    extra = ["--steps", a.steps] if cmd[0] == "finetuning.py" else []
                    runs[name].append(run(cmd + extra, f"{d}/t{i}.json", a.timeout))
            if a.only != "train":
                runs["ours_g"].append(run(["inference.py"] + gen, f"{d}/og.json", a.timeout))
                runs["theirs_g"].append(run(["benchmarks/hf_baseline.py", "generate"] + gen, f"{d}/tg.json", a.timeout))

    from config import load_config
    from utils.bench import write_json
    from utils.flops import peak_tflops, train_flops_per_sample

    result = {"args": vars(a)}

    def med(name, key):
        values = [r[key] for r in runs[name] if r and r.get(key) is not None]
        return median(values) if values else None

    def fig(name, key, ours, theirs, higher_is_better=True):
        o, t = med(ours, key), med(theirs, key)
        ratio = None if o is None or t is None else (o / t if higher_is_better else t / o)
        result[name] = {"ours": o, "hf": t, "ratio": ratio, "runs": [len(runs[ours]), len(runs[theirs])]}
        show = lambda v: "failed" if v is None else f"{v:.4g}"  # noqa: E731
        print(f"{name}: ours {show(o)} | HF PyTorch {show(t)} | {'ours/HF' if higher_is_better else 'HF/ours'} "
              f"{'-' if ratio is None else f'{ratio:.2f}x'} (median of {len(runs[ours])} / {len(runs[theirs])})")
        return o, t

    if a.only != "decode":
        cfg = load_config("finetuning", a.config, {"sequence_length": a.sequence_length,
                                                   "decoder_sequence_length": a.decoder_sequence_length,
                                                   "packing": False})
        flops = train_flops_per_sample(cfg.model, cfg.model.sequence_length,
                                       cfg.model.decoder_sequence_length) * int(a.batch)
        kind = next((r.get("device_kind") or r.get("device") for rs in runs.values() for r in rs if r), "")
        peak = peak_tflops(kind)
        training = {}
        for name in trainers:
            training[name] = {k: med(name, k) for k in ("samples_per_s", "examples_per_s", "nonpad_tokens_per_s",
                                                         "median_step_s")}
            step = training[name]["median_step_s"]
            if a.lengths == "uniform" and step:  # equal, full rows: model FLOPs and MFU of both sides
                training[name]["model_tflops_per_s"] = flops / step / 1e12
                training[name]["mfu"] = flops / step / 1e12 / peak if peak else None
        result["training"] = training
        print(f"training ({a.lengths} lengths; medians of {a.repeats}; {kind or 'device unknown'}):")
        for name, t in training.items():
            ex = t["examples_per_s"]
            extra = ""
            if t.get("model_tflops_per_s"):
                extra = f" | {t['model_tflops_per_s']:.3f} model TFLOP/s" + (f" (MFU {t['mfu']:.1%})" if t["mfu"] else "")
            print(f"  {name:18s} " + ("failed" if ex is None else
                                      f"{ex:9.2f} examples/s | {t['samples_per_s']:8.2f} samples (rows)/s | "
                                      f"{t['nonpad_tokens_per_s']:9.0f} non-pad tokens/s") + extra)
        ours_names = [n for n in trainers if n.startswith("ours")]
        result["ratios"] = {}
        for o in ours_names:
            for h in [n for n in trainers if n.startswith("HF")]:
                x, y = training[o]["examples_per_s"], training[h]["examples_per_s"]
                r = None if x is None or y is None else x / y
                result["ratios"][f"{o} / {h}"] = r
                print(f"  {o} / {h}: " + ("-" if r is None else f"{r:.2f}x examples/s"))
        if a.lengths == "mnli" and len(ours_names) == 2:
            x, y = training["ours packed"]["examples_per_s"], training["ours unpacked"]["examples_per_s"]
            result["ratios"]["ours packed / ours unpacked"] = None if x is None or y is None else x / y
            if x and y:
                print(f"  ours packed / ours unpacked: {x / y:.2f}x examples/s")
    if a.only != "train":
        fig("decode_tokens_per_s", "generated_tokens_per_s", "ours_g", "theirs_g")
        fig("first_token_s", "first_token_s", "ours_g", "theirs_g", higher_is_better=False)
        fig("decode_token_latency_s", "decode_token_latency_s", "ours_g", "theirs_g", higher_is_better=False)
    if a.json:
        write_json(a.json, {**result, "runs": runs})
    return result


if __name__ == "__main__":
    main()
