"""The 24 GB workstation claim, run: a LoRA preset trained for a few steps and validated with the device capped at
22 GiB and the process's host memory capped at 60 GiB, on generated data (no download).

    python3 benchmarks/workstation.py --preset xxl_lora_1gpu --json runs/ws_xxl.json      # a GPU box
    python3 benchmarks/workstation.py --preset tiny --smoke --json /tmp/ws.json              # CPU, tiny shapes

The device cap is JAX's client memory fraction (XLA_PYTHON_CLIENT_MEM_FRACTION = 22 GiB over the device's memory,
read with nvidia-smi); the host cap a memory cgroup (cgroup v2: a child group of this process's own, with
memory.max) where the machine lets one be made, else none: the report says which, and always holds each command's
peak resident memory. The training is ``run_finetuning.py`` (the synthetic NLI task with MultiNLI's lengths, a
tokenizer learnt from it, the preset's random-init base) with --save, then ``run_validation.py`` on the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.bench import run_child, write_json  # noqa: E402
from config.presets import load_config  # noqa: E402
from modelling import registry  # noqa: E402,F401 (the model families' own fields join the config)

GIB = 2 ** 30
CGROUP = "/sys/fs/cgroup"


def device_fraction(device_gib: float) -> str | None:
    """XLA_PYTHON_CLIENT_MEM_FRACTION that caps the first GPU at ``device_gib`` (None where no GPU answers)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=60).stdout.split()
        total_mib = float(out[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None
    return f"{min(device_gib * 1024 / total_mib, 1.0):.4f}"


def host_cgroup(host_gib: float) -> str | None:
    """A cgroup v2 child group capped at ``host_gib`` (memory.max, no swap), or None where none can be made."""
    try:
        with open("/proc/self/cgroup") as f:
            own = f.read().strip().split("::")[-1]
        path = os.path.join(CGROUP + own, f"flan_t5_workstation_{os.getpid()}")
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "memory.max"), "w") as f:
            f.write(str(int(host_gib * GIB)))
        if os.path.exists(os.path.join(path, "memory.swap.max")):
            with open(os.path.join(path, "memory.swap.max"), "w") as f:
                f.write("0")
        return path
    except OSError:
        return None


def run(cmd: list, env: dict, group: str | None, log: str) -> dict:
    """One command (in the cgroup ``group``) -> {status, seconds, peak_rss_bytes, log_tail}."""
    def enter():
        if group:
            with open(os.path.join(group, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    t0 = time.perf_counter()
    code, usage = run_child(cmd, log, env=env, preexec_fn=enter if group else None)  # this child's own usage
    text = open(log).read()
    status = "ok" if code == 0 else ("out_of_memory" if code in (4, -9, 137) or "out of memory" in text.lower()
                                     or "RESOURCE_EXHAUSTED" in text else "failed")
    return {"status": status, "exit": code, "seconds": time.perf_counter() - t0, "command": "python3 " +
            " ".join(cmd), "peak_rss_bytes": usage.ru_maxrss * 1024,
            "log_tail": None if status == "ok" else "\n".join(text.strip().splitlines()[-5:])}


def step_seconds(run_dir: str, rows: int) -> list:
    """The seconds of each step a run logged (metrics.jsonl: ``rows`` a step over its samples per second)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    lines = [json.loads(line) for line in open(path) if line.strip()]
    return [rows / r["samples_per_s"] for r in lines if r.get("samples_per_s")]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--device_gib", type=float, default=22.0)
    p.add_argument("--host_gib", type=float, default=60.0)
    p.add_argument("--limit", type=int, default=64, help="validation examples")
    p.add_argument("--quantize", choices=("none", "int8"), default="none",
                   help="validate with int8 weights (what fits XXL's decoding in 22 GiB)")
    p.add_argument("--stream_encoder", action="store_true",
                   help="validate with the encoder's layers streamed from host memory (with int8: UL2 in 22 GiB)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (LoRA rank 4, 3 steps)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="workstation_")
    save = os.path.join(tmp, "ckpt")
    env = dict(os.environ)
    fraction = device_fraction(a.device_gib)
    if fraction:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
    group = host_cgroup(a.host_gib)
    # the synthetic NLI task with MultiNLI's lengths and a tokenizer learnt from it (a GPU box reaches no hub); the
    # smoke run keeps its tiny preset's own data
    data = ["--split", "validation"] + ([] if a.smoke else ["--dataset", "synthetic-mnli", "--tokenizer", "train",
                                                            "--hf_model", ""])  # (a random-init base: no hub)
    train = ["run_finetuning.py", "--config", a.preset, "--steps", str(3 if a.smoke else a.steps), "--save", save,
             "--checkpoint_steps", "0", "--lora_random_base", *data] + (["--lora_rank", "4"] if a.smoke else [])
    report = {"preset": a.preset, "quantize": a.quantize, "stream_encoder": a.stream_encoder, "device_cap": {"gib": a.device_gib, "mem_fraction": fraction,
                                                 "how": "XLA_PYTHON_CLIENT_MEM_FRACTION" if fraction else "none"},
              "host_cap": {"gib": a.host_gib, "how": "cgroup v2 memory.max" if group else
                           "none (no writable cgroup on this machine): peak RSS reported"}}
    report["train"] = run(train, env, group, os.path.join(tmp, "train.log"))
    report["step_s"] = step_seconds(save, load_config("finetuning", a.preset).training.global_batch_size)
    if report["train"]["status"] == "ok":
        one = [] if a.smoke else ["--data_parallel", "1", "--tensor_parallel", "1", "--micro_batch_size", "32"]
        stream = ["--stream_encoder", "true"] if a.stream_encoder else []
        val = ["run_validation.py", "--load", save, "--limit", str(a.limit), "--quantize", a.quantize, *stream, *one,
               "--output", os.path.join(tmp, "validation.json")]
        report["validate"] = run(val, env, group, os.path.join(tmp, "validate.log"))
        if report["validate"]["status"] == "ok":  # what it scored (on random-init weights: chance) and how fast
            v = json.load(open(os.path.join(tmp, "validation.json")))
            report["validation"] = {k: v.get(k) for k in ("samples", "scores", "seconds", "quantization",
                                                          "peak_device_bytes")}
    report["status"] = "ok" if all(report.get(k, {}).get("status") == "ok" for k in ("train", "validate")) else \
        next(report[k]["status"] for k in ("train", "validate") if k in report and report[k]["status"] != "ok")
    if group:
        try:
            os.rmdir(group)  # (a cgroup goes with rmdir once its processes have ended)
        except OSError:
            pass
    shutil.rmtree(tmp, ignore_errors=True)
    write_json(a.json, report)
    print(json.dumps({k: report[k] for k in ("preset", "status", "step_s")}), flush=True)
    return report


if __name__ == "__main__":
    main()
