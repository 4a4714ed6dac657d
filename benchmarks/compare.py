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
from statistics import median

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


def parse(argv=None):
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
    p.add_argument("--lengths", choices=("uniform", "mnli", "summaries"), default="uniform",
                   help="training lengths: uniform (equal work), mnli or summaries (long targets): ours packed and "
                        "unpacked against HF padded to each micro-batch's longest")
    p.add_argument("--hf", choices=("eager", "compiled", "both"), default="both",
                   help="which HF training baselines to run")
    p.add_argument("--ours_flags", default="--recompute false --unroll_layers true",
                   help="extra flags for our training run: by default no block recomputation (HF's baseline "
                        "recomputes nothing: equal work) and unrolled layers (faster on CPU)")
    p.add_argument("--repeats", type=int, default=1, help="alternate the runs this many times; medians reported")
    p.add_argument("--only", choices=("train", "decode"), default=None, help="run one workload only")
    p.add_argument("--output_length", default=None, help="decoding: tokens generated (default: "
                   "--decoder_sequence_length)")
    p.add_argument("--decode_flags", default="", help="extra flags for both decoding runs, e.g. '--num_beams 4'")
    p.add_argument("--int8", action="store_true", help="decoding: also ours with int8 weights (--quantize int8), "
                   "against ours and HF")
    p.add_argument("--timeout", type=float, default=None, help="seconds per benchmark process")
    p.add_argument("--json", default=None, help="write the figures and every run's report here")
    return p.parse_args(argv)


def commands(a) -> tuple:
    """({training run name: command}, decoding arguments shared by ours and HF's)."""
    shape = ["--config", a.config, "--sequence_length", a.sequence_length, "--precision", a.precision]
    train = shape + ["--decoder_sequence_length", a.decoder_sequence_length, "--global_batch_size", a.batch,
                     "--micro_batch_size", a.micro_batch or a.batch, "--data_parallel", "1", "--tensor_parallel", "1",
                     "--lengths", a.lengths]
    ours = train + a.ours_flags.split()
    trainers = {}  # name -> command
    if a.lengths != "uniform":
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
              "--tensor_parallel", "1"] + a.decode_flags.split())
    return trainers, gen


def run_all(a, trainers: dict, gen: list) -> dict:
    """{run name: [report or None per repeat]}, the runs alternated ``--repeats`` times."""
    runs = {k: [] for k in list(trainers) + ["ours_g", "theirs_g", "int8_g"]}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeats):
            if a.only != "decode":
                for i, (name, cmd) in enumerate(trainers.items()):
                    extra = ["--steps", a.steps] if cmd[0] == "finetuning.py" else []
                    runs[name].append(run(cmd + extra, f"{d}/t{i}.json", a.timeout))
            if a.only != "train":
                runs["ours_g"].append(run(["inference.py"] + gen, f"{d}/og.json", a.timeout))
                runs["theirs_g"].append(run(["benchmarks/hf_baseline.py", "generate"] + gen, f"{d}/tg.json",
                                            a.timeout))
                if a.int8:
                    runs["int8_g"].append(run(["inference.py"] + gen + ["--quantize", "int8"], f"{d}/ig.json",
                                              a.timeout))
    return runs


def _median(runs: dict, name: str, key: str):
    values = [r[key] for r in runs[name] if r and r.get(key) is not None]
    return median(values) if values else None


