"""Probe: does a CPU-only decoding choice pay, measured A/B in one process? Each variant's programs are traced and
compiled with its choice patched in (the choice functions the code asks at trace time), then the variants' batches
run in alternation (A B, B A, ...), each timing the best of 3 calls; ratios are per round, their median and range.

    python3 benchmarks/probes/decode_ab.py --choice integer_dots --quantize int8 --batch 8 \\
        --json benchmarks/results/archive/cpu/ab_integer_dots_b8.json

Choices (``CHOICES``): the value each variant gives the function (the first variant is the baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# choice -> (module, function name, {variant: the value the function returns})
CHOICES = {
    "integer_dots": ("modelling.quant", "integer_dots", {"dequantizing": False, "integer": True}),
}


@contextlib.contextmanager
def patched(module: str, name: str, value):
    mod = importlib.import_module(module)
    saved = getattr(mod, name)
    setattr(mod, name, lambda *a, **k: value)
    try:
        yield
    finally:
        setattr(mod, name, saved)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--choice", choices=sorted(CHOICES), required=True)
    p.add_argument("--config", default="small")
    p.add_argument("--batch", default="8")
    p.add_argument("--sequence_length", default="128")
    p.add_argument("--output_length", type=int, default=16)
    p.add_argument("--quantize", default="none")
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse(argv)
    from app.args import parse_config
    from app.runtime import start_devices

    cfg, _ = parse_config("inference", "probe", "small", [
        "--config", a.config, "--sequence_length", a.sequence_length, "--micro_batch_size", a.batch,
        "--output_length", str(a.output_length), "--tensor_parallel", "1", "--data_parallel", "1", "--precision",
        "float32", "--quantize", a.quantize])
    start_devices(cfg)
    import jax
    import numpy as np

    from data.generated import generated_prompts
    from decoder.engine import Decoder

    module, name, variants = CHOICES[a.choice]
    ids, mask = generated_prompts(cfg)
    progs, tokens, compile_s, params = {}, {}, {}, None
    for v, value in variants.items():
        with patched(module, name, value):
            g = Decoder.of_config(cfg, eos=-1)
            params = g.weights.convert(g.place.init_params()) if params is None else params
            gen, gen1 = g.search(g.options), g.search(dataclasses.replace(g.options, max_new_tokens=1))
            t0 = time.perf_counter()
            tokens[v] = np.asarray(gen(params, ids, mask))
            jax.block_until_ready(gen1(params, ids, mask))
            compile_s[v] = time.perf_counter() - t0
        progs[v] = gen, gen1
    times = {v: {"first_token_s": [], "generate_s": []} for v in variants}
    load_before = os.getloadavg()
    names = list(variants)
    for r in range(a.rounds):
        for v in names if r % 2 == 0 else names[::-1]:
            for key, fn in zip(("first_token_s", "generate_s"), progs[v][::-1]):
                best = float("inf")
                for _ in range(3):
                    t = time.perf_counter()
                    jax.block_until_ready(fn(params, ids, mask))
                    best = min(best, time.perf_counter() - t)
                times[v][key].append(best)
    n, base = a.output_length, names[0]
    per_token = {v: [(g - f) / (n - 1) for g, f in zip(t["generate_s"], t["first_token_s"])] for v, t in times.items()}
    out = {"command": "python3 benchmarks/probes/decode_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "load_before": load_before, "load_after": os.getloadavg(), "compile_s": compile_s,
           "same_tokens_as_" + base: {v: float((tokens[v] == tokens[base]).mean()) for v in names},
           "medians": {v: {**{k: statistics.median(x) for k, x in t.items()},
                           "per_token_s": statistics.median(per_token[v])} for v, t in times.items()},
           "speedup_over_" + base: {}, "rounds": times}
    for v in names[1:]:
        for key, series in (("first_token_s", None), ("generate_s", None), ("per_token_s", per_token)):
            mine = series[v] if series else times[v][key]
            theirs = series[base] if series else times[base][key]
            rs = [b / x for x, b in zip(mine, theirs)]
            out["speedup_over_" + base].setdefault(v, {})[key] = {"median": statistics.median(rs), "min": min(rs),
                                                                   "max": max(rs)}
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
