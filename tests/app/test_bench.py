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


def test_a_decoding_baseline_s_rounds_time_a_first_token_then_n_and_report_their_medians():
    """app/bench.py's ``decode_rounds`` and ``decode_figures`` (HF's and CTranslate2's baselines): each round asks the
    first token alone, then ``n`` tokens; the figures are the medians', a further token's latency over the ``n - 1``
    after the first (one token: the whole call), tokens/s of every row's ``n``."""
    from app.bench import decode_figures, decode_rounds

    asked, clock = [], iter([0.5, 2.0, 0.7, 3.0, 0.6, 2.5])
    times, first, out = decode_rounds(lambda k: (asked.append(k), (next(clock), f"out{len(asked)}"))[1], 5, 3)
    assert asked == [1, 5] * 3 and times == [2.0, 3.0, 2.5] and first == [0.5, 0.7, 0.6] and out == "out6"
    f = decode_figures(times, first, 4, 5)
    assert f == {"generate_s": 2.5, "first_token_s": 0.6, "decode_token_latency_s": (2.5 - 0.6) / 4,
                 "generated_tokens_per_s": 4 * 5 / 2.5, "samples_per_s": 4 / 2.5}
    assert decode_figures([2.0], [0.5], 1, 1)["decode_token_latency_s"] == 2.0
    assert decode_rounds(lambda k: (1.0, None), 5, 0) == ([], [], None)
