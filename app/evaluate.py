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
import numpy as np

from app.predict import decoding_options, prompt_features
from app.runtime import is_main_process
from app.train_data import run_tasks
from data.metrics import headline, primary, score
from data.mixture import evaluation_sets
from data.tasks import tokenize_prompts
from decoder.decoder import Decoder
from partitioning.memory import peak_device_bytes
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def evaluation_data(cfg, overrides: dict, load) -> list:
    """The evaluation set of each of the run's tasks (data.mixture.evaluation_set), refusing to score a checkpoint's
    own training rows as if they were held out."""
    if cfg.mixture.tasks and ("dataset" in overrides or "split" in overrides):
        raise FlanT5Error("a mixture's checkpoint scores each of its tasks on its own data: drop --dataset / --split, "
                          "or pass --mixture none with the task's flags (--dataset, --input_template ...) to score "
                          "one data set")
    sets = evaluation_sets(run_tasks(cfg))
    for data in sets:
        if data.single and load and "dataset" not in overrides:
            raise FlanT5Error(f"{load} was trained on every row of {data.dataset} (a single file, nothing held out): "
                              "scoring its training rows says nothing of unseen data; pass --dataset FILE_OR_DIR "
                              "[--split S] to score other rows, or train with --holdout N")
        if data.single and "split" in overrides:  # (a --split given; without one there is nothing to warn of)
            logger.warning("validating on every row of %s (a single file: --split %s does not apply; pass a "
                           "directory holding %s.jsonl to score a split)", data.dataset, cfg.data.split,
                           cfg.data.split)
        elif data.single:
            logger.info("validating on every row of %s (a single file)", data.dataset)
    return sets


def long_references(examples: list, tokenizer, family, output_length: int, what: str) -> int:
    """How many references need more than ``output_length`` tokens (their end-of-text aside): decoding cannot write
    them whole, which one warning line says with the flag that lets it."""
    ids = family.encode_targets(tokenizer, [e.target for e in examples if e.target])
    longest = max((len(x) - 1 for x in ids), default=0)
    n = sum(len(x) - 1 > output_length for x in ids)
    if n:
        logger.warning("%d of %d references of %s are longer than output_length %d tokens (the longest: %d): "
                       "decoding cannot write them whole; pass --output_length %d", n, len(ids), what,
                       output_length, longest, longest)
    return n


def decoding_name(inference) -> str:
    """The decoding a report holds, as its name and result line say it: greedy, beam4, or sample (with its seed),
    followed by what constrains or processes the answers (labels, regex, schema; penalised: a repetition penalty,
    no repeated n-grams or bad words), the labels ranked beside them (ranked) and the weights' quantization
    (greedy_int8, beam4_labels, greedy_ranked)."""
    i = inference
    if i.do_sample:
        name = f"sample{i.sampling_seed}"
    else:
        name = f"beam{i.num_beams}" if i.num_beams > 1 else "greedy"
    penalised = i.repetition_penalty != 1.0 or i.no_repeat_ngram_size or i.bad_words
    parts = [name] + [x for x, on in (("labels", i.constrain == "labels"), ("regex", i.regex is not None),
                                      ("schema", i.json_schema is not None), ("penalised", penalised),
                                      ("ranked", i.score == "labels")) if on]
    name = "_".join(parts)
    return name if i.quantize == "none" else f"{name}_{i.quantize}"


def report_name(split: str, step=None, limit=None, decoding: str = "greedy", task: str | None = None) -> str:
    """validation_mismatched_step1000.json (..._first100.json for a --limit run, ..._beam4.json for a search other
    than greedy); a split not named validation* gets the prefix (validation_test.json); a mixture's task is named
    after the prefix (validation_nli_mismatched_step10.json, validation_headlines_heldout.json)."""
    base = split if split.startswith("validation") else f"validation_{split}"
    if task:
        rest = base[len("validation"):].lstrip("_")
        base = f"validation_{task}" + (f"_{rest}" if rest else "")
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


