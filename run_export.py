"""A checkpoint of this project back in Hugging Face format: a directory transformers loads.

    python3 run_export.py --load ckpt/tiny --output hf/tiny          # the latest step
    python3 run_export.py --load ckpt/xxl/500 --output hf/xxl-mnli   # a step
    python3 -c "from transformers import AutoModelForSeq2SeqLM as M; M.from_pretrained('hf/tiny')"

Writes config.json and model.safetensors (the family's HF architecture: T5ForConditionalGeneration,
UMT5ForConditionalGeneration or GPTJForCausalLM, padded vocabulary rows stripped) and the checkpoint's tokenizer,
whose end-of-text, pad and start ids go into config.json so that ``generate`` stops where the model learnt to.
A LoRA checkpoint (--lora_rank) exports merged into its base (W + alpha/rank A B), or with --peft as its
adapters alone in PEFT's format. The output directory must not exist or be empty: nothing is ever written over.

    python3 run_export.py --load ckpt/lora --output hf/lora --peft   # adapter_config.json + adapter_model.safetensors
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
from app.runtime import ensure_host_devices, process_count, setup_jax
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


def extra_flags(p):
    p.add_argument("--output", required=True, metavar="DIR", help="the directory to write (new, or empty)")
    p.add_argument("--peft", action="store_true",
                   help="a LoRA checkpoint's adapters alone, in Hugging Face PEFT's format (adapter_config.json, "
                        "adapter_model.safetensors: peft.PeftModel.from_pretrained(base, DIR) loads them); without "
                        "it a LoRA checkpoint is exported merged into its base, as a whole model")


def check_output(path: str) -> None:
    """The export never writes into a directory that holds anything."""
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        raise FlanT5Error(f"--output {path} exists and is not an empty directory: choose a new directory (nothing "
                          "was written)")


def special_tokens(tokenizer) -> dict:
    """The tokenizer's ids that an HF config.json names (a tokenizer without a pad token pads with its
    end-of-text token, as our decoding does: data.mnli.pad_id)."""
    from data.mnli import pad_id

    return {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": pad_id(tokenizer),
            "bos_token_id": getattr(tokenizer, "bos_token_id", None)}


@entry
def main(argv=None) -> str:
    setup_logging()
    args, overrides = parse_args("inference", __doc__.splitlines()[0], "tiny", argv, extra_flags)
    check_output(args.output)
    from run_validation import Validator, validation_config

    cfg = validation_config(args, overrides)
    ensure_host_devices(cfg.devices)
    setup_jax()
    if process_count() > 1:
        raise FlanT5Error("run_export.py runs in one process: start it without the launcher (it needs no more "
                          "devices than the checkpoint's tensor parallelism, simulated on a CPU)")
    import jax
    import numpy as np

    from data.mnli import load_tokenizer
    from modelling.hf_mapping import save_hf_model
    from utils import checkpoint as ckpt

    validator = Validator(cfg)
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1] if cfg.checkpoint.load else (None, None)
    if args.peft:
        return export_peft(validator, directory, step, args.output)
    params = jax.tree.map(np.asarray, validator.load_params(directory, step, None if directory else cfg.data.hf_model))
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    save_hf_model(params, cfg.model, args.output, special_tokens(tokenizer))
    tokenizer.save_pretrained(args.output)
    arch = validator.graphs.family.hf_config_dict(cfg.model)["architectures"][0]
    what = f"{directory}/{step}" if directory else cfg.data.hf_model
    print(f"exported {what} as {arch} with its tokenizer -> {args.output} "
          f"(transformers: {arch}.from_pretrained('{args.output}'))", flush=True)
    return args.output


def export_peft(validator, directory, step, output: str) -> str:
    """A LoRA checkpoint's adapters in PEFT's format (modelling/lora.py names them)."""
    import jax
    import numpy as np
    from safetensors.numpy import save_file

    from graphs.state import describe_base
    from modelling import lora
    from utils import checkpoint as ckpt

    saved = ckpt.load_meta(directory, step) if directory else {}
    if not saved.get("lora_base"):
        raise FlanT5Error(f"--peft exports LoRA adapters, but {directory or 'the model'} was not trained with "
                          "--lora_rank: drop --peft to export the whole model")
    lg, adapters, _ = validator.lora_parts(directory, step, saved, base=False)
    adapters = jax.tree.map(np.asarray, adapters)
    source = saved["lora_base"]["source"]
    config = lora.peft_config(lg.family, adapters, lg.cfg.model, lg.opts, source.get("hf_model", describe_base(source)))
    os.makedirs(output, exist_ok=True)
    save_file(lora.peft_state_dict(lg.family, adapters, lg.cfg.model), os.path.join(output, "adapter_model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(output, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2)
    print(f"exported the adapters of {directory}/{step} (rank {config['r']}, {len(config['target_modules'])} modules) "
          f"in PEFT's format -> {output} (peft: PeftModel.from_pretrained(base, '{output}'), base: "
          f"{config['base_model_name_or_path']})", flush=True)
    return output


if __name__ == "__main__":
    main(sys.argv[1:])
