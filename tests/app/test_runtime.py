"""The process's set-up (app/runtime.py): JAX's persistent compilation cache, on by default in the user's cache
directory, moved or switched off by one variable, and shared safely by processes that compile at once; XLA's CPU
threads (--cpu_threads, and the server's default by the model's decoding step); which platform decodes and which
accelerator plugins are installed; a float32 run multiplying in float32; the pinned host pool of a phased run sized
from its plan (app/host_pool.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import jax
import pytest

from app import runtime
from config import load_config
from tests.helpers import ROOT, machine

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
        jax.config.update("jax_compilation_cache_max_size", -1)  # (unbounded, JAX's default: no lock)
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


@pytest.mark.slow
def test_the_pinned_host_pool_is_sized_from_the_plan_unless_set(monkeypatch):
    """A phased run's pinned host pool is its memory plan's host bytes +80% +2 GiB (computed before JAX starts, in
    a child process on JAX's CPU backend; measured: xxl_1gpu's process peaks at 1.78x its host plan, and +10% ran
    out), at most 90% of the machine's RAM but never under the plan +10% +2 GiB; a fused run, or a pool the user
    set, is left alone; without a GPU plugin nothing is computed."""
    from app.runtime import POOL_VAR, ensure_pinned_host_memory, gpu_plugin_installed, pool_gib
    from graphs.executor import make_executor
    from graphs.graphs import Graphs
    from graphs.plan import plan

    monkeypatch.delenv(POOL_VAR, raising=False)
    assert ensure_pinned_host_memory(load_config("finetuning", "tiny"), force=True) is None and POOL_VAR not in os.environ
    cfg = load_config("finetuning", "tiny", {"phased": True, "layers": 2})
    if not gpu_plugin_installed():
        assert ensure_pinned_host_memory(cfg) is None and POOL_VAR not in os.environ
    gib = ensure_pinned_host_memory(cfg, force=True)
    host = plan(make_executor(Graphs(cfg))).host_peak
    assert gib == pool_gib(host) == int(os.environ[POOL_VAR]) == 3  # a few MiB of plan: +2 GiB, rounded up
    tib = 2 ** 40
    assert pool_gib(62 * 2 ** 30, tib) == 114  # Flan-T5-XXL's ~62 GiB on a large machine: +80%, +2 GiB
    assert pool_gib(62 * 2 ** 30, 100 * 2 ** 30) == 90  # on a 100 GiB one: 90% of its RAM
    assert pool_gib(62 * 2 ** 30, 64 * 2 ** 30) == 71  # never under the plan +10% +2 GiB (the plan refuses the run)
    monkeypatch.setenv(POOL_VAR, "7")
    assert ensure_pinned_host_memory(cfg, force=True) is None and os.environ[POOL_VAR] == "7"


@pytest.mark.parametrize("precision,env,expected", [("float32", None, "highest"), ("bfloat16", None, None),
                                                     ("float16", None, None), ("float32", "tensorfloat32", None)])
def test_a_float32_run_multiplies_in_float32(precision, env, expected, monkeypatch):
    """Every driver's start (start_devices) makes a float32 model's dot products full float32 ("highest"), as HF's
    are: JAX's default would round their inputs to TF32 on a recent GPU. Other precisions are left to JAX, and
    JAX_DEFAULT_MATMUL_PRECISION in the environment wins."""
    from app.args import make_config
    from app.runtime import start_devices

    if env is None:
        monkeypatch.delenv("JAX_DEFAULT_MATMUL_PRECISION", raising=False)
    else:
        monkeypatch.setenv("JAX_DEFAULT_MATMUL_PRECISION", env)
    cfg = make_config("inference", "tiny", {"precision": precision, "tensor_parallel": 1})
    before = jax.config.jax_default_matmul_precision  # (conftest's "highest")
    try:
        jax.config.update("jax_default_matmul_precision", None)
        start_devices(cfg)
        assert jax.config.jax_default_matmul_precision == expected
    finally:
        jax.config.update("jax_default_matmul_precision", before)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="thread names are read from Linux's /proc")
@pytest.mark.parametrize("threads,devices,env", [(1, 1, {}), (3, 1, {}), (0, 1, {}), (1, 2, {}),
                                                 (1, 1, {"NPROC": "3", "PJRT_NPROC": "2"}), (0, 1, {"NPROC": "3"})])
def test_cpu_threads_sizes_xlas_pool(threads, devices, env):
    """--cpu_threads N: XLA's CPU pool has N threads whatever the environment says (0: XLA's default, as many as the
    process may use cores or the environment's NPROC), and at least one a simulated device."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    given = env
    env = {k: v for k, v in os.environ.items() if k not in ("NPROC", "PJRT_NPROC")}
    env.update({**given, "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={devices}"})
    code = ("import os; from app.runtime import set_cpu_threads; set_cpu_threads(%d); import jax.numpy as jnp; "
            "jnp.ones(3).block_until_ready(); root = '/proc/self/task'; "
            "print(sum(open(f'{root}/{t}/comm').read().strip() == 'tf_XLAEigen' for t in os.listdir(root)))" % threads)
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    default = int(given.get("NPROC", len(os.sched_getaffinity(0))))
    assert int(out.stdout.split()[-1]) == max(threads or default, devices)


