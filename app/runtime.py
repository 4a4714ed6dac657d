"""The process and JAX set-up of a run: simulated CPU devices, multi-process start-up (the original's poprun),
pinned host memory, the compilation cache (everything before JAX starts a backend), and what the processes of one
run agree on: a value process 0 decides, barriers, and a failure that ends every process in seconds."""

from __future__ import annotations

import atexit
import importlib.util
import json
import logging
import math
import os
import pkgutil
import subprocess
import sys
import threading
import time
from typing import Optional

from config.presets import to_dict
from utils.errors import ConfigError

logger = logging.getLogger("flan_t5")


def ensure_host_devices(n: int) -> None:
    """Lets the CPU backend simulate ``n`` devices in all (must run before JAX starts).

    In a multi-process run each process simulates its share, n / processes
    (process_count_from_env). Only the host (CPU) platform is affected: on a GPU or TPU machine
    the accelerators are used and this flag is inert.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    procs = process_count_from_env()
    local = -(-n // procs)
    if "xla_force_host_platform_device_count" not in flags and local > 1:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local}".strip()


def check_cpu_threads(n: Optional[int]) -> None:
    """ConfigError for a --cpu_threads below 0 (None, the default, and 0, XLA's own, pass)."""
    if n is not None and n < 0:
        raise ConfigError(f"--cpu_threads {n}: pass 0 (XLA's default: all the cores) or a number of threads")


def set_cpu_threads(n: int) -> None:
    """XLA's thread pool on the CPU (the programs' work on a CPU device, and the host's side of an accelerator's): n
    threads, at least one a simulated CPU device; 0 leaves XLA's default (as many as the process may use cores, or
    what ``PJRT_NPROC`` or ``NPROC`` in the environment say). XLA reads the size once, when its CPU client starts,
    from ``PJRT_NPROC`` (before ``NPROC``), so this must run before JAX starts a backend."""
    check_cpu_threads(n)
    if not n:
        return
    if jax_started():
        raise RuntimeError("set_cpu_threads must run before JAX starts a backend")
    os.environ["PJRT_NPROC"] = str(n)


def jax_started() -> bool:
    """Whether this process's JAX has started a backend (its devices and thread pools are then set)."""
    from jax._src import xla_bridge

    return getattr(xla_bridge, "backends_are_initialized", lambda: False)()


# A decoding step (every slot one token) of at least this many matmul FLOPs is decoded by every core when the CPU is
# the device: its products are then long enough that XLA's second thread pays more than the core left to the
# server's own threads. Measured on a 2-core CPU (benchmarks/serve.py, 8 slots, paired rounds, docs/serving.md): the
# core left cost T5 at width 256 (76 MFLOP a step) 6% to 17% (2.22x static batching's tokens/s on both cores against
# 1.84x, serve_t5_256_threads.json), GPT-J at width 256 (26 MFLOP) ran alike either way (1.00x to 1.04x), and the
# width-64 models (5 and 2 MFLOP) gained 1.09x to 1.30x from it. Between 26 and 76: 40.
HEAVY_STEP_FLOPS = 40e6


def server_cpu_threads(given: Optional[int], step_flops: float = 0.0) -> int:
    """run_server.py's --cpu_threads: as given, else every core this process may use but one, which is left to the
    server's own threads (HTTP, scheduling, text; as vLLM's CPU backend reserves one core for its API server by
    default), else 0 (XLA's default: every core) where the CPU decodes steps of ``step_flops`` (matmul FLOPs of one
    decoding step of every slot) at least HEAVY_STEP_FLOPS, where the environment sets ``PJRT_NPROC`` or ``NPROC``
    (its choice), where one core is all there is, or where JAX has started already. XLA makes at least one thread a
    simulated device whatever this says (``set_cpu_threads``)."""
    if given is not None:
        return given
    if "PJRT_NPROC" in os.environ or "NPROC" in os.environ or jax_started():  # (in a process where JAX runs
        return 0  # already, as a test's or a notebook's, XLA's pool is what it is: the default leaves it)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if step_flops >= HEAVY_STEP_FLOPS and cpu_decodes():
        return 0
    return max(0, cores - 1)


def cpu_decodes() -> bool:
    """Whether JAX will run the model on the CPU (read without starting JAX): the first of ``JAX_PLATFORMS`` where
    the environment names them, else whether no accelerator's plugin is installed (any of JAX's PJRT plugins: CUDA's,
    ROCm's...; or TPU's libtpu)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not accelerator_plugins() and importlib.util.find_spec("libtpu") is None


def accelerator_plugins() -> list:
    """The names of the PJRT plugins JAX would load (the ``jax_plugins`` namespace's modules: xla_cuda12,
    xla_rocm...; read without starting JAX), [] on a CPU-only install."""
    try:
        import jax_plugins  # (absent on a CPU-only install)
    except ImportError:
        return []
    return sorted(m.name for m in pkgutil.iter_modules(jax_plugins.__path__))


def start_devices(cfg, pinned: bool = False) -> None:
    """This process's devices from the config, before JAX starts a backend: the CPU's simulated devices
    (``ensure_host_devices``), with ``pinned`` phased training's pinned host pool (``ensure_pinned_host_memory``),
    then JAX's multi-process start and compilation cache (``setup_jax``), and a float32 model's matrix products in
    float32 (``set_matmul_precision``). Every driver's second step."""
    ensure_host_devices(cfg.devices)
    if pinned:
        ensure_pinned_host_memory(cfg)
    setup_jax()
    set_matmul_precision(cfg.model.precision)


def set_matmul_precision(precision: str) -> Optional[str]:
    """A float32 model multiplies in float32: sets JAX's default precision of float32 dot products to "highest" when
    ``precision`` is float32 and returns it; bfloat16 and float16 runs are left as they are (None).

    JAX's own default lets a float32 dot product round its inputs (TF32 on NVIDIA GPUs since Ampere, bfloat16 passes on
    a TPU), where PyTorch's, and so HF's, multiplies in full float32. On one H100 the base model's server and static
    batching, both "float32" under JAX's default, gave the same greedy tokens for 36 of 48 requests
    (benchmarks/results/h100/serve/). ``JAX_DEFAULT_MATMUL_PRECISION`` in the environment wins (say
    ``tensorfloat32`` to trade accuracy for speed): then nothing is set."""
    if precision != "float32" or os.environ.get("JAX_DEFAULT_MATMUL_PRECISION"):
        return None
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    return "highest"


def process_count_from_env() -> int:
    """The number of processes this run will have, read before JAX starts: JAX_NUM_PROCESSES, or
    under FLAN_T5_DISTRIBUTED=1 the scheduler's count (SLURM_NTASKS, OMPI_COMM_WORLD_SIZE); else 1."""
    names = ["JAX_NUM_PROCESSES"]
    if os.environ.get("FLAN_T5_DISTRIBUTED") == "1":
        names += ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"]
    for name in names:
        n = _env_int(name)
        if n:
            return n
    return 1


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer: set it to a whole number (or unset it)") from None


POOL_VAR = "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"
# The pool is a cap (pinned memory is taken as the run needs it), set above the plan by what the plan does not see:
# the allocator's rounding and fragmentation, staging buffers, XLA's host-side copies. Measured on an H100 box
# (2026-11-26, benchmarks/results/h100/fifteen): xxl_1gpu's host plan 65.7 GiB, its process's peak RSS 1.78x that;
# a pool of the plan +10% +2 GiB (74 GiB) ran out of pinned memory in its first step, 110 GiB did not.
POOL_MARGIN = 0.80  # of the plan
POOL_SLACK_GIB = 2  # and a fixed slack for small plans (a pinned batch, staging buffers)
POOL_RAM_SHARE = 0.9  # never more than this share of the machine's RAM (the plan's own check refuses what cannot fit)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pool_gib(host_plan_bytes: int, ram_bytes: Optional[int] = None) -> int:
    """The pinned host pool for a plan's host bytes: the plan, POOL_MARGIN of it more, and POOL_SLACK_GIB, in GiB,
    at most POOL_RAM_SHARE of ``ram_bytes`` (the machine's RAM when None) but never below the plan + 10% + 2 GiB."""
    want = math.ceil(host_plan_bytes * (1 + POOL_MARGIN) / 2 ** 30) + POOL_SLACK_GIB
    floor = math.ceil(host_plan_bytes * 1.1 / 2 ** 30) + POOL_SLACK_GIB
    ram = ram_bytes if ram_bytes is not None else _ram_bytes()
    cap = int(ram * POOL_RAM_SHARE / 2 ** 30) if ram else want
    return max(min(want, cap), floor, 1)


def _ram_bytes() -> Optional[int]:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def gpu_plugin_installed() -> bool:
    """Whether JAX has a CUDA plugin to load (read without starting JAX): where it has none, the pinned host pool
    is never created and sizing it costs nothing."""
    return any(name.startswith("xla_cuda") for name in accelerator_plugins())


def ensure_pinned_host_memory(cfg, force: bool = False) -> Optional[int]:
    """Phased execution keeps weights, optimizer state and activation rows in pinned host memory, which JAX's GPU
    client caps at 64 GB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise: set it to the run's memory plan
    plus a stated margin (``pool_gib``: the plan +80% +2 GiB, at most 90% of RAM), never to the machine's RAM, when the user has
    not set it. Must run before JAX starts; nothing to do without a GPU plugin (``force``: compute it anyway).
    -> the GiB set, or None."""
    if not cfg.execution.phased or POOL_VAR in os.environ or not (force or gpu_plugin_installed()):
        return None
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={cfg.devices}"}
    proc = subprocess.run([sys.executable, "-m", "app.host_pool"], input=json.dumps(to_dict(cfg)), text=True,
                          capture_output=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        logger.warning("the memory plan for the pinned host pool failed (%s): JAX's default cap stands; set %s to "
                       "size it", (proc.stderr.strip().splitlines() or ["?"])[-1][:200], POOL_VAR)
        return None
    gib = pool_gib(int(proc.stdout.strip().splitlines()[-1]))
    os.environ[POOL_VAR] = str(gib)
    logger.info("pinned host memory pool: %d GiB (the plan's host bytes +80%% +2 GiB, at most 90%% of RAM; set %s to "
                "change it)", gib,
                POOL_VAR)
    return gib


def rank_from_env() -> int:
    """This process's rank as the launcher or scheduler set it (JAX_PROCESS_ID, SLURM_PROCID, OMPI_COMM_WORLD_RANK),
    read before JAX starts; 0 where none is set."""
    for name in ("JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        value = _env_int(name)
        if value is not None:
            return value
    return 0


def distributed_requested() -> bool:
    """Whether this run is one of several processes (the environment asks for jax.distributed)."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or os.environ.get("FLAN_T5_DISTRIBUTED") == "1"


def maybe_initialize_distributed() -> None:
    """Multi-process runs (the original's poprun): jax.distributed.initialize() when a cluster is set up.

    Set JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and
    JAX_PROCESS_ID in every process (``python3 -m app.launch`` does this for processes
    on one machine), or set FLAN_T5_DISTRIBUTED=1 under SLURM / Open MPI / on a TPU pod
    to let JAX detect them. One process otherwise.
    """
    if not distributed_requested():
        return
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    detect = os.environ.get("FLAN_T5_DISTRIBUTED") == "1"  # the scheduler fills in what is not set
    procs, pid = _env_int("JAX_NUM_PROCESSES"), _env_int("JAX_PROCESS_ID")
    missing = [n for n, v in (("JAX_NUM_PROCESSES", procs), ("JAX_PROCESS_ID", pid)) if v is None]
    if missing and not detect:
        raise ConfigError(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} "
                          f"{'is' if len(missing) == 1 else 'are'} not: set all three in every process (or "
                          "FLAN_T5_DISTRIBUTED=1 under SLURM / on a TPU pod)")
    if procs is not None and pid is not None and not 0 <= pid < procs:
        raise ConfigError(f"JAX_PROCESS_ID={pid} is outside 0..{procs - 1} (JAX_NUM_PROCESSES={procs}): number the "
                          "processes 0, 1, ... JAX_NUM_PROCESSES-1")
    import jax

    # a process killed outright is noticed by the coordination service after this many seconds without heartbeats
    # (a process that fails on an error says so at once: report_failure); JAX's default is 100
    heartbeat = _env_int("FLAN_T5_HEARTBEAT_TIMEOUT") or 30
    jax.distributed.initialize(address, procs, pid, heartbeat_timeout_seconds=heartbeat)


def filter_stdout_lines(drop) -> None:
    """Drops the lines of this process's standard output (file descriptor 1, so native libraries' prints too)
    for which ``drop(line: bytes)`` is true. The filter is a pipe and a thread; at exit the descriptor is
    restored and the thread drained, so no line is lost."""
    read_end, write_end = os.pipe()
    original = os.dup(1)
    sys.stdout.flush()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump():
        with os.fdopen(read_end, "rb") as src, os.fdopen(os.dup(original), "wb", buffering=0) as dst:
            for line in src:
                if not drop(line):
                    dst.write(line)

    thread = threading.Thread(target=pump, name="stdout-filter", daemon=True)
    thread.start()

    def restore():
        sys.stdout.flush()
        os.dup2(original, 1)  # the pipe's last writer closes: the pump reads to its end
        thread.join(timeout=5)

    atexit.register(restore)


def _gloo_line(line: bytes) -> bool:
    # gloo prints "[Gloo] Rank N is connected to M peer ranks..." from several threads at once; fragments
    # of interleaved lines carry one of the two marks
    return b"[Gloo]" in line or b"connected peer ranks" in line


CACHE_VARIABLE = "FLAN_T5_COMPILATION_CACHE"  # a directory for compiled programs, or "off"
CACHE_MAX_BYTES = 8 << 30  # the cache's size bound: its least recently used entries go past it


def compilation_cache_dir() -> Optional[str]:
    """Where compiled programs are kept between runs, on by default: $FLAN_T5_COMPILATION_CACHE (a directory; "off"
    or "0": none), else JAX's own JAX_COMPILATION_CACHE_DIR or the original's POPXL_CACHE_DIR, else ``xla`` under
    the data cache's root ($FLAN_T5_CACHE, else ~/.cache/flan_t5), as other serving engines keep theirs."""
    own = os.environ.get(CACHE_VARIABLE)
    if own is not None and own.strip().lower() in ("off", "0", "false", "none", ""):
        return None
    path = own or os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.environ.get("POPXL_CACHE_DIR") or \
        os.path.join(os.environ.get("FLAN_T5_CACHE") or "~/.cache/flan_t5", "xla")
    return os.path.abspath(os.path.expanduser(path))


def setup_jax() -> Optional[str]:
    """Starts multi-process JAX when configured, and switches on the persistent compilation cache
    (``compilation_cache_dir``: on by default); returns its path (None: off).

    The cache is bounded (``CACHE_MAX_BYTES``), which makes JAX take a file lock around every read and write of it:
    processes that share it (a server and its validation, two runs at once) never read an entry half written.
    In a multi-process run only process 0 logs at INFO; the others log warnings and errors.
    """
    maybe_initialize_distributed()
    if not is_main_process():
        logger.setLevel(logging.WARNING)
    if distributed_requested():
        import jax

        if jax.process_count() > 1 and jax.local_devices()[0].platform == "cpu":
            filter_stdout_lines(_gloo_line)  # CPU collectives (gloo) announce every connection on stdout
        watch_for_failures()
    import jax

    path = compilation_cache_dir()
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    # programs that compile in under half a second are not worth a cache entry, unless the environment says otherwise
    # (JAX reads its own variable: the tests set it where the same small programs compile in process after process)
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def is_main_process() -> bool:
    """True in process 0 of a multi-process run (the one that prints and writes reports), and in a
    single-process run."""
    if not distributed_requested():
        return True
    import jax

    return jax.process_index() == 0


# --------------------------------------------------------------------------- the processes of one run


def process_count() -> int:
    """The number of processes of this run (1 unless jax.distributed started)."""
    if not distributed_requested():
        return 1
    import jax

    return jax.process_count()


def process_label() -> str:
    """``process I of N``: who says a line in a multi-process run."""
    import jax

    return f"process {jax.process_index()} of {jax.process_count()}"


def _client():
    """The coordination service's client of this process (JAX's key-value store and barriers), or None."""
    try:
        from jax._src import distributed

        return distributed.global_state.client
    except Exception:  # another JAX version: the callers fall back to collectives
        return None


FAILED = "flan_t5/failed"  # the key under which a failing process leaves "exit code|its one line"
AGREED = "flan_t5/agreed/"


def agree(name: str, make) -> str:
    """The value process 0 computes with ``make()`` (a string: a directory, a path), the same in every process of
    the run; ``make`` runs in process 0 alone."""
    if process_count() == 1:
        return make()
    import jax

    client = _client()
    if jax.process_index() == 0:
        value = make()
        client.key_value_set(AGREED + name, value)
        return value
    return client.blocking_key_value_get(AGREED + name, 10 * 60 * 1000)


def barrier(name: str) -> None:
    """Every process of the run waits here for the others (one process: nothing)."""
    if process_count() == 1:
        return
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)


def any_process(value: int) -> int:
    """The largest of ``value`` over the processes of the run (so that all decide alike, e.g. to stop after a step
    when any of them got a signal); one process: ``value``."""
    if process_count() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils

    return int(np.max(multihost_utils.process_allgather(np.int32(value))))


def report_failure(message: str, code: int, origin: bool = True) -> None:
    """Tells the other processes of the run that this one fails with ``message`` (one line) and ``code``: each of
    them then stops at once (``watch_for_failures``) instead of waiting in a collective for a peer that is gone.
    ``origin``: this process's failure is the run's first (under app.launch, the launcher names it)."""
    if origin:
        _mark_origin()
    client = _client()
    if client is None:
        return
    try:
        client.key_value_set(FAILED, f"{code}|{message}")
    except Exception:
        return  # another process reported first, or the service is gone: either way the others stop
    import jax

    if jax.process_index() == 0:  # the coordination service lives in process 0: give the others a poll to read it
        time.sleep(1.5)


LAUNCH_DIR = "FLAN_T5_LAUNCH_DIR"  # set by app.launch: where the process that fails first leaves its index


def _mark_origin() -> None:
    """Under app.launch, leaves this process's index as the run's first failure (unless another left its own): the
    launcher names the process that failed, not a peer that stopped a moment later because of it."""
    directory = os.environ.get(LAUNCH_DIR)
    if not directory:
        return
    import jax

    try:
        fd = os.open(os.path.join(directory, "failed_first"), os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    except OSError:
        return
    os.write(fd, str(jax.process_index()).encode())
    os.close(fd)


def reported_failure() -> Optional[str]:
    """The line another process reported failing with (``report_failure``), or None."""
    client = _client()
    try:
        found = client.key_value_try_get(FAILED) if client is not None else None
    except Exception:
        return None
    return found.partition("|")[2] if found else None


def watch_for_failures(interval: float = 0.5) -> None:
    """A thread that ends this process within ``interval`` seconds of another process's failure (its line is
    printed, named, with its exit code), or when the coordination service (process 0) is gone."""
    client = _client()
    if client is None:
        return
    import jax

    me = process_label()
    done = threading.Event()

    def poll():
        while not done.wait(interval):
            try:
                found = client.key_value_try_get(FAILED)
            except Exception as e:
                if done.is_set():  # the process is ending normally: the client is being shut down
                    return
                if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
                    continue
                _stop(f"{me} stops: the run's coordinator (process 0) is gone ({type(e).__name__})", 1)
            code, _, message = found.partition("|")
            if not message.startswith(me + ":"):
                _stop(f"{me} stops because {message}", int(code or 1))

    if jax.process_count() > 1:
        watcher = threading.Thread(target=poll, name="failure-watch", daemon=True)
        watcher.start()

        def stop_watching():  # at exit, before JAX's own shutdown (registered earlier, so run later)
            done.set()
            watcher.join(timeout=10)

        atexit.register(stop_watching)


def _stop(line: str, code: int) -> None:
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os.write(2, f"error: {line}\n".encode())
    os._exit(code)
