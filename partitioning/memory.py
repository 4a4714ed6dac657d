"""Device memory as the engine measures it: live arrays, compiled programs' footprints, the allocator's peak."""

from __future__ import annotations

import jax

from partitioning.sharding import per_device_bytes


def peak_device_bytes() -> int | None:
    """Largest peak_bytes_in_use over local devices, where the backend reports it (GPU/TPU)."""
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
    return per_device_bytes([x for x in jax.live_arrays() if not x.is_deleted()
                             and getattr(x.sharding, "memory_kind", None) in ("device", None)])


def program_bytes(analysis, live: int) -> int:
    """Device bytes while a compiled program runs: what is live when it starts (its arguments
    included) plus its temporaries and the outputs that do not reuse a donated argument
    (from XLA's memory analysis of the compiled program, per device)."""
    return int(live + analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)
