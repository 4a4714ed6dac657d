"""What a memory plan is, for training's (graphs/plan.py) and decoding's (decoder/plan.py): a run's device and host
bytes at their peaks, item by item, as a plan prints them, and this machine's memory to check them against.

Device bytes are per device (the busiest); host bytes per process.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import jax

GIB = 2 ** 30


def human_bytes(n: float) -> str:
    """Bytes in the unit that reads best: 512 B, 3.4 MiB, 62.7 GiB."""
    for unit, size in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if n >= size:
            return f"{n / size:.{1 if n >= 10 * size else 2}f} {unit}"
    return f"{int(n)} B"


def format_items(items: dict) -> str:
    """{name: bytes} as a plan prints it: "name 1.5 GiB, ...", the largest first, the empty left out."""
    return ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(items.items(), key=lambda kv: -kv[1]) if v)


@dataclass
class MemoryPlan:
    """Device bytes (per device) and host bytes (per process) of a run, at their peaks."""

    executor: str
    device_peak: int
    device_phase: str
    device_items: dict
    host_peak: int
    host_phase: str
    host_items: dict
    exact: bool
    notes: list = field(default_factory=list)


def device_memory_limit() -> int | None:
    """Bytes an accelerator device can allocate (None on CPU, where device memory is host RAM)."""
    d = jax.local_devices()[0]
    if d.platform == "cpu":
        return None
    try:
        return (d.memory_stats() or {}).get("bytes_limit")
    except Exception:
        return None


def host_memory_limit() -> int | None:
    """This machine's available RAM (MemAvailable), or None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
