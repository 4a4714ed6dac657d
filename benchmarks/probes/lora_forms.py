"""Probe: on XLA:CPU, is a weight's product with many LoRA adapters (each token its own) faster as every slot's
product masked to the token's (x A_all [in, slots * rank], other slots' columns zeroed, then B_all) or as a gather
of each token's A and B (BGMV, as S-LoRA and Punica run it)? One weight, float32, microseconds a call (best of 5).

    python3 benchmarks/probes/lora_forms.py > benchmarks/results/archive/cpu/lora_forms.txt
"""

import time

import jax
import jax.numpy as jnp
import numpy as np


def masked(x, w, a_all, b_all, idx, scale, rank):
    z = jnp.einsum("ni,ic->nc", x, a_all, preferred_element_type=jnp.float32)
    col = jnp.arange(a_all.shape[1]) // rank
    m = jnp.where(col[None] == idx[:, None], scale[:, None], 0.0)
    return x @ w + jnp.einsum("nc,co->no", (z * m).astype(x.dtype), b_all, preferred_element_type=jnp.float32)


def gather(x, w, a, b, idx, scale, rank):
    i = jnp.clip(idx, 0, a.shape[0] - 1)
    z = jnp.einsum("ni,nir->nr", x, a[i], preferred_element_type=jnp.float32) * scale[:, None]
    return x @ w + jnp.einsum("nr,nro->no", z.astype(x.dtype), b[i], preferred_element_type=jnp.float32)


def base(x, w, *_):
    return x @ w


def bench(f, args, reps):
    g = jax.jit(f, static_argnums=(6,))
    g(*args).block_until_ready()
    best = 1e9
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            out = g(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t) / reps)
    return best * 1e6


def main():
    rng = np.random.default_rng(0)
    for d, out, slots, rank, n in [(256, 256, 4, 16, 8), (256, 256, 4, 16, 32), (256, 1024, 4, 16, 8),
                                   (256, 256, 4, 16, 256), (256, 256, 4, 16, 1024), (256, 256, 8, 16, 8),
                                   (512, 512, 4, 16, 16)]:
        x = jnp.asarray(rng.standard_normal((n, d)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((d, out)), jnp.float32)
        a = jnp.asarray(rng.standard_normal((slots, d, rank)), jnp.float32)
        b = jnp.asarray(rng.standard_normal((slots, rank, out)), jnp.float32)
        a_all, b_all = jnp.transpose(a, (1, 0, 2)).reshape(d, slots * rank), b.reshape(slots * rank, out)
        idx = jnp.asarray(rng.integers(-1, slots, n), jnp.int32)
        scale = jnp.asarray(np.where(np.asarray(idx) >= 0, rng.random(n), 0.0), jnp.float32)
        one, two = masked(x, w, a_all, b_all, idx, scale, rank), gather(x, w, a, b, idx, scale, rank)
        assert np.abs(one - two).max() <= 1e-4 * np.abs(two).max()  # the same products
        tb, tm, tg = (bench(f, (x, w, *ab, idx, scale, rank), 300) for f, ab in
                      ((base, (a, b)), (masked, (a_all, b_all)), (gather, (a, b))))
        print(f"in {d} out {out} slots {slots} rank {rank} tokens {n}: base {tb:.1f} us, masked {tm:.1f} us "
              f"({tm / tb:.2f}x), gather {tg:.1f} us ({tg / tb:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
