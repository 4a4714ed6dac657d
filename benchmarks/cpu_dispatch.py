"""Whether XLA:CPU dispatches a program before the previous one has ended, on a mesh of one and of two simulated
devices (docs/serving.md, "Throughput against static batching": why the server's host work overlaps its decoding on
one CPU device and not on two).

    python3 benchmarks/cpu_dispatch.py

Each case jits a ``shard_map`` program of four matmuls (with and without a ``psum``) over its inputs (donated, as
the server's slot programs donate their cache), then times two calls dispatched back to back and the wait for the
second: medians of 5. On one device the second dispatch returns at once; on two it returns after the first call's
whole run.
"""

import argparse
import os
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402


def case(devices: int, collective: bool, size: int = 800, rounds: int = 5) -> dict:
    mesh = Mesh(np.array(jax.devices()[:devices]), ("tp",))

    def body(x):
        for _ in range(4):
            x = jnp.tanh((x @ x.T) @ x * 1e-6)
        return jax.lax.psum(x, "tp") / devices if collective else x

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp"), check_vma=False),
                donate_argnums=0)
    y = f(jnp.ones((size, size)))
    y.block_until_ready()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        y1 = f(y)
        t1 = time.perf_counter()
        y = f(y1)
        t2 = time.perf_counter()
        y.block_until_ready()
        times.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
    first, second, wait = (1000 * float(x) for x in np.median(np.array(times), axis=0))
    return {"devices": devices, "collective": collective, "first_dispatch_ms": first, "second_dispatch_ms": second,
            "wait_ms": wait}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Whether XLA:CPU dispatches a program before the previous one has ended, "
                                            "on one and on two simulated devices")
    p.parse_args(argv)
    if len(jax.devices()) < 2:
        sys.exit("needs two CPU devices: run it on a CPU (JAX_PLATFORMS=cpu), with no XLA_FLAGS device count below 2")
    for devices in (1, 2):
        for collective in (False, True):
            r = case(devices, collective)
            print(f"{devices} device(s), {'a psum' if collective else 'no collective'}: the second of two calls "
                  f"dispatched back to back returned after {r['second_dispatch_ms']:.1f} ms (the first "
                  f"{r['first_dispatch_ms']:.1f} ms), then {r['wait_ms']:.1f} ms until it ended", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
