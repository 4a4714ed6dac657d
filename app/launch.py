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
import time


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc: int, command: list, port: int | None = None, env: dict | None = None) -> int:
    """Starts ``command`` (a Python script and its arguments) ``nproc`` times; returns the exit status.

    The processes share the launcher's process group, so a signal to the group (Ctrl-C) reaches
    them all; SIGTERM to the launcher alone stops them too.
    """
    address = f"127.0.0.1:{port or free_port()}"
    procs = []
    for i in range(nproc):
        penv = dict(os.environ if env is None else env)
        penv.update(JAX_COORDINATOR_ADDRESS=address, JAX_NUM_PROCESSES=str(nproc), JAX_PROCESS_ID=str(i))
        procs.append(subprocess.Popen([sys.executable, *command], env=penv))

    def stop_all():
        for q in procs:
            if q.poll() is None:
                q.terminate()

    def on_sigterm(*_):
        stop_all()
        raise SystemExit(143)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    status = 0
    try:
        running = list(procs)
        while running:
            for p in list(running):
                rc = p.poll()
                if rc is None:
                    continue
                running.remove(p)
                if rc != 0 and status == 0:
                    status = rc
                    stop_all()  # one failed: the others would wait for it forever
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all()
        status = 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        for q in procs:
            try:
                q.wait(timeout=30)
            except subprocess.TimeoutExpired:
                q.kill()
                q.wait()
    return status


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
