"""The training loop's bookkeeping at its boundaries (app/trainer.py, app/evaluate.py, app/resume.py): which steps
--eval_every scores (the last one too), the learning rate a step logs (skipped steps do not move the schedule),
the best step a run names (the earliest of ties, across a resume), and when a resume has nothing to train.

The loop runs for real (its Trainer, Tracker, LossScale and the Evaluator's bookkeeping) over fakes of what is
below it: an executor whose state counts steps (a step can be made to overflow), a loader of empty batches, and a
decoding whose weights at step s score what the test says. No model is built: each run takes milliseconds.
"""

import copy
import json
import logging
import math
import os
import re
import tempfile
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app import tracking
from app import trainer as T
from app.evaluate import Evaluator, mixture_score
from app.resume import resume_point
from config import load_config
from graphs.loss_scale import LossScale
from utils import checkpoint as ckpt
from utils.errors import FlanT5Error


def lr_at(applied: int) -> float:
    """The fake schedule: any that tells its steps apart."""
    return 1e-3 * (applied + 1)


class Executor:
    """The state is the number of steps run; the step run from state s overflows (a non-finite gradient norm)
    when s is in ``overflow``."""

    def __init__(self, overflow=()):
        self.overflow = set(overflow)
        self.g = SimpleNamespace(shard_batch=lambda batch: batch, learning_rate=lr_at, lora=False)

    def train_step(self, state, batch, rng, loss_scale, clip_norm):
        return state + 1, {"loss": 1.0, "grad_norm": math.inf if state in self.overflow else 0.5}

    def to_checkpoint(self, state):
        return SimpleNamespace(params=state, opt_state=None)


class Loader:
    tokenizer = None

    def next_batch(self):
        return {}

    def stats(self, batch):
        return {"examples": 4, "packing_efficiency": 1.0}

    def state(self):
        return {}


class Decoded(Evaluator):
    """The Evaluator's own bookkeeping (``__call__``: the best step so far) over a fake decoding: the weights of
    step s score ``table[s]``."""

    def __init__(self, table: dict, best=None):
        self.table, self.mixed, self.best, self.key, self.what = table, False, best, "eval_accuracy", "held-out"

    def scores(self, state, step):
        return {"eval_accuracy": self.table[int(state)]}


@pytest.fixture(autouse=True)
def _no_figure(monkeypatch):
    monkeypatch.setattr(tracking, "plot_loss_curve", lambda *a, **k: None)  # (the figure is not what is tested)


@pytest.fixture(autouse=True)
def _steps_as_folders(monkeypatch):
    """utils/checkpoint's writing, faked: a saved step is a folder holding what ``saved_steps`` reads (its meta and
    orbax's commit marker), so the Saver's real pruning and the real reading of a save directory run over it."""

    def save(mgr, step, params, opt_state, meta):
        d = os.path.join(mgr.directory, str(step))
        os.makedirs(os.path.join(d, "meta"))
        with open(os.path.join(d, "meta", "metadata"), "w") as f:
            json.dump({"step": step, "config": {}}, f)
        open(os.path.join(d, ckpt.COMMIT), "w").close()

    monkeypatch.setattr(ckpt, "manager", lambda directory: SimpleNamespace(directory=directory,
                                                                           wait_until_finished=lambda: None))
    monkeypatch.setattr(ckpt, "save", save)


BASE = load_config("finetuning", "tiny", {"warmup_steps": 0})


def run(run_dir, start, steps, every, scores, overflow=(), scaler=None, save=None, checkpoint_steps=None,
        to_keep=4, logs=None):
    """One run of the loop from ``start`` to ``steps`` in ``run_dir`` (with ``save``: checkpoints there, as
    --save, --checkpoint_steps and --to_keep say) -> (metrics.jsonl's rows, the best named in the log as (score,
    step) or None, the scaler); ``logs``: a list that gets the run's log lines."""
    cfg = copy.deepcopy(BASE)
    cfg.training.steps, cfg.training.eval_every = steps, every
    cfg.checkpoint.save, cfg.checkpoint.steps, cfg.checkpoint.to_keep = save, checkpoint_steps, to_keep
    scaler = scaler or LossScale(dynamic=True, max_skipped=1000)
    executor = Executor(overflow)
    T.Evaluator = lambda cfg, executor, tokenizer, best: Decoded(scores, best)
    try:
        t = T.Trainer(cfg, executor, Loader(), start, scaler, run_dir, {})
        logs = [] if logs is None else logs
        handler = logging.Handler()
        handler.emit = lambda record: logs.append(record.getMessage())
        logger, level = logging.getLogger("flan_t5"), logging.getLogger("flan_t5").level
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        try:
            t.run(start)
        finally:
            logger.removeHandler(handler)
            logger.setLevel(level)
    finally:
        T.Evaluator = Evaluator
    named = [re.search(r"the best held-out eval_accuracy: ([0-9.]+) at step (\d+)", line) for line in logs]
    named = [(float(m.group(1)), int(m.group(2))) for m in named if m]
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return rows, (named[0] if named else None), scaler


