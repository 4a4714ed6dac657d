"""The process and JAX set-up of a run: simulated CPU devices, multi-process start-up (the original's poprun),
pinned host memory, the compilation cache; everything here runs before JAX starts a backend."""

from __future__ import annotations

import logging
import os
import sys
from typing import Optional

from app.entry import die

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
        die(f"{name}={value!r} is not an integer: set it to a whole number (or unset it)")


def ensure_pinned_host_memory(phased: bool) -> None:
    """Phased execution keeps weights and optimizer state in pinned host memory. JAX's GPU
    client caps that at 64 GB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise (an XL
    model's float32 weights, AdamW state and gradients need more); raise the cap to 90% of
    this host's RAM when the user has not set it. Must run before JAX starts; inert on CPU."""
    if not phased or "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in os.environ:
        return
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(max(int(0.9 * ram / 2**30), 1))


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
        die(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not: set all three in every process (or FLAN_T5_DISTRIBUTED=1 under SLURM / on a TPU pod)")
    if procs is not None and pid is not None and not 0 <= pid < procs:
        die(f"JAX_PROCESS_ID={pid} is outside 0..{procs - 1} (JAX_NUM_PROCESSES={procs}): number the processes "
            "0, 1, ... JAX_NUM_PROCESSES-1")
    import jax

    jax.distributed.initialize(address, procs, pid)


def filter_stdout_lines(drop) -> None:
    """Drops the lines of this process's standard output (file descriptor 1, so native libraries' prints too)
    for which ``drop(line: bytes)`` is true. The filter is a pipe and a thread; at exit the descriptor is
    restored and the thread drained, so no line is lost."""
    import atexit
    import threading

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


def setup_jax() -> Optional[str]:
    """Starts multi-process JAX when configured, and switches on the persistent compilation
    cache from JAX_COMPILATION_CACHE_DIR (or the original's POPXL_CACHE_DIR); returns its path.

    In a multi-process run only process 0 logs at INFO; the others log warnings and errors.
    """
    maybe_initialize_distributed()
    if not is_main_process():
        logger.setLevel(logging.WARNING)
    if distributed_requested():
        import jax

        if jax.process_count() > 1 and jax.local_devices()[0].platform == "cpu":
            filter_stdout_lines(_gloo_line)  # CPU collectives (gloo) announce every connection on stdout
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.environ.get("POPXL_CACHE_DIR")
    if not path:
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def is_main_process() -> bool:
    """True in process 0 of a multi-process run (the one that prints and writes reports), and in a
    single-process run."""
    if not distributed_requested():
        return True
    import jax

    return jax.process_index() == 0
