"""Helpers shared by the benchmarks: report headers, medians, JSON output, the scripts they run (device memory:
partitioning/memory.py)."""

from __future__ import annotations

import glob
import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def device_header(cfg, preset: str) -> dict:
    """The fields every benchmark report starts with: preset, device kind and count, mesh, precision."""
    import jax

    ex = cfg.execution
    return {"config": preset, "device_kind": jax.devices()[0].device_kind, "devices": cfg.devices,
            "data_parallel": ex.data_parallel, "tensor_parallel": ex.tensor_parallel,
            "precision": cfg.model.precision}


def peak_rss_bytes() -> int:
    """This process's peak resident memory (host RAM), in bytes."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # bytes on macOS, KiB on Linux


def children(pid: int) -> list:
    """A process's child processes, started by any of its threads (Linux; [] elsewhere)."""
    out = []
    for f in glob.glob(f"/proc/{pid}/task/*/children"):
        try:
            with open(f) as fh:
                out += [int(x) for x in fh.read().split()]
        except OSError:
            continue
    return out


def descendants(pid: int) -> list:
    """A process's child processes, theirs, and so on (``children``)."""
    out = []
    for k in children(pid):
        out += [k] + descendants(k)
    return out


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def decode_rounds(timed, n: int, count: int) -> tuple:
    """``count`` rounds of a decoding baseline, each its first token alone (``timed(1)``) then ``n`` tokens
    (``timed(tokens) -> (seconds, output)``) -> (the ``n``-token seconds, the first-token seconds, the last output)."""
    times, first, out = [], [], None
    for _ in range(count):
        first.append(timed(1)[0])
        t, out = timed(n)
        times.append(t)
    return times, first, out


def decode_figures(times: list, first: list, rows: int, n: int) -> dict:
    """``decode_rounds``' seconds of ``rows`` prompts -> the figures every decoding benchmark reports (medians)."""
    t, t1 = median(times), median(first)
    return {"generate_s": t, "first_token_s": t1, "decode_token_latency_s": (t - t1) / (n - 1) if n > 1 else t,
            "generated_tokens_per_s": rows * n / t, "samples_per_s": rows / t}


def write_json(path: str | None, report: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


def run_child(argv: list, log: str, env=None, timeout=None, preexec_fn=None) -> tuple:
    """Runs ``python3 ARGV`` from the repository root, its output to ``log`` -> (its exit code, or None when it was
    killed past ``timeout`` seconds; its resource usage: os.wait4's, of the process and the processes it waited
    for: CPU seconds, peak RSS)."""
    timed_out = threading.Event()
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                             preexec_fn=preexec_fn)

        def stop():
            timed_out.set()
            p.kill()

        timer = threading.Timer(max(timeout, 1), stop) if timeout is not None else None
        if timer:
            timer.start()
        try:
            _, status, usage = os.wait4(p.pid, 0)
        finally:
            if timer:
                timer.cancel()
    return (None if timed_out.is_set() else os.waitstatus_to_exitcode(status)), usage


def split_passthrough(argv: list) -> tuple:
    """A benchmark's arguments -> (its own, those after ``--``: passed unchanged to the script it runs)."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def run_script(argv: list) -> float:
    """Runs ``python3 SCRIPT ARGS...`` (a script of this repository, from its root) -> its wall seconds; a failure
    exits with the command and the end of its stderr."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable] + argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def link_bandwidth(nbytes: int | None = None, repeats: int = 3) -> dict:
    """The host link of the first device, measured: {load_gb_per_s, store_gb_per_s}, the best of ``repeats`` copies
    of ``nbytes`` from pinned host memory to the device and back. By default 256 MiB on an accelerator; 32 MiB on a
    CPU, where the copy is a memory copy and a larger one only takes longer (a second of CPU a run)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    d = jax.local_devices()[0]
    if nbytes is None:
        nbytes = (32 if d.platform == "cpu" else 256) * 2 ** 20
    host, dev = SingleDeviceSharding(d, memory_kind="pinned_host"), SingleDeviceSharding(d, memory_kind="device")
    x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), host)
    best = {"load": float("inf"), "store": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        y = jax.block_until_ready(jax.device_put(x, dev, may_alias=False))
        best["load"] = min(best["load"], time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(jax.device_put(y, host))
        best["store"] = min(best["store"], time.perf_counter() - t0)
        del y
    return {f"{k}_gb_per_s": nbytes / v / 1e9 for k, v in best.items()}