def result_line(report: dict, step, what: str, path: str, mixed: bool = False) -> str:
    """``CKPT step N: TASK on DATA (DECODING): scores -> path``; a label set's line keeps the original's accuracy
    figure (after its task's name, for a mixture's)."""
    head = f"{report['checkpoint']}" + (f" step {step}" if step is not None else "")
    how = f" ({report['decoding_name']})" if report.get("decoding_name", "greedy") != "greedy" else ""
    ranked = f"; ranked: {headline(report['ranked']['scores'])}" if report.get("ranked") else ""
    if "accuracy" in report["scores"]:
        rest = {k: v for k, v in report["scores"].items() if k != "accuracy"}
        return (f"{head}: {report['task'] + ' ' if mixed else ''}accuracy {report['accuracy']:.2%} on "
                f"{report['samples']} samples of {what}{how} ({report['unknown']} unknown)"
                + (f", {headline(rest)}" if rest else "") + f"{ranked} -> {path}")
    return (f"{head}: {report['task']} on {report['samples']} samples of {what}{how}: {headline(report['scores'])}"
            f"{ranked} -> {path}")


def mixture_score(sets: list, scores: dict) -> float:
    """A mixture's evaluation in one number (which names its best step): the mean of its tasks' first scores, each
    in [0, 1] (BLEU and chrF divided by 100)."""
    firsts = [scores[f"eval_{s.task.name}_{primary(s.task)}"] for s in sets]
    return sum(v / 100 if p in ("bleu", "chrf") else v for v, p in zip(firsts, [primary(s.task) for s in sets])) \
        / len(sets)


class Validation:
    """run_validation.py's work: each task's evaluation examples tokenized once, then each checkpoint (or an HF model)
    decoded, scored and reported, a report per task (process 0 of a multi-process run writes and prints)."""

    def __init__(self, cfg, overrides: dict, tokenizer, limit=None, output=None):
        self.cfg, self.tokenizer, self.limit, self.output = cfg, tokenizer, limit, output
        self.sets = evaluation_data(cfg, overrides, cfg.checkpoint.load)
        self.mixed = bool(cfg.mixture.tasks)
        self.decoder = Decoder.of_config(cfg, tokenizer)
        self.inputs = []
        for data in self.sets:
            examples = data.examples[:limit]
            feats, unknown = prompt_features(examples, tokenizer, self.decoder.family, cfg.model.sequence_length)
            long_references(examples, tokenizer, self.decoder.family, cfg.inference.output_length, data.what)
            if cfg.inference.score == "labels" and not data.task.labels:
                raise FlanT5Error(f"--score labels ranks a label task's labels, and the task {data.task.name!r} has "
                                  "none (free text): drop --score")
            self.inputs.append((data, examples, feats, unknown, decoding_options(cfg, tokenizer, self.decoder,
                                                                                  data.task)))

    def __call__(self, directory, step, n_targets: int = 1):
        """One checkpoint (``directory`` None: the config's --hf_model) decoded, scored, reported -> the report (a
        list of them, one a task, for a mixture)."""
        cfg = self.cfg
        params = self.decoder.load_params(directory, step, None if directory else cfg.data.hf_model)
        reports = [self.one(params, directory, step, n_targets, *x) for x in self.inputs]
        return reports if self.mixed else reports[0]

    def one(self, params, directory, step, n_targets: int, data, examples, feats, unknown, options) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        report = score(data.task, examples, self.decoder.predict(params, feats, options=options))
        if cfg.inference.score == "labels":
            report["ranked"] = self.ranked(params, data.task, examples, feats)
        how = decoding_name(cfg.inference)
        report.update(split=data.name, dataset=data.dataset, single_file=data.single, data=data.what, step=step,
                      limit=self.limit, prompt_tokens_unknown=unknown, longest_prompt=int(feats["attention_mask"]
                                                                                          .sum(1).max()),
                      checkpoint=directory or cfg.data.hf_model, decoding=asdict(cfg.inference), decoding_name=how,
                      quantization=cfg.inference.quantize, peak_device_bytes=peak_device_bytes(),
                      seconds=time.perf_counter() - t0)
        name = report_name(data.name, step, self.limit, how, data.task.name if self.mixed else None)
        path = os.path.join(directory or "runs", name)
        if self.output and n_targets == 1:
            path = self.output if not self.mixed else f"{os.path.splitext(self.output)[0]}_{data.task.name}.json"
        if is_main_process():
            path = write_report(report, path)
            print(result_line(report, step, data.what, path, self.mixed), flush=True)
        return report

    def ranked(self, params, task, examples: list, feats: dict) -> dict:
        """--score labels: each example's labels ranked by their log-likelihood (their target tokens, the
        end-of-text token's included: SeqIO's rank classification) -> {scores, generated: the most likely label of
        each, log_likelihoods [n, labels]} (ties: the first label)."""
        family = self.decoder.family
        ll = self.decoder.rank(params, feats, family.encode_targets(self.tokenizer, list(task.labels)))
        best = [task.labels[j] for j in np.argmax(ll, axis=1)]
        return {"scores": score(task, examples, best)["scores"], "generated": best,
                "log_likelihoods": ll.round(4).tolist()}


