"""The environment of the processes the tests start (drivers, the launcher's workers, the benchmark suite).

Tests compile far more than they run (tiny shapes, a few steps): XLA:CPU's LLVM backend at -O0 and without its
expensive passes compiles their programs in about two thirds of the CPU time, and the programs compute the same
values (no fast-math either way). Measured on this 2-core machine: tests/test_t5_family.py + tests/test_parallel.py
349 -> 218 s of CPU, tests/test_model_parity.py 61 -> 57 s more with the passes off; a 150-step learning test
62 -> 68 s (its steps run a little slower). Runs and benchmarks keep XLA's defaults.
"""

from __future__ import annotations

import os

FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def child_env(devices: int | None = None, **extra) -> dict:
    """This process's environment for a child: the fast compilation kept, this process's simulated devices dropped
    (a driver simulates what its preset needs), or ``devices`` of them; ``extra`` variables set."""
    flags = f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}" if devices else FAST_COMPILE
    return {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XLA_FLAGS": flags, **extra}
