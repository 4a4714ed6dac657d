"""Runs a driver as N cooperating JAX processes on this machine (the original's ``poprun``, one host).

    python3 -m app.launch --nproc 2 run_finetuning.py --config tiny --save ckpt/tiny
    python3 -m app.launch --nproc 2 run_validation.py --config tiny --load ckpt/tiny

Each process gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES and JAX_PROCESS_ID (the
variables the drivers read, see utils/cli.py); on a CPU each simulates its share of
the preset's devices. Process 0 prints, logs and writes the run's files; the others
only warn. If one process fails the others are stopped, and the exit status is the
first failure's. On a real cluster set the three variables per host (or
FLAN_T5_DISTRIBUTED=1 under SLURM) instead of using this launcher.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, command: list, port: int | None = None, env: dict | None = None, grace: float = 5.0) -> int:
    """Starts ``command`` (a Python script and its arguments) ``nproc`` times; returns the exit status.

    The processes share the launcher's process group, so a signal to the group (Ctrl-C) reaches
    them all; SIGTERM to the launcher alone stops them too. When one process fails (or is killed), the
    launcher says which and how, and stops the others: SIGTERM, then SIGKILL after ``grace`` seconds (they
    cannot go on without it; what they saved before stays loadable)."""
    with tempfile.TemporaryDirectory(prefix="launch-") as marks:
        return _launch(nproc, command, port, env, grace, marks)


def _launch(nproc: int, command: list, port, env, grace: float, marks: str) -> int:
    address = f"127.0.0.1:{port or free_port()}"
    procs = []
    for i in range(nproc):
        penv = dict(os.environ if env is None else env)
        penv.update(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(nproc), JAX_PROCESS_ID=str(i),
                    FLAN_T5_LAUNCH_DIR=marks)
        procs.append(subprocess.Popen([sys.executable, *command], env=penv))

    def on_sigterm(*_):
        _stop(procs, grace)
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    status = 0
    try:
        status = _wait(procs, grace, os.path.join(marks, "failed_first"))
    except KeyboardInterrupt:
        _stop(procs, grace)
        status = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        _stop(procs, 30)
    return status


def _wait(procs: list, grace: float, first_mark: str) -> int:
    """Waits for every process; the first failure stops the others -> the first failure's status (0: none). The
    failure named is the one a process marked as the run's first (``first_mark``, app.runtime.report_failure), not a
    peer that ended a moment later because of it, whichever the polling saw first."""
    running = dict(enumerate(procs))
    while running:
        for i, p in list(running.items()):
            rc = p.poll()
            if rc is None:
                continue
            del running[i]
            if rc != 0:
                # one failed: the others would wait for it in a collective. A process that failed on an error has
                # told them (they stop within a second, saying so); one that was killed has not: they are stopped
                _settle(procs, 3.0)
                i = _first_failure(procs, i, first_mark)
                rc = procs[i].returncode
                how = (f"was killed by signal {-rc} ({signal.Signals(-rc).name})" if rc < 0
                       else f"exited with status {rc}")
                print(f"launch: process {i} of {len(procs)} {how}; stopping the others", file=sys.stderr, flush=True)
                _stop(procs, grace)
                return rc if rc > 0 else 128 - rc
        time.sleep(0.2)
    return 0


def _first_failure(procs: list, seen: int, first_mark: str) -> int:
    """The index of the process that failed first: the one that marked itself so, else the first seen failing."""
    try:
        marked = int(open(first_mark).read())
    except (OSError, ValueError):
        return seen
    return marked if 0 <= marked < len(procs) and procs[marked].returncode not in (None, 0) else seen


def _settle(procs: list, seconds: float) -> None:
    """Waits up to ``seconds`` for the processes to end by themselves."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(q.poll() is None for q in procs):
        time.sleep(0.1)


def _stop(procs: list, grace: float) -> None:
    """SIGTERM to every process still running, SIGKILL to those still running ``grace`` seconds later."""
    for q in procs:
        if q.poll() is None:
            q.terminate()
    deadline = time.monotonic() + grace
    for q in procs:
        try:
            q.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            q.kill()
            q.wait()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, required=True, help="number of processes")
    p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the driver script and its arguments")
    args = p.parse_args(argv)
    if args.nproc < 1:
        p.error("--nproc must be at least 1")
    if not args.command:
        p.error("name the driver to run, e.g. run_finetuning.py --config tiny")
    raise SystemExit(launch(args.nproc, args.command, args.port))


if __name__ == "__main__":
    main()
