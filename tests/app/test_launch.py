"""Multi-process (multi-host) runs: two cooperating JAX processes on this machine, CPU collectives
over gloo, checked against the same run in one process.

Fine-tuning (tiny: dp=2 across the processes, tp=2 within each; fused and phased) must give the
same losses, gradient norms and weights as one process on 4 devices; validation, with tp or dp across the processes, the same
generated texts. The launcher and the distributed set-up's bad input are tested without JAX peers.
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from tests.env import child_env

import run_finetuning
import run_validation
from tests.helpers import SMALL, assert_trained_alike, params_at
from utils import checkpoint as ckpt
from app import runtime as cli
from app.launch import launch
from tests.helpers import ROOT


def two_processes(script: str, argv: list, tmp_path, timeout: int = 300) -> str:
    """Runs a driver as 2 processes under app.launch; each simulates its own share of the devices."""
    env = child_env()  # not this process's 8 devices
    log = tmp_path / f"{os.path.basename(script)}.log"
    with open(log, "w") as f:
        # its own process group: on a timeout the launcher and both processes are stopped together
        proc = subprocess.Popen([sys.executable, "-m", "app.launch", "--nproc", "2", script, *argv],
                                cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"{script} in two processes did not finish in {timeout} s:\n{log.read_text()[-3000:]}")
    assert proc.returncode == 0, log.read_text()[-3000:]
    return log.read_text()


def metrics(run_dir, key) -> list:
    return [json.loads(line)[key] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


@pytest.mark.slow
@pytest.mark.parametrize("preset,phased", [("tiny", "false"), ("tiny", "true"), ("gptj_tiny", "false")])
def test_two_processes_fine_tune_like_one(tmp_path, preset, phased):
    """Fused and phased executors (the phased one builds its host buffers from each process's
    own shards), T5 and GPT-J. The fused T5 run keeps one checkpoint (--to_keep 1: the retention prunes after
    every save, which both processes once raced on) and is validated by two processes."""
    multi, single = str(tmp_path / "multi"), str(tmp_path / "single")
    argv = [preset if a == "tiny" else a for a in SMALL] + ["--steps", "3", "--phased", phased]
    prune = preset == "tiny" and phased == "false"
    keep = ["--to_keep", "1"] if prune else []
    out = two_processes("run_finetuning.py", argv + ["--save", multi] + keep, tmp_path)
    run_finetuning.main(argv + ["--save", single])
    assert "[Gloo]" not in out and "peer ranks" not in out  # the CPU collectives' connection lines are silenced
    assert "step 3/3 loss" in out  # and the rest of the output is kept
    assert "Traceback" not in out and "error" not in out.lower(), out[-3000:]

    # process 0 alone wrote the run's files: one metrics line per step (a checkpoint every step: a tenth of 3)
    assert ckpt.saved_steps(multi) == ([3] if prune else [1, 2, 3])
    assert not [d for d in os.listdir(multi) if "tmp" in d]  # no half-deleted or half-written step left
    assert len(metrics(multi, "loss")) == 3 and os.path.isfile(os.path.join(multi, "loss_curve.png"))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(metrics(multi, key), metrics(single, key), rtol=1e-5, err_msg=key)
    # the checkpoint the two processes wrote, restored on one device
    (meta_m, pm), (meta_s, ps) = params_at(multi, 3), params_at(single, 3)
    assert meta_m["data_position"] == meta_s["data_position"]
    for x, y in zip(jax.tree.leaves(pm), jax.tree.leaves(ps)):
        assert_trained_alike(x, y, lr=1e-3, steps=3)  # (the tiny preset's learning rate, no warm-up in SMALL)
    if prune:  # two processes validate it: process 0 writes the report
        out = two_processes("run_validation.py", ["--load", multi, "--limit", "8"], tmp_path)
        assert "Traceback" not in out and [f for f in os.listdir(multi) if f.startswith("validation")], out[-2000:]


FAILING = """
import os, sys, time
sys.path.insert(0, {root!r})
import run_finetuning
from app import trainer

real = trainer.train_step


def failing(cfg, executor, loader, state, step, *a, **kw):
    import jax

    if step == 3 and jax.process_index() == {rank}:
        open({stamp!r}, "w").write(str(time.time()))
        if {killed}:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)  # as kill -9, or the kernel's OOM killer
        if {bug}:
            raise KeyError("a bug at step 3")
        from data.sources import DataError

        raise DataError("data.jsonl: row 7: column 'label' is empty")
    return real(cfg, executor, loader, state, step, *a, **kw)


