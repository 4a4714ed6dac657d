"""A training run's checkpoints: where it starts (--load resumes a run, --init_from starts a new one from a
checkpoint's weights, --hf_model or a random init), what it may do to its --save directory, and the Saver that
writes its steps (any executor's state in the stacked layout, the data position, the config, the loss scale)."""

from __future__ import annotations

import logging
import os
import shutil

from app.args import local_path
from app.rundir import RunLock
from app.runtime import barrier, is_main_process
from config.carry import saved_value
from config.presets import to_dict
from data.tokenizer import TRAINED
from modelling.hf_mapping import load_hf_model
from partitioning.base import describe_base
from utils import checkpoint as ckpt
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")

# what decides the order and the contents of the training data: a resumed run must keep them to continue its stream
DATA_ORDER = (("dataset", ("data", "dataset")), ("hub_config", ("data", "hub_config")),
              ("train_split", ("data", "train_split")), ("holdout", ("data", "holdout")),
              ("global_batch_size", ("training", "global_batch_size")), ("packing", ("data", "packing")),
              ("causal_packing", ("data", "causal_packing")), ("sequence_length", ("model", "sequence_length")),
              ("seed", ("model", "seed")), ("input_template", ("task", "input_template")),
              ("input_column", ("task", "input_column")), ("target_column", ("task", "target_column")),
              ("labels", ("task", "labels")), ("mixture", ("mixture", "tasks")),
              ("mixture_rates", ("mixture", "rates")), ("mixture_cap", ("mixture", "cap")))
# what else a resumed run keeps: the tokenizer (the embedding's rows are its ids)
KEPT = DATA_ORDER + (("tokenizer", ("data", "tokenizer")),)


def resume_point(cfg):
    """(directory, step) of the checkpoint --load names, checked against --steps and against the data order it
    was trained with; None without --load."""
    if not cfg.checkpoint.load:
        return None
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1]
    if step >= cfg.training.steps:
        raise FlanT5Error(f"{directory} is at step {step} and --steps is {cfg.training.steps}: nothing to train; "
                          f"pass --steps greater than {step} to continue, or evaluate it with run_validation.py")
    saved = ckpt.read_meta(directory, step).get("config") or {}
    differ = []
    for flag, (section, key) in KEPT:
        if key not in saved.get(section, {}):  # a checkpoint older than the field: nothing to compare
            continue
        theirs, ours = local_path(saved[section][key]), getattr(getattr(cfg, section), key)
        ours = list(ours) if isinstance(ours, tuple) else ours  # a saved tuple is a list
        if theirs != ours:  # (None against a value too: --hub_config where there was none is other data)
            differ.append((flag, _flag_value(ours), _flag_value(theirs)))
    if differ:  # every one at once (a resume takes them from the checkpoint: only flags given can differ)
        given = ", ".join(f"--{f} {ours} (it was trained with --{f} {theirs})" for f, ours, theirs in differ)
        raise FlanT5Error(f"resuming {directory}/{step} with {given}: its data order cannot continue; drop "
                          f"{'that flag' if len(differ) == 1 else 'those flags'} (a resume takes them from the "
                          f"checkpoint), or start a new run from its weights with --init_from {directory}/{step} "
                          "(step 0, fresh optimizer state and schedule)")
    return directory, step


def _flag_value(value) -> str:
    """A config value as it is written on the command line (true / false for a bool, words for a list)."""
    if isinstance(value, (list, tuple)):  # a mixture's tasks by their names
        return " ".join(str(v["name"]) if isinstance(v, dict) else str(v) for v in value) or "none"
    return str(value).lower() if isinstance(value, bool) else str(value)


def init_point(cfg, init_from):
    """(directory, step) of --init_from: a new run (step 0, new data, fresh optimizer state and schedule) starting
    from a checkpoint's weights; None without it."""
    if not init_from:
        return None
    if cfg.checkpoint.load:
        raise FlanT5Error("--load resumes a run and --init_from starts a new one from a checkpoint's weights: pass "
                          "one of them")
    directory, step = ckpt.resolve(init_from)[-1]
    try:
        adapters_alone = bool(ckpt.load_meta(directory, step).get("lora_base"))
    except Exception:  # (an unreadable checkpoint: the load that follows names it)
        adapters_alone = False
    if adapters_alone:
        raise FlanT5Error(f"{directory}/{step} holds LoRA adapters alone, and --init_from starts from a checkpoint's "
                          f"whole weights: resume it with --load {directory}, or start from its base, or export the "
                          f"merged model (run_export.py --load {directory}) and pass that as --hf_model")
    return directory, step


