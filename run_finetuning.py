"""MNLI fine-tuning of Flan-T5 or GPT-J with TP x DP.

    python3 run_finetuning.py --config tiny --save ckpt/tiny          # offline, CPU
    python3 run_finetuning.py --config gptj_tiny --save ckpt/gptj      # GPT-J, offline, CPU
    python3 run_finetuning.py --config xxl_pod16 --save ckpt/xxl --wandb
    python3 run_finetuning.py --config tiny --save ckpt/tiny --load ckpt/tiny --steps 1200   # resume
    python3 run_finetuning.py --config xxl_pod16 --data_parallel 1 --tensor_parallel 1 --phased true --plan

Ctrl-C or SIGTERM finish the current step, save it (with --save) and exit 130 / 143; a
non-finite loss or gradient norm stops the run (exit 3) and keeps the last good checkpoint.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import time

from utils.cli import (ensure_host_devices, ensure_pinned_host_memory, ensure_writable, entry, parse_config,
                       setup_jax, setup_logging)
from utils.errors import FlanT5Error, TrainingDiverged

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases (WANDB_MODE=offline works without a login)")
    p.add_argument("--wandb-name", dest="wandb_name", default=None, help="W&B run name")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan of the run (device and host bytes at their peaks, from shapes; "
                        "nothing allocated) and exit")
    p.add_argument("--run_dir", default=None,
                   help="where metrics.jsonl and loss_curve.png go: the --save directory if given, else runs/PRESET")
    p.add_argument("--log_every", type=int, default=None, metavar="N",
                   help="when the output is not a terminal (a cluster job's log), a progress line every N steps "
                        "(default: a twentieth of the run, and at least once a minute)")


def build_executor(cfg):
    """Graphs and the executor (fused, or phased when execution.phased)."""
    from graphs.executor import make_executor
    from graphs.graphs import Graphs

    executor = make_executor(Graphs(cfg))
    if executor.name == "phased":
        logger.info("phased execution: weights, optimizer state and activations in host memory")
    return executor


def build(cfg, executor=None):
    """The executor, checked to fit this machine (graphs/plan.py), and the training data loader."""
    from data.mnli import TrainLoader, check_unknown_tokens, load_rows, load_tokenizer, tokenize_examples
    from graphs.plan import check_fits

    executor = executor or build_executor(cfg)
    plan = check_fits(executor, cfg)
    logger.info("memory plan: %.2f GiB per device, %.2f GiB of host memory (before program temporaries; "
                "--plan counts them)", plan.device_peak / 2**30, plan.host_peak / 2**30)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if len(tokenizer) > cfg.model.embedding.vocab_size:
        raise FlanT5Error(f"tokenizer has {len(tokenizer)} tokens but vocab_size={cfg.model.embedding.vocab_size}: "
                          "raise --vocab_size or use the tokenizer of this model")
    rows = load_rows(cfg.data.dataset, "train", seed=cfg.model.seed)
    causal = cfg.model.family == "gptj"
    examples = tokenize_examples(rows, tokenizer, causal=causal)
    check_unknown_tokens(examples, tokenizer, cfg.data.tokenizer, cfg.data.dataset)
    if causal:
        how = f"{cfg.data.causal_packing}-packed" if cfg.data.packing else "padded"
        logger.info("training on %d samples of %s (causal LM, %s rows of %d tokens, loss on %s tokens)", len(rows),
                    cfg.data.dataset, how, cfg.model.sequence_length, cfg.data.loss_tokens)
    else:
        logger.info("training on %d samples of %s (%s rows of %d/%d tokens)", len(rows), cfg.data.dataset,
                    "packed" if cfg.data.packing else "padded", cfg.model.sequence_length, cfg.decoder_row_length)
    loader = TrainLoader(examples, cfg.training.global_batch_size, cfg.gradient_accumulation, cfg.model.seed,
                         sequence_length=cfg.model.sequence_length, target_length=cfg.model.decoder_sequence_length,
                         packing=cfg.data.packing, decoder_length=cfg.decoder_row_length, causal=causal,
                         causal_packing=cfg.data.causal_packing, loss_tokens=cfg.data.loss_tokens,
                         pad_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id)
    return executor, loader


def resume_point(cfg):
    """(directory, step) of the checkpoint --load names, checked against --steps; None without --load."""
    from utils import checkpoint as ckpt

    if not cfg.checkpoint.load:
        return None
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1]
    if step >= cfg.training.steps:
        raise FlanT5Error(f"{directory} is at step {step} and --steps is {cfg.training.steps}: nothing to train; "
                          f"pass --steps greater than {step} to continue, or evaluate it with run_validation.py")
    return directory, step


def initial_state(cfg, executor, loader, point):
    """Train state from --load (resume: ``point``, the checkpoint ``resume_point`` found), --hf_model
    (pretrained) or random init; returns (state, start step).

    Under phased execution the state lives in host memory, built without ever placing the
    whole model on a device.
    """
    from modelling.hf_mapping import load_hf_model

    if point:
        state, meta = executor.restore(*point, cfg.checkpoint.optim_state)
        loader.restore(meta)
        logger.info("resumed %s at step %d (data position %d)", point[0], meta["step"], loader.position)
        return state, meta["step"]
    if cfg.data.hf_model:
        _, host = load_hf_model(cfg.data.hf_model, cfg.execution.tensor_parallel, expect=cfg.model)
        logger.info("initialised from %s", cfg.data.hf_model)
        return executor.init_state(host), 0
    return executor.init_state(), 0


def check_save_dir(cfg) -> None:
    """Refuses to write into a directory holding another run's checkpoints."""
    from utils import checkpoint as ckpt

    save = cfg.checkpoint.save
    if not save or not ckpt.saved_steps(save):
        return
    loading = cfg.checkpoint.load and os.path.abspath(ckpt.resolve(cfg.checkpoint.load)[-1][0]) == os.path.abspath(save)
    if not loading:
        raise FlanT5Error(f"{save} already holds checkpoints (steps {ckpt.saved_steps(save)}): pass --load {save} to "
                          "resume, or choose a new --save directory")


