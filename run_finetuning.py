"""MNLI fine-tuning of Flan-T5 or GPT-J with TP x DP.

    python3 run_finetuning.py --config tiny --save ckpt/tiny          # offline, CPU
    python3 run_finetuning.py --config gptj_tiny --save ckpt/gptj      # GPT-J, offline, CPU
    python3 run_finetuning.py --config xxl_pod16 --save ckpt/xxl --wandb
    python3 run_finetuning.py --config tiny --save ckpt/tiny --load ckpt/tiny --steps 1200   # resume
    python3 run_finetuning.py --config xxl_pod16 --data_parallel 1 --tensor_parallel 1 --phased true --plan

Ctrl-C or SIGTERM finish the current step, save it (with --save) and exit 130 / 143; a
non-finite loss or gradient norm stops the run (exit 3) and keeps the last good checkpoint. Under dynamic
loss scaling (float16's default) a step whose gradients overflow is skipped and the scale halved; only
--max_skipped_steps such steps in a row stop the run.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below (seconds: JAX's) is one line too, not a traceback
    from app.entry import exit_on_signals

    exit_on_signals()

import copy
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time

from app.args import ensure_writable, parse_config
from app.entry import entry
from app.logs import setup_logging
from app.runtime import ensure_host_devices, ensure_pinned_host_memory, setup_jax
from utils.errors import FlanT5Error, TrainingDiverged

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--wandb", action="store_true", help="log to Weights & Biases (WANDB_MODE=offline works without a login)")
    p.add_argument("--wandb-name", dest="wandb_name", default=None, help="W&B run name")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan of the run (device and host bytes at their peaks, from shapes; "
                        "nothing allocated) and exit")
    p.add_argument("--run_dir", default=None,
                   help="where metrics.jsonl and loss_curve.png go: the --save directory if given, else a fresh "
                        "runs/PRESET-DATE-TIME")
    p.add_argument("--init_from", default=None, metavar="CKPT",
                   help="start a new run from a checkpoint's weights (step 0, fresh optimizer state and learning-rate "
                        "schedule, any dataset), unlike --load, which resumes a run where it stopped")
    p.add_argument("--discard_later_steps", action="store_true",
                   help="with --load DIR/STEP --save DIR: continue from STEP on a new branch, deleting DIR's later "
                        "steps (without it, such a rollback stops before any work)")
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


def build(cfg, executor=None, run_dir: str | None = None):
    """The executor, checked to fit this machine (graphs/plan.py), and the training data loader of the task's
    examples (the training split, less the rows held out: --holdout). The data is read and checked before anything
    is compiled. With ``--tokenizer train`` the tokenizer is learnt from the training examples and saved to
    RUN_DIR/tokenizer, which the config (and so every checkpoint) then names."""
    from data import sources
    from data.tasks import Task, holdout
    from graphs.plan import check_fits, human_bytes

    task = Task.of_config(cfg)
    rows = sources.read(cfg.data.dataset, cfg.data.train_split, cfg.model.seed, cfg.data.hub_config)
    examples, held = holdout(task.examples(rows), cfg.data.holdout, cfg.model.seed)
    if held:
        logger.info("%d rows of %s held out of training (--holdout): --eval_every and validation score them",
                    len(held), rows.where)
    executor = executor or build_executor(cfg)
    plan = check_fits(executor, cfg)
    logger.info("memory plan: %s per device, %s of host memory (before program temporaries; --plan counts them)",
                human_bytes(plan.device_peak), human_bytes(plan.host_peak))
    family = executor.g.family
    tokenizer = training_tokenizer(cfg, task, examples, family, run_dir)
    return executor, training_loader(cfg, task, examples, tokenizer, family, rows.where)


def training_tokenizer(cfg, task, examples: list, family, run_dir):
    """The run's tokenizer: the config's, or with --tokenizer train one learnt from the training examples (process 0
    learns and saves it; the others load what it saved), which the config then names."""
    from app.runtime import agree
    from data.tasks import TRAINED, load_tokenizer, train_tokenizer

    if cfg.data.tokenizer == TRAINED:
        out = os.path.abspath(os.path.join(run_dir or cfg.checkpoint.save or "runs", "tokenizer"))

        def learn() -> str:
            t0 = time.perf_counter()
            tok = train_tokenizer(examples, cfg.model.embedding.vocab_size, out, family, task.labels)
            logger.info("trained a %d-token tokenizer on %d examples of %s in %.1f s -> %s", len(tok), len(examples),
                        cfg.data.dataset, time.perf_counter() - t0, out)
            return out

        cfg.data.tokenizer = agree("tokenizer", learn)  # what checkpoints record: validation loads it from there
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if len(tokenizer) > cfg.model.embedding.vocab_size:
        raise FlanT5Error(f"tokenizer has {len(tokenizer)} tokens but vocab_size={cfg.model.embedding.vocab_size}: "
                          "raise --vocab_size or use the tokenizer of this model")
    return tokenizer


def training_loader(cfg, task, examples: list, tokenizer, family, where: str):
    """The resumable loader of the tokenised examples, its length and unknown-token report attached."""
    from data.loader import TrainLoader
    from data.tasks import check_unknown_tokens, pad_id, tokenize_examples

    tokens = tokenize_examples(examples, tokenizer, family)
    unknown = check_unknown_tokens(tokens, tokenizer, cfg.data.tokenizer, cfg.data.dataset)
    data_report = report_lengths(cfg, task, tokens, tokenizer, family, unknown)
    rows = f"{'packed' if cfg.data.packing else 'padded'} rows of "
    if family.causal:
        how = f"{cfg.data.causal_packing}-packed" if cfg.data.packing else "padded"
        rows = f"a causal LM, {how} rows of {cfg.model.sequence_length} tokens, loss on {cfg.data.loss_tokens} tokens"
    else:
        rows += f"{cfg.model.sequence_length}/{cfg.decoder_row_length} tokens"
    logger.info("training %s on %d examples of %s (%s)", task.name, len(examples), where, rows)
    loader = TrainLoader(tokens, cfg.training.global_batch_size, cfg.gradient_accumulation, cfg.model.seed,
                         sequence_length=cfg.model.sequence_length, target_length=cfg.model.decoder_sequence_length,
                         packing=cfg.data.packing, decoder_length=cfg.decoder_row_length, causal=family.causal,
                         causal_packing=cfg.data.causal_packing, loss_tokens=cfg.data.loss_tokens,
                         pad_id=pad_id(tokenizer))
    loader.report = data_report  # written with the run's first metrics line
    loader.tokenizer = tokenizer  # what --eval_every decodes with
    return loader


# what decides the order and the contents of the training data: a resumed run must keep them to continue its stream
DATA_ORDER = (("dataset", ("data", "dataset")), ("hub_config", ("data", "hub_config")),
              ("train_split", ("data", "train_split")), ("holdout", ("data", "holdout")),
              ("global_batch_size", ("training", "global_batch_size")), ("packing", ("data", "packing")),
              ("causal_packing", ("data", "causal_packing")), ("sequence_length", ("model", "sequence_length")),
              ("seed", ("model", "seed")), ("input_template", ("task", "input_template")),
              ("input_column", ("task", "input_column")), ("target_column", ("task", "target_column")),
              ("labels", ("task", "labels")))


class _Blank(dict):
    def __missing__(self, key):
        return "x"


def report_lengths(cfg, task, examples, tokenizer, family, unknown: float) -> dict:
    """A sequence_length that cannot hold the prompt template is an error; examples (and targets) that do not fit
    are counted and said (a warning when more than 1% are cut), never cut silently."""
    from data.sources import DataError

    L, causal = cfg.model.sequence_length, family.causal
    blank = "" if task.input_column else task.template.format_map(_Blank())
    template = len(family.encode_inputs(tokenizer, [family.prompt(blank)])[0]) + (4 if causal else 0)
    if L < template:
        raise DataError(f"sequence_length={L} cannot hold the prompt template ({template} tokens before any of "
                        f"{', '.join(task.fields)}{' and the target' if causal else ''}): pass --sequence_length "
                        f"{max(64, 2 * template)} or more")
    sizes = [len(x) + (len(t) if causal else 0) for x, t in zip(examples.inputs, examples.targets)]
    target_limit = L if causal else cfg.model.decoder_sequence_length
    cut, cut_targets = sum(n > L for n in sizes), sum(len(t) > target_limit for t in examples.targets)
    share = cut / max(len(sizes), 1)
    log = logger.warning if share > 0.01 or cut_targets > 0.01 * len(sizes) else logger.info
    log("%d of %d training examples (%.1f%%) are longer than sequence_length %d (the longest: %d tokens) and are cut"
        "%s; %d targets are longer than %s %d and are cut (the longest: %d tokens); %.2f%% of the prompt tokens are "
        "unknown to the tokenizer", cut, len(sizes), 100 * share, L, max(sizes),
        " (their start: the target is kept)" if causal else " (their end)", cut_targets,
        "sequence_length" if causal else "decoder_sequence_length", target_limit,
        max(len(t) for t in examples.targets), 100 * unknown)
    return {"truncated_examples": cut, "truncated_share": share, "truncated_targets": cut_targets,
            "unknown_token_share": unknown}


def resume_point(cfg):
    """(directory, step) of the checkpoint --load names, checked against --steps and against the data order it
    was trained with; None without --load."""
    from utils import checkpoint as ckpt

    if not cfg.checkpoint.load:
        return None
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1]
    if step >= cfg.training.steps:
        raise FlanT5Error(f"{directory} is at step {step} and --steps is {cfg.training.steps}: nothing to train; "
                          f"pass --steps greater than {step} to continue, or evaluate it with run_validation.py")
    saved = ckpt.read_meta(directory, step).get("config") or {}
    for flag, (section, key) in DATA_ORDER:
        if key not in saved.get(section, {}):  # a checkpoint older than the field: nothing to compare
            continue
        theirs, ours = saved[section][key], getattr(getattr(cfg, section), key)
        ours = list(ours) if isinstance(ours, tuple) else ours  # a saved tuple is a list
        if theirs != ours:  # (None against a value too: --hub_config where there was none is other data)
            ours, theirs = _flag_value(ours), _flag_value(theirs)
            raise FlanT5Error(f"resuming {directory}/{step} with --{flag} {ours}, but it was trained with --{flag} "
                              f"{theirs}: its data order cannot continue; resume with --{flag} {theirs}, or start a "
                              f"new run from its weights with --init_from {directory}/{step} (step 0, fresh optimizer "
                              "state and schedule)")
    return directory, step


def _flag_value(value) -> str:
    """A config value as it is written on the command line (true / false for a bool, words for a list)."""
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def init_point(cfg, args):
    """(directory, step) of --init_from: a new run (step 0, new data, fresh optimizer state and schedule) starting
    from a checkpoint's weights; None without it."""
    from utils import checkpoint as ckpt

    if not args.init_from:
        return None
    if cfg.checkpoint.load:
        raise FlanT5Error("--load resumes a run and --init_from starts a new one from a checkpoint's weights: pass "
                          "one of them")
    return ckpt.resolve(args.init_from)[-1]