def base_tokenizer(cfg, init_from, given: bool) -> None:
    """A run from a base's weights reads text with that base's tokenizer: its embedding's rows are that tokenizer's
    ids. --init_from's checkpoint names its tokenizer: a run given none (``given``) takes it (one line); a LoRA run
    given another, or ``--tokenizer train``, is refused, naming why (its embedding is frozen: a tokenizer learnt anew
    kept 72 of 512 ids' meaning, and the adapters learnt 8.5% exact match where the base's gave 83%); a full
    fine-tune given another is said in one line. ``--tokenizer train`` on an --hf_model base is refused the same."""
    lora = bool(cfg.lora.rank)
    if lora and cfg.data.tokenizer == TRAINED and (init_from or cfg.data.hf_model):
        base = init_from or cfg.data.hf_model
        raise FlanT5Error(f"--tokenizer train learns a new tokenizer, but LoRA adapters read their base's frozen "
                          f"embedding, whose rows are the ids of the tokenizer {base} was trained with: drop "
                          "--tokenizer (the base's is the default)"
                          + ("" if init_from else f", or pass --tokenizer {base} where it holds its tokenizer"))
    if not init_from:
        return
    directory, step = ckpt.resolve(init_from)[-1]
    saved = local_path(saved_value((ckpt.read_meta(directory, step) or {}).get("config") or {}, "tokenizer"))
    if saved == cfg.data.tokenizer or saved == TRAINED:
        return
    if not given:
        logger.info("the tokenizer of %s/%d, whose ids its weights read: %s", directory, step, saved)
        cfg.data.tokenizer = saved
        return
    what = (f"the tokenizer {saved}, which {directory}/{step} was trained with (its embedding's rows are that "
            f"tokenizer's ids), not --tokenizer {cfg.data.tokenizer}")
    if lora:
        raise FlanT5Error(f"LoRA adapters read their base's frozen embedding: they need {what}: drop --tokenizer (the "
                          "base's is the default)")
    logger.warning("a run from %s/%d reads text with %s: each id now means another word to its embedding (drop "
                   "--tokenizer to use the checkpoint's)", directory, step, what)


def initial_state(cfg, executor, loader, point, warm=None, scaler=None):
    """Train state from --load (resume: ``point``, the checkpoint ``resume_point`` found), --init_from (``warm``:
    a checkpoint's weights, step 0), --hf_model (pretrained) or random init; returns (state, start step). A resumed
    run's data position and loss scale (``scaler``, graphs/loss_scale.py) continue where they stopped. LoRA: the
    frozen base first (``set_lora_base``), then new adapters or the checkpoint's.

    Under phased execution the state lives in host memory, built without ever placing the
    whole model on a device.
    """
    if executor.g.lora:
        set_lora_base(cfg, executor, point, warm)
    if point:
        return resume(executor, point, loader, scaler, cfg.checkpoint.optim_state)
    if executor.g.lora:
        return executor.init_state(), 0  # new adapters on the base just set
    if warm:
        state = executor.warm_start(*warm)
        logger.info("a new run from the weights of %s/%d (step 0, fresh optimizer state and schedule)", *warm)
        return state, 0
    if cfg.data.hf_model:
        _, host = load_hf_model(cfg.data.hf_model, cfg.execution.tensor_parallel, expect=cfg.model)
        logger.info("initialised from %s", cfg.data.hf_model)
        return executor.init_state(host), 0
    return executor.init_state(), 0


def resume(executor, point, loader, scaler, optim_state: bool = True):
    """(state, step) of the checkpoint at ``point``, the loader's data position and the loss scale restored."""
    state, meta = executor.restore(*point, optim_state)
    loader.restore(meta)
    if scaler is not None:
        scaler.restore(meta.get("loss_scale"))
    logger.info("resumed %s at step %d (data position %d)", point[0], meta["step"], loader.position)
    return state, meta["step"]


def set_lora_base(cfg, executor, point, warm=None) -> None:
    """LoRA: the executor's frozen base, from where the checkpoint being resumed says its base came from (refused,
    one line, when the base found there is not the one its adapters were trained on), else from --init_from's
    checkpoint, --hf_model or the seed's random init."""
    meta = ckpt.load_meta(*point) if point else {}
    source = meta.get("lora_base", {}).get("source") or base_source(cfg, warm)
    executor.use_base(source)
    logger.info("LoRA: rank %d adapters on %s (frozen, %s)", cfg.lora.rank, describe_base(source),
                cfg.model.precision)
    if point:
        saved = meta.get("lora_base", {}).get("fingerprint")
        if saved != executor.base["fingerprint"]:
            raise FlanT5Error(f"{point[0]} step {point[1]} holds adapters trained on other base weights than "
                              f"{describe_base(source)} (fingerprint {saved} != {executor.base['fingerprint']}): "
                              "resume with the base they were trained on")


