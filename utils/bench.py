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


def live_device_bytes() -> dict:
    """{device: bytes} of every live array held in device memory (host-memory arrays are not counted)."""
    import jax

    from graphs.sharding import per_device_bytes

    return per_device_bytes([x for x in jax.live_arrays() if not x.is_deleted()
                             and getattr(x.sharding, "memory_kind", None) in ("device", None)])


def program_bytes(analysis, live: int) -> int:
    """Device bytes while a compiled program runs: what is live when it starts (its arguments
    included) plus its temporaries and the outputs that do not reuse a donated argument
    (from XLA's memory analysis of the compiled program, per device)."""
    return int(live + analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)


def device_header(cfg, preset: str) -> dict:
    """The fields every benchmark report starts with: preset, device kind and count, mesh, precision."""
    import jax

    ex = cfg.execution
    return {"config": preset, "device_kind": jax.devices()[0].device_kind, "devices": cfg.devices,
            "data_parallel": ex.data_parallel, "tensor_parallel": ex.tensor_parallel,
            "precision": cfg.model.precision}


def peak_rss_bytes() -> int:
    """This process's peak resident memory (host RAM), in bytes."""
    import resource
    import sys

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
