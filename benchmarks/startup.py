"""Server start-up: seconds from ``run_server.py`` starting to its first ``/health`` 200, cold (an empty compilation
cache) and warm (the same server started again over the cache the first start filled), for models of a few depths.

    python3 benchmarks/startup.py --json benchmarks/results/cpu/startup.json          # this machine's figures
    python3 benchmarks/startup.py --models "base:" --server_args="--slots 32"          # one GPU: base

Each model is a random-init checkpoint of an inference preset's shape (``--models NAME:PRESET:FLAGS``: the preset
and its model flags; the synthetic tokenizer: nothing is downloaded), saved once; each server gets ``--slots 8
--output_length 64`` and ``--server_args``. Reported per model: the cold and warm seconds to healthy, the programs
compiled and the seconds the server says they took (its start-up line), and the warm start over the cold; per
depth pair, the deep model's cold start over the shallow one's (the same width: compile time should not grow with
depth). Each start is a fresh process; ``--repeats`` starts each server that many times (medians).

``--loras N``: each model's server also starts with N LoRA adapters served side by side (``--lora a0=... ``: random
LoRA checkpoints of rank ``--lora_rank`` over its checkpoint, benchmarks/serve.py's), cold and warm, beside the base
alone in the same round; reported: its seconds and the adapters' start over the base alone's.

    python3 benchmarks/startup.py --models "t5_d256_4:tiny:--hidden_size 256 --d_ff 1024 --d_kv 64 --heads 4" \
        --loras 8 --repeats 2 --json benchmarks/results/cpu/startup_adapters.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from statistics import median
from urllib.request import urlopen

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.bench import write_json  # noqa: E402

WIDTH_256 = "--hidden_size 256 --d_ff 1024 --d_kv 64 --heads 4"
MODELS = (f"t5_d256_4:tiny:{WIDTH_256} --layers 4",
          f"t5_d256_16:tiny:{WIDTH_256} --layers 16",
          "t5_base:base:")
SERVER = "--slots 8 --output_length 64 --tensor_parallel 1 --data_parallel 1"


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS),
                   help="NAME:PRESET:FLAGS each (default: T5 of width 256 at 4 and 16 layers a stack, and base)")
    p.add_argument("--server_args", default=SERVER, help=f"every server's flags (default: {SERVER!r})")
    p.add_argument("--repeats", type=int, default=1, help="cold and warm starts of each server (medians)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a start may take before it counts as failed")
    p.add_argument("--loras", type=int, default=0, metavar="N", help="also start each server with N LoRA adapters")
    p.add_argument("--lora_rank", type=int, default=8, help="the --loras adapters' rank")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def checkpoint(preset: str, flags: str, directory: str) -> None:
    """A random-init checkpoint of the preset's shape with the synthetic tokenizer (benchmarks/serve.py's)."""
    cmd = [sys.executable, os.path.join("benchmarks", "serve.py"), "--method", "checkpoint", "--config", preset,
           "--ckpt", directory, f"--model_flags={flags}", "--json", os.path.join(directory + ".json")]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)


def loras(preset: str, flags: str, ckpt: str, n: int, rank: int) -> str:
    """``--lora`` flags of n random LoRA checkpoints over ``ckpt`` (benchmarks/serve.py's ``make_loras``)."""
    cmd = [sys.executable, os.path.join("benchmarks", "serve.py"), "--method", "loras", "--config", preset, "--ckpt",
           ckpt, f"--model_flags={flags}", "--loras", str(n), "--lora_rank", str(rank), "--json", ckpt + "_loras.json"]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    with open(ckpt + "_loras.json") as f:
        paths = json.load(f)["loras"]
    return "--lora " + " ".join(f"a{i}={p}" for i, p in enumerate(paths))


def start(preset: str, ckpt: str, server_args: str, cache: str, timeout: float) -> dict:
    """One server start -> {seconds to /health 200, programs, compile seconds (as the server says them)}."""
    env = {**os.environ, "FLAN_T5_COMPILATION_CACHE": cache, "FLAN_T5_API_KEY": ""}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, "run_server.py", "--config", preset, "--load", ckpt, "--port", "0",
           *shlex.split(server_args)]
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = None
        for line in proc.stdout:
            if line.startswith("serving "):
                url = line.split(" on ")[1].split()[0]
                break
        if url is None:
            log.seek(0)
            raise SystemExit(f"the server did not start: {' '.join(cmd)}\n{log.read()[-3000:]}")
        while True:
            try:
                if urlopen(url + "/health", timeout=5).status == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > timeout:
                raise SystemExit(f"not healthy within {timeout:.0f} s: {' '.join(cmd)}")
            time.sleep(0.05)
        seconds = time.perf_counter() - t0
    finally:
        proc.terminate()
        proc.wait(60)
    log.seek(0)
    said = re.search(r"compiled (\d+) slot programs in ([\d.]+) s", log.read())
    return {"seconds_to_healthy": seconds, "programs": int(said.group(1)) if said else None,
            "compile_s": float(said.group(2)) if said else None}


