"""utils/host_call.py: a host function called from inside a CPU program through XLA's FFI (a ctypes handler), not a
JAX callback: its answers, in loops, conds, vmap and on every device of a shard_map; the call dispatched before the
host answers; errors as the call's error; keys; the program written to JAX's compilation cache."""

import os
import subprocess
import sys
import textwrap
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from utils import host_call as H
from utils.host_call import host_call

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_host_answers_each_turn_of_a_loop_and_an_untaken_cond_asks_nothing():
    asked = []

    def fn(x, i):
        asked.append((x.copy(), int(i)))
        return (x * 10 + i).astype(np.int32)

    @jax.jit
    def f(x, n, ask):
        def body(c):
            i, acc = c
            got = lax.cond(ask, lambda: host_call(fn, jax.ShapeDtypeStruct(x.shape, jnp.int32), x, i),
                           lambda: jnp.full(x.shape, -1, jnp.int32))
            return i + 1, acc + got
        return lax.while_loop(lambda c: c[0] < n, body, (jnp.int32(0), jnp.zeros(x.shape, jnp.int32)))[1]

    x = jnp.arange(6, dtype=jnp.int32).reshape(2, 3)
    out = np.asarray(f(x, 4, True))
    np.testing.assert_array_equal(out, sum(np.arange(6).reshape(2, 3) * 10 + i for i in range(4)))
    assert [i for _, i in asked] == [0, 1, 2, 3] and all((a == np.arange(6).reshape(2, 3)).all() for a, _ in asked)
    np.testing.assert_array_equal(np.asarray(f(x, 3, False)), -3)
    assert len(asked) == 4


def test_every_device_of_a_shard_map_asks_with_its_own_shard():
    seen = []
    lock = threading.Lock()

    def fn(x):
        with lock:
            seen.append(x.copy())
        return x + 100

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))

    @jax.jit
    def f(x):
        return jax.shard_map(lambda v: host_call(fn, jax.ShapeDtypeStruct(v.shape, jnp.int32), v), mesh=mesh,
                             in_specs=P("d"), out_specs=P("d"))(x)

    x = jnp.arange(8, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(f(x)), np.arange(8) + 100)
    assert sorted(tuple(s) for s in seen) == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_vmap_broadcasts_every_operand_to_one_call():
    calls = []

    def fn(x, y):
        calls.append((x.shape, y.shape))
        return (x + y).astype(np.float32)

    f = jax.vmap(lambda x, y: host_call(fn, jax.ShapeDtypeStruct((3,), jnp.float32), x, y), in_axes=(0, None))
    x, y = jnp.ones((5, 3), jnp.float32), jnp.arange(3, dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(jax.jit(f)(x, y)), 1 + np.arange(3)[None].repeat(5, 0))
    assert calls == [((5, 3), (5, 3))]


def test_the_call_returns_before_the_host_answers():
    """An FFI call is an ordinary op: the call dispatches and returns while the program waits for the host (JAX's
    Python callbacks make a CPU program synchronous: this host would wait for its whole timeout)."""
    dispatched, waited = threading.Event(), []

    def fn(x):
        waited.append(dispatched.wait(timeout=30))
        return x

    w = jnp.eye(64, dtype=jnp.float32)

    @jax.jit
    def f(x):
        y = host_call(fn, jax.ShapeDtypeStruct(x.shape, jnp.int32), x)
        return lax.fori_loop(0, 3, lambda i, v: jnp.tanh(v @ w), y.astype(jnp.float32)[:, None] * w[:1])

    dispatched.set()
    f(jnp.arange(4, dtype=jnp.int32)).block_until_ready()  # (compiled)
    dispatched.clear()
    waited.clear()
    out = f(jnp.arange(4, dtype=jnp.int32))
    dispatched.set()
    out.block_until_ready()
    assert waited == [True]


def test_a_failing_host_is_the_call_s_error_naming_it_and_the_next_call_runs():
    def fn(x):
        if int(x[0]) < 0:
            raise ValueError("a negative first element")
        return x

    f = jax.jit(lambda x: host_call(fn, jax.ShapeDtypeStruct(x.shape, jnp.int32), x) * 2)
    with pytest.raises(Exception, match="ValueError: a negative first element"):
        np.asarray(f(jnp.array([-1, 2], jnp.int32)))
    np.testing.assert_array_equal(np.asarray(f(jnp.array([1, 2], jnp.int32))), [2, 4])


def test_an_answer_of_another_shape_is_an_error_naming_both_shapes():
    def fn(x):
        return np.zeros(5, np.int32)

    with pytest.raises(Exception, match=r"answered shape \(5,\), the program expects \(2,\)"):
        np.asarray(jax.jit(lambda x: host_call(fn, jax.ShapeDtypeStruct(x.shape, jnp.int32), x))(
            jnp.array([1, 2], jnp.int32)))


def test_only_the_dtypes_it_passes_are_taken():
    with pytest.raises(TypeError, match="host_call passes"):
        jax.jit(lambda x: host_call(lambda v: v, jax.ShapeDtypeStruct(x.shape, jnp.float16), x))(
            jnp.ones(2, jnp.float16))


def test_a_function_keeps_its_key_and_keys_ascend():
    class Host:
        def __call__(self, x):
            return x

    a, b = Host(), Host()
    ka, kb = H.register(a), H.register(b)
    assert H.register(a) == ka and kb > ka > 0


def test_the_program_is_written_to_jax_s_compilation_cache_and_a_pure_callback_s_is_not(tmp_path):
    """What the FFI call is for (besides speed): a warm start reads the program from the cache. A new process,
    the cache on with no minimum compile time; the same program with jax.pure_callback for contrast."""
    code = textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {ROOT!r})
        import jax, jax.numpy as jnp, numpy as np
        jax.config.update("jax_compilation_cache_dir", {str(tmp_path)!r})
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        from utils.host_call import host_call
        def fn(x):
            return x + 1
        x = np.arange(3, dtype=np.int32)
        s = jax.ShapeDtypeStruct(x.shape, jnp.int32)
        def through_ffi(v):
            return host_call(fn, s, v) * 3
        def through_callback(v):
            return jax.pure_callback(fn, s, v) * 5
        assert list(np.asarray(jax.jit(through_ffi)(x))) == [3, 6, 9]
        assert list(np.asarray(jax.jit(through_callback)(x))) == [5, 10, 15]
        names = os.listdir({str(tmp_path)!r})
        print(*(sum(f.startswith("jit_" + k + "-") and f.endswith("-cache") for f in names)
                for k in ("through_ffi", "through_callback")))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "0"]