def initial_state(cfg, executor, loader, point, warm=None, scaler=None):
    """Train state from --load (resume: ``point``, the checkpoint ``resume_point`` found), --init_from (``warm``:
    a checkpoint's weights, step 0), --hf_model (pretrained) or random init; returns (state, start step). A resumed
    run's data position and loss scale (``scaler``, graphs/loss_scale.py) continue where they stopped.

    Under phased execution the state lives in host memory, built without ever placing the
    whole model on a device.
    """
    from modelling.hf_mapping import load_hf_model

    if executor.g.lora:
        return lora_state(cfg, executor, loader, point, warm, scaler)
    if point:
        state, meta = executor.restore(*point, cfg.checkpoint.optim_state)
        loader.restore(meta)
        if scaler is not None:
            scaler.restore(meta.get("loss_scale"))
        logger.info("resumed %s at step %d (data position %d)", point[0], meta["step"], loader.position)
        return state, meta["step"]
    if warm:
        state = executor.warm_start(*warm)
        logger.info("a new run from the weights of %s/%d (step 0, fresh optimizer state and schedule)", *warm)
        return state, 0
    if cfg.data.hf_model:
        _, host = load_hf_model(cfg.data.hf_model, cfg.execution.tensor_parallel, expect=cfg.model)
        logger.info("initialised from %s", cfg.data.hf_model)
        return executor.init_state(host), 0
    return executor.init_state(), 0