def evaluated(rows):
    return [r["step"] for r in rows if "eval_accuracy" in r]


@pytest.mark.parametrize("steps,every,want", [(5, 2, [2, 4, 5]), (4, 2, [2, 4]), (1, 3, [1]), (7, 7, [7]),
                                              (3, 1, [1, 2, 3])])
def test_eval_every_scores_its_multiples_and_the_last_step(tmp_path, steps, every, want):
    """Guards ``done == total`` (without it a run of 5 steps at --eval_every 2 never scored its final model)."""
    rows, best, _ = run(str(tmp_path), 0, steps, every, {s: 0.5 for s in range(1, steps + 1)})
    assert evaluated(rows) == want and [r["step"] for r in rows] == list(range(1, steps + 1))


def test_the_logged_learning_rate_is_the_schedule_s_at_the_applied_steps(tmp_path):
    """Guards the skipped steps in the logged learning rate: the steps run from states 0 and 2 overflow (skipped:
    the optimizer's count stays), so step 4 logs the schedule's third value, not its fourth."""
    rows, _, scaler = run(str(tmp_path), 0, 6, 0, {}, overflow={0, 2})
    assert [r["grad_norm"] is None for r in rows] == [True, False, True, False, False, False]
    applied = [r for r in rows if r["grad_norm"] is not None]
    assert [r["learning_rate"] for r in applied] == [lr_at(0), lr_at(1), lr_at(2), lr_at(3)]
    assert scaler.skipped_total == 2 and rows[-1]["skipped_steps"] == 2


def test_a_resumed_run_names_the_best_step_of_the_whole_run(tmp_path):
    """Guards the best evaluation a resumed run reads back from its metrics.jsonl (without it, "the best ... at
    step N" named the best since the resume): 0.9 at step 2 before the resume beats 0.7 at step 6 after it."""
    scores = {2: 0.9, 4: 0.5, 6: 0.7}
    run(str(tmp_path), 0, 4, 2, scores)
    rows, best, _ = run(str(tmp_path), 4, 6, 2, scores)
    assert evaluated(rows) == [2, 4, 6] and best == (0.9, 2)


@pytest.mark.parametrize("split", [None, 2, 4, 6])
def test_of_tied_evaluations_the_earliest_step_is_the_best(tmp_path, split):
    """Guards ``>`` in the best step (``>=`` named, and kept, the latest of tied steps), in one run and across a
    resume at any step (the tie read back from metrics.jsonl against the one scored after)."""
    scores = {2: 0.5, 4: 0.7, 6: 0.7, 8: 0.6}
    if split:
        run(str(tmp_path), 0, split, 2, scores)
    _, best, _ = run(str(tmp_path), split or 0, 8, 2, scores)
    assert best == (0.7, 4)


@pytest.mark.parametrize("scores,written", [({4: 0.9, 8: 0.5, 10: 0.6}, [3, 4, 6, 9, 10]),
                                             ({4: 0.5, 8: 0.9, 10: 0.6}, [3, 4, 6, 8, 9, 10])])
def test_an_evaluated_step_that_is_the_best_so_far_is_saved_between_checkpoint_steps(tmp_path, scores, written):
    """Guards ``best_now`` in the loop's save (without it --eval_every 250 beside the default checkpoint interval,
    150, ended with "no checkpoint of step 250 was saved"): --checkpoint_steps 3 --eval_every 4 saves steps 3, 6, 9
    and the last, and each evaluated step that is the best so far; a worse one (step 8, then 10) is not saved."""
    d = str(tmp_path)
    run(d, 0, 10, 4, scores, save=d, checkpoint_steps=3, to_keep=0)
    assert ckpt.saved_steps(d) == written


def test_the_best_step_s_checkpoint_is_kept_whatever_to_keep_says_and_named(tmp_path):
    d, logs = str(tmp_path), []
    _, best, _ = run(d, 0, 10, 4, {4: 0.9, 8: 0.5, 10: 0.6}, save=d, checkpoint_steps=3, to_keep=1, logs=logs)
    assert best == (0.9, 4) and ckpt.saved_steps(d) == [4, 10]
    assert any(line.endswith(f"at step 4 ({d}/4)") for line in logs), logs


@pytest.mark.parametrize("stop", [3, 4, 5])
def test_a_resumed_run_keeps_the_best_step_when_it_saves_more_often_than_it_evaluates(tmp_path, stop):
    """Guards the Saver's ``keep`` set from the run's metrics.jsonl at the start of a resume (without it, a run
    resumed at step 3 with --checkpoint_steps 1 --eval_every 3 --to_keep 1 deleted its best step, 3, at step 5's
    save, before its first evaluation)."""
    d, scores = str(tmp_path), {**{s: 0.1 for s in range(1, 10)}, 3: 0.9, 6: 0.5}
    run(d, 0, stop, 3, scores, save=d, checkpoint_steps=1, to_keep=1)
    _, best, _ = run(d, stop, 9, 3, scores, save=d, checkpoint_steps=1, to_keep=1)
    assert best == (0.9, 3) and ckpt.saved_steps(d) == [3, 9]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(total=st.integers(1, 12), every=st.integers(0, 5), data=st.data())
