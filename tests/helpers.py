"""What several test modules share (no tests here): the tiny presets' small runs, a random-init checkpoint, data files
of a few rows, reading a checkpoint back, relative errors, a driver's one-line failure, a driver in a process of its
own. HF models and the batches they are
compared on are in tests/hf_utils.py; the environment of the processes tests start in tests/env.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from config import load_config
from tests.env import ROOT, child_env

# the tiny preset at a small shape: what most in-process driver tests run
SMALL = ["--config", "tiny", "--sequence_length", "16", "--global_batch_size", "8", "--micro_batch_size", "2",
         "--warmup_steps", "0"]

# the gptj_tiny preset at a small shape, with dropout and warm-up
GPTJ_SMALL = ["--config", "gptj_tiny", "--sequence_length", "32", "--global_batch_size", "8", "--micro_batch_size", "2",
              "--warmup_steps", "3", "--dropout_prob", "0.1"]

__all__ = ["ROOT", "SMALL", "GPTJ_SMALL", "build", "fails", "fro_rel", "leaves", "max_rel", "params_at", "start",
           "tiny", "update_rel", "wait_for_lines", "assert_trained_alike", "machine", "threads_passed", "train",
           "save_random_checkpoint", "save_lora_checkpoint", "base_fingerprint", "write_jsonl", "nli_file", "qa_dir"]


def tiny(**overrides):
    """The tiny preset's config at 16 tokens, 16 rows on one device (``overrides``: flat flags)."""
    base = dict(global_batch_size=16, micro_batch_size=4, data_parallel=1, tensor_parallel=1, sequence_length=16,
                warmup_steps=0, learning_rate=1e-3)
    base.update(overrides)
    return load_config("finetuning", "tiny", base)


def build(cfg):
    """(executor, training loader) of a config, as run_finetuning.py builds them."""
    import run_finetuning
    from app.train_data import training_data

    executor = run_finetuning.build_executor(cfg)
    return executor, training_data(cfg, executor.g.family)


def train(save, steps, *extra):
    """``steps`` steps of the SMALL run saved in ``save`` (run_finetuning.py in this process)."""
    import run_finetuning

    run_finetuning.main(SMALL + ["--steps", str(steps), "--save", save, *extra])


def save_random_checkpoint(preset: str, directory: str, seed: int = 7, step: int = 1, meta: dict | None = None,
                           **overrides) -> None:
    """A random-init checkpoint of a preset (its fields ``overrides``; ``meta``: more of its meta), saved as
    run_finetuning saves one."""
    from config import load_config
    from config.presets import to_dict
    from graphs.graphs import Graphs
    from utils import checkpoint as ckpt

    cfg = load_config("finetuning", preset, overrides)
    mgr = ckpt.manager(directory)
    ckpt.save(mgr, step, Graphs(cfg).init_params(seed), None, {"step": step, "seed": cfg.model.seed,
                                                               "config": to_dict(cfg), **(meta or {})})
    mgr.wait_until_finished()
    mgr.close()


def base_fingerprint(directory: str, step: int = 1) -> str:
    """The fingerprint (partitioning/base.py) a LoRA run over this full checkpoint records of its base."""
    from partitioning.base import fingerprint

    return fingerprint(jax.tree.map(jax.numpy.asarray, params_at(directory, step)[1]))


def save_lora_checkpoint(preset: str, directory: str, base: str, digest: str, rank: int = 4, alpha: float = 8.0,
                         targets: tuple = ("q", "v"), seed: int = 0, scale: float = 0.3) -> str:
    """A LoRA checkpoint as run_finetuning.py --lora_rank RANK --init_from BASE saves one, of random adapters (B not
    zero: they change the model; each value ``scale`` times a standard normal) -> its directory. ``digest``: the
    fingerprint its meta records of the base (``base_fingerprint(base)``, or another's)."""
    from config.presets import to_dict
    from modelling.params import is_spec
    from partitioning.base import base_record
    from partitioning.placement import Placement
    from utils import checkpoint as ckpt

    cfg = load_config("finetuning", preset, {"lora_rank": rank, "lora_alpha": alpha, "lora_targets": list(targets)})
    rng = np.random.default_rng(seed)
    adapters = jax.tree.map(lambda s: (scale * rng.standard_normal(s.shape)).astype(np.float32), Placement(cfg).specs,
                            is_leaf=is_spec)
    mgr = ckpt.manager(directory)
    ckpt.save(mgr, 1, adapters, None, {"step": 1, "seed": seed, "config": to_dict(cfg),
                                       "lora_base": base_record({"init_from": [base, 1]}, digest)})
    mgr.wait_until_finished()
    mgr.close()
    return directory


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def nli_file(path, n=200, seed=9):
    """A JSONL file of ``n`` synthetic NLI rows."""
    from data.synthetic import generate_split

    path.write_text("".join(json.dumps(r) + "\n" for r in generate_split("train", n, seed=seed)))
    return str(path)