def checkpoint_every(cfg) -> int:
    """Steps between checkpoints: --checkpoint_steps, else a tenth of the run when saving (0: at the end only)."""
    if cfg.checkpoint.steps is not None:
        return cfg.checkpoint.steps
    return max(cfg.training.steps // 10, 1) if cfg.checkpoint.save else 0


class StopSignals:
    """SIGINT and SIGTERM (what cluster schedulers send) during training: the current step finishes, then
    the loop saves and stops. A second signal stops at once."""

    def __init__(self):
        self.signum = None
        self._old = {}

    def __enter__(self):
        if _in_main_thread():
            for s in (signal.SIGINT, signal.SIGTERM):
                self._old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving and stopping "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def diverged(step: int, loss: float, grad_norm: float, lr: float, cfg, last_saved) -> TrainingDiverged:
    causes = [f"a learning rate too high for this model (--learning_rate {lr:g})"]
    if cfg.model.precision == "float16":
        causes.append("float16 overflow (--precision bfloat16, or --loss_scaling / --scale_ff)")
    causes.append("a corrupt batch of data")
    kept = f"the last good checkpoint, {last_saved}, is kept" if last_saved else "no checkpoint was written"
    return TrainingDiverged(f"step {step}: loss {loss} and gradient norm {grad_norm}: training diverged; likely causes: "
                            f"{'; '.join(causes)}. Nothing of this step was saved ({kept})")


class Saver:
    """Checkpoints of a run: the stacked layout whichever executor ran (either one resumes from them), the data
    position and the config; remembers the last one written (named when a run stops)."""

    def __init__(self, cfg, executor, loader, start_step: int):
        from utils import checkpoint as ckpt

        self.cfg, self.executor, self.loader = cfg, executor, loader
        self.mgr = ckpt.manager(cfg.checkpoint.save, cfg.checkpoint.to_keep) if cfg.checkpoint.save else None
        self.last = f"{cfg.checkpoint.load} step {start_step}" if start_step else None

    def save(self, step: int, state) -> None:
        from config.config import to_dict
        from utils import checkpoint as ckpt

        cfg = self.cfg
        meta = {"step": step, **self.loader.state(), "seed": cfg.model.seed, "config": to_dict(cfg)}
        stacked = self.executor.to_checkpoint(state)
        ckpt.save(self.mgr, step, stacked.params, stacked.opt_state if cfg.checkpoint.optim_state else None, meta)
        self.last = f"{cfg.checkpoint.save}/{step}"

    def wait(self) -> None:
        if self.mgr:
            self.mgr.wait_until_finished()


class Progress:
    """A progress bar on a terminal; in a cluster log (no terminal) a line every ``log_every`` steps and at least
    once a minute, with the ETA. Process 0 of a multi-process run alone shows it."""

    def __init__(self, start_step: int, total: int, primary: bool, log_every: int | None):
        from tqdm import tqdm

        self.terminal, self.primary, self.total, self.start = sys.stderr.isatty(), primary, total, start_step
        self.every = log_every or max(total // 20, 1)
        self.bar = tqdm(range(start_step, total), initial=start_step, total=total, desc="fine-tuning", unit="step",
                        disable=not (primary and self.terminal))
        self.t_start = self.t_logged = time.perf_counter()

    def __iter__(self):
        return iter(self.bar)

    def update(self, done: int, loss: float, lr: float, rows_s: float, examples_s: float) -> None:
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", examples_s=f"{examples_s:.1f}")
        now = time.perf_counter()
        if self.primary and not self.terminal and (done % self.every == 0 or now - self.t_logged > 60
                                                   or done == self.total):
            eta = (now - self.t_start) / (done - self.start) * (self.total - done)
            logger.info("step %d/%d loss %.4f lr %.2e %.1f samples/s %.1f examples/s ETA %s", done, self.total, loss,
                        lr, rows_s, examples_s, _duration(eta))
            self.t_logged = now


def train_step(cfg, executor, loader, state, step: int, start_step: int) -> tuple:
    """One step of the run -> (state, metrics, batch statistics); DivergedError past a non-finite loss."""
    import jax

    from data.packing import batch_stats

    host_batch = loader.next_batch()
    stats = batch_stats(host_batch)
    if step == start_step:
        rows = cfg.training.global_batch_size
        logger.info("%d examples in the first batch of %d rows: %.1f per row, %.1f%% of the token slots used",
                    stats["examples"], rows, stats["examples"] / rows, 100 * stats["packing_efficiency"])
    rng = jax.random.key_data(jax.random.fold_in(jax.random.key(cfg.model.seed), step))
    state, metrics = executor.train_step(state, executor.g.shard_batch(host_batch), rng)
    return state, {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}, stats


def stop_after_signal(signum: int, done: int, cfg, saver: Saver, state, tracker) -> None:
    """Saves the finished step (with --save) and exits 128 + the signal's number, with one line."""
    if saver.mgr:
        saver.save(done, state)
        saver.wait()
    tracker.close()
    where = f"saved {cfg.checkpoint.save}/{done}; resume with --load {cfg.checkpoint.save}" \
        if saver.mgr else "nothing saved (no --save)"
    print(f"{signal.Signals(signum).name}: stopped after step {done}: {where}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def train(cfg, args, executor, loader, state, start_step: int) -> None:
    """The training loop: steps, logging, periodic checkpoints, signals, and the non-finite stop."""
    from config.config import to_dict
    from utils import checkpoint as ckpt
    from utils.cli import is_main_process
    from utils.tracking import Tracker

    primary = is_main_process()  # process 0 of a multi-process run writes the metrics and shows progress
    run_dir = args.run_dir or cfg.checkpoint.save or os.path.join("runs", args.config)
    tracker = Tracker(run_dir, to_dict(cfg), args.wandb, args.wandb_name, resume_step=start_step, enabled=primary,
                      name=f"{args.config} ({os.path.basename(os.path.abspath(run_dir))})")
    saver = Saver(cfg, executor, loader, start_step)
    total, every, rows = cfg.training.steps, checkpoint_every(cfg), cfg.training.global_batch_size
    progress = Progress(start_step, total, primary, args.log_every)
    t_last = time.perf_counter()
    try:
        with StopSignals() as stop:
            for step in progress:
                state, m, stats = train_step(cfg, executor, loader, state, step, start_step)
                lr = executor.g.learning_rate(step)
                if not (math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"])):
                    raise diverged(step + 1, m["loss"], m["grad_norm"], lr, cfg, saver.last)
                now = time.perf_counter()
                dt, t_last = now - t_last, now
                done = step + 1
                tracker.log(done, {"loss": m["loss"], "learning_rate": lr, "grad_norm": m["grad_norm"],
                                   "samples_per_s": rows / dt, "examples": stats["examples"],
                                   "examples_per_s": stats["examples"] / dt,
                                   "packing_efficiency": stats["packing_efficiency"]})
                progress.update(done, m["loss"], lr, rows / dt, stats["examples"] / dt)
                if stop.signum is not None:
                    stop_after_signal(stop.signum, done, cfg, saver, state, tracker)
                if saver.mgr and every and done % every == 0 and done < total:
                    saver.save(done, state)
    except TrainingDiverged:
        saver.wait()  # earlier checkpoints stay complete
        tracker.close()
        raise
    if saver.mgr:
        if start_step < total or not ckpt.saved_steps(cfg.checkpoint.save):
            saver.save(total, state)
        saver.wait()
        logger.info("saved %s/%d", cfg.checkpoint.save, total)
    tracker.close()
    logger.info("metrics and loss curve in %s", run_dir)


def _duration(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


@entry
def main(argv=None) -> None:
    setup_logging()
    cfg, args = parse_config("finetuning", __doc__.splitlines()[0], "tiny", argv, extra_flags)
    if cfg.model.eval:
        raise FlanT5Error("eval=true builds no optimizer: drop --eval to fine-tune, or use run_validation.py")
    # fail before any work: paths that cannot be written, a W&B run that cannot start
    if cfg.checkpoint.save:
        ensure_writable(cfg.checkpoint.save, "--save")
    if args.run_dir:
        ensure_writable(args.run_dir, "--run_dir")
    if args.wandb:
        from utils.tracking import check_wandb

        check_wandb()
    ensure_host_devices(cfg.devices)
    ensure_pinned_host_memory(cfg.execution.phased)
    setup_jax()
    from graphs.plan import plan

    if args.plan:
        print(plan(build_executor(cfg), exact=True).format())
        return
    check_save_dir(cfg)
    executor = build_executor(cfg)
    point = resume_point(cfg)
    if point:  # a checkpoint of another model shape fails here, before the data is read
        from utils import checkpoint as ckpt

        ckpt.check_shapes(*point, executor.g.abstract_params(), ckpt.read_meta(*point).get("config"), cfg)
    executor, loader = build(cfg, executor)
    state, start = initial_state(cfg, executor, loader, point)
    train(cfg, args, executor, loader, state, start)


if __name__ == "__main__":
    main(sys.argv[1:])
