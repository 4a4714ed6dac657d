"""Validation: decode a held-out set and score it as the task asks (MNLI's validation_mismatched by default).

    python3 run_validation.py --load ckpt/tiny                          # offline: the task and data it trained on
    python3 run_validation.py --config xxl-mnli --load 'ckpt/xxl/*'     # every checkpoint, in step order
    python3 run_validation.py --config xl-mnli --hf_model google/flan-t5-xl
    python3 run_validation.py --load ckpt/sum --num_beams 4 --length_penalty 0.8

A checkpoint carries the model's shape (layers, widths, heads, vocabulary) and the task it was trained on (its
template, target, label set, metrics, tokenizer, data: its held-out rows or its validation split, and output
length): none needs repeating, and any flag changes them (--dataset, --split, --metrics ...). An --hf_model's
shape comes from its config.json. Decoding is greedy unless --num_beams or --do_sample say otherwise.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below (seconds: JAX's) is one line too, not a traceback
    from app.entry import exit_on_signals

    exit_on_signals()

import argparse
import copy
import json
import logging
import os
import sys
import time
from dataclasses import asdict

from app.args import carried_model, ensure_writable, make_config, parse_args
from app.entry import entry
from app.logs import setup_logging
from app.runtime import ensure_host_devices, is_main_process, setup_jax
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def _positive(text: str) -> int:

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} must be at least 1 (omit --limit to score every sample)")
    return n


def extra_flags(p):
    p.add_argument("--output", default=None,
                   help="JSON report path (default: SPLIT[_stepN].json, e.g. validation_mismatched_step1000.json, "
                        "beside the checkpoint, else in runs/)")
    p.add_argument("--limit", type=_positive, default=None,
                   help="score only the first N samples (the report is then named ..._firstN.json: it never "
                        "replaces the full one)")


def report_name(split: str, step=None, limit=None) -> str:
    """validation_mismatched_step1000.json (..._first100.json for a --limit run); a split not named validation*
    gets the prefix (validation_test.json)."""
    base = split if split.startswith("validation") else f"validation_{split}"
    return base + (f"_step{step}" if step is not None else "") + (f"_first{limit}" if limit else "") + ".json"


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


class Validator:
    """Compiled sharded decoding (greedy, beam search or sampling: the config's inference section) over
    length-bucketed micro-batches."""

    def __init__(self, cfg, graphs=None):
        from graphs.graphs import Graphs

        if cfg.execution.rts:
            raise ValueError("Validator needs a config with rts=false: inference keeps whole tp shards (nothing "
                             "to gather per call); build it as validation_config does")
        self.cfg, self.graphs = cfg, graphs or Graphs(cfg)
        self.batch_size = cfg.execution.micro_batch_size * cfg.execution.data_parallel
        self.left_pad = self.graphs.family.left_pad_prompts  # a causal LM continues its prompt
        self._generate = None

    def generate(self, tokenizer):
        """The compiled decoding program, stopping at the tokenizer's end-of-text token."""
        if self._generate is None:
            from data.tasks import pad_id
            from modelling.decoding import Options

            inf = self.cfg.inference
            self._generate = self.graphs.decode_phase(Options.of_config(inf), eos_id=tokenizer.eos_token_id,
                                                      pad_id=pad_id(tokenizer), seed=inf.sampling_seed)
        return self._generate

    def load_params(self, directory=None, step=None, hf_model=None):
        from utils import checkpoint as ckpt

        g = self.graphs
        if hf_model:
            from modelling.hf_mapping import load_hf_model

            _, host = load_hf_model(hf_model, self.cfg.execution.tensor_parallel, expect=self.cfg.model)
            return g.shard_params(host)
        saved = ckpt.load_meta(directory, step)
        if saved.get("lora_base"):
            return self.merged_params(directory, step, saved)
        params, _, _ = ckpt.load(directory, step, ckpt.abstract_like(g.abstract_params(), g.param_shardings),
                                 hint=g.shape_hint)
        return params

    def merged_params(self, directory: str, step: int, saved: dict):
        """A LoRA checkpoint's adapters on their frozen base (which its meta names), merged: the weights decoded."""
        import jax

        from modelling import lora

        lg, adapters, frozen = self.lora_parts(directory, step, saved)
        merge = lambda b, a: lora.merged(b, a, lg.opts)  # noqa: E731
        return jax.jit(merge, out_shardings=self.graphs.param_shardings)(frozen, adapters)

    def lora_parts(self, directory: str, step: int, saved: dict, base: bool = True) -> tuple:
        """(the LoRA run's Graphs, its adapters, its frozen base or None) of a LoRA checkpoint: the base found where
        the checkpoint's meta says, and refused (one line) when its fingerprint is not the one trained on."""
        from config.config import FIELDS, coerce, set_path
        from graphs.graphs import Graphs
        from graphs.state import describe_base, device_base, fingerprint
        from utils import checkpoint as ckpt

        lcfg = copy.deepcopy(self.cfg)
        for flag in ("lora_rank", "lora_alpha", "lora_targets"):
            value = saved["config"]
            for p in FIELDS[flag].path:
                value = value[p]
            set_path(lcfg, FIELDS[flag].path, coerce(FIELDS[flag], value))
        lg = Graphs(lcfg, mesh=self.graphs.mesh)
        adapters, _, _ = ckpt.load(directory, step, ckpt.abstract_like(lg.abstract_params(), lg.param_shardings),
                                   hint=lg.shape_hint)
        if not base:
            return lg, adapters, None
        meta, source = saved["lora_base"], saved["lora_base"]["source"]
        frozen = device_base(lg, source)
        if fingerprint(frozen) != meta["fingerprint"]:
            raise FlanT5Error(f"{directory} step {step} holds adapters trained on other weights than "
                              f"{describe_base(source)} as found now (fingerprint {meta['fingerprint']} != "
                              f"{fingerprint(frozen)}): restore that base")
        return lg, adapters, frozen

    def predict(self, params, feats: dict, tokenizer, progress: str = "validating") -> list:
        """Generated texts for every row of feats (input_ids/attention_mask [n, len]), in row order."""
        from tqdm import tqdm

        from data.loader import length_buckets

        lengths = feats["attention_mask"].sum(1)
        out = [None] * len(lengths)
        for idx in tqdm(length_buckets(lengths, self.batch_size), desc=progress, unit="batch",
                        disable=None if is_main_process() else True):
            for i, text in zip(idx, self.predict_batch(params, feats, idx, tokenizer)):
                out[i] = text
        return out

    def predict_batch(self, params, feats: dict, idx, tokenizer, tokens: bool = False) -> list:
        """Generated texts of rows ``idx`` of feats (at most one batch), padded to their longest prompt (a multiple
        of 8: few compilations; no prompt is ever cut); ``tokens``: their token ids [len(idx), output_length]."""
        import numpy as np

        from data.packing import left_align
        from graphs.sharding import fetch, put_global

        n = int(-(-int(feats["attention_mask"][idx].sum(1).max()) // 8) * 8)
        width = feats["input_ids"].shape[1]
        rows = np.concatenate([idx, np.repeat(idx[-1:], self.batch_size - len(idx))])  # fill the last batch
        ids, mask = feats["input_ids"][rows, :n], feats["attention_mask"][rows, :n]
        if n > width:  # the feats' width: pad it to the multiple of 8
            ids, mask = (np.pad(x, ((0, 0), (0, n - width))) for x in (ids, mask))
        if self.left_pad:  # right-align each prompt: the generated tokens follow its last token
            ids, mask = left_align(ids, mask)
        ids, mask = put_global(ids, self.graphs.row_sharding), put_global(mask, self.graphs.row_sharding)
        out = fetch(self.generate(tokenizer)(params, ids, mask))[: len(idx)]
        return out if tokens else tokenizer.batch_decode(out, skip_special_tokens=True)


def validation_config(args, overrides: dict):
    """The inference preset, the model's own shape (explicit flags that contradict it are errors), the task the
    checkpoint was trained on (its data, template, labels, metrics, tokenizer, output length: flags change them),
    the command line, and what validation requires (eval mode, no RTS), validated once."""
    load, hf_model = overrides.get("load"), overrides.get("hf_model")
    if not load and not hf_model:
        raise FlanT5Error("nothing to validate: pass --load CKPT (a --save directory of run_finetuning.py) or "
                          "--hf_model NAME")
    carried = carried_model(overrides, load, hf_model)
    if "dataset" in overrides or "split" in overrides:  # data named on the command line: its rows, not held-out ones
        carried["holdout"] = 0
    # a LoRA checkpoint's adapters are merged into their base (Validator.merged_params): the model decoded has none
    return make_config("inference", args.config, overrides, fixed={"eval": True, "rts": False, "lora_rank": 0},
                       defaults=carried)


def evaluation_data(cfg, overrides: dict, load):
    """The examples to score (data.tasks.evaluation_set), refusing to score a checkpoint's own training rows as if
    they were held out."""
    from data.tasks import Task, evaluation_set

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


def prompt_features(examples: list, tokenizer, validator, cfg) -> tuple:
    """(input features padded to the longest prompt, none cut, the share of unknown prompt tokens)."""
    from data.tasks import tokenize_prompts, unknown_share

    feats = tokenize_prompts(examples, tokenizer, validator.graphs.family)  # never truncated
    longest = feats["input_ids"].shape[1]
    if longest > cfg.model.sequence_length:
        logger.info("%d prompt(s) are longer than sequence_length %d (the longest: %d tokens): each batch is padded "
                    "to its own longest prompt, as the original validated, none is cut",
                    int((feats["attention_mask"].sum(1) > cfg.model.sequence_length).sum()), cfg.model.sequence_length,
                    longest)
    unknown = unknown_share([row[m > 0] for row, m in zip(feats["input_ids"], feats["attention_mask"])], tokenizer,
                            sample=len(examples))
    if unknown > 0.01:
        logger.warning("%.1f%% of the prompt tokens are unknown to tokenizer %s: the model sees <unk> there",
                       100 * unknown, cfg.data.tokenizer)
    return feats, unknown


def result_line(report: dict, step, what: str, path: str) -> str:
    """``CKPT step N: TASK on DATA: scores -> path``; a label set's line keeps the original's accuracy figure."""
    from data.metrics import headline

    head = f"{report['checkpoint']}" + (f" step {step}" if step is not None else "")
    if "accuracy" in report["scores"]:
        rest = {k: v for k, v in report["scores"].items() if k != "accuracy"}
        return (f"{head}: accuracy {report['accuracy']:.2%} on {report['samples']} samples of {what} "
                f"({report['unknown']} unknown)" + (f", {headline(rest)}" if rest else "") + f" -> {path}")
    return f"{head}: {report['task']} on {report['samples']} samples of {what}: {headline(report['scores'])} -> {path}"


@entry
def main(argv=None) -> None:
    setup_logging()
    args, overrides = parse_args("inference", __doc__.splitlines()[0], "tiny", argv, extra_flags)
    if args.output:
        ensure_writable(args.output, "--output", is_dir=False)
    cfg = validation_config(args, overrides)
    ensure_host_devices(cfg.devices)
    setup_jax()
    from data.tasks import load_tokenizer
    from utils import checkpoint as ckpt

    targets = ckpt.resolve(cfg.checkpoint.load) if cfg.checkpoint.load else [(None, None)]
    for directory, _ in targets:
        if directory and not args.output:
            ensure_writable(directory, "the checkpoint directory (where the report goes; pass --output)")
    task, data = evaluation_data(cfg, overrides, cfg.checkpoint.load)
    examples = data.examples[: args.limit]
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    validator = Validator(cfg)
    feats, unknown = prompt_features(examples, tokenizer, validator, cfg)
    for directory, step in targets:
        validate(cfg, args, validator, (task, data, examples, feats, unknown), tokenizer, directory, step,
                 len(targets))


def validate(cfg, args, validator, inputs: tuple, tokenizer, directory, step, n_targets: int) -> None:
    """One checkpoint decoded, scored, reported (process 0 of a multi-process run writes and prints)."""
    from data.metrics import score

    task, data, examples, feats, unknown = inputs
    t0 = time.perf_counter()
    params = validator.load_params(directory, step, None if directory else cfg.data.hf_model)
    report = score(task, examples, validator.predict(params, feats, tokenizer))
    report.update(split=data.name, dataset=data.dataset, single_file=data.single, data=data.what, step=step,
                  limit=args.limit, prompt_tokens_unknown=unknown, longest_prompt=int(feats["attention_mask"].sum(1).max()),
                  checkpoint=directory or cfg.data.hf_model, decoding=asdict(cfg.inference),
                  seconds=time.perf_counter() - t0)
    name = report_name(data.name, step, args.limit)
    path = args.output if args.output and n_targets == 1 else os.path.join(directory or "runs", name)
    if not is_main_process():
        return
    path = write_report(report, path)
    print(result_line(report, step, data.what, path), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
