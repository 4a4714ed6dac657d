"""A run's tasks: its one task (the config's ``task`` and ``data`` sections), or the tasks of its ``mixture`` (SeqIO's
``Mixture``: several tasks, each with its own source, template, target, labels and metrics, mixed by rates), and
what evaluation scores of each: its held-out rows (read from the training split's cache) or its validation split.

Rates: explicit (``mixture_rates``: a task's share of the examples is its rate over their sum), or
examples-proportional (each task's rate is its number of training examples, at most ``mixture_cap``: T5's K, so
that a huge task does not drown the others).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

from config.schema import FIELDS
from data import cache, sources
from data.loader import holdout_indices
from data.sources import DataError
from data.tasks import Task

DEFAULT_SPLIT = FIELDS["split"].default  # MNLI's validation_mismatched


@dataclass
class TaskData:
    """One task of a run and where its rows come from: ``task`` (data.tasks.Task), ``dataset``, ``hub_config``,
    ``train_split``, ``split`` (what evaluation scores when nothing is held out), ``holdout`` (rows of the training
    split held out of training, which evaluation then scores), the run's ``seed`` (which rows are held out; a
    local directory's shuffle) and ``cache_dir`` (the data section's)."""

    task: Task
    dataset: str
    hub_config: Optional[str]
    train_split: str
    split: str
    holdout: int
    seed: int
    cache_dir: Optional[str]
    how: str = "--split {}"  # how the user names its split: a flag, or a mixture task's mapping key (messages)

    @property
    def name(self) -> str:
        return self.task.name

    def part(self, training: bool = True) -> cache.Part:
        """The cache part of its training split (or its validation split)."""
        src = sources.locate(self.dataset, self.train_split if training else self.split, self.seed,
                             self.hub_config, self.cache_dir, self.how.replace("split", "train_split", 1)
                             if training else self.how)
        t = self.task
        return cache.Part(source=vars(src).copy(), task={"name": t.name, "input_template": t.template,
                                                         "input_column": t.input_column,
                                                         "target_column": t.target_column,
                                                         "labels": list(t.labels) if t.labels else None,
                                                         "metrics": list(t.metrics)},
                          held=self.holdout if training else 0, seed=self.seed)


def tasks_of(task, data, mixture, seed: int) -> list:
    """The run's tasks, from the config's sections that say them: the ``mixture``'s tasks, or its one ``task`` over
    the ``data`` section's source; ``seed``: the run's (the model section's)."""
    if mixture.tasks:
        return [TaskData(Task(SimpleNamespace(**e)), e["dataset"], e["hub_config"], e["train_split"],
                         scored_split(e["dataset"], e["split"]), e["holdout"], seed, data.cache_dir,
                         f"split: {{}} in task {e['name']}'s mapping") for e in mixture.tasks]
    return [TaskData(Task(task), data.dataset, data.hub_config, data.train_split,
                     scored_split(data.dataset, data.split), data.holdout, seed, data.cache_dir)]


def scored_split(dataset: str, split: str) -> str:
    """The split evaluation scores: ``split``; or where that is the default (MNLI's validation_mismatched) and a
    local directory of splits has no such split but a ``validation`` one, ``validation`` (a directory of one's own
    task is scored on its validation file without being told)."""
    if split != DEFAULT_SPLIT or not dataset or not os.path.isdir(dataset):
        return split
    try:
        sources.locate(dataset, split)
    except DataError:
        try:
            sources.locate(dataset, "validation")
        except DataError:
            return split
        return "validation"
    return split


def check_evaluation(tasks: list) -> None:
    """Before any data is read (--eval_every): each task's evaluation rows exist, and are not the rows the run trains
    on (a single file with nothing held out: its rows say nothing of unseen data)."""
    for td in tasks:
        if td.holdout:
            continue
        if td.part(training=False).located().single:
            raise DataError(f"--eval_every would score rows the run trains on: {td.dataset} is a single file and "
                            "nothing is held out of it; pass --holdout N to score N rows held out of training, or "
                            "drop --eval_every")


def inference_task(tasks: list, name: Optional[str] = None) -> TaskData:
    """The task run_inference.py predicts of the run's ``tasks``: its one task, or a mixture's task named ``name``
    (its first without one)."""
    if name is None:
        return tasks[0]
    for td in tasks:
        if td.name == name:
            return td
    raise DataError(f"--task_name {name} is not a task of the mixture: choose one of "
                    f"{', '.join(t.name for t in tasks)}")


def rates(mixture, sizes: list) -> list:
    """Each task's rate (``mixture``: the config's mixture section): its own, else examples-proportional to the
    tasks' ``sizes`` (capped at mixture_cap)."""
    if mixture.rates:
        return [float(r) for r in mixture.rates]
    cap = mixture.cap
    return [float(min(n, cap) if cap else n) for n in sizes]


def shares(names: list, sizes: list, rates_: list) -> dict:
    """{task: {examples, rate, share}}: what the run reports of its mixture."""
    total = sum(rates_)
    return {n: {"examples": int(s), "rate": r, "share": r / total} for n, s, r in zip(names, sizes, rates_)}


# --------------------------------------------------------------------------- what evaluation scores


@dataclass
class EvalSet:
    """The examples an evaluation scores and how to name them: ``name`` (the report's stem: a split, a file's
    stem, or heldout), ``what`` (the result line's: which rows of which data) and the ``task``."""

    examples: list
    name: str
    what: str
    dataset: str
    single: bool = False
    task: Optional[Task] = None


def held_rows(td: TaskData, n: int, where: str):
    """The sorted indices of the rows of a task's ``n`` training examples held out of training (--holdout, drawn
    from the run's seed): what training leaves out and evaluation scores; an error when that is every one of them."""
    if td.holdout >= n:
        raise DataError(f"--holdout {td.holdout} holds out every one of the {n} training examples of {where}: pass a "
                        "smaller --holdout")
    return holdout_indices(n, td.holdout, td.seed)


def held_out(td: TaskData) -> tuple:
    """(the texts cache of a task's training split, the sorted indices held out of training)."""
    req = cache.Request([td.part()], family="", tokenizer="", root=sources.cache_root(td.cache_dir), tokens=False)
    texts = cache.TextSet(cache.run(req)["texts"][0])
    return texts, held_rows(td, len(texts), texts.meta["where"])


def evaluation_set(td: TaskData) -> EvalSet:
    """The examples a task's evaluation scores: the rows held out of training (``holdout``), else its split
    (``split``); a single file is scored whole, whatever the split."""
    if td.holdout:
        texts, held = held_out(td)
        return EvalSet(texts.examples(held), "heldout", f"the {len(held)} rows of {texts.meta['where']} held out of "
                       "training", td.dataset, task=td.task)
    rows = sources.read(td.dataset, td.split, td.seed, td.hub_config, td.cache_dir, td.how)
    examples = td.task.examples(rows)
    if rows.single:  # one file holds one set of rows, whatever --split says: name the file, not a split
        stem = os.path.splitext(os.path.basename(td.dataset))[0]
        return EvalSet(examples, stem, f"the rows of {td.dataset}", td.dataset, single=True, task=td.task)
    return EvalSet(examples, td.split, f"{rows.where}", td.dataset, task=td.task)


def evaluation_sets(tasks: list) -> list:
    """Every task's evaluation set (one for a single task)."""
    return [evaluation_set(td) for td in tasks]
