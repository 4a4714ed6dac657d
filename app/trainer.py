"""The training loop, below run_finetuning.py: steps on the executor, progress, metrics (metrics.jsonl, W&B, the loss
plot), periodic checkpoints, --eval_every, loss scaling, the non-finite stop and the signals that stop a run after
the step it is in (saving it)."""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
import time

from tqdm import tqdm

from app.entry import exit_on_signal
from app.evaluate import Evaluator, best_logged
from app.resume import Saver, checkpoint_every
from app.runtime import any_process, is_main_process
from app.tracking import Tracker
from config.presets import to_dict
from utils import checkpoint as ckpt
from utils.errors import TrainingDiverged

logger = logging.getLogger("flan_t5")


class StopSignals:
    """SIGINT and SIGTERM (what cluster schedulers send) during training: the current step finishes, then
    the loop saves and stops. A second signal stops at once."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            exit_on_signal(signum)  # a checkpoint being written stays incomplete: it is never loaded
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving and stopping "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


def diverged(step: int, loss: float, grad_norm: float, lr: float, cfg, last_saved, scaler=None) -> TrainingDiverged:
    causes = [f"a learning rate too high for this model (--learning_rate {lr:g})"]
    if cfg.model.precision == "float16":
        causes.append("float16 overflow in the forward pass (--precision bfloat16, or --scale_ff 8)")
    causes.append("a corrupt batch of data")
    kept = f"the last good checkpoint, {last_saved}, is kept" if last_saved else "no checkpoint was written"
    what = f"loss {loss} and gradient norm {grad_norm}"
    if scaler is not None and scaler.dynamic and scaler.skipped_in_a_row:
        what = (f"{scaler.skipped_in_a_row} steps in a row overflowed (--max_skipped_steps {scaler.max_skipped}), the "
                f"loss scale lowered to {scaler.scale:g}; the last: {what}")
    return TrainingDiverged(f"step {step}: {what}: training diverged; likely causes: "
                            f"{'; '.join(causes)}. Nothing of this step was saved ({kept})")


class Progress:
    """A progress bar on a terminal; in a cluster log (no terminal) a line every ``log_every`` steps and at least
    once a minute, with the ETA. Process 0 of a multi-process run alone shows it."""

    def __init__(self, start_step: int, total: int, primary: bool, log_every: int | None):
        self.terminal, self.primary, self.total, self.start = sys.stderr.isatty(), primary, total, start_step
        self.every = log_every or max(total // 20, 1)
        self.bar = tqdm(range(start_step, total), initial=start_step, total=total, desc="fine-tuning", unit="step",
                        disable=not (primary and self.terminal))
        self.t_start = self.t_logged = time.perf_counter()

    def __iter__(self):
        return iter(self.bar)

    def close(self, done: int) -> None:
        """The bar at ``done`` steps, closed: what is printed next starts on a line of its own."""
        self.bar.n = done
        self.bar.refresh()
        self.bar.close()

    def update(self, done: int, loss: float, lr: float, rows_s: float, examples_s: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", examples_s=f"{examples_s:.1f}")
        now = time.perf_counter()
        if self.primary and not self.terminal and (done % self.every == 0 or now - self.t_logged > 60
                                                   or done == self.total):
            eta = (now - self.t_start) / (done - self.start) * (self.total - done)
            logger.info("step %d/%d loss %.4f lr %.2e %.1f samples/s %.1f examples/s ETA %s", done, self.total, loss,
                        lr, rows_s, examples_s, _duration(eta))
            self.t_logged = now


def train_step(cfg, executor, loader, state, step: int, start_step: int, loss_scale: float = 1.0,
               clip_norm: float | None = None) -> tuple:
    """One step of the run at ``loss_scale`` (clipped with ``clip_norm`` under update_in_backward) -> (state,
    metrics, batch statistics)."""
    host_batch = loader.next_batch()
    stats = loader.stats(host_batch)  # (a mixture's: each task's examples in the batch too)
    if step == start_step:
        rows = cfg.training.global_batch_size
        logger.info("%d examples in the first batch of %d rows: %.1f per row, %.1f%% of the token slots used",
                    stats["examples"], rows, stats["examples"] / rows, 100 * stats["packing_efficiency"])
    # the step's key: the executor's, of its state's step (graphs/state.step_key, the one place it is derived)
    state, metrics = executor.train_step(state, executor.g.shard_batch(host_batch), None, loss_scale, clip_norm)
    return state, {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}, stats


def stop_after_signal(signum: int, done: int, cfg, saver: Saver, tracker, progress) -> None:
    """Exits 128 + the signal's number with one line (below the progress bar, which shows the step the line names),
    once the finished step is saved (with --save: the caller saved it)."""
    saver.wait()
    tracker.close()
    progress.close(done)
    save = cfg.checkpoint.save
    where = f"saved {save}/{done}; resume (and go on saving) with --load {save} --save {save}" if saver.mgr else \
        "nothing saved (no --save)"
    print(f"{signal.Signals(signum).name}: stopped after step {done}: {where}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


class Trainer:
    """A run's steps from ``start_step`` to ``cfg.training.steps`` (see the module docstring). ``scaler``:
    graphs/loss_scale.py's LossScale, restored with the state."""

    def __init__(self, cfg, executor, loader, start_step: int, scaler, run_dir: str, tracking: dict):
        primary = is_main_process()  # process 0 of a multi-process run writes the metrics and shows progress
        self.cfg, self.executor, self.loader, self.start, self.scaler = cfg, executor, loader, start_step, scaler
        # (the evaluator first: a run it refuses has written nothing)
        self.evaluator = Evaluator(cfg, executor, loader.tokenizer, None) if cfg.training.eval_every else None
        self.tracker = Tracker(run_dir, to_dict(cfg), tracking.get("wandb", False), tracking.get("wandb_name"),
                               resume_step=start_step, enabled=primary, name=tracking.get("name", "run"))
        if self.evaluator:
            self.evaluator.best = best_logged(getattr(self.tracker, "path", None), self.evaluator.key)
        self.saver = Saver(cfg, executor, loader, start_step, scaler)
        if self.evaluator and self.evaluator.best:  # a resumed run's best step so far is kept too
            self.saver.keep = {self.evaluator.best[1]}
        self.progress = Progress(start_step, cfg.training.steps, primary, tracking.get("log_every"))

    def run(self, state) -> None:
        """The loop (see the module docstring), then ``finish``."""
        cfg, saver = self.cfg, self.saver
        total, every, t_last = cfg.training.steps, checkpoint_every(cfg), time.perf_counter()
        try:
            with StopSignals() as stop:
                for step in self.progress:
                    state, record = self.step(state, step, time.perf_counter() - t_last)
                    t_last, done = time.perf_counter(), step + 1
                    best_now = False
                    if self.evaluator and (done % cfg.training.eval_every == 0 or done == total):
                        record.update(self.evaluator(state, done))
                        best_now = self.evaluator.best[1] == done
                        saver.keep = {self.evaluator.best[1]}  # --to_keep never deletes the best step's checkpoint
                        t_last = time.perf_counter()  # the evaluation's time is not the next step's
                    self.tracker.log(done, record)
                    self.progress.update(done, record.get("loss", math.nan), record["learning_rate"],
                                         record["samples_per_s"], record["examples_per_s"])
                    signum = any_process(stop.signum or 0)  # every process stops after the same step
                    if signum:
                        if saver.mgr:
                            saver.save(done, state)
                        stop_after_signal(signum, done, cfg, saver, self.tracker, self.progress)
                    # every --checkpoint_steps, and an evaluated step that is the best so far (the checkpoint the
                    # run names at its end; the last step is saved by ``finish``)
                    if saver.mgr and done < total and (best_now or (every and done % every == 0)):
                        saver.save(done, state)
        except TrainingDiverged:
            saver.wait()  # earlier checkpoints stay complete
            self.tracker.close()
            raise
        self.finish(state)

    def step(self, state, step: int, seconds_before: float) -> tuple:
        """One step at the scaler's loss scale -> (state, its metrics line); a non-finite step stops the run."""
        cfg, scaler = self.cfg, self.scaler
        used = scaler.scale
        clip = scaler.last_norm if cfg.execution.update_in_backward else None  # the previous step's norm
        t0 = time.perf_counter()
        state, m, stats = train_step(cfg, self.executor, self.loader, state, step, self.start, used, clip)
        applied = scaler.update(m["grad_norm"])  # a step that overflowed left the weights as they were
        # the schedule counts applied updates (the optimizer's count does not move on a skipped step)
        lr = self.executor.g.learning_rate(step - scaler.skipped_total)
        if scaler.gave_up or (applied and not math.isfinite(m["loss"])):
            raise diverged(step + 1, m["loss"], m["grad_norm"], lr, cfg, self.saver.last, scaler)
        if not applied:
            logger.warning("step %d: the gradients overflowed at loss scale %g: the step is skipped (weights "
                           "and optimizer state unchanged) and the scale lowered to %g", step + 1, used, scaler.scale)
        record = step_record(cfg, m, stats, lr, applied, used, scaler, time.perf_counter() - t0 + seconds_before)
        if step == self.start:
            record.update(getattr(self.loader, "report", {}))
        return state, record

    def finish(self, state) -> None:
        """The end of a run: its last checkpoint, the best --eval_every step named, the plot."""
        cfg, saver, evaluator, total = self.cfg, self.saver, self.evaluator, self.cfg.training.steps
        if saver.mgr:
            if self.start < total or not ckpt.saved_steps(cfg.checkpoint.save):
                saver.save(total, state)
            saver.wait()
            logger.info("saved %s/%d", cfg.checkpoint.save, total)
        if evaluator and evaluator.best:
            logger.info("the best %s %s: %.4f at step %d%s", evaluator.what, evaluator.key, *evaluator.best,
                        best_checkpoint(cfg, evaluator.best[1]) if saver.mgr else "")
        self.tracker.close()
        logger.info("metrics and loss curve in %s", self.tracker.run_dir)


