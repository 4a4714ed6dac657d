"""The server's host ceiling: its engine (scheduler and output threads, the same code run_server.py runs) with the
device replaced by the tests' fake backend, whose calls take next to no time, so the tokens/s measured is what the
host alone can keep up with, and each thread's CPU a token is its own work.

    python3 benchmarks/host_cost.py [--requests 512] [--slots 32] [--steps_per_call 8] [--json OUT]

Workload: benchmarks/serve.py's ``workload`` (prompts of 8 to 48 words, outputs of 16 to 256 tokens, log-uniform),
all submitted at once, each sequence going to its ``max_tokens``; the synthetic tokenizer. Reported for streamed and
whole completions: tokens/s, and each thread's CPU seconds and microseconds a token (``time.thread_time`` around its
loop). No HTTP: serve.py's ``cpu_s`` gives the HTTP thread's share. On a GPU a thread waiting for the device may
spin, so serve.py's CPU seconds of the decoding thread there are not its work; this is.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.bench import write_json  # noqa: E402


def fake_engine(requests: int, slots: int, steps: int):
    """The server's engine (as run_server.py builds it for ``steps`` a call, up to 4x with every slot taken, prompts
    up to 64 tokens, 256 new) over the tests' fake device (``engine.backend``) and the synthetic tokenizer."""
    from data.tokenizer import load_tokenizer
    from serving.engine import Engine, ServeOptions, default_insert_rows
    from tests.fake_backend import FakeBackend

    tok = load_tokenizer("synthetic")
    width, rows, most = 64, tuple(default_insert_rows(slots)), 4 * steps
    backend = FakeBackend(slots=slots, max_prompt=width, steps=most, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                          vocab=len(tok), score_rows=slots)
    options = ServeOptions(slots, requests, width, rows, steps, 256, 1 << 20, 1 << 20, "host_cost", max_steps=most)
    return Engine(backend, tok, lambda texts: [tok(t, add_special_tokens=False)["input_ids"] for t in texts], options)


def run(requests: int, slots: int, steps: int, stream: bool, seed: int = 0) -> dict:
    """One run of the engine over the fake device -> its figures."""
    from benchmarks import serve
    from serving.output import Output
    from serving.scheduler import Sequence

    engine = fake_engine(requests, slots, steps)
    cpu = {}
    for name, obj in (("scheduler", engine.scheduler), ("output", engine.output)):
        loop = obj._loop

        def timed(loop=loop, name=name):
            t = time.thread_time()
            loop()
            cpu[name] = time.thread_time() - t

        obj._loop = timed
    done, left, events = threading.Event(), [requests], [0]

    def deliver(batch):
        events[0] += len(batch)
        left[0] -= sum(1 for _, ev in batch if ev.finish_reason or ev.error)
        if left[0] <= 0:
            done.set()

    work = serve.workload(serve.parse(["--requests", str(requests), "--seed", str(seed)]))
    seqs = [Sequence(engine.tokenize(r["prompt"]), r["max_tokens"], 0.0, out=Output(0, None, stream=stream))
            for r in work]
    engine.start(deliver)
    t0 = time.perf_counter()
    engine.submit(seqs)
    if not done.wait(600):
        raise SystemExit("the engine did not finish within 600 s")
    wall = time.perf_counter() - t0
    tokens = sum(s.count for s in seqs)  # (read when the last one ended: the tokens of the wall time)
    engine.stop()
    return {"stream": stream, "tokens": tokens, "asked": int(sum(s.max_tokens for s in seqs)), "events": events[0],
            "decoding_calls": len(engine.backend.ns), "wall_s": wall, "tokens_per_s": tokens / wall,
            "cpu_s": cpu, "cpu_us_per_token": {k: 1e6 * v / tokens for k, v in cpu.items()}}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=512)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--steps_per_call", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="runs of each (the median run's by tokens/s)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    report = {"command": "python3 benchmarks/host_cost.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "cpus": len(os.sched_getaffinity(0)),
              "requests": a.requests, "slots": a.slots, "steps_per_call": a.steps_per_call}
    for stream in (True, False):
        runs = sorted((run(a.requests, a.slots, a.steps_per_call, stream) for _ in range(a.repeats)),
                      key=lambda r: r["tokens_per_s"])
        r = runs[len(runs) // 2]
        r["tokens_per_s_runs"] = [x["tokens_per_s"] for x in runs]
        report["streamed" if stream else "whole"] = r
        us = ", ".join(f"{k} {v:.1f} µs" for k, v in r["cpu_us_per_token"].items())
        print(f"{'streamed' if stream else 'whole'}: {r['tokens']} tokens in {r['wall_s']:.3f} s, "
              f"{r['tokens_per_s']:,.0f} tokens/s (median of {a.repeats}); CPU a token: {us}")
    if a.json:
        write_json(a.json, report)
    return report


if __name__ == "__main__":
    main()