@pytest.mark.slow
def test_cpu_threads_is_refused_below_zero_and_after_jax_started(tmp_path):
    from app.runtime import set_cpu_threads
    from utils.errors import ConfigError

    with pytest.raises(ConfigError, match="--cpu_threads -1"):
        set_cpu_threads(-1)
    jax.devices()
    with pytest.raises(RuntimeError, match="before JAX starts"):
        set_cpu_threads(1)
    out = subprocess.run([sys.executable, "run_server.py", "--load", str(tmp_path), "--cpu_threads", "-1"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "--cpu_threads -1" in out.stderr.strip().splitlines()[-1], out.stderr


@pytest.mark.slow
@pytest.mark.parametrize("given,cores,env,started,step,want", [
    (None, 4, {}, False, 0, 3), (None, 2, {}, False, 0, 1), (None, 1, {}, False, 0, 0), (0, 4, {}, False, 0, 0),
    (2, 4, {}, False, 0, 2), (5, 2, {}, False, 0, 5), (None, 4, {"NPROC": "2"}, False, 0, 0),
    (None, 4, {"PJRT_NPROC": "3"}, False, 0, 0), (1, 4, {"NPROC": "2"}, False, 0, 1), (None, 4, {}, True, 0, 0),
    (2, 4, {}, True, 0, 2),
    # a heavy step on the CPU: every core; just below, or on an accelerator, or given: as above
    (None, 4, {}, False, "heavy", 0), (None, 2, {}, False, "heavy", 0), (None, 4, {}, False, "below", 3),
    (None, 4, {"JAX_PLATFORMS": "cuda"}, False, "heavy", 3), (None, 4, {"JAX_PLATFORMS": "cuda,cpu"}, False, 1e12, 3),
    (1, 4, {}, False, "heavy", 1), (None, 4, {"NPROC": "2"}, False, "below", 0)])
def test_the_server_leaves_one_core_to_its_own_threads_unless_the_cpu_decodes_heavy_steps(monkeypatch, given, cores,
                                                                                          env, started, step, want):
    """server_cpu_threads: as given (0: XLA's default); by default every core the process may use but one (the HTTP,
    scheduling and text threads' core; 0 where there is one core), but every core (0) where the CPU decodes a step of
    at least HEAVY_STEP_FLOPS (``<``: one left), the environment's PJRT_NPROC or NPROC where it sets one, and XLA's
    pool as it is where JAX has started already (a server run in a test's process; given there, set_cpu_threads
    refuses it)."""
    from app import runtime

    machine(monkeypatch, cores, started=started, **env)  # (env's JAX_PLATFORMS over the "cpu" default)
    step = {"heavy": runtime.HEAVY_STEP_FLOPS, "below": runtime.HEAVY_STEP_FLOPS - 1}.get(step, step)
    assert runtime.server_cpu_threads(given, step) == want


@pytest.mark.slow
@pytest.mark.parametrize("platforms,plugin,libtpu,want", [
    ("cpu", True, True, True), ("cuda,cpu", False, False, False), ("CPU, cuda", True, False, True),
    ("tpu", False, False, False), ("", True, False, False), ("", False, True, False), ("", False, False, True),
    (None, False, False, True), (None, True, False, False)])
def test_the_cpu_decodes_where_jax_platforms_names_it_first_or_no_accelerator_is_installed(monkeypatch, platforms,
                                                                                           plugin, libtpu, want):
    """cpu_decodes (read before JAX starts): JAX_PLATFORMS's first platform where it names any, else True unless a
    PJRT plugin (CUDA's, ROCm's...) or libtpu is installed."""
    import importlib.util

    from app import runtime

    if platforms is None:
        monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    else:
        monkeypatch.setenv("JAX_PLATFORMS", platforms)
    monkeypatch.setattr(runtime, "accelerator_plugins", lambda: ["xla_rocm"] if plugin else [])
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "libtpu" and libtpu
                        else None if name == "libtpu" else find(name, *a))
    assert runtime.cpu_decodes() is want


@pytest.mark.slow
def test_accelerator_plugins_are_the_jax_plugins_namespace_s_modules(monkeypatch, tmp_path):
    """accelerator_plugins: every module of the ``jax_plugins`` namespace package (what JAX loads as PJRT plugins),
    whatever its accelerator; [] where there is none."""
    import importlib
    import sys

    from app import runtime

    for name in ("xla_cuda12", "xla_rocm"):
        (tmp_path / "jax_plugins" / name).mkdir(parents=True)
        (tmp_path / "jax_plugins" / name / "__init__.py").write_text("")
    monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path)] + [p for p in sys.path if p])
    importlib.invalidate_caches()
    assert runtime.accelerator_plugins() == ["xla_cuda12", "xla_rocm"]
    monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)
    monkeypatch.setattr(sys, "path", [str(tmp_path / "none")])
    assert runtime.accelerator_plugins() == []
    monkeypatch.delitem(sys.modules, "jax_plugins", raising=False)


