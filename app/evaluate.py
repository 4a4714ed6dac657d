"""Evaluation: a task's held-out examples decoded (app/predict.py) and scored as the task asks (data/metrics.py),
reported under names that never replace another report; and ``Evaluator``, the same during training (--eval_every).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict

import jax

from app.predict import Predictor, decoding_graphs_config, prompt_features
from app.runtime import is_main_process
from data.metrics import headline, primary, score
from data.tasks import Task, evaluation_set, tokenize_prompts
from graphs.graphs import Graphs
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def evaluation_data(cfg, overrides: dict, load):
    """(task, the examples to score: data.tasks.evaluation_set), refusing to score a checkpoint's own training rows
    as if they were held out."""
    task = Task.of_config(cfg)
    data = evaluation_set(cfg.data, task, cfg.model.seed)
    if data.single and load and "dataset" not in overrides:
        raise FlanT5Error(f"{load} was trained on every row of {cfg.data.dataset} (a single file, nothing held out): "
                          "scoring its training rows says nothing of unseen data; pass --dataset FILE_OR_DIR "
                          "[--split S] to score other rows, or train with --holdout N")
    if data.single:
        logger.warning("validating on every row of %s (a single file: --split %s does not apply; pass a directory "
                       "holding %s.jsonl to score a split)", cfg.data.dataset, cfg.data.split, cfg.data.split)
    return task, data


def decoding_name(inference) -> str:
    """The decoding a report holds, as its name and result line say it: greedy, beam4, or sample (with its seed)."""
    if inference.do_sample:
        return f"sample{inference.sampling_seed}"
    return f"beam{inference.num_beams}" if inference.num_beams > 1 else "greedy"


def report_name(split: str, step=None, limit=None, decoding: str = "greedy") -> str:
    """validation_mismatched_step1000.json (..._first100.json for a --limit run, ..._beam4.json for a search other
    than greedy); a split not named validation* gets the prefix (validation_test.json)."""
    base = split if split.startswith("validation") else f"validation_{split}"
    return (base + (f"_step{step}" if step is not None else "") + (f"_first{limit}" if limit else "")
            + ("" if decoding == "greedy" else f"_{decoding}") + ".json")


def unused_path(path: str) -> str:
    """``path``, or when it exists ``stem_2.json``, ``stem_3.json`` ...: a report never replaces another."""
    stem, ext = os.path.splitext(path)
    n, out = 1, path
    while os.path.exists(out):
        n += 1
        out = f"{stem}_{n}{ext}"
    return out


def write_report(report: dict, path: str) -> str:
    """Writes a report under a name no other report has (``unused_path``), atomically: an interrupted write
    leaves no half report and every earlier one intact. -> the path written."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    final = unused_path(path)
    if final != path:
        logger.warning("%s exists (another dataset or an earlier run): this report goes to %s", path, final)
    tmp = f"{final}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1)
    os.replace(tmp, final)
    return final


def result_line(report: dict, step, what: str, path: str) -> str:
    """``CKPT step N: TASK on DATA (DECODING): scores -> path``; a label set's line keeps the original's accuracy
    figure."""
    head = f"{report['checkpoint']}" + (f" step {step}" if step is not None else "")
    how = f" ({report['decoding_name']})" if report.get("decoding_name", "greedy") != "greedy" else ""
    if "accuracy" in report["scores"]:
        rest = {k: v for k, v in report["scores"].items() if k != "accuracy"}
        return (f"{head}: accuracy {report['accuracy']:.2%} on {report['samples']} samples of {what}{how} "
                f"({report['unknown']} unknown)" + (f", {headline(rest)}" if rest else "") + f" -> {path}")
    return (f"{head}: {report['task']} on {report['samples']} samples of {what}{how}: {headline(report['scores'])} "
            f"-> {path}")


