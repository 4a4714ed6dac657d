"""A model's outputs: on a few examples beside their references (and HF generate's), or on a whole file of inputs.

    python3 run_inference.py --load ckpt/tiny --limit 5                       # 5 held-out examples of its task
    python3 run_inference.py --load ckpt/gptj --compare_hf --limit 5          # and HF generate's outputs beside ours
    python3 run_inference.py --config gpt-j --prompt "mnli hypothesis: ... premise: ..."
    python3 run_inference.py --load ckpt/sum --input tickets.jsonl --predictions tickets.out.jsonl --num_beams 4

As the original's run_inference.py: a quick look at what a fine-tuned model says, for both families. Inputs come
from --prompt (the task's input, in the task's prompt format as training and validation render it: GPT-J reads
``TEXT target:`` and answers the target alone, as T5 does), from --input (a file of rows in the task's format: its
input columns, a target column optional), or from the task's held-out data (a checkpoint's own: its template and
format). The model's shape, family and task come from the checkpoint or the --hf_model's config.json. Decoding is
greedy unless --num_beams or --do_sample say otherwise.

With --input the predictions go to a JSONL file (--predictions; default: beside the input, NAME.predictions.jsonl),
one line a row in the input's order ({"row", "input", "prediction"}, "reference" where the row has a target, and the
row's id where the input has an id column: id, idx, uid or guid),
written batch by batch: an interrupted run keeps what it finished, and the same command continues after it. What
wrote them (the checkpoint and step, a fingerprint of the weights, the tokenizer, every decoding option) is recorded
beside it (NAME.meta.json): another model or setting does not continue the file, it names each difference.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below (seconds: JAX's) is one line too, not a traceback
    from app.entry import exit_on_signals

    exit_on_signals()

import logging
import os
import sys

from app.args import command_line
from app.entry import entry
from app.runtime import is_main_process
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--prompt", nargs="+", action="extend", default=None, metavar="TEXT",
                   help="the task's inputs: --prompt TEXT [TEXT ...] (the flag may be repeated too), each rendered in "
                        "the task's prompt format as validation renders it (GPT-J: TEXT target:)")
    p.add_argument("--input", default=None, metavar="FILE",
                   help="a file of rows in the task's format (jsonl, json, csv, tsv, parquet) to predict")
    p.add_argument("--predictions", default=None, metavar="JSONL",
                   help="with --input: where the predictions go (default: INPUT's name + .predictions.jsonl)")
    p.add_argument("--limit", type=int, default=None,
                   help="the first N rows: of --input's file (default: all), or of the task's held-out data "
                        "(default 4)")
    p.add_argument("--compare_hf", action="store_true",
                   help="also decode with Hugging Face generate on the same weights and show whether they agree")


@entry
def main(argv=None) -> list:
    args, overrides = command_line("inference", __doc__, argv, extra_flags)
    from app.predict import start_decoding

    cfg = start_decoding(args, overrides)
    from app import predict
    from app.train_data import run_tasks
    from data.mixture import inference_task
    from data.tokenizer import load_tokenizer
    from decoder.decoder import Decoder
    from utils import checkpoint as ckpt

    # a mixture's checkpoint predicts with the task --task_name names (its first without the flag)
    td = inference_task(run_tasks(cfg), overrides.get("task_name") if cfg.mixture.tasks else None)
    examples = predict.inference_inputs(args.prompt, args.input, args.limit, cfg, td)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    decoder = Decoder.of_config(cfg, tokenizer)
    decoder.options = predict.decoding_options(cfg, tokenizer, decoder, td.task)  # (the processors the flags ask)
    feats, _ = predict.prompt_features(examples, tokenizer, decoder.family, cfg.model.sequence_length)
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1] if cfg.checkpoint.load else (None, None)
    params = decoder.load_params(directory, step, None if directory else cfg.data.hf_model)
    ranked = cfg.inference.score == "labels"
    if ranked and (args.input or not td.task.labels):
        raise FlanT5Error("--score labels ranks a label task's labels beside a few examples' answers: "
                          + ("run_validation.py --score labels scores a whole set" if args.input else
                             f"the task {td.task.name!r} has none (free text): drop --score"))
    if args.input:
        path = args.predictions or os.path.splitext(args.input)[0] + ".predictions.jsonl"
        writer = predict.written_by(cfg, directory, step, params)
        out, done = predict.predict_file(decoder, params, examples, feats, path, writer)
        if is_main_process():
            print(f"{len(examples) - done} predictions of {args.input} -> {path} ({len(examples)} rows in all)",
                  flush=True)
        return out
    out = predict.side_by_side(decoder, params, examples, feats, tokenizer, args.compare_hf)
    if ranked:  # each example's most likely label (rank classification), beside the decoded answer
        ll = decoder.rank(params, feats, decoder.family.encode_targets(tokenizer, list(td.task.labels)))
        for r, j in zip(out, ll.argmax(axis=1)):
            r["ranked"] = td.task.labels[j]
    if is_main_process():
        show(out, args.compare_hf)
    return out


def show(out: list, compared: bool) -> None:
    """Each input, our output, its reference, and HF generate's with --compare_hf, printed."""
    for r in out:
        print(f"prompt: {r['prompt']}\n  ours: {r['ours']!r}" + (f"\n  reference: {r['reference']!r}"
                                                                 if "reference" in r else "")
              + (f"\n  ranked: {r['ranked']!r}" if "ranked" in r else "")
              + (f"\n  HF:   {r['hf']!r} ({'same tokens' if r['same_tokens'] else 'DIFFERENT tokens'})"
                 if compared else ""))
    if compared:
        agree = [r["same_tokens"] for r in out]
        print(f"{sum(agree)} of {len(agree)} outputs token for token equal to HF generate")


if __name__ == "__main__":
    main(sys.argv[1:])
