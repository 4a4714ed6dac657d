"""The benchmarks' helpers (app/bench.py): a process's descendants are its children and theirs."""

import os
import signal
import subprocess
import sys


def test_a_process_s_descendants_are_its_children_and_theirs():
    """app/bench.py's ``descendants``: what the serving benchmark counts the CPU of and the large-data benchmark the
    memory of (a run's helpers, a server's engine process); ``children`` the first generation alone."""
    from app.bench import children, descendants

    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                              "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                              "print(g.pid, flush=True)\nsys.stdin.read()\ng.kill()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    grandchild = int(child.stdout.readline())
    try:
        assert {child.pid, grandchild} <= set(descendants(os.getpid()))
        assert descendants(grandchild) == [] == children(grandchild)
        assert child.pid in children(os.getpid()) and grandchild not in children(os.getpid())
        assert children(child.pid) == [grandchild]
    finally:
        os.kill(grandchild, signal.SIGKILL)
        child.kill()
        child.wait()
