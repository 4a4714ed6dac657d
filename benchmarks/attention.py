"""T5 attention kernels side by side: our XLA attend() against jax.nn.dot_product_attention (cuDNN).

    python3 benchmarks/attention.py --batch 8 --length 512 --heads 32     # Flan-T5-XL encoder layer, on a GPU

T5 attention has no 1/sqrt(d) scaling and a learned relative-position bias whose
gradient is needed. Times forward + backward (gradients of q, k, v and the bias),
median of --iterations, and the error of each against attend() in float32.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def kernels(q, k, v, lengths, keep, pad_bias) -> dict:
    """{name: fn(q, k, v, bias)}: our XLA attention and three ways of asking cuDNN for the same result."""
    import jax
    import jax.numpy as jnp

    from modelling.layers import attend

    b, n = q.shape[:2]

    def ours(q, k, v, bias):
        return attend(q, k, v, bias + pad_bias)

    def cudnn_mask(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, mask=keep[:, None, None, :], scale=1.0,
                                            implementation="cudnn")

    def cudnn_bias(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=(bias + pad_bias).astype(q.dtype), scale=1.0,
                                            implementation="cudnn")

    def cudnn_lengths(q, k, v, bias):
        return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=1.0, key_value_seq_lengths=lengths,
                                            query_seq_lengths=jnp.full((b,), n, jnp.int32), implementation="cudnn")

    return {"xla attend": ours, "cudnn, bias + bool mask": cudnn_mask, "cudnn, bias with padding": cudnn_bias,
            "cudnn, bias + key lengths": cudnn_lengths}


def measure(f, args, ref, iterations: int) -> dict:
    """{ms: median forward + backward time, rel_err: {output or gradient: relative error against ref}}."""
    import jax
    import numpy as np

    got = jax.block_until_ready(f(*args))
    times = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    errs = {nm: float(np.linalg.norm(np.asarray(g, np.float32) - r) / max(np.linalg.norm(r), 1e-30))
            for nm, g, r in zip(("out", "dq", "dk", "dv", "dbias"), got, ref)}
    return {"ms": float(np.median(times)) * 1e3, "rel_err": errs}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--length", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d_kv", type=int, default=64)
    p.add_argument("--iterations", type=int, default=20)
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from modelling.layers import MASK_VALUE

    b, n, h, d = a.batch, a.length, a.heads, a.d_kv
    ks = jax.random.split(jax.random.key(0), 5)
    q, k, v, dout = (jax.random.normal(ks[i], (b, n, h, d), jnp.float32) * 0.5 for i in range(4))
    pos_bias = jax.random.normal(ks[4], (1, h, n, n), jnp.float32)
    lengths = jnp.asarray(np.linspace(n // 2, n, b).astype(np.int32))
    keep = jnp.arange(n)[None, :] < lengths[:, None]  # [b, k]
    fns = kernels(q, k, v, lengths, keep, jnp.where(keep, 0.0, MASK_VALUE)[:, None, None, :])

    def fwd_bwd(fn, dtype):
        def f(q, k, v, bias):
            out, vjp = jax.vjp(lambda *x: fn(*x), q.astype(dtype), k.astype(dtype), v.astype(dtype),
                               bias.astype(dtype))
            return (out,) + vjp(dout.astype(out.dtype))
        return jax.jit(f)

    ref = [np.asarray(x, np.float32) for x in fwd_bwd(fns["xla attend"], jnp.float32)(q, k, v, pos_bias)]
    result = {}
    for name, fn in fns.items():
        try:
            result[name] = measure(fwd_bwd(fn, jnp.bfloat16), (q, k, v, pos_bias), ref, a.iterations)
            print(f"{name:28s} {result[name]['ms']:8.3f} ms  "
                  + "  ".join(f"{nm} {e:.1e}" for nm, e in result[name]["rel_err"].items()), flush=True)
        except Exception as e:  # an implementation this backend or shape does not support
            result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
            print(f"{name:28s} unsupported: {result[name]['error']}", flush=True)
    return result


if __name__ == "__main__":
    main()