def training_figures(a, trainers: dict, runs: dict) -> dict:
    """{"training": {run: figures}, "ratios": {ours / peer: examples/s ratio}}, printed."""
    from app.flops import peak_tflops, train_flops_per_sample
    from config import load_config

    cfg = load_config("finetuning", a.config, {"sequence_length": a.sequence_length,
                                               "decoder_sequence_length": a.decoder_sequence_length, "packing": False})
    flops = train_flops_per_sample(cfg.model, cfg.model.sequence_length, cfg.model.decoder_sequence_length) * int(a.batch)
    kind = next((r.get("device_kind") or r.get("device") for rs in runs.values() for r in rs if r), "")
    peak = peak_tflops(kind)
    training = {}
    for name in trainers:
        t = training[name] = {k: _median(runs, name, k) for k in ("samples_per_s", "examples_per_s",
                                                                   "nonpad_tokens_per_s", "median_step_s")}
        if a.lengths == "uniform" and t["median_step_s"]:  # equal, full rows: model FLOPs and MFU of both sides
            t["model_tflops_per_s"] = flops / t["median_step_s"] / 1e12
            t["mfu"] = t["model_tflops_per_s"] / peak if peak else None
    print(f"training ({a.lengths} lengths; medians of {a.repeats}; {kind or 'device unknown'}):")
    for name, t in training.items():
        ex, extra = t["examples_per_s"], ""
        if t.get("model_tflops_per_s"):
            extra = f" | {t['model_tflops_per_s']:.3f} model TFLOP/s" + (f" (MFU {t['mfu']:.1%})" if t["mfu"] else "")
        print(f"  {name:18s} " + ("failed" if ex is None else
                                  f"{ex:9.2f} examples/s | {t['samples_per_s']:8.2f} samples (rows)/s | "
                                  f"{t['nonpad_tokens_per_s']:9.0f} non-pad tokens/s") + extra)
    pairs = [(o, h) for o in trainers if o.startswith("ours") for h in trainers if h.startswith("HF")]
    if a.lengths != "uniform" and "ours unpacked" in trainers:
        pairs.append(("ours packed", "ours unpacked"))
    ratios = {}
    for o, h in pairs:
        x, y = training[o]["examples_per_s"], training[h]["examples_per_s"]
        ratios[f"{o} / {h}"] = None if x is None or y is None else x / y
        print(f"  {o} / {h}: " + ("-" if ratios[f'{o} / {h}'] is None else f"{x / y:.2f}x examples/s"))
    return {"training": training, "ratios": ratios}


def decode_figures(runs: dict) -> dict:
    """Ours against HF ``generate``: tokens/s, time to the first token, per-token latency; printed. With int8 runs,
    their tokens/s against ours and HF's."""
    out = {}
    i8, o, t = (_median(runs, n, "generated_tokens_per_s") for n in ("int8_g", "ours_g", "theirs_g"))
    if i8 is not None:
        out["int8_tokens_per_s"] = {"int8": i8, "over_ours": i8 / o if o else None, "over_hf": i8 / t if t else None,
                                    "runs": len(runs["int8_g"])}
        print(f"int8 weights: {i8:.4g} tokens/s | ours {'-' if o is None else f'{i8 / o:.2f}x'} | HF "
              f"{'-' if t is None else f'{i8 / t:.2f}x'}")
    for name, key, higher_is_better in (("decode_tokens_per_s", "generated_tokens_per_s", True),
                                        ("first_token_s", "first_token_s", False),
                                        ("decode_token_latency_s", "decode_token_latency_s", False)):
        o, t = _median(runs, "ours_g", key), _median(runs, "theirs_g", key)
        ratio = None if o is None or t is None else (o / t if higher_is_better else t / o)
        out[name] = {"ours": o, "hf": t, "ratio": ratio, "runs": [len(runs["ours_g"]), len(runs["theirs_g"])]}
        show = lambda v: "failed" if v is None else f"{v:.4g}"  # noqa: E731
        print(f"{name}: ours {show(o)} | HF PyTorch {show(t)} | {'ours/HF' if higher_is_better else 'HF/ours'} "
              f"{'-' if ratio is None else f'{ratio:.2f}x'} (median of {len(runs['ours_g'])} / "
              f"{len(runs['theirs_g'])})")
    return out


def main(argv=None) -> dict:
    from app.bench import write_json

    a = parse(argv)
    trainers, gen = commands(a)
    runs = run_all(a, trainers, gen)
    result = {"args": vars(a)}
    if a.only != "decode":
        result.update(training_figures(a, trainers, runs))
    if a.only != "train":
        result.update(decode_figures(runs))
    write_json(a.json, {**result, "runs": runs})
    return result


if __name__ == "__main__":
    main()
