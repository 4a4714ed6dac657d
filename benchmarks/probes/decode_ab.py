"""Probe: does a CPU-only decoding choice pay, measured A/B in one process? Each variant's programs are traced and
compiled with its choice patched in (the choice functions the code asks at trace time), then the variants' batches
run in alternation (A B, B A, ...), each timing the best of 3 calls, in wall and in CPU seconds (the process's, every
thread's: the work done, which the machine's other processes move less); ratios are per round, their median and
range.

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
    "unrolled_decoder": ("decoder.decoder", "unrolled_decoder", {"scanned": False, "unrolled": True}),
    "heads_major_attention": ("modelling.layers", "heads_major_attention", {"positions_major": False,
                                                                            "heads_major": True}),
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


def build(cfg, module: str, name: str, variants: dict, ids, mask) -> tuple:
    """({variant: (its whole decoding, its first token) programs, compiled}, {variant: its weights, in its layout},
    {variant: its tokens}, {variant: seconds of its first calls})."""
    import jax
    import numpy as np

    from decoder.decoder import Decoder

    progs, params, tokens, compile_s, init = {}, {}, {}, {}, None
    for v, value in variants.items():
        with patched(module, name, value):
            g = Decoder.of_config(cfg, eos=-1)
            init = g.place.init_params() if init is None else init  # (the same weights, in each variant's layout)
            params[v] = g.weights.convert(init)
            gen, gen1 = g.search(g.options), g.search(dataclasses.replace(g.options, max_new_tokens=1))
            t0 = time.perf_counter()
            tokens[v] = np.asarray(gen(params[v], ids, mask))
            jax.block_until_ready(gen1(params[v], ids, mask))
            compile_s[v] = time.perf_counter() - t0
        progs[v] = gen, gen1
    return progs, params, tokens, compile_s


def alternate(progs: dict, params: dict, ids, mask, rounds: int) -> dict:
    """{clock: {variant: {first_token_s / generate_s: [per round]}}}: each round every variant in turn (A B, B A),
    each figure the best of 3 calls, in wall seconds and in the process's CPU seconds (every thread's: the work done,
    which other processes on the machine move less than the wall clock)."""
    import jax

    names = list(progs)
    out = {c: {v: {"first_token_s": [], "generate_s": []} for v in names} for c in ("wall", "cpu")}
    for r in range(rounds):
        for v in names if r % 2 == 0 else names[::-1]:
            for key, fn in zip(("first_token_s", "generate_s"), progs[v][::-1]):
                best = {"wall": float("inf"), "cpu": float("inf")}
                for _ in range(3):
                    t, c = time.perf_counter(), time.process_time()
                    jax.block_until_ready(fn(params[v], ids, mask))
                    best = {"wall": min(best["wall"], time.perf_counter() - t),
                            "cpu": min(best["cpu"], time.process_time() - c)}
                for clock in out:
                    out[clock][v][key].append(best[clock])
    return out


def speedups(times: dict, n: int) -> dict:
    """{clock: {variant: {figure: median, min, max of the rounds' baseline / variant}}} (> 1: the variant is faster),
    per-token time (T(n) - T(1)) / (n - 1) among the figures; and the medians themselves."""
    out, medians = {}, {}
    for clock, by in times.items():
        per = {v: {**t, "per_token_s": [(g - f) / (n - 1) for g, f in zip(t["generate_s"], t["first_token_s"])]}
               for v, t in by.items()}
        names = list(per)
        medians[clock] = {v: {k: statistics.median(x) for k, x in t.items()} for v, t in per.items()}
        for v in names[1:]:
            for key in per[v]:
                rs = [b / x for x, b in zip(per[v][key], per[names[0]][key])]
                out.setdefault(clock, {}).setdefault(v, {})[key] = {"median": statistics.median(rs), "min": min(rs),
                                                                     "max": max(rs)}
    return {"speedup_over_baseline": out, "medians": medians}


def main(argv=None) -> dict:
    a = parse(argv)
    from app.args import parse_config
    from app.runtime import start_devices

    cfg, _ = parse_config("inference", "probe", "small", [
        "--config", a.config, "--sequence_length", a.sequence_length, "--micro_batch_size", a.batch,
        "--output_length", str(a.output_length), "--tensor_parallel", "1", "--data_parallel", "1", "--precision",
        "float32", "--quantize", a.quantize])
    start_devices(cfg)
    from data.generated import generated_prompts

    module, name, variants = CHOICES[a.choice]
    ids, mask = generated_prompts(cfg)
    progs, params, tokens, compile_s = build(cfg, module, name, variants, ids, mask)
    base = list(variants)[0]
    load_before = os.getloadavg()
    times = alternate(progs, params, ids, mask, a.rounds)
    out = {"command": "python3 benchmarks/probes/decode_ab.py " + " ".join(sys.argv[1:] if argv is None else argv),
           "baseline": base, "load_before": load_before, "load_after": os.getloadavg(), "compile_s": compile_s,
           "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "same_tokens_as_baseline": {v: float((tokens[v] == tokens[base]).mean()) for v in variants},
           **speedups(times, a.output_length), "rounds": times}
    print(json.dumps({k: v for k, v in out.items() if k != "rounds"}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
