"""Serving benchmark: the server (continuous batching) against static batching and HF generate one by one, on the
same requests: Poisson arrivals, prompt and output lengths drawn from a spread.

    python3 benchmarks/serve.py --model_flags="--tensor_parallel 1 --data_parallel 1" --hf_requests 16 \
        --model_flags="--hidden_size 256 --d_ff 1024 --d_kv 64 --tensor_parallel 1 --data_parallel 1" \
        --repeats 3 --json benchmarks/results/cpu/serve_readme.json    # CPU: tiny T5 and GPT-J, and 4x wider
    python3 benchmarks/serve.py --configs base xl --requests 128 --slots 32 --hf_requests 16 \
        --model_flags="--tensor_parallel 1 --data_parallel 1"                        # one GPU

Each model is a random-init checkpoint of an inference preset's shape (the synthetic tokenizer: nothing is
downloaded; the weights do not matter for speed), saved once. Its requests (``--requests``, arriving as a Poisson
process of ``--rate`` per second; prompts of ``--min_prompt``..``--max_prompt`` words, outputs of ``--min_new``..
``--max_new`` tokens, log-uniform: many short answers, a few long ones) go, all greedy:
  - server: run_server.py with ``--slots`` slots, over HTTP, streamed (each request sent at its arrival time);
  - static: run_inference.py's batches (decoder/decoder.py's Decoder: rows of micro_batch_size * dp =
    ``--slots``, padded to their longest prompt, decoded up to the output length every request may ask for,
    ``--max_new``, or until every row has written its end-of-text); a batch takes the requests that have arrived
    when the previous one ends (or waits for the next);
  - hf: HF ``generate`` one request at a time, in arrival order, on the same weights (``--hf_requests`` first).
Static and HF run on a virtual clock (their measured compute, the arrivals' idle time), the server in real time,
with a load generator as light as can be (one connection per request, HTTP/1.1 over asyncio's streams) on the same
machine: the server's figures carry its HTTP layer and its clients' work, static batching's carry neither.
``--model_flags`` given several times runs every preset once per value (another shape of the same preset).

``--loras N``: LoRA adapters served side by side instead, against one adapter merged: N random LoRA checkpoints over
the model's checkpoint (rank ``--lora_rank``, the family's default weights, B not zero), and two servers taking
turns in the same rounds on the same requests: ``merged`` (run_server.py --load the first adapter: merged into its
base, the fastest way to serve one) and ``adapters`` (--load the base --lora a0=... with every adapter unmerged in
one stack, each request naming one of them in turn); reported: each one's tokens/s and adapters / merged, per round
and their median. Static batching and HF generate do not run.

``--profile``: where a decoding call's time goes on the host instead: the server's engine in this process (no HTTP;
built from the flags each server of the run gets, ``--server_args`` included), the same requests submitted at once,
its parts timed (dispatching the decoding and insert calls, waiting for the device, the scheduler's own bookkeeping,
the output thread's work), beside the device's time per call alone (calls back to back, every slot decoding).

Where the machine's CPU goes in each run (Linux): ``cpu_s``, the CPU seconds of the server's main thread (its HTTP
layer), of XLA's threads (the programs' work on a CPU device), of its other threads (the decoding and output
threads), and of the load generator, beside the run's wall seconds; static batching's worker's the same way.

Reported per method: generated tokens/s (the tokens each request asked for, up to its end-of-text, over the time
from the first arrival to the last answer), time to the first token and inter-token latency (p50, p99; a static
batch and HF generate give a request's tokens all at once, at its end), request latency, and the share of requests
whose tokens equal the server's; ratios server / static and server / hf measured in this run. Each method runs in a
process of its own (on a GPU each takes the device in turn).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.bench import descendants, write_json  # noqa: E402
from serving.engine import MAX_STEPS_FACTOR  # noqa: E402


def progress(what: str, since: Optional[float] = None) -> None:
    """A line on stderr as each part of a run ends (with its seconds): a run stopped by a time limit shows where its
    time went (on a GPU, compiling the server's programs can take minutes)."""
    took = f" ({time.perf_counter() - since:.1f} s)" if since is not None else ""
    print(f"{time.strftime('%H:%M:%S')} serve.py: {what}{took}", file=sys.stderr, flush=True)


RESULT = "static run: "
WORDS = ("the a cat dog bird horse child woman in at sleeps eats runs park house garden small red old . "
         "mnli hypothesis: premise:").split()


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", nargs="+", default=["tiny", "gptj_tiny"], help="inference presets: the shapes")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--rate", type=float, default=400.0,
                   help="arrivals per second (Poisson; the default keeps every method busy: throughput)")
    p.add_argument("--slots", type=int, default=8, help="the server's slots = a static batch's rows")
    p.add_argument("--steps_per_call", type=int, nargs="+", default=[1, 8],
                   help="the server's decoding steps per call (a server run for each)")
    p.add_argument("--max_steps_per_call", type=int, default=None,
                   help="the server's most steps per call, every slot taken (default: its own, 4 x steps_per_call)")
    p.add_argument("--server_args", action="append", default=None,
                   help="more flags of the server alone, e.g. --server_args='--max_steps_per_call 8'; given again, "
                        "another server with those (all of them take turns in the same rounds)")
    p.add_argument("--min_prompt", type=int, default=8)
    p.add_argument("--max_prompt", type=int, default=48)
    p.add_argument("--min_new", type=int, default=16)
    p.add_argument("--max_new", type=int, default=256)
    p.add_argument("--hf_requests", type=int, default=None, help="requests HF generate runs (default: all)")
    p.add_argument("--repeats", type=int, default=3, help="runs of the server's and static batching's (medians)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--insert_rows", type=int, nargs="+", default=None, help="the server's (default: its own)")
    p.add_argument("--model_flags", action="append", default=None,
                   help="config flags of every method, e.g. --model_flags='--tensor_parallel 1'; given again, "
                        "every preset runs once per value (another shape: --model_flags='--hidden_size 256')")
    p.add_argument("--json", default=None)
    p.add_argument("--profile", action="store_true", help="where a decoding call's time goes on the host (above)")
    p.add_argument("--loras", type=int, default=0, metavar="N",
                   help="N LoRA adapters served side by side against one merged (above), instead of static and HF")
    p.add_argument("--lora_rank", type=int, default=8, help="the --loras adapters' rank")
    p.add_argument("--method", choices=("checkpoint", "loras", "static", "hf", "profile"), default=None,
                   help=argparse.SUPPRESS)
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def workload(a) -> list:
    """[{arrival s, prompt, max_tokens}]: Poisson arrivals, uniform prompt words, log-uniform output lengths."""
    rng = np.random.default_rng(a.seed)
    arrivals = np.cumsum(rng.exponential(1.0 / a.rate, a.requests)) - 0.0
    new = np.exp(rng.uniform(math.log(a.min_new), math.log(a.max_new + 1), a.requests)).astype(int)
    words = rng.integers(a.min_prompt, a.max_prompt + 1, a.requests)
    return [{"arrival": float(t - arrivals[0]), "prompt": " ".join(rng.choice(WORDS, int(w))),
             "max_tokens": int(min(n, a.max_new))} for t, n, w in zip(arrivals, new, words)]