@pytest.mark.slow
@pytest.mark.parametrize("plugins,want", [([], False), (["xla_rocm"], False), (["xla_cuda12"], True),
                                          (["xla_rocm", "xla_cuda13"], True)])
def test_a_gpu_plugin_is_cuda_s(monkeypatch, plugins, want):
    """gpu_plugin_installed (what sizes phased training's pinned host pool): a CUDA plugin among JAX's, no other."""
    from app import runtime

    monkeypatch.setattr(runtime, "accelerator_plugins", lambda: plugins)
    assert runtime.gpu_plugin_installed() is want


WIDE = {"hidden_size": 256, "d_ff": 1024, "d_kv": 64}  # benchmarks/serve.py's width-256 models


@pytest.mark.slow
@pytest.mark.parametrize("preset,shape,platforms,want", [
    ("tiny", WIDE, "cpu", 0), ("gptj_tiny", WIDE, "cpu", 1), ("tiny", {}, "cpu", 1), ("gptj_tiny", {}, "cpu", 1),
    ("tiny", WIDE, "cuda", 1)])
def test_the_benchmarked_models_get_the_threads_measured_for_them(monkeypatch, preset, shape, platforms, want):
    """The measured cases the default's bound sits between (2-core CPU, 8 slots, docs/serving.md): T5 at width 256
    (76 MFLOP a step) served fastest on both cores (0), both at width 64 with a core left to the server's threads
    (1), GPT-J at width 256 (26 MFLOP) alike either way (a core left: its setting before). On an accelerator a core
    is left whatever the model."""
    from app import runtime
    from app.flops import decode_step_flops

    machine(monkeypatch, 2, platforms)
    m = load_config("inference", preset, dict(shape)).model
    assert runtime.server_cpu_threads(None, 8 * decode_step_flops(m)) == want