def lora_state(cfg, executor, loader, point, warm=None, scaler=None):
    """initial_state of a LoRA run: the frozen base (the checkpoint's weights of --init_from, --hf_model's or the
    seed's random init), then new adapters, or a checkpoint's adapters when resuming, refused (one line) when they
    were trained on another base."""
    from graphs.state import describe_base

    if point:
        meta = ckpt_meta(*point)
        source = meta.get("lora_base", {}).get("source") or base_source(cfg, warm)
    else:
        source = base_source(cfg, warm)
    executor.use_base(source)
    logger.info("LoRA: rank %d adapters on %s (frozen, %s)", cfg.lora.rank, describe_base(source),
                cfg.model.precision)
    if not point:
        return executor.init_state(), 0  # new adapters on the base just set
    saved = meta.get("lora_base", {}).get("fingerprint")
    if saved != executor.base["fingerprint"]:
        raise FlanT5Error(f"{point[0]} step {point[1]} holds adapters trained on other base weights than "
                          f"{describe_base(source)} (fingerprint {saved} != {executor.base['fingerprint']}): resume "
                          "with the base they were trained on")
    state, meta = executor.restore(*point, cfg.checkpoint.optim_state)
    loader.restore(meta)
    if scaler is not None:
        scaler.restore(meta.get("loss_scale"))
    logger.info("resumed %s at step %d (data position %d)", point[0], meta["step"], loader.position)
    return state, meta["step"]


