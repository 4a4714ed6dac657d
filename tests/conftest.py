"""Test setup: 8 simulated CPU devices and exact float32 matmuls, before JAX starts; one persistent compilation
cache for the session (the drivers' subprocesses share it), so a program the suite already compiled (the tiny
training step, again and again) is compiled once; one data cache for the session, likewise."""

import os
import tempfile

from tests.env import FAST_COMPILE  # noqa: E402  (tests/env.py: compile fast, compute the same)

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" {FAST_COMPILE} "
                           "--xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("FLAN_T5_COMPILATION_CACHE", None)  # (a developer's own cache is never the session's)
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
import pytest  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_compilation_cache_max_size", 8 << 30)  # (bounded: JAX locks it, as app/runtime.py does)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# FLAN_T5_TEST_CPU=FILE: each test's CPU seconds (this process and every process it started and waited for) appended
# to FILE as JSON lines: what the suite's time is spent on, measured rather than guessed from contended wall times
if os.environ.get("FLAN_T5_TEST_CPU"):
    import json  # noqa: E402
    import resource  # noqa: E402

    def _cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        t0 = _cpu()
        yield
        with open(os.environ["FLAN_T5_TEST_CPU"], "a") as f:
            f.write(json.dumps({"test": item.nodeid, "cpu_s": round(_cpu() - t0, 2)}) + "\n")


LONG = os.path.join(os.path.dirname(__file__), "long.txt")


def long_tests() -> set:
    """The test ids tests/long.txt lists (its comment says what they are and why CI leaves them out)."""
    with open(LONG) as f:
        return {line.rsplit(maxsplit=1)[0] for line in f if line.strip() and not line.startswith("#")}


@pytest.fixture(scope="session")
def two_models(tmp_path_factory):
    """Two random-init checkpoints of the tiny preset (other weights: another seed), saved as run_finetuning saves
    one, and a file of 11 rows in the task's format (MNLI's columns, no label)."""
    import json

    from tests.helpers import save_random_checkpoint

    d = tmp_path_factory.mktemp("models")
    a, b = str(d / "a"), str(d / "b")
    save_random_checkpoint("tiny", a)
    save_random_checkpoint("tiny", b, seed=8)
    rows = d / "rows.jsonl"
    rows.write_text("".join(json.dumps({"premise": f"the cat sleeps in the park {i}", "hypothesis": "the cat sleeps"})
                            + "\n" for i in range(11)))
    return a, b, str(rows)


def pytest_collection_modifyitems(config, items):
    """The tests of tests/long.txt are marked ``long`` (CI's `make test` runs ``-m "not long"``; `make test-all`
    runs them too); ``gpu`` tests (pyproject.toml's marker) are skipped, with the reason, where JAX sees no GPU."""
    listed = long_tests()
    for item in items:
        if item.nodeid in listed:
            item.add_marker(pytest.mark.long)
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    try:
        present = bool(jax.devices("gpu"))
    except RuntimeError:
        present = False
    if not present:
        for item in gpu:
            item.add_marker(pytest.mark.skip(reason="needs a GPU (marked gpu): JAX sees none here"))
