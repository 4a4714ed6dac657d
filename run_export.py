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

import logging
import sys

from app.args import command_line
from app.entry import entry
from app.runtime import process_count
from utils.errors import FlanT5Error

logger = logging.getLogger("flan_t5")


# what an export reads of the config (every field is accepted, as by every driver; --help lists these)
LISTED = ("load", "hf_model", "tokenizer", "tensor_parallel")
USAGE = "run_export.py (--load CKPT | --hf_model NAME_OR_DIR) --output DIR [--peft] [--config PRESET] [--FIELD VALUE ...]"


def extra_flags(p):
    p.add_argument("--output", required=True, metavar="DIR", help="the directory to write (new, or empty)")
    p.add_argument("--peft", action="store_true",
                   help="a LoRA checkpoint's adapters alone, in Hugging Face PEFT's format (adapter_config.json, "
                        "adapter_model.safetensors: peft.PeftModel.from_pretrained(base, DIR) loads them); without "
                        "it a LoRA checkpoint is exported merged into its base, as a whole model")


@entry
def main(argv=None) -> str:
    args, overrides = command_line("inference", __doc__, argv, extra_flags, listed=LISTED, usage=USAGE)
    for flag in ("quantize", "stream_encoder"):
        if flag in overrides:
            raise FlanT5Error(f"--{flag} is how a model is decoded; run_export.py writes the weights as trained (the "
                              f"checkpoint's dtype, never int8): drop --{flag}")
    from app.export import check_output

    check_output(args.output)
    from app.predict import start_decoding

    cfg = start_decoding(args, overrides, "export")
    if process_count() > 1:
        raise FlanT5Error("run_export.py runs in one process: start it without the launcher (it needs no more "
                          "devices than the checkpoint's tensor parallelism, simulated on a CPU)")
    from app.export import export_model, export_peft
    from data.tokenizer import load_tokenizer
    from decoder.decoder import Decoder
    from utils import checkpoint as ckpt

    tokenizer = load_tokenizer(cfg.data.tokenizer)
    decoder = Decoder.of_config(cfg, tokenizer)
    directory, step = ckpt.resolve(cfg.checkpoint.load)[-1] if cfg.checkpoint.load else (None, None)
    if args.peft:
        config = export_peft(decoder, directory, step, tokenizer, args.output)
        print(f"exported the adapters of {directory}/{step} (rank {config['r']}, {len(config['target_modules'])} "
              f"modules) in PEFT's format -> {args.output} (peft: PeftModel.from_pretrained(base, '{args.output}'), "
              f"base: {config['base_model_name_or_path']})", flush=True)
        return args.output
    params = decoder.weights.host_tree(decoder.load_params(directory, step, None if directory else
                                                           cfg.data.hf_model))
    arch = export_model(params, cfg.model, tokenizer, decoder.family, args.output)
    what = f"{directory}/{step}" if directory else cfg.data.hf_model
    print(f"exported {what} as {arch} with its tokenizer -> {args.output} "
          f"(transformers: {arch}.from_pretrained('{args.output}'))", flush=True)
    return args.output


if __name__ == "__main__":
    main(sys.argv[1:])
