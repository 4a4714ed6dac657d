"""The environment of the processes the tests start (drivers, the launcher's workers, the benchmark suite).

Most tests compile far more than they run (tiny shapes, a few steps). ``FAST_COMPILE`` compiles their programs
cheaply and computes the same values (no fast-math either way): XLA:CPU's LLVM backend at -O0 without its expensive
passes, XLA's elemental emitters instead of its MLIR fusion emitters, and code generation in one piece rather than
split across threads. The few tests that train or decode for hundreds of steps run the other way round: -O0 code
steps 2-4x slower, so they run their drivers in a child process at -O1 (``RUN_FAST``: ``run_optimized``).

Measured on this 2-core machine (CPU seconds): tests/modelling/test_t5.py + tests/modelling/test_layers.py 155 with
-O0 and no expensive passes alone, 101 with the elemental emitters too, 91 with one code-generation piece as well
(the whole suite: 1797 -> 1293); tests/modelling/test_t5.py + tests/graphs/test_graphs.py 304 with XLA's defaults,
196 with -O0 and no expensive passes. The tiny preset's 300 bfloat16 steps: 40 at -O1 (with either emitter), 68 at -O0 with the fusion
emitters, 120 at -O0 with the elemental ones. Runs and benchmarks keep XLA's defaults.
"""

from __future__ import annotations

import os
import subprocess
import sys

FAST_COMPILE = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                "--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1")
RUN_FAST = "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true"


def child_env(devices: int | None = None, **extra) -> dict:
    """This process's environment for a child: the fast compilation kept, this process's simulated devices dropped
    (a driver simulates what its preset needs), or ``devices`` of them; ``extra`` variables set."""
    flags = f"{FAST_COMPILE} --xla_force_host_platform_device_count={devices}" if devices else FAST_COMPILE
    # every program into the shared compilation cache, however fast it compiled: the children compile the same tiny
    # programs process after process
    return {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "XLA_FLAGS": flags,
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", **extra}


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_optimized(driver: str, args: list, timeout: float = 900) -> str:
    """``python3 DRIVER ARGS`` from the repository root compiled with ``RUN_FAST`` (a long training run or a large
    decoding: its steps, not its compilation, take the time) -> its output (stdout and the log); a failure is the
    test's, with the output's tail."""
    env = {**os.environ, "XLA_FLAGS": RUN_FAST}  # (the driver simulates its preset's devices)
    p = subprocess.run([sys.executable, driver, *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{driver} exited {p.returncode}:\n{out[-3000:]}"
    return out
