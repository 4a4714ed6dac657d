"""Helpers shared by the benchmarks: report headers, medians, JSON output, the scripts they run (device memory:
graphs/memory.py)."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
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


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def write_json(path: str | None, report: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)


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
