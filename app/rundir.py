"""Run directories: one owner at a time, and a fresh one for a run that names none.

A run holds an exclusive lock on each directory it writes (``--save``, the run directory) for its whole life;
the lock file names the holder (process, host, start time, command). The operating system releases the lock
when the process ends, however it ends, so a lock left by a dead process never blocks the next run; a second
live run into the same directory stops at once, naming the first.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time

from utils.errors import FlanT5Error

LOCK = ".run.lock"


class DirectoryBusy(FlanT5Error, RuntimeError):
    """Another live run holds the directory."""


def check_free(directory: str) -> None:
    """DirectoryBusy if a live run holds the directory; reads only (a run refused later must leave no trace)."""
    path = os.path.join(directory, LOCK)
    if not os.path.exists(path):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "another process"
        raise DirectoryBusy(f"{directory} is in use by another run ({holder}): wait for it to end, or choose "
                            "another directory") from None
    finally:
        os.close(fd)


def missing_chain(directory: str) -> list:
    """The folders ``os.makedirs(directory)`` would create, deepest first."""
    chain, d = [], os.path.abspath(directory)
    while not os.path.exists(d):
        chain.append(d)
        d = os.path.dirname(d)
    return chain


def remove_if_empty(chain: list, leftovers: tuple = (), folders: tuple = ()) -> None:
    """Removes the folders of ``chain`` (deepest first: those a run created) while they hold nothing but
    ``leftovers`` (its own bookkeeping: the lock, an empty metrics.jsonl) and ``folders`` (what the run put there
    before any result: the tokenizer it learnt or copied), these with them."""
    for d in chain:
        try:
            names = os.listdir(d)
            kept = [n for n in names if not (n in folders and os.path.isdir(os.path.join(d, n)))
                    and (n not in leftovers or (os.path.getsize(os.path.join(d, n)) and n != LOCK))]
            if kept:
                return
            for n in names:
                path = os.path.join(d, n)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            os.rmdir(d)
        except OSError:
            return


class RunLock:
    """An exclusive lock on a directory, held until ``release`` or the process's end. A directory the lock made
    that holds nothing of the run at release (a run refused before writing: its lock, an empty metrics.jsonl, the
    tokenizer it learnt or copied) is removed again, with the folders made for it."""

    def __init__(self, directory: str):
        self.made = missing_chain(directory)
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, LOCK)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self._fd, 4096, 0).decode(errors="replace").strip() or "another process"
            os.close(self._fd)
            raise DirectoryBusy(f"{directory} is in use by another run ({holder}): wait for it to end, or choose "
                                "another directory") from None
        info = (f"pid {os.getpid()} on {socket.gethostname()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                f"{' '.join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))}")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, info.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None
            remove_if_empty(self.made, (LOCK, "metrics.jsonl"), ("tokenizer",))


def fresh_run_dir(root: str, name: str) -> str:
    """A run directory of its own under ``root``: ``name-YYYYmmdd-HHMMSS`` (with a suffix if that exists)."""
    base = os.path.join(root, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


def check_metrics_owner(run_dir: str, resuming_here: bool) -> None:
    """A run never truncates or replaces another run's metrics.jsonl: refused unless this run resumes the one that
    wrote it (the --save directory it loads from)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path) and os.path.getsize(path) and not resuming_here:
        raise FlanT5Error(f"{run_dir} already holds another run's metrics.jsonl: choose a new --run_dir (or --save) "
                          "directory, or resume that run with --load")
