"""int8 weights against the weights as trained, on the tiny presets' own tasks: each preset trained once, then
validated in float32, bfloat16, and each with int8 weights (--quantize int8); the scores side by side.

    python3 benchmarks/int8_accuracy.py --json benchmarks/results/cpu/int8_accuracy.json     # CPU, a few minutes

Runs (offline, generated data): ``tiny`` (T5, the synthetic NLI task, accuracy), ``tiny`` with LoRA adapters on
every layer weight (merged into the base, then quantized), ``gptj_tiny_headlines`` (GPT-J, a free-text task,
exact match and ROUGE-L).
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

from app.bench import write_json  # noqa: E402

RUNS = {
    "tiny (T5)": ["--config", "tiny", "--steps", "300"],
    "tiny + LoRA (T5, merged then quantized)": ["--config", "tiny", "--steps", "150", "--lora_random_base",
                                                "--lora_rank", "16",
                                                "--lora_targets", "q", "k", "v", "o", "cq", "ck", "cv", "co", "wi_0",
                                                "wi_1", "wo", "--learning_rate", "3e-3"],
    "gptj_tiny_headlines (GPT-J)": ["--config", "gptj_tiny_headlines", "--steps", "120"],
}
DECODINGS = {"float32": ["--precision", "float32"], "float32 + int8": ["--precision", "float32", "--quantize", "int8"],
             "bfloat16": ["--precision", "bfloat16"], "bfloat16 + int8": ["--precision", "bfloat16", "--quantize",
                                                                          "int8"]}


def sh(args: list) -> None:
    p = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(args)} exited {p.returncode}: {(p.stdout + p.stderr)[-2000:]}")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--limit", type=int, default=500, help="validation examples")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    out = {"limit": a.limit, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in RUNS.items():
            save = os.path.join(tmp, str(len(out["runs"])))
            sh(["run_finetuning.py", *flags, "--save", save, "--checkpoint_steps", "0"])
            scores = {}
            for how, dflags in DECODINGS.items():
                report = os.path.join(tmp, "report.json")
                sh(["run_validation.py", "--load", save, "--limit", str(a.limit), *dflags, "--output", report])
                scores[how] = json.load(open(report))["scores"]
                os.remove(report)
            out["runs"][name] = {"train": "python3 run_finetuning.py " + " ".join(flags), "scores": scores}
            print(name, json.dumps(scores), flush=True)
    write_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
