"""Test setup: 8 simulated CPU devices and exact float32 matmuls, before JAX starts; one persistent compilation
cache for the session (the drivers' subprocesses share it), so a program the suite already compiled (the tiny
training step, again and again) is compiled once; one data cache for the session, likewise."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# one folder for the session's every process: pytest-xdist's workers share its run id (each worker imports this
# file itself, so a folder made here per process would give each worker a cache of its own)
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    _cache = (os.path.join(tempfile.gettempdir(), f"flan_t5_tests_jax_cache_{_run}") if _run
              else tempfile.mkdtemp(prefix="flan_t5_tests_jax_cache_"))
    os.makedirs(_cache, exist_ok=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
# the data caches (data/cache.py) likewise: one folder for the session, which every test and driver shares, so the
# synthetic sets are read and tokenized once (and the user's own cache is never written)
if "FLAN_T5_CACHE" not in os.environ:
    os.environ["FLAN_T5_CACHE"] = os.path.join(os.environ["JAX_COMPILATION_CACHE_DIR"], "data")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
