"""Greedy-decoding validation on MNLI (validation_mismatched by default).

    python3 run_validation.py --config tiny --load ckpt/tiny            # offline, synthetic split
    python3 run_validation.py --config xxl-mnli --load 'ckpt/xxl/*'     # every checkpoint, in step order
    python3 run_validation.py --config xl-mnli --hf_model google/flan-t5-xl
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time

from utils.cli import die, ensure_host_devices, is_main_process, parse_config, setup_jax, setup_logging

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--output", default=None,
                   help="JSON report path (default: SPLIT[_stepN].json, e.g. validation_mismatched_step1000.json, "
                        "beside the checkpoint, else in runs/)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N samples")


def report_name(split: str, step=None) -> str:
    """validation_mismatched_step1000.json; a split not named validation* gets the prefix (validation_test.json)."""
    base = split if split.startswith("validation") else f"validation_{split}"
    return base + (f"_step{step}" if step is not None else "") + ".json"


class Validator:
    """Compiled sharded greedy decoding over length-bucketed micro-batches."""

    def __init__(self, cfg):
        import jax

        from graphs.graphs import Graphs

        cfg.execution.rts = False  # inference keeps whole tp shards: nothing to gather per call
        self.cfg, self.graphs = cfg, Graphs(cfg)
        self._generate = self.graphs.generate_phase(cfg.inference.output_length)
        self.batch_size = cfg.execution.micro_batch_size * cfg.execution.data_parallel
        self._jax = jax

    def load_params(self, directory=None, step=None, hf_model=None):
        from utils import checkpoint as ckpt

        g = self.graphs
        if hf_model:
            from modelling.hf_mapping import load_hf_model

            _, host = load_hf_model(hf_model, self.cfg.execution.tensor_parallel, expect=self.cfg.model)
            return g.shard_params(host)
        abstract = self._jax.eval_shape(lambda: g.init_params())
        params, _, _ = ckpt.load(directory, step, ckpt.abstract_like(abstract, g.param_shardings))
        return params

    def predict(self, params, feats: dict, tokenizer) -> list:
        """Generated texts for every row of feats (input_ids/attention_mask [n, len]), in row order."""
        import numpy as np
        from tqdm import tqdm

        from data.mnli import length_buckets
        from graphs.sharding import fetch, put_global

        lengths = feats["attention_mask"].sum(1)
        out = [None] * len(lengths)
        L = self.cfg.model.sequence_length
        for idx in tqdm(length_buckets(lengths, self.batch_size), desc="validating", unit="batch",
                        disable=None if is_main_process() else True):
            # shrink the encoder to the longest prompt of the batch (multiple of 8: few compilations)
            n = int(min(L, -(-int(lengths[idx].max()) // 8) * 8))
            rows = np.concatenate([idx, np.repeat(idx[-1:], self.batch_size - len(idx))])  # fill the last batch
            ids = put_global(feats["input_ids"][rows, :n], self.graphs.row_sharding)
            mask = put_global(feats["attention_mask"][rows, :n], self.graphs.row_sharding)
            tokens = fetch(self._generate(params, ids, mask))[: len(idx)]
            for i, text in zip(idx, tokenizer.batch_decode(tokens, skip_special_tokens=True)):
                out[i] = text
        return out


def main(argv=None) -> None:
    setup_logging()
    cfg, args = parse_config("inference", __doc__.splitlines()[0], "tiny", argv, extra_flags)
    cfg.model.eval = True
    ensure_host_devices(cfg.devices)
    setup_jax()
    from data.mnli import DataError, load_rows, load_tokenizer, score, tokenize_inputs
    from graphs.sharding import DeviceCountError
    from config import ConfigError
    from modelling.hf_mapping import CheckpointError
    from utils import checkpoint as ckpt

    try:
        if not cfg.checkpoint.load and not cfg.data.hf_model:
            die("nothing to validate: pass --load CKPT (a --save directory of run_finetuning.py) or --hf_model NAME")
        targets = ckpt.resolve(cfg.checkpoint.load) if cfg.checkpoint.load else [(None, None)]
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        rows = load_rows(cfg.data.dataset, cfg.data.split, seed=cfg.model.seed)[: args.limit]
        feats = tokenize_inputs(rows, tokenizer, cfg.model.sequence_length)
        labels = [r["label"] for r in rows]
        validator = Validator(cfg)
        for directory, step in targets:
            t0 = time.perf_counter()
            params = validator.load_params(directory, step, None if directory else cfg.data.hf_model)
            report = score(labels, validator.predict(params, feats, tokenizer))
            report.update(split=cfg.data.split, dataset=cfg.data.dataset, step=step,
                          checkpoint=directory or cfg.data.hf_model, seconds=time.perf_counter() - t0)
            name = report_name(cfg.data.split, step)
            path = args.output if args.output and len(targets) == 1 else os.path.join(directory or "runs", name)
            if not is_main_process():  # process 0 of a multi-process run writes and prints the report
                continue
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump(report, f, indent=1)
            print(f"{report['checkpoint']}" + (f" step {step}" if step is not None else "")
                  + f": accuracy {report['accuracy']:.2%} on {report['samples']} samples of {cfg.data.split} "
                  f"({report['unknown']} unknown) -> {path}", flush=True)
    except (DataError, DeviceCountError, ConfigError, CheckpointError, ckpt.CheckpointNotFound) as e:
        die(str(e))


if __name__ == "__main__":
    main(sys.argv[1:])