def base_source(cfg, init_from=None) -> dict:
    """LoRA: where a run's frozen base weights come from, as its checkpoints record it (``load_base`` reads it back):
    a checkpoint's weights (--init_from), an HF model (--hf_model), or the family's random init of the seed."""
    if init_from:
        return {"init_from": [str(init_from[0]), int(init_from[1])]}
    if cfg.data.hf_model:
        return {"hf_model": cfg.data.hf_model}
    return {"random_init_seed": cfg.model.seed}


def ckpt_meta(directory: str, step: int) -> dict:
    from utils import checkpoint as ckpt

    return ckpt.load_meta(directory, step)


def check_save_dir(cfg, point, discard_later: bool = False) -> list:
    """Decides, before any work and reading only, what a run may do to its --save directory: never write into
    another run's checkpoints, never over a folder that is not ours, and roll back (``--load DIR/STEP --save DIR``
    with later steps in DIR) only when asked to discard the later steps. ``point``: (directory, step) of --load,
    or None. -> the later steps to discard (``discard_steps``)."""
    from utils import checkpoint as ckpt

    save = cfg.checkpoint.save
    if not save:
        return []
    foreign = ckpt.foreign_steps(save)
    start, total, every = (point[1] if point else 0), cfg.training.steps, checkpoint_every(cfg)
    will = {s for s in range(start + 1, total + 1) if every and s % every == 0} | {total}
    clash = sorted(set(foreign) & will)
    if clash:
        raise FlanT5Error(f"{save} holds folder(s) {', '.join(map(str, clash))} that are not this project's "
                          "checkpoints, and this run would save steps of those numbers: choose another --save "
                          "directory (nothing was touched)")
    if foreign:
        logger.info("%s holds folder(s) %s that are not checkpoints of this project: they are left alone", save,
                    ", ".join(map(str, foreign)))
    ours = sorted(set(ckpt.saved_steps(save)) | set(ckpt.incomplete_steps(save)))
    if not ours:
        return []
    if not (point and os.path.abspath(point[0]) == os.path.abspath(save)):
        raise FlanT5Error(f"{save} already holds checkpoints (steps {ckpt.saved_steps(save)}): pass --load {save} to "
                          "resume, or choose a new --save directory")
    later = [s for s in ours if s > point[1]]
    if later and not discard_later:
        raise FlanT5Error(f"--load {save}/{point[1]} is older than {save}'s step(s) {', '.join(map(str, later))}, "
                          f"which this run would write over: pass --discard_later_steps to continue from step "
                          f"{point[1]} on a new branch (deleting step(s) {', '.join(map(str, later))} of {save}), or "
                          "--save NEW_DIR to keep them")
    return later


