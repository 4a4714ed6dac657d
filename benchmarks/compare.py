"""Ours vs Hugging Face PyTorch, same workloads and shapes, one process each, run one after the other.

    python3 benchmarks/compare.py                      # Flan-T5-small shape, float32, CPU
    python3 benchmarks/compare.py --precision bfloat16 --sequence_length 512   # e.g. on a GPU

Prints training samples/s and decoding tokens/s of both, and the ratio ours / theirs.
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
    a = p.parse_args(argv)
    shape = ["--config", a.config, "--sequence_length", a.sequence_length, "--precision", a.precision]
    train = shape + ["--decoder_sequence_length", a.decoder_sequence_length, "--global_batch_size", a.batch,
                     "--micro_batch_size", a.batch, "--data_parallel", "1", "--tensor_parallel", "1"]
    gen = shape + ["--micro_batch_size", a.batch, "--output_length", a.decoder_sequence_length,
                   "--tensor_parallel", "1"]
    with tempfile.TemporaryDirectory() as d:
        ours_t = run(["finetuning.py"] + train + ["--steps", a.steps], f"{d}/ot.json")
        theirs_t = run(["benchmarks/hf_baseline.py", "train"] + train + ["--iterations", str(int(a.steps) - 2)],
                       f"{d}/tt.json")
        ours_g = run(["inference.py"] + gen, f"{d}/og.json")
        theirs_g = run(["benchmarks/hf_baseline.py", "generate"] + gen, f"{d}/tg.json")
    result = {
        "train_samples_per_s": {"ours": ours_t["samples_per_s"], "hf": theirs_t["samples_per_s"],
                                "ratio": ours_t["samples_per_s"] / theirs_t["samples_per_s"]},
        "decode_tokens_per_s": {"ours": ours_g["generated_tokens_per_s"], "hf": theirs_g["generated_tokens_per_s"],
                                "ratio": ours_g["generated_tokens_per_s"] / theirs_g["generated_tokens_per_s"]},
        "train_model_tflops_per_s_ours": ours_t["model_tflops_per_s"],
        "train_model_tflops_per_s_hf": ours_t["model_tflops_per_step"] / theirs_t["median_step_s"],
    }
    for k in ("train_samples_per_s", "decode_tokens_per_s"):
        r = result[k]
        print(f"{k}: ours {r['ours']:.2f} | HF PyTorch {r['hf']:.2f} | ours/HF {r['ratio']:.2f}x")
    print(f"training model TFLOP/s: ours {result['train_model_tflops_per_s_ours']:.3f} | "
          f"HF {result['train_model_tflops_per_s_hf']:.3f}")
    return result


if __name__ == "__main__":
    main()
