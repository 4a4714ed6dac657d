"""Ours vs Hugging Face PyTorch, same workloads and shapes, one process each, run one after the other.

    python3 benchmarks/compare.py                      # Flan-T5-small shape, float32, CPU
    python3 benchmarks/compare.py --precision bfloat16 --sequence_length 512   # e.g. on a GPU

Prints training samples/s, decoding tokens/s and the per-token decode latency of both, and
the ratio ours / theirs. ``--repeats N`` alternates the runs N times and reports the median
of each figure (this shared CPU moves by ~20% from run to run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(cmd: list, out: str) -> dict:
    subprocess.run([sys.executable] + cmd + ["--json", out], cwd=ROOT, check=True)
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--sequence_length", default="128")
    p.add_argument("--decoder_sequence_length", default="8")
    p.add_argument("--batch", default="8")
    p.add_argument("--precision", default="float32")
    p.add_argument("--steps", default="7", help="training steps (2 warm-up)")
    p.add_argument("--ours_flags", default="--recompute false --unroll_layers true",
                   help="extra flags for our training run: by default no block recomputation (HF's baseline "
                        "recomputes nothing: equal work) and unrolled layers (faster on CPU)")
    p.add_argument("--repeats", type=int, default=1, help="alternate ours/HF this many times; medians reported")
    p.add_argument("--only", choices=("train", "decode"), default=None, help="run one workload only")
    a = p.parse_args(argv)
    shape = ["--config", a.config, "--sequence_length", a.sequence_length, "--precision", a.precision]
    train = shape + ["--decoder_sequence_length", a.decoder_sequence_length, "--global_batch_size", a.batch,
                     "--micro_batch_size", a.batch, "--data_parallel", "1", "--tensor_parallel", "1"]
    ours_train = train + a.ours_flags.split()
    gen = shape + ["--micro_batch_size", a.batch, "--output_length", a.decoder_sequence_length,
                   "--tensor_parallel", "1"]
    from statistics import median

    runs = {k: [] for k in ("ours_t", "theirs_t", "ours_g", "theirs_g")}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeats):
            if a.only != "decode":
                runs["ours_t"].append(run(["finetuning.py"] + ours_train + ["--steps", a.steps], f"{d}/ot.json"))
                runs["theirs_t"].append(run(["benchmarks/hf_baseline.py", "train"] + train
                                            + ["--iterations", str(int(a.steps) - 2)], f"{d}/tt.json"))
            if a.only != "train":
                runs["ours_g"].append(run(["inference.py"] + gen, f"{d}/og.json"))
                runs["theirs_g"].append(run(["benchmarks/hf_baseline.py", "generate"] + gen, f"{d}/tg.json"))

    def fig(name, key, ours, theirs, higher_is_better=True):
        o, t = median(r[key] for r in runs[ours]), median(r[key] for r in runs[theirs])
        ratio = o / t if higher_is_better else t / o
        result[name] = {"ours": o, "hf": t, "ratio": ratio, "runs": len(runs[ours])}
        print(f"{name}: ours {o:.4g} | HF PyTorch {t:.4g} | {'ours/HF' if higher_is_better else 'HF/ours'} "
              f"{ratio:.2f}x (median of {len(runs[ours])})")

    result = {}
    if a.only != "decode":
        fig("train_samples_per_s", "samples_per_s", "ours_t", "theirs_t")
        steps = [r["model_tflops_per_step"] for r in runs["ours_t"]]
        result["train_model_tflops_per_s_ours"] = median(r["model_tflops_per_s"] for r in runs["ours_t"])
        result["train_model_tflops_per_s_hf"] = steps[0] / median(r["median_step_s"] for r in runs["theirs_t"])
        print(f"training model TFLOP/s: ours {result['train_model_tflops_per_s_ours']:.3f} | "
              f"HF {result['train_model_tflops_per_s_hf']:.3f}")
    if a.only != "train":
        fig("decode_tokens_per_s", "generated_tokens_per_s", "ours_g", "theirs_g")
        fig("first_token_s", "first_token_s", "ours_g", "theirs_g", higher_is_better=False)
        fig("decode_token_latency_s", "decode_token_latency_s", "ours_g", "theirs_g", higher_is_better=False)
    return result


if __name__ == "__main__":
    main()