class Evaluator:
    """--eval_every: each task's evaluation examples (data.mixture.evaluation_set: its held-out rows, else its
    validation split; the first eval_rows of them) decoded with the run's current weights, on the run's devices, and
    scored as the task asks (a mixture's: each task's scores under its name, eval_TASK_METRIC, and their mean,
    eval_score). The weights are read, never changed, and no training data is read: the run's data order and its
    exact resume are untouched."""

    def __init__(self, cfg, executor, tokenizer, best=None):
        self.decoder = Decoder.of_config(cfg, tokenizer, mesh=executor.g.mesh)
        self.executor, self.tokenizer, self.mixed = executor, tokenizer, bool(cfg.mixture.tasks)
        self.sets, self.inputs = evaluation_sets(run_tasks(cfg)), []
        family = executor.g.family
        for data in self.sets:
            examples = data.examples[: cfg.training.eval_rows]
            long_references(examples, tokenizer, family, cfg.inference.output_length, data.what)
            self.inputs.append((examples, tokenize_prompts(examples, tokenizer, family),
                                decoding_options(cfg, tokenizer, self.decoder, data.task)))
            logger.info("--eval_every %d: %d examples of %s", cfg.training.eval_every, len(examples), data.what)
        self.key = "eval_score" if self.mixed else f"eval_{primary(self.sets[0].task)}"
        self.best = best  # (score, step) of the best evaluation so far (a resumed run's: ``best_logged``)
        first = self.sets[0].name
        self.what = "mixture" if self.mixed else "held-out" if first == "heldout" else first

    def __call__(self, state, step: int) -> dict:
        """The scores of the weights in ``state`` (a mixture's mean too), and the best step so far: the highest
        score, the earliest of ties."""
        scores = self.scores(state, step)
        if self.mixed:
            scores["eval_score"] = mixture_score(self.sets, scores)
        if self.best is None or scores[self.key] > self.best[0]:
            self.best = (scores[self.key], step)
        return scores

    def scores(self, state, step: int) -> dict:
        """Each task's scores of the weights in ``state``, decoded on the run's devices: eval_METRIC (a mixture's
        eval_TASK_METRIC)."""
        stacked = self.executor.weights(state)  # the stacked weights, wherever they live
        g = self.decoder  # decoding's layout, once (int8 when the run asked for it: --quantize int8)
        params = (g.to_decoding(jax.device_put(stacked, g.place.param_shardings)) if g.quantize == "none"
                  else g.weights.place(stacked))
        scores = {}
        for data, (examples, feats, options) in zip(self.sets, self.inputs):
            report = score(data.task, examples, self.decoder.predict(params, feats, progress="evaluating",
                                                                     options=options))
            prefix = f"eval_{data.task.name}_" if self.mixed else "eval_"
            scores.update({prefix + k: v for k, v in report["scores"].items()})
            logger.info("step %d: %s%s %s", step, f"{data.task.name} " if self.mixed else "",
                        "held-out" if data.name == "heldout" else data.name, headline(report["scores"]))
        del params
        return scores


def best_logged(path, key: str):
    """(score, step) of the best evaluation a run logged in its metrics.jsonl ``path`` (a resumed run's, before its
    checkpoint), or None."""
    if not path or not os.path.exists(path):
        return None
    rows = [json.loads(line) for line in open(path) if line.strip()]
    found = [(r[key], r["step"]) for r in rows if key in r]
    return max(found, key=lambda x: (x[0], -x[1])) if found else None