def quantiles(xs) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return {"p50": None, "p99": None}
    return {"p50": float(np.percentile(xs, 50)), "p99": float(np.percentile(xs, 99))}


def summarize(reqs: list, arrivals: list, ends: list, tokens: list, ttft: list, times=None) -> dict:
    """One run's figures; ``times``: each request's token arrival times (streamed), for ITL and TPOT."""
    n = sum(len(t) for t in tokens)
    span = max(ends) - min(arrivals)
    itl = [b - a for t in times or [] for a, b in zip(t, t[1:])]
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times or [] if len(t) > 1]
    return {"requests": len(reqs), "tokens": n, "seconds": span, "tokens_per_s": n / span,
            "ttft_s": quantiles(ttft), "itl_s": quantiles(itl), "tpot_s": quantiles(tpot),
            "latency_s": quantiles([e - a for e, a in zip(ends, arrivals)]), "outputs": tokens}


def median_run(runs: list) -> dict:
    """The run of median throughput, with every run's tokens/s beside it."""
    best = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
    return {**best, "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def useful(row, max_tokens: int, eos: int) -> list:
    """The tokens a request gets from a decoded row: up to its end-of-text, at most max_tokens."""
    row = [int(t) for t in row[:max_tokens]]
    return row[:row.index(eos) + 1] if eos in row else row


# --------------------------------------------------------------------------- the methods in their own processes


def decoding_setup(a, extra: list, overrides: dict):
    """(config, Decoder, tokenizer, weights) of the checkpoint, as run_inference.py builds them."""
    from app.args import parse_args
    from app.predict import start_decoding

    flags = ["--config", a.config, "--load", a.ckpt] + [x for k, v in overrides.items() for x in (f"--{k}", str(v))]
    args, over = parse_args("inference", "serve benchmark", a.config, flags + extra)
    cfg = start_decoding(args, over)
    from data.tokenizer import load_tokenizer
    from decoder.decoder import Decoder
    from utils import checkpoint as ckpt

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    decoder = Decoder.of_config(cfg, tokenizer)
    directory, step = ckpt.resolve(a.ckpt)[-1]
    return cfg, decoder, tokenizer, decoder.load_params(directory, step)


def make_checkpoint(a, extra: list) -> dict:
    """A random-init checkpoint of the preset's shape with the synthetic tokenizer, as run_finetuning saves one."""
    from app.args import make_config, parse_args
    from app.runtime import ensure_host_devices

    _, over = parse_args("inference", "serve benchmark", a.config, ["--config", a.config] + extra)
    cfg = make_config("inference", a.config, {**over, "tokenizer": "synthetic", "hf_model": None},
                      fixed={"eval": True, "rts": False})
    ensure_host_devices(cfg.devices)
    from config.presets import to_dict
    from partitioning.placement import Placement
    from utils import checkpoint as ckpt

    mgr = ckpt.manager(a.ckpt)
    ckpt.save(mgr, 1, Placement(cfg).init_params(a.seed), None, {"step": 1, "seed": a.seed, "config": to_dict(cfg)})
    mgr.wait_until_finished()
    mgr.close()
    return {"checkpoint": a.ckpt}


def make_loras(a, extra: list) -> dict:
    """``--loras`` LoRA checkpoints over the checkpoint ``--ckpt`` (random adapters of rank ``--lora_rank`` of the
    family's default weights, B not zero, seeds 1..N), saved as run_finetuning.py --lora_rank --init_from saves one
    (its base's fingerprint recorded), in ``--ckpt``_lora0 ... -> {"loras": [directories]}."""
    from app.args import make_config, parse_args
    from app.runtime import ensure_host_devices

    _, over = parse_args("inference", "serve benchmark", a.config, ["--config", a.config] + extra)
    over = {**over, "tokenizer": "synthetic", "hf_model": None}
    base_cfg = make_config("inference", a.config, over, fixed={"eval": True, "rts": False})
    ensure_host_devices(base_cfg.devices)
    import jax

    from config.presets import to_dict
    from modelling.params import is_spec
    from partitioning.base import base_record, fingerprint
    from partitioning.placement import Placement
    from utils import checkpoint as ckpt

    digest = fingerprint(Placement(base_cfg).init_params(a.seed))  # (make_checkpoint's weights, made again)
    out = []
    for i in range(a.loras):
        cfg = make_config("inference", a.config, {**over, "lora_rank": a.lora_rank, "lora_alpha": 2.0 * a.lora_rank},
                          fixed={"eval": True, "rts": False})
        rng = np.random.default_rng(a.seed + 1 + i)
        adapters = jax.tree.map(lambda sp: (0.05 * rng.standard_normal(sp.shape)).astype(np.float32),
                                Placement(cfg).specs, is_leaf=is_spec)
        directory = f"{a.ckpt}_lora{i}"
        mgr = ckpt.manager(directory)
        ckpt.save(mgr, 1, adapters, None, {"step": 1, "seed": a.seed + 1 + i, "config": to_dict(cfg),
                                           "lora_base": base_record({"init_from": [a.ckpt, 1]}, digest)})
        mgr.wait_until_finished()
        mgr.close()
        out.append(directory)
    return {"loras": out}


def run_static(a, extra: list) -> dict:
    """run_inference.py's batches on a virtual clock: each batch the requests arrived when the previous ended. A
    worker: compiled once, it runs the requests once for each line it reads, printing each run's report."""
    from app.predict import prompt_features
    from data.tasks import Example

    reqs = json.load(open(a.workload))
    cfg, predictor, tok, params = decoding_setup(a, extra, {"output_length": a.max_new,
                                                            "micro_batch_size": a.slots})
    b = predictor.batch_size
    feats, _ = prompt_features([Example(r["prompt"], "") for r in reqs], tok, predictor.family,
                               cfg.model.sequence_length, given=True)
    lengths = feats["attention_mask"].sum(1)
    decode = lambda idx: predictor.predict_batch(params, feats, idx, tokens=True)  # noqa: E731
    for w in sorted({int(-(-n // 8) * 8) for n in lengths}):  # every prompt width a batch can have, compiled
        decode(np.array([int(np.argmax(-(-lengths // 8) * 8 == w))]))
    static_once(reqs, decode, b, tok.eos_token_id)  # and the shapes its batches pack into (as the server, compiled)
    print("ready", flush=True)
    for line in sys.stdin:  # a run each time the orchestrator asks (between the server's runs): the same load
        run = static_once(reqs, decode, b, tok.eos_token_id)
        print(RESULT + json.dumps({**run, "batch_rows": b, "output_length": a.max_new}), flush=True)
    return {}


def static_once(reqs: list, decode, b: int, eos: int) -> dict:
    clock, i, ends, outputs = 0.0, 0, [0.0] * len(reqs), [None] * len(reqs)
    while i < len(reqs):
        clock = max(clock, reqs[i]["arrival"])
        idx = [j for j in range(i, min(i + b, len(reqs))) if reqs[j]["arrival"] <= clock] or [i]
        t0 = time.perf_counter()
        rows = decode(np.array(idx))
        clock += time.perf_counter() - t0
        for j, row in zip(idx, rows):
            ends[j], outputs[j] = clock, useful(row, reqs[j]["max_tokens"], eos)
        i = idx[-1] + 1
    arrivals = [r["arrival"] for r in reqs]
    return summarize(reqs, arrivals, ends, outputs, [e - r for e, r in zip(ends, arrivals)])


def run_hf(a, extra: list) -> dict:
    """HF generate, one request at a time in arrival order, on a virtual clock."""
    import torch

    from app.hf_generate import hf_model_of

    reqs = json.load(open(a.workload))[:a.hf_requests]
    cfg, predictor, tok, params = decoding_setup(a, extra, {"output_length": a.max_new})
    family = predictor.family
    model = hf_model_of(cfg, family, predictor.weights.host_tree(params))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":  # one request at a time of a small model: more threads only wait for each other (a 2-core
        torch.set_num_threads(1)  # machine shared with other work ran 70x slower with 2)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg.model.precision, torch.float32)
    model = model.to(device=device, dtype=dtype)
    clock, ends, outputs = 0.0, [], []
    for k, r in enumerate([reqs[0]] + reqs):  # the first once more, untimed: warm-up
        ids = torch.tensor([family.encode_inputs(tok, [r["prompt"]])[0]], device=device)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=r["max_tokens"],
                                 do_sample=False, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
                                 if tok.pad_token_id is not None else tok.eos_token_id, **family.hf.generate_kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        if k == 0:
            continue
        clock = max(clock, r["arrival"]) + time.perf_counter() - t0
        ends.append(clock)
        outputs.append(useful(family.hf.new_tokens(out.cpu().numpy(), ids.shape[1])[0], r["max_tokens"],
                              tok.eos_token_id))
    arrivals = [r["arrival"] for r in reqs]
    return {**summarize(reqs, arrivals, ends, outputs, [e - r for e, r in zip(ends, arrivals)]), "device": device}


# --------------------------------------------------------------------------- where a call's time goes


class _Timed:
    """Wall seconds and calls of methods, wrapped in place."""

    def __init__(self):
        self.seconds, self.calls = {}, {}

    def wrap(self, obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(obj, name, timed)


def server_setup(a, steps: int, args: str, extra: list, reqs: list) -> tuple:
    """(config, ServeOptions) of a server of this run (``args``: its --server_args) for the requests, as run_server.py
    reads them from its flags, before JAX starts."""
    from app.args import parse_args, server_flags
    from app.predict import decoding_config
    from serving.engine import ServeOptions

    flags = ["--load", a.ckpt, *server_argv(a, a.config, steps, reqs, extra, args)]
    server, over = parse_args("inference", "serve benchmark", a.config, flags, server_flags)
    cfg = decoding_config(server, over, "serve")
    return cfg, ServeOptions.of(server, cfg)


def profile_engine(cfg, options, steps: int, args: str, reqs: list) -> dict:
    """The server's engine on the workload, in this process, built as run_server.py builds it from the flags a
    server of this run gets (``server_setup``; ``args``: its --server_args): its parts' host time per decoding
    call."""
    from app.runtime import start_devices
    from serving.build import build_engine

    start_devices(cfg)
    engine = build_engine(cfg, options)
    engine.backend.compile_constrained().join()  # (structured outputs' programs: not while it measures)
    device = device_seconds(engine, options.insert_rows)
    return {"steps_per_call": steps, "max_steps_per_call": options.max_steps, "server_args": args,
            "attention_spans": list(engine.backend.spans), **profile_parts(engine, reqs),
            "device_ms_per_call_alone": device}


def profile_parts(engine, reqs: list) -> dict:
    """The requests submitted at once to a started-fresh ``engine`` (greedy, streamed), its parts timed: the host's
    milliseconds a decoding call in each, the calls' steps and attention spans (benchmarks/host_cost.py and the tests
    run it over the fake device)."""
    from serving.output import Output
    from serving.scheduler import Sequence

    ns, spans, advance = [], [], engine.backend.advance  # each decoding call's steps and the span it asked for

    def counted(keep, n, span=None):
        ns.append(n)
        spans.append(span)
        return advance(keep, n, span)

    engine.backend.advance = counted
    t = _Timed()
    for name in ("insert", "advance", "fetch"):
        t.wrap(engine.backend, name, name)
    t.wrap(engine.scheduler, "_round", "round")
    t.wrap(engine.output, "handle", "output")
    done, left = threading.Event(), [len(reqs)]

    def deliver(events):
        left[0] -= sum(1 for _, ev in events if ev.finish_reason or ev.error)
        if left[0] <= 0:
            done.set()

    engine.start(deliver)
    seqs = [Sequence(engine.tokenize(r["prompt"]), r["max_tokens"], 0.0, out=Output(0, None, stream=True))
            for r in reqs]
    t0 = time.perf_counter()
    engine.submit(seqs)
    if not done.wait(3600):
        raise SystemExit("the engine did not finish the requests within an hour")
    wall = time.perf_counter() - t0
    engine.stop()
    failed = [s.aborted for s in seqs if s.aborted is not None]
    if failed:
        raise SystemExit(f"{len(failed)} of the profile's requests failed, the first: {failed[0]}")
    n = t.calls["advance"]
    s = {k: 1000 * v / n for k, v in t.seconds.items()}
    asked = [x for x in spans if x is not None]  # (None: the whole cache)
    return {"decoding_calls": n, "steps_per_decoding_call": float(np.mean(ns)),
            "attention_span_asked_per_decoding_call": float(np.mean(asked)) if asked else None,
            "inserts": t.calls.get("insert", 0), "tokens": sum(x.count for x in seqs),
            "tokens_per_s": sum(x.count for x in seqs) / wall, "wall_s": wall,
            "host_ms_per_decoding_call": {
                "dispatching the decoding call": s["advance"], "dispatching inserts": s.get("insert", 0.0),
                "waiting for the device (reading)": s["fetch"],
                "scheduler bookkeeping": s["round"] - s["advance"] - s.get("insert", 0.0) - s["fetch"],
                "output thread (text, events)": s.get("output", 0.0)}}


def device_seconds(engine, insert_rows: tuple, calls: int = 20) -> dict:
    """Milliseconds of a decoding call (every slot decoding) and of an insert of each compiled size (as many
    prompts of the widest length a shard as its packed rows), back to back."""
    import numpy as np

    b = engine.backend
    out = {}
    for rows in insert_rows:
        joiners = [(d * b.local + j, [3] * b.max_prompt, (0.0, 0, 0.0, 0, 0, -1), 1 << 20)
                   for d in range(b.dp) for j in range(rows)]
        b.fetch(b.insert(joiners)[0])
        t0 = time.perf_counter()
        for _ in range(calls):
            last = b.insert(joiners)[0]
        b.fetch(last)
        out[f"insert of {rows} packed row(s) a shard"] = 1000 * (time.perf_counter() - t0) / calls
    keep = np.ones(b.slots, bool)
    for steps in sorted({engine.scheduler.steps, b.steps}):
        b.fetch(b.advance(keep, steps)[0])  # (over the whole cache: no span)
        t0 = time.perf_counter()
        for _ in range(calls):
            last = b.advance(keep, steps)[0]
        b.fetch(last)
        out[f"decoding call ({steps} steps, {b.slots} slots)"] = 1000 * (time.perf_counter() - t0) / calls
    b.reset()
    return out


def profile_threads(a):
    """The --cpu_threads every server of a --profile run gives (None: the server's default); SystemExit where they
    differ (XLA's threads are set once, before JAX starts: one process, one setting)."""
    threads = {own_flag(args, "cpu_threads") for _, _, args in server_variants(a)}
    if len(threads) > 1:
        raise SystemExit("--profile runs every server setting in one process: give them one --cpu_threads")
    return threads.pop()


def run_profile(a, extra: list) -> dict:
    from app.flops import decode_step_flops
    from app.runtime import server_cpu_threads, set_cpu_threads

    given = profile_threads(a)
    reqs = json.load(open(a.workload))
    setups = {name: (*server_setup(a, k, args, extra, reqs), k, args) for name, k, args in server_variants(a)}
    threads = {server_cpu_threads(given, options.slots * decode_step_flops(cfg.model))
               for cfg, options, _, _ in setups.values()}  # (as run_server.py sets them: by a step of its slots)
    if len(threads) > 1:
        raise SystemExit("--profile runs every server setting in one process: give them one --cpu_threads (their "
                         f"defaults differ: {sorted(threads)})")
    set_cpu_threads(threads.pop())
    return {name: profile_engine(*setup, reqs) for name, setup in setups.items()}


def own_flag(args: str, name: str):
    """The value a server's own flags (``--server_args``) give one of its flags (``name``: its dest, as
    ``cpu_threads``), as run_server.py parses them (``--flag=value`` too, the last one winning), else None."""
    from app.args import server_flags

    p = argparse.ArgumentParser(add_help=False)
    server_flags(p)
    return getattr(p.parse_known_args(shlex.split(args))[0], name)


# --------------------------------------------------------------------------- the server, over HTTP


def server_width(reqs: list) -> int:
    """The prompt width a server takes for the requests: their longest (and T5's end-of-text, slack), rounded up to a
    multiple of 8."""
    return -(-(max(len(r["prompt"].split()) for r in reqs) + 2) // 8) * 8


def server_variants(a) -> list:
    """[(name, steps per call, the server's own flags)]: one server per --steps_per_call and --server_args."""
    return [(f"server_{k}step" + (f" {args}" if args else ""), k, args)
            for k in a.steps_per_call for args in (a.server_args or [""])]


def most_steps(a, steps: int, args: str) -> int:
    """A server's --max_steps_per_call: its own flags', else the run's, else the server's default."""
    own = own_flag(args, "max_steps_per_call")
    return own if own is not None else a.max_steps_per_call or MAX_STEPS_FACTOR * steps


def server_argv(a, config: str, steps: int, reqs: list, extra: list, args: str = "") -> list:
    """A server's command line but --load and --port (run_server.py's; --profile's engine parses the same): the
    preset (the checkpoint carries the model's shape, the preset the rest: its precision), the run's slots, a queue
    that holds every request, the prompt width the requests need, the output length, the steps a call, the model's
    flags (``extra``), then its own (``args``, last: they override the above)."""
    cmd = ["--config", config, "--slots", str(a.slots), "--max_queue", str(len(reqs)), "--output_length",
           str(a.max_new), "--prompt_width", str(server_width(reqs)), "--steps_per_call", str(steps), *extra]
    cmd += ["--max_steps_per_call", str(a.max_steps_per_call)] if a.max_steps_per_call else []
    cmd += ["--insert_rows", *map(str, a.insert_rows)] if a.insert_rows else []
    return cmd + shlex.split(args)


def start_server(a, config: str, steps: int, ckpt: str, reqs: list, extra: list, args: str = "") -> tuple:
    """run_server.py on a free port with every program compiled -> (process, base url, model id)."""
    cmd = [sys.executable, "run_server.py", "--load", ckpt, "--port", "0",
           *server_argv(a, config, steps, reqs, extra, args)]
    env = {**os.environ, "FLAN_T5_API_KEY": ""}
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**env, **SHARED_DEVICE}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    compiled = threading.Event()  # the constrained rows' programs, which it compiles once it serves: not while timed

    def errors():
        for line in proc.stderr:
            sys.stderr.write(line)
            if "the constrained rows' programs" in line or "compiled the constrained rows'" in line:
                compiled.set()
        compiled.set()

    threading.Thread(target=errors, daemon=True).start()
    for line in proc.stdout:
        if line.startswith("serving "):
            compiled.wait()
            return proc, line.split(" on ")[1].split()[0], line.split()[1]
    raise SystemExit(f"the server did not start: {' '.join(cmd)} (exit {proc.wait()})")


async def _post_stream(host: str, port: int, body: dict):
    """POST /v1/completions and yield each server-sent event's JSON: HTTP/1.1 over asyncio's streams, a connection
    per request. A load generator as light as it can be (httpx's parsing of every event cost the 2-core machine
    as much as the server's work at the tiny shapes)."""
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(data), data))
    try:
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"the server answered {status!r}: {await reader.read()!r}")
        while (await reader.readline()).strip():  # headers (the body is chunked)
            pass
        pending = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            pending += (await reader.readexactly(size + 2))[:-2]  # the chunk, without its CRLF
            *events, pending = pending.split(b"\n\n")
            for e in events:
                if e.startswith(b"data: {"):
                    yield json.loads(e[6:])
    finally:
        writer.close()


async def _one(url: str, model: str, r: dict, t0: float) -> dict:
    await asyncio.sleep(max(t0 + r["arrival"] - time.perf_counter(), 0))
    host, port = url.split("//")[1].rsplit(":", 1)
    sent, times, tokens = time.perf_counter(), [], []
    body = {"model": r.get("model", model), "prompt": r["prompt"], "max_tokens": r["max_tokens"], "temperature": 0,
            "stream": True, "return_token_ids": True}
    async for event in _post_stream(host, int(port), body):
        ids = event["choices"][0].get("token_ids") or []
        now = time.perf_counter()
        times += [now] * len(ids)
        tokens += ids
    return {"sent": sent - t0, "times": [t - t0 for t in times], "tokens": tokens}


async def _drive(url: str, model: str, reqs: list) -> list:
    """The requests sent at their arrival times (after two untimed ones)."""
    for r in reqs[:2]:
        await _one(url, model, {**r, "arrival": 0.0}, time.perf_counter())
    t0 = time.perf_counter()
    return await asyncio.gather(*[_one(url, model, r, t0) for r in reqs])


def thread_seconds(pid: int) -> dict:
    """{thread id: (name, CPU seconds so far, user and system)} of a process's threads and its child processes'
    (Linux; {} elsewhere)."""
    out = {}
    for p in [pid] + descendants(pid):
        out.update(_own_thread_seconds(p))
    return out


def _own_thread_seconds(pid: int) -> dict:
    out, tick = {}, os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    root = f"/proc/{pid}/task"
    for tid in (os.listdir(root) if os.path.isdir(root) else []):
        try:
            with open(f"{root}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{root}/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # from the state on: utime and stime are the 12th, 13th
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return out


def thread_split(pid: int, before: dict, after: dict) -> tuple:
    """``thread_seconds``' two readings -> CPU seconds between them of (the main thread, XLA's threads (named tf_*,
    XLA*), the other threads). A thread that ended between the two readings is not counted."""
    used = {tid: sec - before.get(tid, (name, 0.0))[1] for tid, (name, sec) in after.items()}
    xla = sum(sec for tid, sec in used.items() if after[tid][0].startswith(("tf_", "XLA", "xla")))
    main = used.get(pid, 0.0)
    return main, xla, sum(used.values()) - main - xla


def cpu_shares(pid: int, before: dict, after: dict, client: float, wall: float) -> dict:
    """A server run's CPU seconds: its main thread (HTTP), XLA's threads, its other threads, the load generator."""
    main, xla, other = thread_split(pid, before, after)
    return {"http (main thread)": main, "xla threads": xla, "other threads (decoding, output)": other,
            "load generator": client, "wall": wall}


def server_run(url: str, model: str, reqs: list, pid: int = None) -> dict:
    """The requests sent to the server at url; with its pid, ``cpu_s`` beside them (the module docstring)."""
    before, c0, t0 = thread_seconds(pid) if pid else {}, time.process_time(), time.perf_counter()
    out = _server_run(url, model, reqs)
    if pid:
        out["cpu_s"] = cpu_shares(pid, before, thread_seconds(pid), time.process_time() - c0, time.perf_counter() - t0)
    return out


def static_run(pid: int, run) -> dict:
    """One static-batching run, with the CPU seconds of the worker's threads beside it (``cpu_s``: its main thread,
    XLA's, the others; its clock is virtual, so no wall)."""
    before = thread_seconds(pid)
    out = run()
    out["cpu_s"] = dict(zip(("main thread", "xla threads", "other threads"),
                            thread_split(pid, before, thread_seconds(pid))))
    return out


def _server_run(url: str, model: str, reqs: list) -> dict:
    got = asyncio.run(_drive(url, model, reqs))
    return summarize(reqs, [g["sent"] for g in got], [g["times"][-1] for g in got], [g["tokens"] for g in got],
                     [g["times"][0] - g["sent"] for g in got], [g["times"] for g in got])


def start_static(a, config: str, ckpt: str, work: str, flags: str):
    """The static-batching worker (its programs compiled) -> (process, run(): one run's report)."""
    cmd = _method_cmd(a, "static", config, ckpt, work, flags, os.devnull)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, **SHARED_DEVICE})
    def until(mark: str) -> str:  # the worker's next line that starts with ``mark`` (a library may print others)
        for line in proc.stdout:
            if line.startswith(mark):
                return line[len(mark):]
        raise SystemExit(f"{' '.join(cmd)} stopped (exit {proc.wait()})")

    until("ready")

    def run() -> dict:
        proc.stdin.write("run\n")
        proc.stdin.flush()
        return json.loads(until(RESULT))

    return proc, run


def interleaved(a, config: str, ckpt: str, work: str, flags: str, reqs: list) -> dict:
    """The servers (one per --steps_per_call) and static batching, each compiled once, their runs taking turns
    (the order turned each round), so that a shared machine's slow spell falls on all of them."""
    t = time.perf_counter()
    static, run_static_once = start_static(a, config, ckpt, work, flags)
    progress(f"{config}: static batching compiled", t)
    servers = {}
    for name, k, args in server_variants(a):
        t = time.perf_counter()
        servers[name] = (k, args, *start_server(a, config, k, ckpt, reqs, shlex.split(flags), args))
        progress(f"{config}: {name} started, its programs compiled", t)
    runs = {name: [] for name in list(servers) + ["static"]}
    try:
        for r in range(a.repeats):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                t = time.perf_counter()
                runs[name].append(static_run(static.pid, run_static_once) if name == "static" else
                                  server_run(*servers[name][3:], reqs, pid=servers[name][2].pid))
                progress(f"{config}: round {r + 1} of {a.repeats}, {name}: "
                         f"{runs[name][-1]['tokens_per_s']:.0f} tokens/s", t)
    finally:
        for _, _, proc, _, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        static.stdin.close()
        static.wait(120)
    out = {name: {**median_run(runs[name]), "slots": a.slots, "steps_per_call": k,
                  "max_steps_per_call": most_steps(a, k, args), "server_args": args,
                  # each round's server / static: runs next to each other in time, the ratio a slow spell spares
                  "over_static_per_round": [x["tokens_per_s"] / y["tokens_per_s"]
                                            for x, y in zip(runs[name], runs["static"])]}
           for name, (k, args, _, _, _) in servers.items()}
    out["static"] = median_run(runs["static"])
    return out


def adapters_against_merged(a, config: str, ckpt: str, loras: list, flags: str, reqs: list) -> dict:
    """``--loras``: the merged server and the adapters' server (see the module docstring), each compiled once, their
    runs taking turns (the order turned each round) on the same requests -> their reports and the ratios."""
    names = [f"a{i}" for i in range(len(loras))]
    mixed = [{**r, "model": names[i % len(names)]} for i, r in enumerate(reqs)]  # (each adapter in turn)
    servers = {}
    for name, load, args in (("merged", loras[0], ""),
                             ("adapters", ckpt, "--lora " + " ".join(f"{n}={p}" for n, p in zip(names, loras)))):
        t = time.perf_counter()
        servers[name] = start_server(a, config, a.steps_per_call[0], load, reqs, shlex.split(flags), args)
        progress(f"{config}: the {name} server started, its programs compiled", t)
    runs = {name: [] for name in servers}
    try:
        for r in range(a.repeats):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                proc, url, model = servers[name]
                runs[name].append(server_run(url, model, mixed if name == "adapters" else reqs, pid=proc.pid))
                progress(f"{config}: round {r + 1} of {a.repeats}, {name}: {runs[name][-1]['tokens_per_s']:.0f} "
                         "tokens/s")
    finally:
        for proc, _, _ in servers.values():
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
    per_round = [x["tokens_per_s"] / y["tokens_per_s"] for x, y in zip(runs["adapters"], runs["merged"])]
    out = {name: {**median_run(runs[name]), "slots": a.slots, "steps_per_call": a.steps_per_call[0]} for name in runs}
    for name in out:
        out[name].pop("outputs")
    out["adapters"].update(loras=len(loras), lora_rank=a.lora_rank, over_merged_per_round=per_round)
    out["ratios"] = {"adapters / merged tokens_per_s": out["adapters"]["tokens_per_s"] / out["merged"]["tokens_per_s"],
                     "adapters / merged, median of rounds": float(np.median(per_round))}
    return out


# --------------------------------------------------------------------------- the whole run


# the server and the static worker share the accelerator: each takes memory as it needs it, none preallocates
SHARED_DEVICE = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def _method_cmd(a, name: str, config: str, ckpt: str, work: str, flags: str, out: str) -> list:
    cmd = [sys.executable, os.path.join("benchmarks", "serve.py"), "--method", name, "--config", config, "--ckpt",
           ckpt, "--workload", work, "--json", out, "--slots", str(a.slots), "--max_new", str(a.max_new),
           "--seed", str(a.seed), f"--model_flags={flags}", "--steps_per_call", *map(str, a.steps_per_call)]
    cmd += ["--max_steps_per_call", str(a.max_steps_per_call)] if a.max_steps_per_call else []
    cmd += ["--insert_rows", *map(str, a.insert_rows)] if a.insert_rows else []
    cmd += [f"--server_args={args}" for args in a.server_args or []]
    cmd += ["--loras", str(a.loras), "--lora_rank", str(a.lora_rank)] if a.loras else []
    return cmd + (["--hf_requests", str(a.hf_requests)] if a.hf_requests else [])


def method(a, name: str, config: str, ckpt: str, work: str, flags: str, tmp: str) -> dict:
    """One method in a process of its own -> its report."""
    out = os.path.join(tmp, f"{config}_{name}.json")
    cmd = _method_cmd(a, name, config, ckpt, work, flags, out)
    # HF generate's process keeps JAX off the accelerator (it only reads the checkpoint): torch gets the device
    env = {**os.environ, "JAX_PLATFORMS": "cpu"} if name == "hf" else {**os.environ, **SHARED_DEVICE}
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed (exit {p.returncode}):\n{p.stderr[-3000:]}")
    return json.load(open(out))


def one_model(a, config: str, flags: str, tmp: str) -> dict:
    """Every method on one model's requests, and their ratios."""
    tmp = tempfile.mkdtemp(dir=tmp)
    ckpt, work = os.path.join(tmp, f"{config}_ckpt"), os.path.join(tmp, f"{config}_workload.json")
    reqs = workload(a)
    with open(work, "w") as f:
        json.dump(reqs, f)
    t = time.perf_counter()
    method(a, "checkpoint", config, ckpt, work, flags, tmp)
    progress(f"{config}: checkpoint saved", t)
    if a.loras:
        return adapters_against_merged(a, config, ckpt, method(a, "loras", config, ckpt, work, flags, tmp)["loras"],
                                       flags, reqs)
    if a.profile:
        return method(a, "profile", config, ckpt, work, flags, tmp)
    servers = [name for name, _, _ in server_variants(a)]
    out = interleaved(a, config, ckpt, work, flags, reqs)
    t = time.perf_counter()
    out["hf"] = method(a, "hf", config, ckpt, work, flags, tmp)
    progress(f"{config}: HF generate, {out['hf']['requests']} requests", t)
    served = out[servers[0]]["outputs"]
    for name in servers[1:] + ["static", "hf"]:
        theirs = out[name].pop("outputs")
        out[name]["same_tokens_as_server"] = float(np.mean([x == y for x, y in zip(served, theirs)]))
    out[servers[0]].pop("outputs")
    out["ratios"] = {f"{s} / {b} tokens_per_s": out[s]["tokens_per_s"] / out[b]["tokens_per_s"]
                     for s in servers for b in ("static", "hf")}
    for s in servers:  # the median of the rounds' ratios (tokens/s, server over static batching)
        out["ratios"][f"{s} / static, median of rounds"] = float(np.median(out[s]["over_static_per_round"]))
    return out


def main(argv=None) -> dict:
    own = list(sys.argv[1:] if argv is None else argv)
    a = parse(own)
    variants = a.model_flags or [""]
    if a.method:
        report = {"checkpoint": make_checkpoint, "loras": make_loras, "static": run_static, "hf": run_hf,
                  "profile": run_profile}[a.method](a, shlex.split(variants[0]))
        write_json(a.json, report)
        return report
    if a.profile:
        profile_threads(a)  # (refused before any checkpoint is made)
    report = {"command": "python3 benchmarks/serve.py " + shlex.join(own),
              "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "cpus": os.cpu_count(),
              "workload": {k: getattr(a, k) for k in ("requests", "rate", "slots", "steps_per_call",
                                                      "max_steps_per_call", "server_args", "min_prompt",
                                                      "max_prompt", "min_new", "max_new", "hf_requests", "repeats",
                                                      "seed", "loras", "lora_rank")},
              "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for flags, config in [(f, c) for f in variants for c in a.configs]:
            name = f"{config} {flags}".strip()
            report["models"][name] = m = one_model(a, config, flags, tmp)
            m["model_flags"] = flags
            if a.profile:
                print(f"{name}: {json.dumps(m)}", flush=True)
                write_json(a.json, report)
                continue
            print(f"{name}: " + ", ".join(f"{k} {m[k]['tokens_per_s']:.0f} tokens/s (TTFT p50 "
                                             f"{m[k]['ttft_s']['p50']:.3f} s, p99 {m[k]['ttft_s']['p99']:.3f} s)"
                                             for k in m if k not in ("ratios", "model_flags"))
                  + "; " + ", ".join(f"{k} {v:.2f}x" for k, v in m["ratios"].items()), flush=True)
            write_json(a.json, report)
    return report


if __name__ == "__main__":
    main()
