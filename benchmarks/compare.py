"""Ours vs Hugging Face PyTorch, same workloads and shapes, one process each, run one after the other.

    python3 benchmarks/compare.py                      # Flan-T5-small shape, float32, CPU
    python3 benchmarks/compare.py --config xl_pod8 --inference_config xl --precision bfloat16 \
        --sequence_length 512 --batch 64 --micro_batch 8 --json runs/xl.json     # e.g. on a GPU

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
    p.add_argument("--batch", default="8", help="training: global batch; decoding: batch")
    p.add_argument("--micro_batch", default=None, help="training micro-batch (gradient accumulation); "
                   "default: --batch")
    p.add_argument("--precision", default="float32")
    p.add_argument("--steps", default="7", help="training steps (2 warm-up)")
    p.add_argument("--ours_flags", default="--recompute false --unroll_layers true",
                   help="extra flags for our training run: by default no block recomputation (HF's baseline "
                        "recomputes nothing: equal work) and unrolled layers (faster on CPU)")
    p.add_argument("--repeats", type=int, default=1, help="alternate ours/HF this many times; medians reported")
    p.add_argument("--only", choices=("train", "decode"), default=None, help="run one workload only")
    p.add_argument("--output_length", default=None, help="decoding: tokens generated (default: "
                   "--decoder_sequence_length)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per benchmark process")
    p.add_argument("--json", default=None, help="write the figures and every run's report here")
    a = p.parse_args(argv)
    shape = ["--config", a.config, "--sequence_length", a.sequence_length, "--precision", a.precision]
    train = shape + ["--decoder_sequence_length", a.decoder_sequence_length, "--global_batch_size", a.batch,
                     "--micro_batch_size", a.micro_batch or a.batch, "--data_parallel", "1", "--tensor_parallel", "1"]
    ours_train = train + a.ours_flags.split()
    gen = (["--config", a.inference_config or a.config] + shape[2:]
           + ["--micro_batch_size", a.batch, "--output_length", a.output_length or a.decoder_sequence_length,
              "--tensor_parallel", "1"])
    from statistics import median

    runs = {k: [] for k in ("ours_t", "theirs_t", "ours_g", "theirs_g")}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeats):
            if a.only != "decode":
                runs["ours_t"].append(run(["finetuning.py"] + ours_train + ["--steps", a.steps], f"{d}/ot.json", a.timeout))
                runs["theirs_t"].append(run(["benchmarks/hf_baseline.py", "train"] + train
                                            + ["--iterations", str(int(a.steps) - 2)], f"{d}/tt.json", a.timeout))
            if a.only != "train":
                runs["ours_g"].append(run(["inference.py"] + gen, f"{d}/og.json", a.timeout))
                runs["theirs_g"].append(run(["benchmarks/hf_baseline.py", "generate"] + gen, f"{d}/tg.json", a.timeout))

    from config import load_config
    from utils.bench import write_json
    from utils.flops import peak_tflops, train_flops_per_sample

    def fig(name, key, ours, theirs, higher_is_better=True):
        os_ = [r[key] for r in runs[ours] if r]
        ts = [r[key] for r in runs[theirs] if r]
        o, t = (median(os_) if os_ else None), (median(ts) if ts else None)
        ratio = None if o is None or t is None else (o / t if higher_is_better else t / o)
        result[name] = {"ours": o, "hf": t, "ratio": ratio, "runs": [len(os_), len(ts)]}
        show = lambda v: "failed" if v is None else f"{v:.4g}"  # noqa: E731
        print(f"{name}: ours {show(o)} | HF PyTorch {show(t)} | {'ours/HF' if higher_is_better else 'HF/ours'} "
              f"{'-' if ratio is None else f'{ratio:.2f}x'} (median of {len(os_)} / {len(ts)})")
        return o, t

    result = {"args": vars(a)}
    if a.only != "decode":
        cfg = load_config("finetuning", a.config, {"sequence_length": a.sequence_length,
                                                   "decoder_sequence_length": a.decoder_sequence_length})
        flops = train_flops_per_sample(cfg.model, cfg.model.sequence_length,
                                       cfg.model.decoder_sequence_length) * int(a.batch)
        kind = next((r.get("device_kind") or r.get("device") for r in runs["ours_t"] + runs["theirs_t"] if r), "")
        peak = peak_tflops(kind)
        fig("train_samples_per_s", "samples_per_s", "ours_t", "theirs_t")
        o, t = fig("train_step_s", "median_step_s", "ours_t", "theirs_t", higher_is_better=False)
        for who, step in (("ours", o), ("hf", t)):
            result[f"train_model_tflops_per_s_{who}"] = None if step is None else flops / step / 1e12
            result[f"train_mfu_{who}"] = None if step is None or not peak else flops / step / 1e12 / peak
        show = lambda who: ("failed" if result[f"train_model_tflops_per_s_{who}"] is None  # noqa: E731
                            else f"{result[f'train_model_tflops_per_s_{who}']:.3f}"
                            + (f" (MFU {result[f'train_mfu_{who}']:.1%})" if peak else ""))
        print(f"training model TFLOP/s: ours {show('ours')} | HF {show('hf')}"
              + (f" | peak {peak:.0f} TFLOP/s ({kind})" if peak else ""))
    if a.only != "train":
        fig("decode_tokens_per_s", "generated_tokens_per_s", "ours_g", "theirs_g")
        fig("first_token_s", "first_token_s", "ours_g", "theirs_g", higher_is_better=False)
        fig("decode_token_latency_s", "decode_token_latency_s", "ours_g", "theirs_g", higher_is_better=False)
    if a.json:
        write_json(a.json, {**result, "runs": runs})
    return result


if __name__ == "__main__":
    main()