class Validation:
    """run_validation.py's work: the task's evaluation examples tokenized once, then each checkpoint (or an HF model)
    decoded, scored and reported (process 0 of a multi-process run writes and prints)."""

    def __init__(self, cfg, overrides: dict, tokenizer, limit=None, output=None):
        self.cfg, self.tokenizer, self.limit, self.output = cfg, tokenizer, limit, output
        self.task, self.data = evaluation_data(cfg, overrides, cfg.checkpoint.load)
        self.examples = self.data.examples[:limit]
        self.predictor = Predictor(cfg)
        self.feats, self.unknown = prompt_features(self.examples, tokenizer, self.predictor.family,
                                                   cfg.model.sequence_length)

    def __call__(self, directory, step, n_targets: int = 1):
        """One checkpoint (``directory`` None: the config's --hf_model) decoded, scored, reported -> the report."""
        cfg, t0 = self.cfg, time.perf_counter()
        params = self.predictor.load_params(directory, step, None if directory else cfg.data.hf_model)
        report = score(self.task, self.examples, self.predictor.predict(params, self.feats, self.tokenizer))
        how = decoding_name(cfg.inference)
        report.update(split=self.data.name, dataset=self.data.dataset, single_file=self.data.single,
                      data=self.data.what, step=step, limit=self.limit, prompt_tokens_unknown=self.unknown,
                      longest_prompt=int(self.feats["attention_mask"].sum(1).max()),
                      checkpoint=directory or cfg.data.hf_model, decoding=asdict(cfg.inference), decoding_name=how,
                      seconds=time.perf_counter() - t0)
        name = report_name(self.data.name, step, self.limit, how)
        path = self.output if self.output and n_targets == 1 else os.path.join(directory or "runs", name)
        if is_main_process():
            path = write_report(report, path)
            print(result_line(report, step, self.data.what, path), flush=True)
        return report


class Evaluator:
    """--eval_every: the task's evaluation examples (data.tasks.evaluation_set: its held-out rows, else its validation
    split; the first eval_rows of them) decoded with the run's current weights, on the run's devices, and scored as
    the task asks. The weights are read, never changed, and no training data is read: the run's data order and its
    exact resume are untouched."""

    def __init__(self, cfg, executor, tokenizer, best=None):
        ecfg = decoding_graphs_config(cfg)
        self.predictor = Predictor(ecfg, Graphs(ecfg, mesh=executor.g.mesh))
        self.task, self.executor, self.tokenizer = Task.of_config(cfg), executor, tokenizer
        data = evaluation_set(cfg.data, self.task, cfg.model.seed)
        self.examples = data.examples[: cfg.training.eval_rows]
        self.feats = tokenize_prompts(self.examples, tokenizer, executor.g.family)
        self.key = f"eval_{primary(self.task)}"
        self.best = best  # (score, step) of the best evaluation so far (a resumed run's: ``best_logged``)
        self.what = "held-out" if data.name == "heldout" else data.name
        logger.info("--eval_every %d: %d examples of %s", cfg.training.eval_every, len(self.examples), data.what)

    def __call__(self, state, step: int) -> dict:
        stacked = self.executor.weights(state)  # the stacked weights, wherever they live
        params = jax.device_put(stacked, self.predictor.graphs.param_shardings)
        report = score(self.task, self.examples, self.predictor.predict(params, self.feats, self.tokenizer,
                                                                        progress="evaluating"))
        del params
        scores = {f"eval_{k}": v for k, v in report["scores"].items()}
        if self.best is None or scores[self.key] > self.best[0]:
            self.best = (scores[self.key], step)
        logger.info("step %d: %s %s", step, self.what, headline(report["scores"]))
        return scores


def best_logged(path, key: str):
    """(score, step) of the best evaluation a run logged in its metrics.jsonl ``path`` (a resumed run's, before its
    checkpoint), or None."""
    if not path or not os.path.exists(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    found = [(r[key], r["step"]) for r in rows if key in r]
    return max(found, key=lambda x: (x[0], -x[1])) if found else None
