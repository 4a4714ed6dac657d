"""The serving benchmark (benchmarks/serve.py) and its host ceiling (benchmarks/host_cost.py): each thread's CPU
counted and sorted, the server's engine over the fake device, the profile timing the engine's parts with the flags
and the XLA threads each server of the run gets, and a server's own flags read as the server reads them."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from app.flops import decode_step_flops
from tests.helpers import machine, threads_passed


@pytest.mark.skipif(not os.path.isdir(f"/proc/{os.getpid()}/task"), reason="reads Linux's /proc")
def test_the_serving_benchmark_counts_each_thread_s_cpu_and_sorts_it():
    """benchmarks/serve.py's ``cpu_s``: a thread that spins for a while gains about that much CPU (user + system,
    from /proc), the main thread is the process id; ``cpu_shares`` puts XLA's threads (tf_*, XLA*) apart from the
    main thread (the server's HTTP) and the rest, and only counts what each used between the two readings."""
    import threading

    from benchmarks.serve import cpu_shares, thread_seconds

    before = thread_seconds(os.getpid())
    assert before[os.getpid()][0] and all(sec >= 0 for _, sec in before.values())
    done, read, ident = threading.Event(), threading.Event(), []

    def spin():
        ident.append(threading.get_native_id())
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.3:  # this thread's own CPU
            pass
        done.set()
        read.wait(30)  # alive until read

    threading.Thread(target=spin, daemon=True).start()
    assert done.wait(60)
    after = thread_seconds(os.getpid())
    read.set()
    assert after[ident[0]][1] - before.get(ident[0], ("", 0.0))[1] >= 0.2
    # a child process's threads count with the process's (a server's engine process)
    child = subprocess.Popen([sys.executable, "-c", "import sys, time\nt = time.process_time()\n"
                              "while time.process_time() - t < 0.3: pass\nprint('spun', flush=True)\n"
                              "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "spun"
        assert thread_seconds(os.getpid())[child.pid][1] >= 0.2
    finally:
        child.kill()
        child.wait()
    pid = 100
    b = {100: ("python3", 1.0), 101: ("tf_XLAEigen", 2.0), 102: ("python3", 0.5), 104: ("XLATfrtCpuClient", 0.0)}
    a = {100: ("python3", 1.25), 101: ("tf_XLAEigen", 2.5), 102: ("python3", 0.5), 103: ("python3", 0.125),
         104: ("XLATfrtCpuClient", 0.25)}
    assert cpu_shares(pid, b, a, client=0.75, wall=2.0) == {
        "http (main thread)": 0.25, "xla threads": 0.75, "other threads (decoding, output)": 0.125,
        "load generator": 0.75, "wall": 2.0}


@pytest.mark.parametrize("stream", [True, False])
def test_the_host_ceiling_runs_the_server_s_engine_over_the_fake_device(stream):
    """benchmarks/host_cost.py: every sequence decodes to its max_tokens (the fake's prompts hold no end-of-text), a
    streamed one gets an event per call with something new and a whole one only its last, and each of the two threads'
    CPU is counted per token."""
    from benchmarks.host_cost import run

    r = run(requests=12, slots=4, steps=2, stream=stream)
    assert r["tokens"] == r["asked"] > 12 * 16 - 1
    if stream:
        assert r["events"] > 2 * 12  # (at most 2 steps a call while a slot is free: many events a sequence)
    else:
        assert r["events"] == 12
    assert r["decoding_calls"] >= r["tokens"] / (4 * 4 * 2)  # (at most 4 slots x 4 x 2 steps a call)
    assert set(r["cpu_s"]) == {"scheduler", "output"} and all(v > 0 for v in r["cpu_s"].values())
    assert r["cpu_us_per_token"]["output"] == pytest.approx(1e6 * r["cpu_s"]["output"] / r["tokens"])
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["wall_s"])


def test_the_profile_times_the_engine_s_parts_and_records_each_call_s_steps_and_span():
    """benchmarks/serve.py --profile's measuring half over the fake device: the decoding calls it counts are the
    backend's, their mean steps and attention span are what the backend was given (the span passed through, not
    dropped: a call without one attends over the whole cache), every request runs to its max_tokens, and the parts'
    milliseconds are parts of the scheduler's rounds."""
    from benchmarks import serve
    from benchmarks.host_cost import fake_engine

    reqs = serve.workload(serve.parse(["--requests", "12", "--seed", "3"]))
    engine = fake_engine(len(reqs), slots=4, steps=2)
    backend = engine.backend
    inserts = []
    insert = backend.insert
    backend.insert = lambda joiners: (inserts.append(len(joiners)), insert(joiners))[1]
    p = serve.profile_parts(engine, reqs)
    assert p["decoding_calls"] == len(backend.ns) > 0
    assert p["steps_per_decoding_call"] == pytest.approx(np.mean(backend.ns))
    assert None not in backend.spans
    assert p["attention_span_asked_per_decoding_call"] == pytest.approx(np.mean(backend.spans))
    assert p["inserts"] == len(inserts) and sum(inserts) == len(reqs)  # every request joins once
    assert p["tokens"] == sum(r["max_tokens"] for r in reqs)
    parts = p["host_ms_per_decoding_call"]
    assert set(parts) == {"dispatching the decoding call", "dispatching inserts", "waiting for the device (reading)",
                          "scheduler bookkeeping", "output thread (text, events)"}
    assert all(v >= 0 for v in parts.values()) and parts["dispatching the decoding call"] > 0


def test_the_profile_s_engine_gets_the_flags_each_server_of_the_run_gets():
    """benchmarks/serve.py: a server's flags (the run's slots, queue, widths, steps; the model's flags; its own
    --server_args last, so they win) are what --profile's engine parses with run_server.py's own flags, and the
    profile's worker gets every --server_args (before, it built its options apart and left the spans at 1)."""
    from app.args import parse_args, server_flags
    from benchmarks import serve

    a = serve.parse(["--requests", "6", "--slots", "4", "--max_new", "32", "--server_args=--attention_spans 2",
                     "--server_args=--steps_per_call 2 --min_join 3"])
    reqs = serve.workload(a)
    names = [(name, k, args) for name, k, args in serve.server_variants(a)]
    assert [n for n, _, _ in names] == [f"server_{k}step {x}" for k in a.steps_per_call
                                        for x in ("--attention_spans 2", "--steps_per_call 2 --min_join 3")]
    for _, k, args in names:
        flags = serve.server_argv(a, "base", k, reqs, ["--tensor_parallel", "1"], args)
        got, over = parse_args("inference", "t", "tiny", flags, server_flags)
        assert got.config == "base"  # (the preset's precision: the checkpoint carries the shape alone)
        assert (got.slots, got.max_queue, got.prompt_width) == (4, 6, serve.server_width(reqs))
        assert got.prompt_width % 8 == 0 and got.prompt_width >= max(len(r["prompt"].split()) for r in reqs) + 2
        assert (int(over["output_length"]), int(over["tensor_parallel"])) == (32, 1)  # (as given: strings)
        if "--attention_spans" in args:
            assert (got.attention_spans, got.steps_per_call) == (2, k)
        else:
            assert (got.attention_spans, got.steps_per_call, got.min_join) == (None, 2, 3)
    worker = serve.parse(serve._method_cmd(a, "profile", "tiny", "c", "w", "", "o")[2:])
    assert worker.server_args == a.server_args and worker.method == "profile"


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """benchmarks/serve.py's flags of a --profile worker over a tiny checkpoint and its workload, both made."""
    from benchmarks import serve

    root = tmp_path_factory.mktemp("profile")
    flags = ["--config", "tiny", "--ckpt", str(root / "ckpt"), "--workload", str(root / "work.json")]
    a = serve.parse(flags)
    serve.make_checkpoint(a, [])
    with open(a.workload, "w") as f:
        json.dump(serve.workload(a), f)
    return flags


def heavy_slots() -> int:
    """The fewest slots of the tiny T5 whose decoding step is heavy (every core to XLA on a CPU by default)."""
    import math

    from app.runtime import HEAVY_STEP_FLOPS
    from config import load_config

    return math.ceil(HEAVY_STEP_FLOPS / decode_step_flops(load_config("inference", "tiny").model))


@pytest.mark.parametrize("server_args,want", [([], 3), (["--server_args=--cpu_threads 2"], 2),
                                               (["--server_args=--cpu_threads 0"], 0), (["heavy"], 0),
                                               (["heavy --cpu_threads 1"], 1)])
def test_the_profile_sets_xla_s_threads_as_the_server_does(monkeypatch, profiled, server_args, want):
    """--profile's one process gives XLA the threads a server of the run would have: its --cpu_threads, else the
    server's default (every core but one; every core for a heavy step of its model and slots on the CPU), set
    before anything starts JAX; servers that differ are refused, given or by default."""
    from benchmarks import serve

    machine(monkeypatch, 4)
    passed = threads_passed(monkeypatch)
    heavy = f"--server_args=--slots {heavy_slots()}"
    with pytest.raises(SystemExit):
        serve.run_profile(serve.parse(profiled + [x.replace("heavy", heavy) for x in server_args]), [])
    assert passed == [want]
    for differ in (["--server_args=--cpu_threads 1", "--server_args="], ["--server_args=--cpu_threads=1",
                                                                          "--server_args=--cpu_threads 2"]):
        with pytest.raises(SystemExit, match="one --cpu_threads"):
            serve.run_profile(serve.parse(profiled + differ), [])
        with pytest.raises(SystemExit, match="one --cpu_threads"):  # (before any checkpoint is made)
            serve.main(differ + ["--profile", "--configs", "no_such_preset"])
    with pytest.raises(SystemExit, match=r"their defaults differ: \[0, 3\]"):  # (by their slots)
        serve.run_profile(serve.parse(profiled + ["--server_args=", heavy]), [])
    assert passed == [want]


def test_a_server_s_own_flags_are_read_as_the_server_reads_them():
    """What a run's JSON says of each server (its most steps a call) and what --profile sets (its XLA threads) come
    from its --server_args as run_server.py parses them: either spelling, the last one winning."""
    from benchmarks import serve

    assert serve.own_flag("--cpu_threads=3 --min_join 2", "cpu_threads") == 3
    assert serve.own_flag("--cpu_threads 1 --cpu_threads 4", "cpu_threads") == 4
    assert serve.own_flag("--min_join 2", "cpu_threads") is None
    a = serve.parse(["--steps_per_call", "8"])
    assert [serve.most_steps(a, 8, x) for x in ("", "--max_steps_per_call=12", "--max_steps_per_call 9")] == [
        32, 12, 9]