def one_model(spec: str, a, tmp: str) -> dict:
    name, preset, flags = (spec.split(":", 2) + [""])[:3]
    ckpt = os.path.join(tmp, name)
    checkpoint(preset, flags, ckpt)
    colds, warms = [], []
    for r in range(a.repeats):
        cache = os.path.join(tmp, f"{name}_cache_{r}")
        colds.append(start(preset, ckpt, a.server_args, cache, a.timeout))
        warms.append(start(preset, ckpt, a.server_args, cache, a.timeout))
        print(f"{name}: cold {colds[-1]['seconds_to_healthy']:.1f} s ({colds[-1]['programs']} programs compiled in "
              f"{colds[-1]['compile_s']} s), warm {warms[-1]['seconds_to_healthy']:.1f} s", flush=True)
    med = lambda runs, k: median(x[k] for x in runs if x[k] is not None)  # noqa: E731
    cold, warm = med(colds, "seconds_to_healthy"), med(warms, "seconds_to_healthy")
    out = {"preset": preset, "model_flags": flags, "cold_s": cold, "warm_s": warm, "warm_over_cold": warm / cold,
           "programs": colds[0]["programs"], "cold_compile_s": med(colds, "compile_s"),
           "warm_compile_s": med(warms, "compile_s"), "runs": {"cold": colds, "warm": warms}}
    if a.loras:
        out["adapters"] = with_adapters(a, name, preset, flags, ckpt, tmp, out)
    return out


def with_adapters(a, name: str, preset: str, flags: str, ckpt: str, tmp: str, alone: dict) -> dict:
    """The same server started with ``--loras`` adapters (cold, then warm, a cache of its own each repeat) -> its
    medians and each over the base alone's."""
    args = f"{a.server_args} {loras(preset, flags, ckpt, a.loras, a.lora_rank)}"
    colds, warms = [], []
    for r in range(a.repeats):
        cache = os.path.join(tmp, f"{name}_lora_cache_{r}")
        colds.append(start(preset, ckpt, args, cache, a.timeout))
        warms.append(start(preset, ckpt, args, cache, a.timeout))
        print(f"{name} with {a.loras} adapters: cold {colds[-1]['seconds_to_healthy']:.1f} s, warm "
              f"{warms[-1]['seconds_to_healthy']:.1f} s", flush=True)
    cold, warm = (median(x["seconds_to_healthy"] for x in runs) for runs in (colds, warms))
    return {"loras": a.loras, "lora_rank": a.lora_rank, "cold_s": cold, "warm_s": warm,
            "cold_over_alone": cold / alone["cold_s"], "warm_over_alone": warm / alone["warm_s"],
            "runs": {"cold": colds, "warm": warms}}


def main(argv=None) -> dict:
    own = list(sys.argv[1:] if argv is None else argv)
    a = parse(own)
    report = {"command": "python3 benchmarks/startup.py " + shlex.join(own), "date": time.strftime("%Y-%m-%d %H:%M"),
              "cpus": os.cpu_count(), "server_args": a.server_args, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for spec in a.models:
            report["models"][spec.split(":")[0]] = one_model(spec, a, tmp)
            write_json(a.json, report)
    models = report["models"]
    if "t5_d256_4" in models and "t5_d256_16" in models:
        report["deep_over_shallow_cold"] = models["t5_d256_16"]["cold_s"] / models["t5_d256_4"]["cold_s"]
        print(f"16 layers over 4, cold: {report['deep_over_shallow_cold']:.2f}x", flush=True)
    write_json(a.json, report)
    print(json.dumps({k: {x: v[x] for x in ("cold_s", "warm_s", "programs")} for k, v in models.items()}), flush=True)
    for k, v in models.items():
        if "adapters" in v:
            print(f"{k} with {a.loras} adapters over alone: cold {v['adapters']['cold_over_alone']:.2f}x, warm "
                  f"{v['adapters']['warm_over_alone']:.2f}x", flush=True)
    return report


if __name__ == "__main__":
    main()