def qa_dir(path, splits=("train", "validation")):
    """A directory of split files (``splits``) of 40 question/answer rows each."""
    path.mkdir()
    for split in splits:
        (path / f"{split}.jsonl").write_text("".join(json.dumps({"question": f"what is {i} plus one ?",
                                                                 "answer": str(i + 1)}) + "\n" for i in range(40)))
    return str(path)


def params_at(directory, step):
    """(meta, weights as numpy) of a checkpoint, restored on one device (whatever devices or processes wrote it)."""
    import orbax.checkpoint as ocp

    from utils import checkpoint as ckpt

    meta = ckpt.load_meta(directory, step)
    saved = ocp.StandardCheckpointer().metadata(os.path.join(directory, str(step), "params")).item_metadata
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=one), saved)
    mgr = ckpt.manager(directory, read_only=True)
    restored = mgr.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(target)))
    return meta, jax.tree.map(np.asarray, restored["params"])


def leaves(tree) -> list:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def max_rel(a, b) -> float:
    """max |a - b| / max |b|."""
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def fro_rel(a, b) -> float:
    """||a - b|| / ||b|| (Frobenius)."""
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def update_rel(new, ref, start) -> float:
    """||new - ref|| / ||ref - start||: how far two runs' updates of a weight from ``start`` differ, relative to the
    update. Relative to the weight it would hide an update error behind the weight's size; and unlike an
    elementwise maximum it stays put where Adam, dividing by sqrt(v) + 1e-8, turns the summation-order noise of a
    near-zero gradient (~1e-8) into a few per cent of the learning rate on one element."""
    new, ref, start = (np.asarray(x, np.float64) for x in (new, ref, start))
    return float(np.linalg.norm(new - ref) / max(np.linalg.norm(ref - start), 1e-30))


def assert_trained_alike(a, b, lr: float, steps: int, what: str = "") -> None:
    """Two runs' weights after ``steps`` Adam(W) steps of at most ``lr`` from the same start (another layout, other
    processes): equal to float32 noise (rtol 1e-5, atol 1e-6) but for a few elements (at most 2, or 0.1% of a large
    weight), and those within the steps' reach (2 lr a step). The few: Adam divides by sqrt(v) + 1e-8, so where a
    gradient is near zero the summation-order noise of another layout (~1e-8) moves the update by up to lr
    (measured: 0.7% and 3.6% of lr; a check of every element, or of the norm at 1e-5, failed by that on another
    machine). A layout that computes something else moves many elements, or the loss (compared beside)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, what
    d = np.abs(a - b)
    off = d > 1e-5 * np.abs(b) + 1e-6
    assert off.sum() <= max(2, 1e-3 * off.size), (what, int(off.sum()), off.size, float(d.max()))
    assert d.max() <= 2 * lr * steps, (what, float(d.max()), lr)


def fails(capsys, main, argv, message, code=2) -> str:
    """A driver's ``main(argv)`` exits ``code`` with ``message`` in its last line of stderr, and no traceback ->
    that line."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == code, e.value.code
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line.strip()]
    assert err and message in err[-1], err[-3:]
    assert not any("Traceback" in line for line in err)
    return err[-1]


def start(argv, devices=4, **kw) -> subprocess.Popen:
    """``python3 ARGV`` from the repository root in a process of its own (``devices`` simulated), its output piped."""
    env = child_env(devices, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable] + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def wait_for_lines(path, n, proc, timeout=300) -> None:
    """Until the file ``path`` (a run's metrics.jsonl) holds ``n`` lines; a process that ends first fails the test
    with its output's tail."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(proc.stderr.read()[-3000:])
        time.sleep(0.2)
    raise AssertionError("the run did not reach step %d" % n)


def machine(monkeypatch, cores: int, platforms: str = "cpu", started: bool = False, **env) -> None:
    """What app/runtime.py reads of the machine before JAX starts, as a test sets it: the ``cores`` this process may
    use, JAX_PLATFORMS, whether JAX has started, and ``env`` (NPROC and PJRT_NPROC unset unless given there)."""
    from app import runtime

    monkeypatch.delenv("NPROC", raising=False)
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", platforms)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(runtime, "jax_started", lambda: started)


def threads_passed(monkeypatch) -> list:
    """The values handed to app.runtime.set_cpu_threads from now on, each call then ending its caller there with
    SystemExit (a driver's first step after reading its config: nothing else runs)."""
    from app import runtime

    passed = []

    def stop(n):
        passed.append(n)
        raise SystemExit(7)

    monkeypatch.setattr(runtime, "set_cpu_threads", stop)
    return passed