def test_a_run_stopped_and_resumed_anywhere_keeps_its_bookkeeping(total, every, data):
    """A run of ``stop`` steps, then resumed to ``total`` (any stop, skipped steps anywhere, scores with ties): its
    metrics.jsonl has every step once, the evaluations at the multiples of --eval_every and at each run's last step,
    the learning rate of every applied step is the schedule's at the count of applied steps before it, the
    best step named is the highest score's, the earliest of ties, and its checkpoint is there at the end beside the
    last step's and the newest --to_keep (whatever --checkpoint_steps and --to_keep say)."""
    stop = data.draw(st.integers(1, total), "stop")
    overflow = data.draw(st.sets(st.integers(0, total - 1)), "overflow")
    scores = {s: data.draw(st.sampled_from([0.25, 0.5, 0.75]), f"score{s}") for s in range(1, total + 1)}
    saving = dict(checkpoint_steps=data.draw(st.sampled_from([None, 0, 1, 2, 3, 5]), "checkpoint_steps"),
                  to_keep=data.draw(st.integers(0, 3), "to_keep"))
    with tempfile.TemporaryDirectory() as d:
        rows, best, scaler = run(d, 0, stop, every, scores, overflow, save=d, **saving)
        if stop < total:
            again = LossScale(dynamic=True, max_skipped=1000)
            again.restore(json.loads(json.dumps(scaler.state())))  # as a checkpoint's metadata carries it
            rows, best, _ = run(d, stop, total, every, scores, overflow, again, save=d, **saving)
        saved = ckpt.saved_steps(d)
    assert [r["step"] for r in rows] == list(range(1, total + 1))
    want = [s for s in range(1, total + 1) if every and (s % every == 0 or s in (stop, total))]
    assert evaluated(rows) == want
    skipped = 0
    for r in rows:
        skipped += (r["step"] - 1) in overflow
        if r["grad_norm"] is not None:
            assert r["learning_rate"] == lr_at(r["step"] - 1 - skipped), (r, overflow)
    if want:
        top = max(scores[s] for s in want)
        assert best == (top, min(s for s in want if scores[s] == top))
        assert best[1] in saved, (best, saved)
    assert total in saved and (not saving["to_keep"] or len(saved) <= saving["to_keep"] + 1), saved


# --------------------------------------------------------------------------- resume and mixture scores


@pytest.mark.parametrize("steps,resumes", [(4, False), (5, False), (6, True), (50, True)])
def test_a_resume_with_nothing_to_train_is_refused(monkeypatch, steps, resumes):
    """Guards ``step >= steps`` (with ``>`` resuming a finished run of 5 steps with --steps 5 trained on)."""
    from app import resume

    monkeypatch.setattr(resume.ckpt, "resolve", lambda path: [("/runs/a", 5)])
    monkeypatch.setattr(resume.ckpt, "read_meta", lambda directory, step: {"config": {}})
    cfg = load_config("finetuning", "tiny", {"load": "/runs/a", "steps": steps})
    if resumes:
        assert resume_point(cfg) == ("/runs/a", 5)
    else:
        with pytest.raises(FlanT5Error, match=f"/runs/a is at step 5 and --steps is {steps}: nothing to train; pass "
                                              "--steps greater than 5"):
            resume_point(cfg)


def _sets(*metrics):
    return [SimpleNamespace(task=SimpleNamespace(name=f"t{i}", metrics=(m,))) for i, m in enumerate(metrics)]


def test_a_mixture_s_score_puts_every_task_in_0_to_1():
    """Guards chrF (and BLEU) divided by 100 in a mixture's one number (undivided, a chrF task's 0-100 picked the
    best step alone)."""
    scores = {"eval_t0_chrf": 60.0, "eval_t1_accuracy": 0.5, "eval_t2_bleu": 40.0, "eval_t3_rougeL": 0.3,
              "eval_t4_exact_match": 0.1}
    got = mixture_score(_sets("chrf", "accuracy", "bleu", "rouge", "exact_match"), scores)
    assert got == pytest.approx((0.6 + 0.5 + 0.4 + 0.3 + 0.1) / 5)
    # a step better on the 0-1 task and worse on chrF by as much, in points of each: the mean names neither
    a = mixture_score(_sets("chrf", "accuracy"), {"eval_t0_chrf": 50.0, "eval_t1_accuracy": 0.9})
    b = mixture_score(_sets("chrf", "accuracy"), {"eval_t0_chrf": 90.0, "eval_t1_accuracy": 0.5})
    assert a == pytest.approx(b) == pytest.approx(0.7)
