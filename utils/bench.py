"""Helpers shared by the benchmarks: device memory, medians, JSON output."""

from __future__ import annotations

import json
import os
import statistics


def peak_device_bytes() -> int | None:
    """Largest peak_bytes_in_use over local devices, where the backend reports it (GPU/TPU)."""
    import jax

    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats() or {}
        except Exception:
            stats = {}
        if "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def write_json(path: str | None, report: dict) -> None:
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
