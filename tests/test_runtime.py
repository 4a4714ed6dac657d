"""The process's set-up (app/runtime.py): JAX's persistent compilation cache, on by default in the user's cache
directory, moved or switched off by one variable, and shared safely by processes that compile at once."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from app import runtime
from tests.helpers import ROOT

CACHE_VARS = ("FLAN_T5_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR", "POPXL_CACHE_DIR", "FLAN_T5_CACHE")


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """No cache variable set, and a home of the test's own."""
    for v in CACHE_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    return tmp_path


def test_the_compilation_cache_is_on_by_default_under_the_user_s_cache(bare, monkeypatch):
    assert runtime.compilation_cache_dir() == str(bare / ".cache" / "flan_t5" / "xla")
    monkeypatch.setenv("FLAN_T5_CACHE", str(bare / "data"))  # beside the data cache, wherever that is
    assert runtime.compilation_cache_dir() == str(bare / "data" / "xla")


def test_one_variable_moves_the_compilation_cache_or_switches_it_off(bare, monkeypatch):
    """FLAN_T5_COMPILATION_CACHE first, then JAX's own variable, then the original's POPXL_CACHE_DIR; "off" (or 0,
    false, none, empty) switches it off whatever else is set."""
    monkeypatch.setenv("POPXL_CACHE_DIR", str(bare / "popxl"))
    assert runtime.compilation_cache_dir() == str(bare / "popxl")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(bare / "jax"))
    assert runtime.compilation_cache_dir() == str(bare / "jax")
    monkeypatch.setenv("FLAN_T5_COMPILATION_CACHE", "~/mine")
    assert runtime.compilation_cache_dir() == str(bare / "mine")
    for off in ("off", "OFF", "0", "false", "none", ""):
        monkeypatch.setenv("FLAN_T5_COMPILATION_CACHE", off)
        assert runtime.compilation_cache_dir() is None, off


def test_setup_jax_points_jax_at_the_cache_bounded_or_switches_it_off(bare, monkeypatch):
    import jax

    monkeypatch.setattr(runtime, "maybe_initialize_distributed", lambda: None)
    before = {k: getattr(jax.config, k) for k in ("jax_compilation_cache_dir", "jax_compilation_cache_max_size",
                                                  "jax_enable_compilation_cache")}
    try:
        assert runtime.setup_jax() == str(bare / ".cache" / "flan_t5" / "xla")
        assert jax.config.jax_compilation_cache_dir == str(bare / ".cache" / "flan_t5" / "xla")
        assert jax.config.jax_compilation_cache_max_size == runtime.CACHE_MAX_BYTES > 0  # (bounded: JAX locks it)
        monkeypatch.setenv("FLAN_T5_COMPILATION_CACHE", "off")
        assert runtime.setup_jax() is None and jax.config.jax_enable_compilation_cache is False
    finally:
        for k, v in before.items():
            jax.config.update(k, v)


CHILD = """
import sys, jax, jax.numpy as jnp
from app.runtime import setup_jax
setup_jax()
f = jax.jit(lambda x: jnp.tanh(x @ x.T).sum() + sum(jnp.sin(x * k).sum() for k in range(40)))
print(float(f(jnp.arange(64.0).reshape(8, 8) / 64)))
"""


@pytest.mark.slow
def test_processes_compiling_at_once_share_the_cache_and_a_later_one_reads_it(tmp_path):
    """Two processes compiling the same program into one fresh cache at once: both finish with the same value, the
    cache holds the program once, and a third process reads it from there (it writes nothing new)."""
    cache = tmp_path / "xla"
    env = {**os.environ, "FLAN_T5_COMPILATION_CACHE": str(cache), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)

    def start():
        return subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    pair = [start(), start()]
    outs = [p.communicate(timeout=300) for p in pair]
    assert [p.returncode for p in pair] == [0, 0], [o[1][-2000:] for o in outs]
    assert outs[0][0] == outs[1][0]
    entries = sorted(f.name for f in cache.iterdir() if f.name.endswith("-cache"))
    assert entries, os.listdir(cache)
    third = start()
    out, err = third.communicate(timeout=300)
    assert third.returncode == 0 and out == outs[0][0], err[-2000:]
    assert sorted(f.name for f in cache.iterdir() if f.name.endswith("-cache")) == entries
