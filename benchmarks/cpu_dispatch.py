"""Whether XLA:CPU dispatches a program before the previous one has ended, on a mesh of one and of two simulated
devices (docs/serving.md, "Throughput against static batching": why the server's host work overlaps its decoding on
one CPU device and not on two).

    python3 benchmarks/cpu_dispatch.py

Each case jits a ``shard_map`` program of four matmuls (with and without a ``psum``), times one call alone, then two
calls dispatched back to back (the second taking the first's output, donated, as the server's calls take its cache;
or each on an input of its own, nothing donated) and the wait for the second: medians of 5. On one device the second
dispatch returns at once; on two it returns after about the first call's whole run (measured; it agrees with the
scope of JAX's CPU asynchronous dispatch, ``jax_cpu_enable_async_dispatch``: "only applies to non-parallel
computations").
"""

import argparse
import os
import sys
import time


def case(devices: int, collective: bool, donate: bool, size: int = 800, rounds: int = 5) -> dict:
    """donate: each call takes the previous call's output, donated (as the server's calls take its cache); else two
    calls on inputs of their own, nothing donated."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:devices]), ("tp",))

    def body(x):
        for _ in range(4):
            x = jnp.tanh((x @ x.T) @ x * 1e-6)
        return jax.lax.psum(x, "tp") / devices if collective else x

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "tp"), out_specs=P(None, "tp"), check_vma=False),
                donate_argnums=0 if donate else ())
    y = f(jnp.ones((size, size)))
    y.block_until_ready()
    a, b = jnp.ones((size, size)), jnp.full((size, size), 2.0)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        y = f(y if donate else a)  # one call alone
        y.block_until_ready()
        alone = time.perf_counter() - t
        t0 = time.perf_counter()
        y1 = f(y if donate else a)
        t1 = time.perf_counter()
        y = f(y1 if donate else b)
        t2 = time.perf_counter()
        y.block_until_ready()  # (calls run in order: the first has ended too)
        times.append((alone, t1 - t0, t2 - t1, time.perf_counter() - t2))
    alone, first, second, wait = (1000 * float(x) for x in np.median(np.array(times), axis=0))
    return {"devices": devices, "collective": collective, "donate": donate, "alone_ms": alone,
            "first_dispatch_ms": first, "second_dispatch_ms": second, "wait_ms": wait}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Whether XLA:CPU dispatches a program before the previous one has ended, "
                                            "on one and on two simulated devices")
    p.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    if len(jax.devices()) < 2:
        sys.exit("needs two CPU devices: run it on a CPU (JAX_PLATFORMS=cpu), with no XLA_FLAGS device count below 2")
    for devices in (1, 2):
        for collective, donate in ((False, True), (True, True), (False, False)):
            r = case(devices, collective, donate)
            how = "the first call's output donated to the second" if donate else "inputs of their own"
            print(f"{devices} device(s), {'a psum' if collective else 'no collective'}, {how}: one "
                  f"call alone {r['alone_ms']:.1f} ms; of two dispatched back to back the second returned after "
                  f"{r['second_dispatch_ms']:.1f} ms (the first {r['first_dispatch_ms']:.1f} ms), then "
                  f"{r['wait_ms']:.1f} ms until it ended", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
