"""A model's outputs: on a few examples beside their references (and HF generate's), or on a whole file of inputs.

    python3 run_inference.py --load ckpt/tiny --limit 5                       # 5 held-out examples of its task
    python3 run_inference.py --load ckpt/gptj --compare_hf --limit 5          # and HF generate's outputs beside ours
    python3 run_inference.py --config gpt-j --prompt "mnli hypothesis: ... premise: ... target:"
    python3 run_inference.py --load ckpt/sum --input tickets.jsonl --predictions tickets.out.jsonl --num_beams 4

As the original's run_inference.py: a quick look at what a fine-tuned model says, for both families. Inputs come
from --prompt (as given: the whole text the model reads), from --input (a file of rows in the task's format: its
input columns, a target column optional), or from the task's held-out data (a checkpoint's own: its template and
format). The model's shape, family and task come from the checkpoint or the --hf_model's config.json. Decoding is
greedy unless --num_beams or --do_sample say otherwise.

With --input the predictions go to a JSONL file (--predictions; default: beside the input, NAME.predictions.jsonl),
one line a row in the input's order ({"row", "input", "prediction"} and "reference" where the row has a target),
written batch by batch: an interrupted run keeps what it finished, and the same command continues after it.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below (seconds: JAX's) is one line too, not a traceback
    from app.entry import exit_on_signals

    exit_on_signals()

import json
import logging
import os
import sys

from app.args import parse_args
from app.entry import entry
from app.logs import setup_logging
from app.runtime import ensure_host_devices, is_main_process, setup_jax
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt to continue, as given (repeat the flag for several)")
    p.add_argument("--input", default=None, metavar="FILE",
                   help="a file of rows in the task's format (jsonl, json, csv, tsv, parquet) to predict")
    p.add_argument("--predictions", default=None, metavar="JSONL",
                   help="with --input: where the predictions go (default: INPUT's name + .predictions.jsonl)")
    p.add_argument("--limit", type=int, default=4, help="examples taken from the task's held-out data (default 4)")
    p.add_argument("--compare_hf", action="store_true",
                   help="also decode with Hugging Face generate on the same weights and show whether they agree")


def hf_generate(cfg, family, host_params, ids, mask, eos: int, pad: int):
    """HF ``generate`` of the same weights with the same decoding options: tokens [b, output_length] padded with
    ``pad`` after each end-of-text."""
    import numpy as np
    import torch
    import transformers

    kw = family.hf_config_dict(cfg.model)
    arch = kw.pop("architectures")[0]
    model = getattr(transformers, arch)(transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)).eval()
    sd = {k: torch.tensor(np.asarray(v)) for k, v in family.hf_state_dict(host_params, cfg.model).items()}
    if "lm_head.weight" in sd and model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        # transformers 5 ties T5's head to the embedding whatever the config says; Flan-T5's are separate, so
        # the head gets its own tensor before loading (loading into tied tensors would overwrite the embedding)
        model.get_output_embeddings().weight = torch.nn.Parameter(sd["lm_head.weight"].clone())
    if not cfg.model.tie_word_embeddings:
        model.config.tie_word_embeddings = False  # UMT5 rescales its output when it reads True (forced on construction)
    model.load_state_dict(sd, strict=False)
    n = cfg.inference.output_length
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=n,
                             eos_token_id=eos, pad_token_id=pad, **hf_decoding(cfg.inference),
                             **family.hf_generate_kwargs())
    # a causal LM's output continues its prompt; an encoder-decoder's starts with the decoder's start token
    out = (out[:, ids.shape[1]:] if family.causal else out[:, 1:]).numpy()
    out = np.pad(out, ((0, 0), (0, n - out.shape[1])), constant_values=pad)
    ended = np.cumsum(out == eos, axis=1) - (out == eos) > 0  # HF's beam search fills after EOS with EOS
    return np.where(ended, pad, out)


def hf_decoding(inference) -> dict:
    """The config's decoding options as HF ``generate``'s arguments."""
    es = {"true": True, "false": False, "never": "never"}[inference.early_stopping]
    return dict(do_sample=inference.do_sample, num_beams=inference.num_beams, length_penalty=inference.length_penalty,
                early_stopping=es, temperature=inference.temperature, top_k=inference.top_k, top_p=inference.top_p)


def inputs_of(args, cfg, task) -> list:
    """The examples to decode: --prompt texts (as given), --input's rows, or the task's held-out examples."""
    from data import sources
    from data.tasks import Example, evaluation_set

    if args.prompt:
        return [Example(t, "") for t in args.prompt]
    if args.input:
        return task.examples(sources.read(args.input, "", cfg.model.seed), targets=False)
    if args.limit < 1:
        raise FlanT5Error(f"--limit {args.limit} must be at least 1")
    return evaluation_set(cfg.data, task, cfg.model.seed).examples[: args.limit]


def features(examples: list, tokenizer, family, given: bool, sequence_length: int) -> dict:
    """Input ids and mask (the family's format; --prompt texts as given), never cut: a longer prompt is an error."""
    import numpy as np

    from data.tasks import pad_id, unknown_share

    enc = family.encode_inputs(tokenizer, [e.input if given else family.prompt(e.input) for e in examples])
    n = max(len(x) for x in enc)
    if n > sequence_length:
        raise FlanT5Error(f"a prompt has {n} tokens but sequence_length is {sequence_length}: pass --sequence_length "
                          f"{n} or a shorter prompt")
    share = unknown_share(enc, tokenizer)
    if share > 0:
        logger.warning("%.1f%% of the prompt tokens are unknown to tokenizer %s (<unk>): the model sees nothing "
                       "there; pass the tokenizer of this model (--tokenizer)", 100 * share, tokenizer.name_or_path)
    ids, mask = np.full((len(enc), n), pad_id(tokenizer), np.int32), np.zeros((len(enc), n), np.int32)
    for i, x in enumerate(enc):
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    return {"input_ids": ids, "attention_mask": mask}


@entry
def main(argv=None) -> list:
    setup_logging()
    args, overrides = parse_args("inference", __doc__.splitlines()[0], "tiny", argv, extra_flags)
    from run_validation import Validator, validation_config

    cfg = validation_config(args, overrides)
    ensure_host_devices(cfg.devices)
    setup_jax()
    from data.tasks import Task, load_tokenizer
    from utils import checkpoint as ckpt

    task = Task.of_config(cfg)
    examples = inputs_of(args, cfg, task)
    validator = Validator(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    feats = features(examples, tokenizer, validator.graphs.family, bool(args.prompt), cfg.model.sequence_length)
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1] if cfg.checkpoint.load else (None, None)
    params = validator.load_params(directory, step, None if directory else cfg.data.hf_model)
    if args.input:
        return predict_file(args, validator, params, examples, feats, tokenizer)
    return show(args, cfg, validator, params, examples, feats, tokenizer)


def show(args, cfg, validator, params, examples: list, feats: dict, tokenizer) -> list:
    """Each input, our output (its reference, and HF generate's with --compare_hf), printed."""
    import jax
    import numpy as np

    from data.tasks import pad_id

    idx = np.arange(len(examples))
    tokens = np.concatenate([validator.predict_batch(params, feats, idx[i: i + validator.batch_size], tokenizer,
                                                     tokens=True) for i in range(0, len(idx), validator.batch_size)])
    ours = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    theirs = agree = None
    if args.compare_hf:
        host = jax.tree.map(np.asarray, params)
        ids, mask = feats["input_ids"], feats["attention_mask"]
        if validator.left_pad:
            from data.packing import left_align

            ids, mask = left_align(ids, mask)
        hf_tokens = hf_generate(cfg, validator.graphs.family, host, ids, mask, tokenizer.eos_token_id,
                                pad_id(tokenizer))
        theirs = tokenizer.batch_decode(hf_tokens, skip_special_tokens=True)
        agree = [bool(np.array_equal(a, h)) for a, h in zip(tokens, hf_tokens)]
    out = [{"prompt": e.input, "ours": o, **({"reference": e.target} if e.target else {}),
            **({} if theirs is None else {"hf": h, "same_tokens": a})}
           for e, o, h, a in zip(examples, ours, theirs or ours, agree or ours)]
    if is_main_process():
        for r in out:
            print(f"prompt: {r['prompt']}\n  ours: {r['ours']!r}" + (f"\n  reference: {r['reference']!r}"
                                                                     if "reference" in r else "")
                  + (f"\n  HF:   {r['hf']!r} ({'same tokens' if r['same_tokens'] else 'DIFFERENT tokens'})"
                     if theirs else ""))
        if args.compare_hf:
            print(f"{sum(agree)} of {len(agree)} outputs token for token equal to HF generate")
    return out


def predict_file(args, validator, params, examples: list, feats: dict, tokenizer) -> list:
    """--input: predictions appended to --predictions batch by batch, in the input's order; a file that already
    holds the first rows' predictions (an interrupted run's) is continued after them."""
    import numpy as np
    from tqdm import tqdm

    path = args.predictions or os.path.splitext(args.input)[0] + ".predictions.jsonl"
    done = finished_rows(path, examples)
    if done:
        logger.info("%s holds the predictions of the first %d of %d rows: continuing after them", path, done,
                    len(examples))
    out = []
    primary = is_main_process()
    with open(path, "a") if primary else open(os.devnull, "w") as f:
        for start in tqdm(range(done, len(examples), validator.batch_size), desc="predicting", unit="batch",
                          disable=None if primary else True):
            idx = np.arange(start, min(start + validator.batch_size, len(examples)))
            for i, text in zip(idx, validator.predict_batch(params, feats, idx, tokenizer)):
                e = examples[i]
                line = {"row": int(i), "input": e.input, "prediction": text, **({"reference": e.target}
                                                                                if e.target else {})}
                out.append(line)
                f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
    if primary:
        print(f"{len(examples) - done} predictions of {args.input} -> {path} ({len(examples)} rows in all)", flush=True)
    return out


def finished_rows(path: str, examples: list) -> int:
    """How many rows an existing predictions file already holds (they must be this input's first rows, in order);
    a file of other inputs is an error, never written over."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    try:
        rows = [json.loads(line) for line in lines]
    except ValueError:
        rows = None
    if rows is None or len(rows) > len(examples) or any(
            r.get("row") != i or r.get("input") != examples[i].input for i, r in enumerate(rows)):
        raise FlanT5Error(f"--predictions {path} exists and holds other predictions than this input's first rows: "
                          "choose another --predictions path (nothing was written)")
    return len(rows)


if __name__ == "__main__":
    main(sys.argv[1:])