def best_checkpoint(cfg, step: int) -> str:
    """Where the best step's checkpoint is (the loop saves an evaluated step that is the best so far, and the Saver
    keeps it whatever --to_keep says), or that it is not there (removed by hand since)."""
    if step in ckpt.saved_steps(cfg.checkpoint.save):
        return f" ({cfg.checkpoint.save}/{step})"
    return f" (no checkpoint of step {step} is in {cfg.checkpoint.save})"


def step_record(cfg, m: dict, stats: dict, lr: float, applied: bool, scale: float, scaler, seconds: float) -> dict:
    """A step's line of metrics.jsonl (and W&B)."""
    rows = cfg.training.global_batch_size
    scaling = {"loss_scale": scale, "skipped_steps": scaler.skipped_total} if scaler.dynamic else {}
    loss = {"loss": m["loss"]} if math.isfinite(m["loss"]) else {}  # metrics.jsonl stays plain JSON
    return {**loss, "learning_rate": lr, "grad_norm": m["grad_norm"] if applied else None,
            "samples_per_s": rows / seconds, "examples": stats["examples"], "examples_per_s": stats["examples"] / seconds,
            "packing_efficiency": stats["packing_efficiency"], **stats.get("by_task", {}), **scaling}


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def run_name(preset: str, run_dir: str) -> str:
    """A run's name in W&B: its preset and its run directory's name."""
    return f"{preset} ({os.path.basename(os.path.abspath(run_dir))})"