def base_source(cfg, init_from=None) -> dict:
    """LoRA: where a run's frozen base weights come from, as its checkpoints record it (``load_base`` reads it back):
    a checkpoint's weights (--init_from), an HF model (--hf_model), or the family's random init of the seed."""
    if init_from:  # (absolute: the checkpoint resumed, validated or exported from another directory finds it)
        return {"init_from": [os.path.abspath(str(init_from[0])), int(init_from[1])]}
    if cfg.data.hf_model:
        return {"hf_model": cfg.data.hf_model}
    return {"random_init_seed": cfg.model.seed}


def check_save_dir(cfg, point, discard_later: bool = False) -> list:
    """Decides, before any work and reading only, what a run may do to its --save directory: never write into
    another run's checkpoints, never over a folder that is not ours, and roll back (``--load DIR/STEP --save DIR``
    with later steps in DIR) only when asked to discard the later steps. ``point``: (directory, step) of --load,
    or None. -> the later steps to discard (``discard_steps``)."""
    save = cfg.checkpoint.save
    if not save:
        return []
    foreign = ckpt.foreign_steps(save)
    start, total, every, evals = (point[1] if point else 0), cfg.training.steps, checkpoint_every(cfg), \
        cfg.training.eval_every
    # the steps it may save: every --checkpoint_steps, each evaluated step (saved when it is the best so far), the last
    will = {s for s in range(start + 1, total + 1) if any(n and s % n == 0 for n in (every, evals))} | {total}
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


def own_directories(directories) -> list:
    """Locks the directories a run writes (process 0 of a multi-process run) -> the locks, held until released."""
    if not is_main_process():
        return []
    locks = []
    try:
        for d in dict.fromkeys(directories):
            if d:
                locks.append(RunLock(d))
    except BaseException:
        for lock in locks:
            lock.release()
        raise
    return locks


class Saver:
    """Checkpoints of a run: the stacked layout whichever executor ran (either one resumes from them), the data
    position and the config; remembers the last one written (named when a run stops)."""

    def __init__(self, cfg, executor, loader, start_step: int, scaler):
        self.cfg, self.executor, self.loader, self.scaler = cfg, executor, loader, scaler
        self.mgr = ckpt.manager(cfg.checkpoint.save) if cfg.checkpoint.save else None
        self.last = f"{cfg.checkpoint.load} step {start_step}" if start_step else None
        self.pending = None  # the step being written (asynchronously)
        self.keep = set()  # steps pruning never deletes (the best --eval_every step's)

    def save(self, step: int, state) -> None:
        self.wait()  # the previous checkpoint complete (and older ones pruned) before the next starts
        cfg = self.cfg
        meta = {"step": step, **self.loader.state(), "seed": cfg.model.seed, "config": to_dict(cfg),
                "loss_scale": self.scaler.state()}  # the loss scale and the last gradient norm, for an exact resume
        if self.executor.g.lora:  # the adapters alone are saved: where their frozen base comes from
            meta["lora_base"] = self.executor.base
        longest = getattr(self.loader, "report", {}).get("longest_prompt")
        if longest is not None:  # the longest prompt the task's rows hold: the server reads that many by default
            meta["longest_prompt"] = longest
        stacked = self.executor.to_checkpoint(state)
        ckpt.save(self.mgr, step, stacked.params, stacked.opt_state if cfg.checkpoint.optim_state else None, meta)
        self.last, self.pending = f"{cfg.checkpoint.save}/{step}", step

    def wait(self) -> None:
        """Waits for the checkpoint being written; then keeps the newest ``to_keep`` of this run's steps. Process 0
        of a multi-process run alone deletes (the others wait for it): every process of the run shares the
        directory."""
        if not self.mgr:
            return
        self.mgr.wait_until_finished()
        if self.pending is not None:
            if is_main_process():
                gone = ckpt.prune(self.cfg.checkpoint.save, self.cfg.checkpoint.to_keep,
                                  keep=(self.pending, *self.keep))
                if gone:
                    logger.info("removed checkpoint step(s) %s of %s (--to_keep %d)", ", ".join(map(str, gone)),
                                self.cfg.checkpoint.save, self.cfg.checkpoint.to_keep)
            barrier(f"pruned after step {self.pending}")
            self.pending = None
