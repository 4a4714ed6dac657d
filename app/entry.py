"""Every driver's entry: expected errors as one line, signals outside the training loop, out of memory."""

from __future__ import annotations

import functools
import os
import signal
import sys
import threading
import typing
from typing import Callable, Optional

from utils.errors import FlanT5Error, OutOfMemory


def die(message: str, code: int = 2) -> typing.NoReturn:
    """Prints a one-line error and exits non-zero."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def entry(main: Callable) -> Callable:
    """Every driver's ``main``: an expected error (``utils.errors.FlanT5Error``) becomes one line on stderr
    and its exit code; Ctrl-C outside the training loop (which handles it itself) exits 130 without a
    traceback; a device out of memory becomes one line with the knobs that lower memory."""

    @functools.wraps(main)
    def run(argv=None):
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, exit_on_signal)
        try:
            return main(argv)
        except FlanT5Error as e:
            die(str(e), e.exit_code)
        except KeyboardInterrupt:
            die("interrupted", 130)
        except Exception as e:  # XLA's out-of-memory errors carry no type of their own
            oom = out_of_memory_message(e)
            if oom is None:
                raise
            die(oom, OutOfMemory.exit_code)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    return run


def exit_on_signal(signum, frame=None) -> None:
    """Ctrl-C or SIGTERM at any moment outside the training loop's own handling (start-up, compilation, loading,
    validation, decoding): one line and exit 130 / 143 at once. No Python exception is raised into a program
    that XLA's threads are running (that is what ended in segmentation faults, or in an interrupt swallowed by a
    garbage-collection callback); files are written atomically, so what was saved before stays intact."""
    name = signal.Signals(signum).name
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os.write(2, f"\n{name}: stopped; the work in progress was not saved (earlier checkpoints and reports are "
                f"intact)\n".encode())
    os._exit(128 + signum)


def out_of_memory_message(e: BaseException) -> Optional[str]:
    """One line for an XLA RESOURCE_EXHAUSTED error (bytes asked for, and the knobs), else None."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text:
        return None
    import re

    m = re.search(r"allocat\w* ([0-9.]+)\s*(bytes|[KMGT]i?B)", text)
    need = ""
    if m:
        scale = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6,
                 "GB": 1e9, "TB": 1e12}.get(m.group(2), 1)
        need = f" allocating {float(m.group(1)) * scale / 2**30:.1f} GiB"
    return (f"a device ran out of memory{need}: lower --micro_batch_size, pass --recompute true (--remat_policy "
            "full), raise --tensor_parallel (more devices), or pass --phased true (weights and optimizer state in "
            "host memory); --plan prints what the run needs")
