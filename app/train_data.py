"""A training run's data: each task's training split read, checked and tokenized once into the cache (data/cache.py:
process 0 builds what is missing, every process maps it), the run's tokenizer (the config's, or one learnt from the
data), the rows held out, the lengths checked and said, and the resumable loader of their batches (one task, or a
mixture of tasks with rates: data/mixture.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil

import numpy as np

from app.runtime import agree
from data import cache, mixture
from data.loader import TaskStream, TrainLoader
from data.sources import DataError, cache_root
from data.tokenizer import TRAINED, check_unknown, load_tokenizer, pad_id
from modelling.rows import RowShape
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def run_tasks(cfg) -> list:
    """The run's tasks (data/mixture.py's TaskData), from the config's task, data and mixture sections and its seed:
    the one place a run names them, so that training and evaluation hold out the same rows."""
    return mixture.tasks_of(cfg.task, cfg.data, cfg.mixture, cfg.model.seed)


def training_data(cfg, family, run_dir: str | None = None) -> TrainLoader:
    """The training loader of the run's tasks (each task's training split, less the rows held out: --holdout), read
    and checked before anything is compiled. With ``--tokenizer train`` the tokenizer is learnt from the training
    texts and saved to RUN_DIR/tokenizer, which the config (and so every checkpoint) then names."""
    tasks = run_tasks(cfg)
    req = cache.Request([td.part() for td in tasks], family.name, cfg.data.tokenizer, cache_root(cfg.data.cache_dir),
                        vocab_size=cfg.model.embedding.vocab_size, num_proc=cfg.data.num_proc,
                        labels=tuple(dict.fromkeys(w for td in tasks for w in td.task.labels or ())))
    built = json.loads(agree("data", lambda: json.dumps(cache.run(req))))  # process 0 builds, the others map it
    tokenizer = training_tokenizer(cfg, built["tokenizer"], run_dir)
    sets = [cache.TokenSet(path) for path in built["tokens"]]
    streams = []
    for td, tokens in zip(tasks, sets):
        held = mixture.held_rows(td, len(tokens), tokens.meta["where"])
        if len(held):
            logger.info("%d rows of %s held out of training (--holdout): --eval_every and validation score them",
                        len(held), tokens.meta["where"])
        streams.append(TaskStream(tokens.examples, held, td.name))
    return training_loader(cfg, tasks, sets, streams, tokenizer, family)


def training_tokenizer(cfg, name: str, run_dir):
    """The run's tokenizer: the config's, or with --tokenizer train the one learnt from the training texts (``name``:
    its cached folder), copied to RUN_DIR/tokenizer by process 0, which the config then names (validation loads it
    from there)."""
    if cfg.data.tokenizer == TRAINED:
        out = os.path.abspath(os.path.join(run_dir or cfg.checkpoint.save or "runs", "tokenizer"))

        def copy() -> str:
            shutil.copytree(name, out, dirs_exist_ok=True, ignore=shutil.ignore_patterns("meta.json"))
            logger.info("the tokenizer learnt from the training data -> %s", out)
            return out

        cfg.data.tokenizer = agree("tokenizer", copy)  # what checkpoints record
    elif cfg.checkpoint.save and os.path.isdir(cfg.data.tokenizer):  # a local tokenizer travels with the checkpoint
        cfg.data.tokenizer = agree("tokenizer", lambda: copied_tokenizer(cfg.data.tokenizer, cfg.checkpoint.save))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if len(tokenizer) > cfg.model.embedding.vocab_size:
        raise FlanT5Error(f"tokenizer has {len(tokenizer)} tokens but vocab_size={cfg.model.embedding.vocab_size}: "
                          "raise --vocab_size or use the tokenizer of this model")
    return tokenizer


def copied_tokenizer(directory: str, save: str) -> str:
    """A --tokenizer DIR copied into the --save directory (SAVE/tokenizer, absolute), which the config then names: a
    checkpoint holds its tokenizer, as one learnt with --tokenizer train (a moved or deleted DIR once left it
    unreadable)."""
    out = os.path.abspath(os.path.join(save, "tokenizer"))
    if os.path.abspath(directory) != out:
        shutil.copytree(directory, out, dirs_exist_ok=True)
        logger.info("the tokenizer %s -> %s (the checkpoints hold it)", directory, out)
    return out


def training_loader(cfg, tasks: list, sets: list, streams: list, tokenizer, family) -> TrainLoader:
    """The resumable loader of the tokenised examples, its length, unknown-token and mixture report attached."""
    shape = RowShape.of_config(cfg, pad_id(tokenizer))
    report = report_lengths(cfg, tasks, sets, tokenizer, family, shape)
    rates = None
    if len(tasks) > 1:
        rates = mixture.rates(cfg.mixture, [s.size for s in streams])
        report["mixture"] = mixture.shares([t.name for t in tasks], [s.size for s in streams], rates)
        logger.info("mixing %s", "; ".join(f"{n}: {m['examples']} examples, rate {m['rate']:g} ({m['share']:.1%} of "
                                           "the examples)" for n, m in report["mixture"].items()))
    where = ", ".join(s.meta["where"] for s in sets)
    logger.info("training %s on %d examples of %s (%s)", " + ".join(t.name for t in tasks),
                sum(s.size for s in streams), where, family.rows.describe(shape))
    loader = TrainLoader(streams, cfg.training.global_batch_size, cfg.gradient_accumulation, cfg.model.seed,
                         fmt=family.rows, shape=shape, rates=rates)
    loader.report = report  # written with the run's first metrics line
    loader.tokenizer = tokenizer  # what --eval_every decodes with
    return loader


class _Blank(dict):
    def __missing__(self, key):
        return "x"


def report_lengths(cfg, tasks: list, sets: list, tokenizer, family, shape) -> dict:
    """A sequence_length that cannot hold a prompt template is an error; examples and targets that do not fit are
    counted and said (a warning naming the flag that keeps them when a target is cut), never cut silently."""
    L, fmt = shape.sequence_length, family.rows
    for td in tasks:
        t = td.task
        blank = "" if t.input_column else t.template.format_map(_Blank())
        need, what = fmt.template_room(len(family.encode_inputs(tokenizer, [family.prompt(blank)])[0]))
        if L < need:
            raise DataError(f"sequence_length={L} cannot hold the prompt template of {t.name} ({need} tokens before "
                            f"any of {', '.join(t.fields)}{what}): pass --sequence_length {max(64, 2 * need)} or "
                            "more")
    hist = {k: _sum([s.histogram(k) for s in sets]) for k in ("input", "target", "joint")}
    cut = fmt.truncation(hist["input"], hist["target"], hist["joint"], shape)
    n = int(hist["input"].sum())
    unknown = max(check_unknown(s.meta["unknown"], cfg.data.tokenizer, td.dataset) for td, s in zip(tasks, sets))
    share = cut["cut_examples"] / max(n, 1)
    logger.info("%d of %d examples (%.1f%%) are longer than sequence_length %d (the longest: %d tokens) and are cut "
                "(%s); %d targets are longer than %s %d (the longest: %d tokens); %.2f%% of the prompt tokens are "
                "unknown to the tokenizer", cut["cut_examples"], n, 100 * share, L, cut["longest_example"],
                cut["cut_where"], cut["cut_targets"], cut["target_flag"], cut["target_limit"], cut["longest_target"],
                100 * unknown)
    if share > 0.01:
        logger.warning("%.1f%% of the examples are cut to sequence_length %d (the longest: %d tokens): pass "
                       "--sequence_length %d to keep them whole", 100 * share, L, cut["longest_example"],
                       cut["longest_example"])
    if cut["cut_targets"]:
        keep = cut["longest_target"]
        logger.warning("%d of %d targets (%.1f%%) are longer than %s %d tokens and are cut (the longest: %d): the model "
                       "learns only their start; pass --%s %d to keep them whole%s", cut["cut_targets"], n,
                       100 * cut["cut_targets"] / max(n, 1), cut["target_flag"], cut["target_limit"], keep,
                       cut["target_flag"], keep, f" (and --output_length {keep} to decode them whole)"
                       if cfg.inference.output_length < keep - 1 else "")
    return {"truncated_examples": cut["cut_examples"], "truncated_share": share,
            "truncated_targets": cut["cut_targets"], "unknown_token_share": unknown,
            "longest_prompt": int(len(hist["input"]) - 1)}  # (its checkpoints record it: the server's default width)


def _sum(hists: list) -> np.ndarray:
    size = max(len(h) for h in hists)
    out = np.zeros(size, np.int64)
    for h in hists:
        out[: len(h)] += h
    return out