trainer.train_step = failing
run_finetuning.main(sys.argv[1:])
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["launcher", "by hand", "killed"])
def test_a_process_that_fails_ends_the_whole_job_in_seconds_naming_its_error(tmp_path, how):
    """A process raising mid-training (process 1 on an expected error under the launcher; process 0, the
    coordinator, on a bug when each process is started by hand as on a cluster) or killed (SIGKILL, under the
    launcher): every process ends within seconds of it, each naming the failed process and its error (the killed
    one's by the launcher: the signal), with a non-zero status and no C++ stack dump; the checkpoints saved before
    stay loadable."""
    save, stamp = str(tmp_path / "ck"), str(tmp_path / "failed_at")
    rank, bug, killed = {"launcher": (1, False, False), "by hand": (0, True, False), "killed": (1, False, True)}[how]
    script = tmp_path / "failing.py"
    script.write_text(FAILING.format(root=ROOT, rank=rank, stamp=stamp, bug=bug, killed=killed))
    argv = [str(script)] + SMALL + ["--steps", "8", "--save", save, "--checkpoint_steps", "2"]
    env = child_env()
    if how != "by hand":
        procs = [subprocess.Popen([sys.executable, "-m", "app.launch", "--nproc", "2", *argv], cwd=ROOT, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    else:
        from app.launch import free_port

        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}", JAX_NUM_PROCESSES="2")
        procs = [subprocess.Popen([sys.executable, *argv], cwd=ROOT, env={**env, "JAX_PROCESS_ID": str(i)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    ended = time.time()
    assert ended - float(open(stamp).read()) < 30, "\n".join(outs)[-3000:]
    assert all(p.returncode != 0 for p in procs)
    text = "\n".join(outs)
    if killed:
        assert "launch: process 1 of 2 was killed by signal 9 (SIGKILL); stopping the others" in text, text[-3000:]
        assert "Traceback" not in text and "Check failure stack trace" not in text
        assert 2 in ckpt.saved_steps(save)
        return
    expected = ("process 1 of 2: data.jsonl: row 7: column 'label' is empty" if rank == 1 else
                "process 0 of 2: KeyError: 'a bug at step 3'")
    assert f"error: {expected}" in text, text[-3000:]
    other = 1 - rank
    assert f"error: process {other} of 2" in text and expected in text.split(f"error: process {other} of 2")[1]
    assert "Check failure stack trace" not in text and "(unknown)" not in text
    if how == "launcher":
        assert f"launch: process {rank} of 2 exited with status 2" in text
    assert 2 in ckpt.saved_steps(save)
    meta, params = params_at(save, 2)
    assert meta["step"] == 2 and all(np.all(np.isfinite(x)) for x in jax.tree.leaves(params))


@pytest.mark.slow
def test_two_processes_validate_like_one(tmp_path):
    """Greedy decoding of a random model (texts that differ from row to row, so a misplaced row
    shows) by two processes and by one: tp across the processes (tiny's tp=2), then dp across them
    (each decodes its own rows and the tokens are gathered); process 0 writes the report."""
    from tests.hf_utils import make_hf

    hf, _, _ = make_hf("1.1", vocab_size=128, d_model=64, d_ff=256, num_heads=4, d_kv=16, num_layers=4,
                       relative_attention_num_buckets=32, relative_attention_max_distance=128,
                       initializer_factor=5.0)  # larger weights than HF's default: texts vary with the prompt
    hf.save_pretrained(tmp_path / "hf")
    for name, layout in (("tp", []), ("dp", ["--data_parallel", "2", "--tensor_parallel", "1"])):
        args = ["--config", "tiny", "--hf_model", str(tmp_path / "hf"), "--limit", "24"] + layout
        out = two_processes("run_validation.py", args + ["--output", str(tmp_path / f"{name}_multi.json")], tmp_path)
        assert out.count("model shape from the model") == 1, out[-2000:]  # logged by process 0 alone
        run_validation.main(args + ["--output", str(tmp_path / f"{name}_single.json")])
        rm, rs = (json.load(open(tmp_path / f"{name}_{n}.json")) for n in ("multi", "single"))
        assert rm["samples"] == rs["samples"] == 24
        assert len(set(rs["generated"])) > 12, rs["generated"]
        assert rm["generated"] == rs["generated"], name


SLURM_PROBE = r"""
import sys
sys.path.insert(0, {root!r})
from app.runtime import ensure_host_devices, setup_jax
ensure_host_devices(4)
setup_jax()
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from partitioning.sharding import fetch, make_mesh, put_global
mesh = make_mesh(2, 2)
x = put_global(np.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("dp")))
total = jax.jit(lambda a: a.sum(), out_shardings=NamedSharding(mesh, P()))(x)
print(jax.process_index(), jax.process_count(), jax.device_count(), len(jax.local_devices()), float(total),
      fetch(x).ravel().tolist())
"""


@pytest.mark.slow
def test_slurm_environment_is_detected_with_flan_t5_distributed(tmp_path):
    """FLAN_T5_DISTRIBUTED=1 under (a faked) SLURM: JAX reads rank, size and coordinator from the
    scheduler's variables; each process simulates its share of 4 devices; arrays placed per
    process and gathered back whole."""
    from app.launch import free_port

    env = {k: v for k, v in child_env().items() if not k.startswith("JAX_")}
    env.update(JAX_PLATFORMS="cpu", FLAN_T5_DISTRIBUTED="1", SLURM_JOB_ID="4242", SLURM_STEP_NODELIST="localhost",
               SLURM_NTASKS="2", JAX_COORDINATOR_PORT=str(free_port()))
    script = SLURM_PROBE.format(root=ROOT)
    procs = [subprocess.Popen([sys.executable, "-c", script], env={**env, "SLURM_PROCID": str(i), "SLURM_LOCALID": str(i)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outs = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    lines = sorted(out.strip().splitlines()[-1] for out, _ in outs)
    for rank, line in enumerate(lines):
        assert line == f"{rank} 2 4 2 28.0 [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]"


def test_launcher_stops_the_other_processes_when_one_fails():
    # process 1 fails at once; process 0 would wait for its peer forever
    script = ("import os, sys, time\n"
              "if os.environ['JAX_PROCESS_ID'] == '1': sys.exit(3)\n"
              "time.sleep(120)\n")
    t0 = time.perf_counter()
    assert launch(2, ["-c", script]) == 3
    assert time.perf_counter() - t0 < 60


def test_sigterm_to_the_launcher_stops_its_processes(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import os, sys, time\n"
                      "open(os.path.join(sys.argv[1], os.environ['JAX_PROCESS_ID']), 'w').write(str(os.getpid()))\n"
                      "time.sleep(120)\n")
    launcher = subprocess.Popen([sys.executable, "-m", "app.launch", "--nproc", "2", str(script), str(tmp_path)],
                                cwd=ROOT)
    deadline = time.time() + 60
    while not all((tmp_path / r).exists() and (tmp_path / r).read_text() for r in ("0", "1")):
        assert time.time() < deadline and launcher.poll() is None
        time.sleep(0.1)
    pids = [int((tmp_path / r).read_text()) for r in ("0", "1")]
    launcher.terminate()
    assert launcher.wait(timeout=60) == 143
    for pid in pids:  # gone (reaped by the launcher), not orphaned
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_launcher_gives_each_process_its_rank(tmp_path):
    script = ("import os, sys\n"
              "open(os.path.join(sys.argv[1], os.environ['JAX_PROCESS_ID']), 'w').write("
              "os.environ['JAX_NUM_PROCESSES'] + ' ' + os.environ['JAX_COORDINATOR_ADDRESS'])\n")
    assert launch(3, ["-c", script, str(tmp_path)]) == 0
    seen = {p: (tmp_path / p).read_text() for p in ("0", "1", "2")}
    assert len(set(seen.values())) == 1 and next(iter(seen.values())).startswith("3 127.0.0.1:")


@pytest.mark.parametrize("env, message", [
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234"}, "JAX_NUM_PROCESSES and JAX_PROCESS_ID are not"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2"}, "JAX_PROCESS_ID is not"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"},
     "JAX_PROCESS_ID=2 is outside 0..1"),
    ({"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234", "JAX_NUM_PROCESSES": "two", "JAX_PROCESS_ID": "0"},
     "JAX_NUM_PROCESSES='two' is not an integer"),
])
def test_incomplete_distributed_environment_is_a_one_line_error(monkeypatch, capsys, env, message):
    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "FLAN_T5_DISTRIBUTED"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    from app.entry import entry

    with pytest.raises(SystemExit) as e:
        entry(lambda argv: cli.maybe_initialize_distributed())(None)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_each_process_simulates_its_share_of_the_devices(monkeypatch):
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    cli.ensure_host_devices(4)
    assert os.environ["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"
    monkeypatch.delenv("XLA_FLAGS")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    cli.ensure_host_devices(4)  # one device each: the default, no flag
    assert "XLA_FLAGS" not in os.environ
