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
import logging
import sys

from app.args import command_line, ensure_writable
from app.entry import entry

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
                   help="JSON report path (default: SPLIT[_stepN][_DECODING].json, e.g. "
                        "validation_mismatched_step1000.json, beside the checkpoint, else in runs/)")
    p.add_argument("--limit", type=_positive, default=None,
                   help="score only the first N samples (the report is then named ..._firstN.json: it never "
                        "replaces the full one)")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan of decoding (device and host bytes: weights, KV cache of a batch of "
                        "micro_batch_size x data_parallel prompts of sequence_length tokens and output_length new "
                        "ones, activations; from shapes, nothing loaded) and exit")
    p.add_argument("--plan_exact", action="store_true",
                   help="with --plan: count the programs' temporaries as XLA compiles them for this backend")


@entry
def main(argv=None) -> None:
    args, overrides = command_line("inference", __doc__, argv, extra_flags)
    if args.output:
        ensure_writable(args.output, "--output", is_dir=False)
    from app.predict import start_decoding

    cfg = start_decoding(args, overrides)
    if args.plan or args.plan_exact:
        from app.predict import print_plan

        print_plan(cfg, cfg.execution.rows_per_micro_batch, exact=args.plan_exact)
        return
    from app.evaluate import Validation
    from data.tokenizer import load_tokenizer
    from utils import checkpoint as ckpt

    targets = ckpt.resolve(cfg.checkpoint.load) if cfg.checkpoint.load else [(None, None)]
    for directory, _ in targets:
        if directory and not args.output:
            ensure_writable(directory, "the checkpoint directory (where the report goes; pass --output)")
    validation = Validation(cfg, overrides, load_tokenizer(cfg.data.tokenizer), args.limit, args.output)
    for directory, step in targets:
        validation(directory, step, len(targets))


if __name__ == "__main__":
    main(sys.argv[1:])