def discard_steps(save: str, later: list, point) -> None:
    """--discard_later_steps: deletes the steps ``check_save_dir`` found after the loaded one (under the run's lock;
    process 0 of a multi-process run alone, the others wait for it)."""
    from app.runtime import barrier, is_main_process

    for s_ in later if is_main_process() else ():
        shutil.rmtree(os.path.join(save, str(s_)))
    barrier("discarded later steps")
    if later:
        logger.info("--discard_later_steps: deleted step(s) %s of %s; continuing from step %d", ", ".join(map(str, later)),
                    save, point[1])


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
            from app.entry import exit_on_signal

            exit_on_signal(signum)  # a checkpoint being written stays incomplete: it is never loaded
        self.signum = signum
        print(f"\n{signal.Signals(signum).name}: finishing this step, then saving and stopping "
              "(send it again to stop at once)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)


def _in_main_thread() -> bool:

    return threading.current_thread() is threading.main_thread()


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


class Saver:
    """Checkpoints of a run: the stacked layout whichever executor ran (either one resumes from them), the data
    position and the config; remembers the last one written (named when a run stops)."""

    def __init__(self, cfg, executor, loader, start_step: int, scaler):
        from utils import checkpoint as ckpt

        self.cfg, self.executor, self.loader, self.scaler = cfg, executor, loader, scaler
        self.mgr = ckpt.manager(cfg.checkpoint.save) if cfg.checkpoint.save else None
        self.last = f"{cfg.checkpoint.load} step {start_step}" if start_step else None
        self.pending = None  # the step being written (asynchronously)

    def save(self, step: int, state) -> None:
        from config.config import to_dict
        from utils import checkpoint as ckpt

        self.wait()  # the previous checkpoint complete (and older ones pruned) before the next starts
        cfg = self.cfg
        meta = {"step": step, **self.loader.state(), "seed": cfg.model.seed, "config": to_dict(cfg),
                "loss_scale": self.scaler.state()}  # the loss scale and the last gradient norm, for an exact resume
        if self.executor.g.lora:  # the adapters alone are saved: where their frozen base comes from
            meta["lora_base"] = self.executor.base
        stacked = self.executor.to_checkpoint(state)
        ckpt.save(self.mgr, step, stacked.params, stacked.opt_state if cfg.checkpoint.optim_state else None, meta)
        self.last, self.pending = f"{cfg.checkpoint.save}/{step}", step

    def wait(self) -> None:
        """Waits for the checkpoint being written; then keeps the newest ``to_keep`` of this run's steps. Process 0
        of a multi-process run alone deletes (the others wait for it): every process of the run shares the
        directory."""
        from app.runtime import barrier, is_main_process
        from utils import checkpoint as ckpt

        if not self.mgr:
            return
        self.mgr.wait_until_finished()
        if self.pending is not None:
            if is_main_process():
                gone = ckpt.prune(self.cfg.checkpoint.save, self.cfg.checkpoint.to_keep, keep=(self.pending,))
                if gone:
                    logger.info("removed checkpoint step(s) %s of %s (--to_keep %d)", ", ".join(map(str, gone)),
                                self.cfg.checkpoint.save, self.cfg.checkpoint.to_keep)
            barrier(f"pruned after step {self.pending}")
            self.pending = None


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
    from data.packing import batch_stats

    host_batch = loader.next_batch()
    stats = batch_stats(host_batch)
    if step == start_step:
        rows = cfg.training.global_batch_size
        logger.info("%d examples in the first batch of %d rows: %.1f per row, %.1f%% of the token slots used",
                    stats["examples"], rows, stats["examples"] / rows, 100 * stats["packing_efficiency"])
    # the step's key: the executor's, of its state's step (graphs/state.step_key, the one place it is derived)
    state, metrics = executor.train_step(state, executor.g.shard_batch(host_batch), None, loss_scale, clip_norm)
    return state, {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}, stats


def stop_after_signal(signum: int, done: int, cfg, saver: Saver, state, tracker, progress) -> None:
    """Saves the finished step (with --save) and exits 128 + the signal's number, with one line (below the
    progress bar, which shows the step the line names)."""
    if saver.mgr:
        saver.save(done, state)
        saver.wait()
    tracker.close()
    progress.close(done)
    save = cfg.checkpoint.save
    where = f"saved {save}/{done}; resume (and go on saving) with --load {save} --save {save}" if saver.mgr else \
        "nothing saved (no --save)"
    print(f"{signal.Signals(signum).name}: stopped after step {done}: {where}", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def train(cfg, args, executor, loader, state, start_step: int, scaler) -> None:
    """The training loop: steps, logging, periodic checkpoints, --eval_every, signals, loss scaling (``scaler``,
    graphs/loss_scale.py, restored with the state) and the non-finite stop."""
    from app.runtime import any_process, is_main_process
    from app.tracking import Tracker
    from config.config import to_dict

    primary = is_main_process()  # process 0 of a multi-process run writes the metrics and shows progress
    tracker = Tracker(args.run_dir, to_dict(cfg), args.wandb, args.wandb_name, resume_step=start_step,
                      enabled=primary, name=f"{args.config} ({os.path.basename(os.path.abspath(args.run_dir))})")
    evaluator = Evaluator(cfg, executor, loader.tokenizer, tracker) if cfg.training.eval_every else None
    saver = Saver(cfg, executor, loader, start_step, scaler)
    total, every = cfg.training.steps, checkpoint_every(cfg)
    progress = Progress(start_step, total, primary, args.log_every)
    t_last = time.perf_counter()
    try:
        with StopSignals() as stop:
            for step in progress:
                used = scaler.scale
                clip = scaler.last_norm if cfg.execution.update_in_backward else None  # the previous step's norm
                state, m, stats = train_step(cfg, executor, loader, state, step, start_step, used, clip)
                applied = scaler.update(m["grad_norm"])  # a step that overflowed left the weights as they were
                # the schedule counts applied updates (the optimizer's count does not move on a skipped step)
                lr = executor.g.learning_rate(step - scaler.skipped_total)
                if scaler.gave_up or (applied and not math.isfinite(m["loss"])):
                    raise diverged(step + 1, m["loss"], m["grad_norm"], lr, cfg, saver.last, scaler)
                if not applied:
                    logger.warning("step %d: the gradients overflowed at loss scale %g: the step is skipped (weights "
                                   "and optimizer state unchanged) and the scale lowered to %g", step + 1, used,
                                   scaler.scale)
                now = time.perf_counter()
                record = step_record(cfg, m, stats, lr, applied, used, scaler, now - t_last)
                t_last, done = now, step + 1
                if step == start_step:
                    record.update(getattr(loader, "report", {}))
                if evaluator and (done % cfg.training.eval_every == 0 or done == total):
                    record.update(evaluator(state, done))
                    t_last = time.perf_counter()  # the evaluation's time is not the next step's
                tracker.log(done, record)
                progress.update(done, m["loss"], lr, record["samples_per_s"], record["examples_per_s"])
                signum = any_process(stop.signum or 0)  # every process stops after the same step
                if signum:
                    stop_after_signal(signum, done, cfg, saver, state, tracker, progress)
                if saver.mgr and every and done % every == 0 and done < total:
                    saver.save(done, state)
    except TrainingDiverged:
        saver.wait()  # earlier checkpoints stay complete
        tracker.close()
        raise
    finish(cfg, saver, state, tracker, start_step, evaluator)


def step_record(cfg, m: dict, stats: dict, lr: float, applied: bool, scale: float, scaler, seconds: float) -> dict:
    """A step's line of metrics.jsonl (and W&B)."""
    rows = cfg.training.global_batch_size
    scaling = {"loss_scale": scale, "skipped_steps": scaler.skipped_total} if scaler.dynamic else {}
    loss = {"loss": m["loss"]} if math.isfinite(m["loss"]) else {}  # metrics.jsonl stays plain JSON
    return {**loss, "learning_rate": lr, "grad_norm": m["grad_norm"] if applied else None,
            "samples_per_s": rows / seconds, "examples": stats["examples"], "examples_per_s": stats["examples"] / seconds,
            "packing_efficiency": stats["packing_efficiency"], **scaling}


def finish(cfg, saver, state, tracker, start_step: int, evaluator) -> None:
    """The end of a run: its last checkpoint, the best --eval_every step named, the plot."""
    from utils import checkpoint as ckpt

    total = cfg.training.steps
    if saver.mgr:
        if start_step < total or not ckpt.saved_steps(cfg.checkpoint.save):
            saver.save(total, state)
        saver.wait()
        logger.info("saved %s/%d", cfg.checkpoint.save, total)
    if evaluator and evaluator.best:
        logger.info("the best held-out %s: %.4f at step %d%s", evaluator.key, *evaluator.best,
                    f" ({cfg.checkpoint.save}/{evaluator.best[1]}, if kept)" if saver.mgr else "")
    tracker.close()
    logger.info("metrics and loss curve in %s", tracker.run_dir)


class Evaluator:
    """--eval_every: the task's held-out examples (data.tasks.evaluation_set, the first eval_rows of them) decoded
    with the run's current weights, on the run's devices, and scored as the task asks. The weights are read, never
    changed, and no training data is read: the run's data order and its exact resume are untouched."""

    def __init__(self, cfg, executor, tokenizer, tracker):

        from data.metrics import primary
        from data.tasks import Task, evaluation_set, tokenize_prompts
        from graphs.graphs import Graphs
        from run_validation import Validator

        ecfg = copy.deepcopy(cfg)
        ecfg.model.eval, ecfg.execution.rts, ecfg.execution.phased = True, False, False
        ecfg.lora.rank = 0  # LoRA: the adapters are merged into the weights decoded (executor.weights)
        self.validator = Validator(ecfg.validate(), Graphs(ecfg, mesh=executor.g.mesh))
        self.task, self.executor, self.tokenizer = Task.of_config(cfg), executor, tokenizer
        data = evaluation_set(cfg.data, self.task, cfg.model.seed)
        self.examples = data.examples[: cfg.training.eval_rows]
        self.feats = tokenize_prompts(self.examples, tokenizer, executor.g.family)
        self.key = f"eval_{primary(self.task)}"
        self.best = _best_so_far(tracker, self.key)
        logger.info("--eval_every %d: %d examples of %s", cfg.training.eval_every, len(self.examples), data.what)

    def __call__(self, state, step: int) -> dict:
        import jax

        from data.metrics import headline, score

        stacked = self.executor.weights(state)  # the stacked weights, wherever they live
        params = jax.device_put(stacked, self.validator.graphs.param_shardings)
        report = score(self.task, self.examples, self.validator.predict(params, self.feats, self.tokenizer,
                                                                         progress="evaluating"))
        del params
        scores = {f"eval_{k}": v for k, v in report["scores"].items()}
        if self.best is None or scores[self.key] > self.best[0]:
            self.best = (scores[self.key], step)
        logger.info("step %d: held-out %s", step, headline(report["scores"]))
        return scores


def _best_so_far(tracker, key: str):
    """(score, step) of the best evaluation a resumed run logged before its checkpoint, or None."""
    path = getattr(tracker, "path", None)
    if not path or not os.path.exists(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    found = [(r[key], r["step"]) for r in rows if key in r]
    return max(found, key=lambda x: (x[0], -x[1])) if found else None


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
        from app.tracking import check_wandb

        check_wandb()
    ensure_host_devices(cfg.devices)
    ensure_pinned_host_memory(cfg.execution.phased)
    setup_jax()
    from graphs.plan import plan

    if args.plan:
        print(plan(build_executor(cfg), exact=True).format())
        return
    if cfg.training.steps == 0:
        raise FlanT5Error("--steps 0: nothing to train (and nothing is written): pass --steps 1 or more")
    from app.rundir import check_free, check_metrics_owner, fresh_run_dir
    from app.runtime import agree, is_main_process

    point, warm = resume_point(cfg), init_point(cfg, args)
    if point and not cfg.checkpoint.save:
        logger.warning("resuming %s/%d without --save: nothing of this run will be saved; pass --save %s to go on "
                       "saving where it stopped", *point, point[0])
    # a fresh directory is chosen (and made) by process 0 alone; every process of the run uses the same
    args.run_dir = args.run_dir or cfg.checkpoint.save or agree("run_dir", lambda: fresh_run_dir("runs", args.config))
    # every check that can refuse the run reads only: a refused run leaves its directories as they were
    for d in dict.fromkeys([cfg.checkpoint.save, args.run_dir]):
        if d and is_main_process():  # process 0 owns the run's directories (and holds their locks)
            check_free(d)
    later = check_save_dir(cfg, point, args.discard_later_steps)
    check_metrics_owner(args.run_dir, bool(point) and os.path.abspath(point[0]) == os.path.abspath(args.run_dir))
    locks = own_directories(cfg, args)  # held for the run's life, released on any exit
    try:
        discard_steps(cfg.checkpoint.save, later, point)
        executor = build_executor(cfg)
        for source in (point, warm):  # a checkpoint of another model shape fails here, before the data is read
            if source:
                from utils import checkpoint as ckpt

                ckpt.check_shapes(*source, executor.g.abstract_params(), executor.g.shape_hint)
        executor, loader = build(cfg, executor, args.run_dir)
        from graphs.loss_scale import LossScale

        scaler = LossScale.of_config(cfg)
        state, start = initial_state(cfg, executor, loader, point, warm, scaler)
        train(cfg, args, executor, loader, state, start, scaler)
    finally:
        for lock in locks:
            lock.release()


def own_directories(cfg, args) -> list:
    """Locks the directories this run writes (process 0 of a multi-process run)."""
    from app.rundir import RunLock
    from app.runtime import is_main_process

    save = cfg.checkpoint.save
    if not is_main_process():
        return []
    locks = []
    try:
        for d in dict.fromkeys([save, args.run_dir]):
            if d:
                locks.append(RunLock(d))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


if __name__ == "__main__":
    main(sys.argv[1:])
