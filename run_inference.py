"""Greedy outputs of a model on a few prompts, optionally beside Hugging Face ``generate`` on the same weights.

    python3 run_inference.py --load ckpt/tiny --limit 5                      # 5 prompts of the preset's split
    python3 run_inference.py --load ckpt/gptj --compare_hf --limit 5         # and HF's outputs beside ours
    python3 run_inference.py --config gpt-j --prompt "mnli hypothesis: ... premise: ... target:"

As the original's run_inference.py: a quick look at what a fine-tuned model says, for both families.
Prompts come from --prompt (as given: with the template) or from the dataset's split (MNLI prompt format of
the model's family). The model's shape and family come from the checkpoint or the --hf_model's config.json.
"""

from __future__ import annotations

import logging
import sys

from app.args import parse_args
from app.entry import entry
from app.logs import setup_logging
from app.runtime import ensure_host_devices, is_main_process, setup_jax
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="a prompt to continue (repeat the flag for several); default: the dataset split's prompts")
    p.add_argument("--limit", type=int, default=4, help="prompts taken from the dataset (default 4)")
    p.add_argument("--compare_hf", action="store_true",
                   help="also decode with Hugging Face generate on the same weights and show whether they agree")


def hf_generate(cfg, family, host_params, ids, mask, eos: int, pad: int):
    """HF ``generate`` (greedy) of the same weights: tokens [b, output_length] padded with ``pad``."""
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
        out = model.generate(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), do_sample=False,
                             num_beams=1, max_new_tokens=n, eos_token_id=eos, pad_token_id=pad,
                             **family.hf_generate_kwargs())
    # a causal LM's output continues its prompt; an encoder-decoder's starts with the decoder's start token
    out = out[:, ids.shape[1]:] if family.causal else out[:, 1:]
    out = out.numpy()
    return np.pad(out, ((0, 0), (0, n - out.shape[1])), constant_values=pad)


@entry
def main(argv=None) -> list:
    setup_logging()
    args, overrides = parse_args("inference", __doc__.splitlines()[0], "tiny", argv, extra_flags)
    from run_validation import Validator, validation_config

    cfg = validation_config(args, overrides)
    ensure_host_devices(cfg.devices)
    setup_jax()
    import jax
    import numpy as np

    from data.mnli import load_rows, load_tokenizer, pad_id, prompt
    from data.packing import left_align
    from graphs.sharding import fetch, put_global
    from utils import checkpoint as ckpt

    validator = Validator(cfg)
    family = validator.graphs.family
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    if args.prompt:
        texts = args.prompt
    else:
        if args.limit < 1:
            raise FlanT5Error(f"--limit {args.limit} must be at least 1")
        texts = [family.prompt(prompt(r["hypothesis"], r["premise"]))
                 for r in load_rows(cfg.data.dataset, cfg.data.split, seed=cfg.model.seed)[: args.limit]]
    enc = family.encode_inputs(tokenizer, texts)
    n = max(len(x) for x in enc)
    if n > cfg.model.sequence_length:
        raise FlanT5Error(f"a prompt has {n} tokens but sequence_length is {cfg.model.sequence_length}: pass "
                          f"--sequence_length {n} or a shorter prompt")
    b = -(-len(enc) // cfg.execution.data_parallel) * cfg.execution.data_parallel
    ids, mask = np.full((b, n), pad_id(tokenizer), np.int32), np.zeros((b, n), np.int32)
    for i, x in enumerate(enc + [enc[-1]] * (b - len(enc))):  # rows fill the last dp shard
        ids[i, : len(x)], mask[i, : len(x)] = x, 1
    if family.left_pad_prompts:
        ids, mask = left_align(ids, mask)
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1] if cfg.checkpoint.load else (None, None)
    params = validator.load_params(directory, step, None if directory else cfg.data.hf_model)
    rows = validator.graphs.row_sharding
    tokens = fetch(validator.generate(tokenizer)(params, put_global(ids, rows), put_global(mask, rows)))[: len(enc)]
    ours = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    theirs = agree = None
    if args.compare_hf:
        host = jax.tree.map(np.asarray, params)
        hf_tokens = hf_generate(cfg, family, host, ids[: len(enc)], mask[: len(enc)], tokenizer.eos_token_id,
                                pad_id(tokenizer))
        theirs = tokenizer.batch_decode(hf_tokens, skip_special_tokens=True)
        agree = [bool(np.array_equal(a, h)) for a, h in zip(tokens, hf_tokens)]
    out = [{"prompt": t, "ours": o, **({} if theirs is None else {"hf": h, "same_tokens": a})}
           for t, o, h, a in zip(texts, ours, theirs or ours, agree or ours)]
    if is_main_process():
        for r in out:
            print(f"prompt: {r['prompt']}\n  ours: {r['ours']!r}" + (f"\n  HF:   {r['hf']!r} "
                  f"({'same tokens' if r['same_tokens'] else 'DIFFERENT tokens'})" if args.compare_hf else ""))
        if args.compare_hf:
            print(f"{sum(agree)} of {len(agree)} outputs token for token equal to HF generate")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
