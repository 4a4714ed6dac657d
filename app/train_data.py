"""A training run's data: the task's training examples (less the rows held out), the run's tokenizer (the config's,
or one learnt from the data), their lengths checked and said, and the resumable loader of their batches."""

from __future__ import annotations

import logging
import os
import time

from app.runtime import agree
from data import sources
from data.loader import TrainLoader
from data.sources import DataError
from data.tasks import (TRAINED, Task, check_unknown_tokens, holdout, load_tokenizer, pad_id, tokenize_examples,
                        train_tokenizer)
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def training_data(cfg, family, run_dir: str | None = None) -> TrainLoader:
    """The training loader of the task's examples (the training split, less the rows held out: --holdout), read and
    checked before anything is compiled. With ``--tokenizer train`` the tokenizer is learnt from the training examples
    and saved to RUN_DIR/tokenizer, which the config (and so every checkpoint) then names."""
    task = Task.of_config(cfg)
    rows = sources.read(cfg.data.dataset, cfg.data.train_split, cfg.model.seed, cfg.data.hub_config)
    examples, held = holdout(task.examples(rows), cfg.data.holdout, cfg.model.seed)
    if held:
        logger.info("%d rows of %s held out of training (--holdout): --eval_every and validation score them",
                    len(held), rows.where)
    tokenizer = training_tokenizer(cfg, task, examples, family, run_dir)
    return training_loader(cfg, task, examples, tokenizer, family, rows.where)


def training_tokenizer(cfg, task, examples: list, family, run_dir):
    """The run's tokenizer: the config's, or with --tokenizer train one learnt from the training examples (process 0
    learns and saves it; the others load what it saved), which the config then names."""
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


def training_loader(cfg, task, examples: list, tokenizer, family, where: str) -> TrainLoader:
    """The resumable loader of the tokenised examples, its length and unknown-token report attached."""
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


class _Blank(dict):
    def __missing__(self, key):
        return "x"


def report_lengths(cfg, task, examples, tokenizer, family, unknown: float) -> dict:
    """A sequence_length that cannot hold the prompt template is an error; examples (and targets) that do not fit
    are counted and said (a warning when more than 1% are cut), never cut silently."""
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
