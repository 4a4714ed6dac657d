"""Greedy-decoding validation on MNLI (validation_mismatched by default).

    python3 run_validation.py --config tiny --load ckpt/tiny            # offline, synthetic split
    python3 run_validation.py --config xxl-mnli --load 'ckpt/xxl/*'     # every checkpoint, in step order
    python3 run_validation.py --config xl-mnli --hf_model google/flan-t5-xl

The model's shape (layers, widths, heads, vocabulary) comes from the checkpoint's saved
config, or from the --hf_model's config.json: the training overrides need not be repeated.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from app.args import carried_model, ensure_writable, make_config, parse_args
from app.entry import entry
from app.logs import setup_logging
from app.runtime import ensure_host_devices, is_main_process, setup_jax
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def _positive(text: str) -> int:
    import argparse

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
    """Compiled sharded greedy decoding over length-bucketed micro-batches."""

    def __init__(self, cfg):
        import jax

        from graphs.graphs import Graphs

        if cfg.execution.rts:
            raise ValueError("Validator needs a config with rts=false: inference keeps whole tp shards (nothing "
                             "to gather per call); build it as validation_config does")
        self.cfg, self.graphs = cfg, Graphs(cfg)
        self.batch_size = cfg.execution.micro_batch_size * cfg.execution.data_parallel
        self.left_pad = self.graphs.family.left_pad_prompts  # a causal LM continues its prompt
        self._generate = None
        self._jax = jax

    def generate(self, tokenizer):
        """The compiled decoding program, stopping at the tokenizer's end-of-text token."""
        if self._generate is None:
            from data.mnli import pad_id

            self._generate = self.graphs.generate_phase(self.cfg.inference.output_length, eos_id=tokenizer.eos_token_id,
                                                        pad_id=pad_id(tokenizer))
        return self._generate

    def load_params(self, directory=None, step=None, hf_model=None):
        from utils import checkpoint as ckpt

        g = self.graphs
        if hf_model:
            from modelling.hf_mapping import load_hf_model

            _, host = load_hf_model(hf_model, self.cfg.execution.tensor_parallel, expect=self.cfg.model)
            return g.shard_params(host)
        params, _, _ = ckpt.load(directory, step, ckpt.abstract_like(g.abstract_params(), g.param_shardings),
                                 hint=g.shape_hint)
        return params

    def predict(self, params, feats: dict, tokenizer) -> list:
        """Generated texts for every row of feats (input_ids/attention_mask [n, len]), in row order."""
        import numpy as np
        from tqdm import tqdm

        from data.mnli import length_buckets
        from data.packing import left_align
        from graphs.sharding import fetch, put_global

        lengths = feats["attention_mask"].sum(1)
        out = [None] * len(lengths)
        L = feats["input_ids"].shape[1]
        for idx in tqdm(length_buckets(lengths, self.batch_size), desc="validating", unit="batch",
                        disable=None if is_main_process() else True):
            # pad to the longest prompt of the batch (a multiple of 8: few compilations); no prompt is ever cut
            n = int(-(-int(lengths[idx].max()) // 8) * 8)
            if n > L:  # the feats' width: pad it to the multiple of 8
                feats = {k: np.pad(v, ((0, 0), (0, n - L))) for k, v in feats.items()}
                L = n
            rows = np.concatenate([idx, np.repeat(idx[-1:], self.batch_size - len(idx))])  # fill the last batch
            ids, mask = feats["input_ids"][rows, :n], feats["attention_mask"][rows, :n]
            if self.left_pad:  # right-align each prompt: the generated tokens follow its last token
                ids, mask = left_align(ids, mask)
            ids, mask = put_global(ids, self.graphs.row_sharding), put_global(mask, self.graphs.row_sharding)
            tokens = fetch(self.generate(tokenizer)(params, ids, mask))[: len(idx)]
            for i, text in zip(idx, tokenizer.batch_decode(tokens, skip_special_tokens=True)):
                out[i] = text
        return out


def validation_config(args, overrides: dict):
    """The inference preset, the model's own shape (explicit flags that contradict it are errors), the command
    line, and what validation requires (eval mode, no RTS), validated once."""
    load, hf_model = overrides.get("load"), overrides.get("hf_model")
    if not load and not hf_model:
        raise FlanT5Error("nothing to validate: pass --load CKPT (a --save directory of run_finetuning.py) or "
                          "--hf_model NAME")
    carried = carried_model(overrides, load, hf_model)
    return make_config("inference", args.config, overrides, fixed={"eval": True, "rts": False},
                       defaults={k: v for k, v in carried.items() if not (k == "tokenizer" and not load)})


@entry
def main(argv=None) -> None:
    setup_logging()
    args, overrides = parse_args("inference", __doc__.splitlines()[0], "tiny", argv, extra_flags)
    if args.output:
        ensure_writable(args.output, "--output", is_dir=False)
    cfg = validation_config(args, overrides)
    ensure_host_devices(cfg.devices)
    setup_jax()
    from data.mnli import load_rows, load_tokenizer, score, tokenize_inputs
    from utils import checkpoint as ckpt

    targets = ckpt.resolve(cfg.checkpoint.load) if cfg.checkpoint.load else [(None, None)]
    for directory, _ in targets:
        if directory and not args.output:
            ensure_writable(directory, "the checkpoint directory (where the report goes; pass --output)")
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    split, single_file = cfg.data.split, os.path.isfile(cfg.data.dataset)
    if single_file:
        # one file holds one set of rows, whatever --split says: name the file, not a split
        split = os.path.splitext(os.path.basename(cfg.data.dataset))[0]
        logger.warning("validating on every row of %s (a single file: --split %s does not apply; pass a directory "
                       "holding %s.jsonl to score a split)", cfg.data.dataset, cfg.data.split, cfg.data.split)
    rows = load_rows(cfg.data.dataset, cfg.data.split, seed=cfg.model.seed)[: args.limit]
    validator = Validator(cfg)
    feats = tokenize_inputs(rows, tokenizer, None, validator.graphs.family)  # never truncated
    longest = feats["input_ids"].shape[1]
    if longest > cfg.model.sequence_length:
        logger.info("%d prompt(s) are longer than sequence_length %d (the longest: %d tokens): each batch is padded "
                    "to its own longest prompt, as the original validated, none is cut",
                    int((feats["attention_mask"].sum(1) > cfg.model.sequence_length).sum()), cfg.model.sequence_length,
                    longest)
    labels = [r["label"] for r in rows]
    unk = getattr(tokenizer, "unk_token_id", None)
    unknown_share = 0.0 if unk is None else float((feats["input_ids"][feats["attention_mask"] > 0] == unk).mean())
    if unknown_share > 0.01:
        logger.warning("%.1f%% of the prompt tokens are unknown to tokenizer %s: the model sees <unk> there",
                       100 * unknown_share, cfg.data.tokenizer)
    for directory, step in targets:
        t0 = time.perf_counter()
        params = validator.load_params(directory, step, None if directory else cfg.data.hf_model)
        report = score(labels, validator.predict(params, feats, tokenizer))
        report.update(split=split, dataset=cfg.data.dataset, single_file=single_file, step=step, limit=args.limit,
                      prompt_tokens_unknown=unknown_share, longest_prompt=int(feats["attention_mask"].sum(1).max()),
                      checkpoint=directory or cfg.data.hf_model, seconds=time.perf_counter() - t0)
        name = report_name(split, step, args.limit)
        path = args.output if args.output and len(targets) == 1 else os.path.join(directory or "runs", name)
        if not is_main_process():  # process 0 of a multi-process run writes and prints the report
            continue
        path = write_report(report, path)
        what = f"the rows of {cfg.data.dataset}" if single_file else cfg.data.split
        print(f"{report['checkpoint']}" + (f" step {step}" if step is not None else "")
              + f": accuracy {report['accuracy']:.2%} on {report['samples']} samples of {what} "
              f"({report['unknown']} unknown) -> {path}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
