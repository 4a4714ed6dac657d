"""Every driver's entry: expected errors as one line, signals outside the training loop, out of memory; in a
multi-process run a failure in any process ends every process within seconds, each saying which one failed."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
import threading
import traceback
import typing
from typing import Callable, Optional

from app import runtime
from utils.errors import FlanT5Error, OutOfMemory


def die(message: str, code: int = 2) -> typing.NoReturn:
    """Prints a one-line error and exits non-zero."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def entry(main: Callable) -> Callable:
    """Every driver's ``main``: an expected error (``utils.errors.FlanT5Error``) becomes one line on stderr
    and its exit code; Ctrl-C outside the training loop (which handles it itself) exits 130 without a
    traceback; a device out of memory becomes one line with the knobs that lower memory.

    In a run of several processes, a process that fails says so to the others (``runtime.report_failure``: each
    stops at once, naming it) and exits without waiting for them: JAX's exit would wait at a barrier for peers that
    wait in a collective for it, until its heartbeat timeout."""

    @functools.wraps(main)
    def run(argv=None):
        old = exit_on_signals() if threading.current_thread() is threading.main_thread() else {}
        try:
            return main(argv)
        except FlanT5Error as e:
            fail(str(e), e.exit_code)
        except KeyboardInterrupt:
            die("interrupted", 130)
        except Exception as e:  # XLA's out-of-memory errors carry no type of their own
            line, code, origin = out_of_memory_message(e), OutOfMemory.exit_code, True
            if line is None:  # a peer is gone: this process did not fail first (a killed one leaves no mark)
                line, code, origin = peer_failure_message(e), 1, False
            if line is None and runtime.process_count() == 1:
                raise
            if line is None:  # a bug: its traceback, then the line the other processes see
                traceback.print_exc()
                first = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
                line, origin = f"{type(e).__name__}: {first}", True
            fail(line, code, origin)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    return run


def fail(message: str, code: int, origin: bool = True) -> typing.NoReturn:
    """The one line of a failure and its exit code; in a multi-process run the line names this process, the others
    are told, and the process ends at once (``os._exit``: no barrier at exit waits for the peers). ``origin``: this
    process failed first (False: it stops because a peer is gone, and the launcher names that peer)."""
    if runtime.process_count() == 1:
        die(message, code)
    line = f"{runtime.process_label()}: {message}"
    runtime.report_failure(line, code, origin)
    try:
        sys.stdout.flush()
    except Exception:
        pass
    os.write(2, f"error: {line}\n".encode())
    os._exit(code)


def peer_failure_message(e: BaseException) -> Optional[str]:
    """One line for a collective that failed because another process of the run is gone (gloo's connection
    errors on CPUs; the coordination service's on any backend), else None."""
    text = str(e)
    marks = ("Connection reset by peer", "Connection closed by peer", "Gloo", "failed to connect",
             "coordination service", "DistributedRuntimeClient")
    if runtime.process_count() == 1 or not any(m in text for m in marks):
        return None
    other = runtime.reported_failure()
    if other:
        return f"stops because {other}"
    first = next((x.strip() for x in text.splitlines() if x.strip()), type(e).__name__)[:200]
    return (f"a collective with the other processes failed ({first}): another process of the run stopped; its own "
            "output (or the launcher's) says why")


def exit_on_signals() -> dict:
    """Ctrl-C or SIGTERM from now on is one line and exit 130 / 143 (``exit_on_signal``); returns the handlers it
    replaced. ``entry`` installs it around a driver's ``main``; a driver run as a script also calls it before its
    other imports (JAX's take seconds), so that the imports are covered too."""
    return {sig: signal.signal(sig, exit_on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}


class _Stop:
    """What a signal outside the training loop finds: what the driver has kept so far (``kept``: None, nothing of
    the work in progress), and a write that must end whole first (``writing``, and the signal it held back)."""
    kept: Optional[str] = None
    writing = False
    held: Optional[int] = None


def keeping(note: Optional[str]) -> None:
    """What a signal's line says is kept of the work in progress, from now on (run_inference.py's finished
    predictions); None: nothing (the line says the work in progress was not saved)."""
    _Stop.kept = note


@contextlib.contextmanager
def written_whole():
    """A write that a signal never cuts: a signal that comes during it stops the process once it is done."""
    _Stop.writing = True
    try:
        yield
    finally:
        _Stop.writing, held, _Stop.held = False, _Stop.held, None
        if held is not None:
            exit_on_signal(held)


def exit_on_signal(signum, frame=None) -> None:
    """Ctrl-C or SIGTERM at any moment outside the training loop's own handling (start-up, compilation, loading,
    validation, decoding): one line and exit 130 / 143 at once (after the write in progress, under
    ``written_whole``). No Python exception is raised into a program that XLA's threads are running (that is what
    ended in segmentation faults, or in an interrupt swallowed by a garbage-collection callback); files are written
    atomically, so what was saved before stays intact, and the line says what the driver kept (``keeping``)."""
    if _Stop.writing:
        _Stop.held = signum
        return
    name = signal.Signals(signum).name
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    what = _Stop.kept or "the work in progress was not saved (earlier checkpoints and reports are intact)"
    os.write(2, f"\n{name}: stopped; {what}\n".encode())
    os._exit(128 + signum)


def out_of_memory_message(e: BaseException) -> Optional[str]:
    """One line for an XLA RESOURCE_EXHAUSTED error (bytes asked for, and the knobs), else None."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text:
        return None

    m = re.search(r"allocat\w* ([0-9.]+)\s*(bytes|[KMGT]i?B)", text)
    need = ""
    if m:
        scale = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6,
                 "GB": 1e9, "TB": 1e12}.get(m.group(2), 1)
        need = f" allocating {float(m.group(1)) * scale / 2**30:.1f} GiB"
    return (f"a device ran out of memory{need}: lower --micro_batch_size, pass --recompute true (--remat_policy "
            "full), raise --tensor_parallel (more devices), or pass --phased true (weights and optimizer state in "
            "host memory); --plan prints what the run needs")
