"""Where a step's time goes: one step under the JAX profiler, top ops by device time.

``finetuning.py --profile DIR`` traces one extra step after the timed ones with
``jax.profiler.trace(create_perfetto_trace=True)`` and prints the ops that took
the most time on the device (on CPU: on the XLA executor threads), grouped by
name, with their share of the step. The trace (``perfetto_trace.json.gz``,
viewable in ui.perfetto.dev) is left under DIR.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import time
from collections import defaultdict

from app.bench import write_json


def op_family(name: str) -> str:
    """Coarse kind of a device op from its kernel / HLO name."""
    n = name.lower()
    if any(k in n for k in ("gemm", "cublas", "cutlass", "xmma", "nvjet", "matmul", "dot", "convolution",
                            "ynn_fusion", "xnn_fusion", "onednn")):  # the last three: XLA:CPU's matmul libraries
        return "matmul"
    if any(k in n for k in ("all-reduce", "all-gather", "reduce-scatter", "nccl", "collective", "all-to-all")):
        return "collective"
    if "memcpy" in n or "memset" in n or "copy" in n:
        return "copy"
    if "scatter" in n or "gather" in n or "dynamic" in n:
        return "gather/scatter/slice"
    if "reduce" in n:
        return "reduction fusion"
    return "elementwise/other fusion"


def summarise(trace_path: str, top: int) -> dict:
    """Device-time totals by op name from a Perfetto JSON trace."""
    with gzip.open(trace_path, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device_pids = {p for p, n in pname.items() if re.search(r"/device:(GPU|TPU)", n)}
    on_host = not device_pids
    if on_host:  # CPU: XLA runs the ops on host threads beside Python's events; keep the XLA ops (hlo_op)
        device_pids = {p for p, n in pname.items() if "/host:CPU" in n}
    by_name, by_family = defaultdict(float), defaultdict(float)
    counts, detail = defaultdict(int), {}
    span = [float("inf"), 0.0]
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in device_pids or "dur" not in e:
            continue
        name = e.get("name", "?")
        if name.startswith(("Thunk", "PjRt", "Execute", "$")) or "::" in name:
            continue  # host-side wrappers around the ops
        if on_host and "hlo_op" not in e.get("args", {}):
            continue  # Python and runtime events (argument parsing, dispatch), not device work
        by_name[name] += e["dur"]
        counts[name] += 1
        if name not in detail:
            args = e.get("args", {})
            detail[name] = str(args.get("long_name") or args.get("hlo_op") or args.get("kernel_details") or "")
        by_family[op_family(name)] += e["dur"]
        span[0], span[1] = min(span[0], e["ts"]), max(span[1], e["ts"] + e["dur"])
    busy = sum(by_name.values())
    rows = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
    return {"busy_us": busy, "span_us": span[1] - span[0] if busy else 0.0,
            "families": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n, "us": t, "count": counts[n], "detail": detail[n]} for n, t in rows]}


def trace(out: str, run, top: int = 30) -> dict:
    """Runs ``run()`` (which must block until the device is done) under the JAX profiler,
    prints where the device time went, and writes ``summary.json`` beside the trace."""
    import jax

    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    with jax.profiler.trace(out, create_perfetto_trace=True):
        run()
    wall = time.perf_counter() - t0
    traces = sorted(glob.glob(os.path.join(out, "**", "perfetto_trace.json.gz"), recursive=True),
                    key=os.path.getmtime)
    if not traces:
        raise RuntimeError(f"the profiler wrote no perfetto_trace.json.gz under {out}")
    s = summarise(traces[-1], top)
    s["trace"], s["wall_s"] = traces[-1], wall
    print(f"profiled step: {wall * 1e3:.1f} ms wall | device busy {s['busy_us'] / 1e3:.1f} ms "
          f"over a span of {s['span_us'] / 1e3:.1f} ms")
    for fam, us in s["families"].items():
        print(f"  {fam:28s} {us / 1e3:9.2f} ms  {us / max(s['busy_us'], 1):6.1%}")
    for r in s["top"]:
        print(f"  {r['us'] / 1e3:9.2f} ms  {r['us'] / max(s['busy_us'], 1):6.1%}  x{r['count']:<5d} "
              f"{r['name'][:60]}  {r['detail'][:150]}")
    write_json(os.path.join(out, "summary.json"), s)
    return s
