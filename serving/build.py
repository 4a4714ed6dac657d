"""The engine over a model's compiled slot programs (decoder/slot_programs.py's SlotPrograms: the scheduler's Backend).

    engine = build_engine(cfg, ServeOptions.of(args, cfg))     # run_server.py

The weights the config names (a checkpoint, LoRA adapters merged into their base, or an HF model), or a base with
LoRA adapters served side by side unmerged (``--lora``, ``--max_loras``: decoder/adapters.py's stack), its
tokenizer, and every program compiled before the server listens but the constrained rows' (structured outputs,
``allowed_token_ids``): run_server.py compiles those in a thread once it serves (``SlotPrograms.compile_constrained``:
a cold start does not wait for them; on a GPU or TPU they ask the host through a JAX callback, and a program with one
is never written to JAX's compilation cache, while a CPU's ask through XLA's FFI and are cached like the others:
utils/host_call.py), and a constrained request before they are ready waits for its own.
"""

from __future__ import annotations

import logging
import time

from data.tokenizer import encoder_of, load_tokenizer
from decoder.adapters import make_stack
from decoder.decoder import Decoder
from decoder.slot_programs import SlotPrograms
from modelling import registry
from serving.engine import Engine, ServeOptions
from utils import checkpoint as ckpt
from utils.errors import ConfigError

logger = logging.getLogger("flan_t5")


def build_engine(cfg, options: ServeOptions, params=None) -> Engine:
    """The engine over the weights the config names (or ``params``), every program compiled; chat messages rendered
    in the family's prompt format."""
    backend, tokenizer, encode = build_backend(cfg, options, params)
    family = registry.checked(cfg)
    return Engine(backend, tokenizer, encode, options, prompt_format=family.prompt,
                  continues_prompt=family.continues_prompt)


def build_backend(cfg, options: ServeOptions, params=None) -> tuple:
    """(the compiled slot programs over the weights the config names (or ``params``); the tokenizer;
    ``encode(texts) -> ids`` as the model reads prompts)."""
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    decoder = Decoder.of_config(cfg, tokenizer)
    stack = None
    if params is not None and options.max_loras:
        raise ConfigError("LoRA adapters are served over a base read from --load or --hf_model (its fingerprint "
                          "checked against theirs), not over weights given")
    if params is None:
        directory, step = ckpt.resolve(cfg.checkpoint.load)[-1] if cfg.checkpoint.load else (None, None)
        hf_model = None if directory else cfg.data.hf_model
        if options.max_loras:  # the base of LoRA adapters served side by side: its fingerprint too
            params, digest = decoder.load_params(directory, step, hf_model, base=True)
            stack = make_stack(decoder, options.loras, options.max_loras, options.max_lora_rank, options.lora_targets,
                               (digest, directory or hf_model))
        else:
            params = decoder.load_params(directory, step, hf_model)
    loaded = time.perf_counter() - t0
    programs = SlotPrograms(decoder, options.slots, options.width, options.insert_rows, options.max_new_tokens,
                            options.most_steps, options.max_logprobs, options.attention_spans, stack)
    compiled = programs.compile(params)
    logger.info("start-up: weights and tokenizer %.1f s%s, %d programs compiled in %.1f s", loaded,
                f" (and {len(options.loras)} LoRA adapters)" if options.loras else "", programs.programs, compiled)
    return programs, tokenizer, prompt_encoder(decoder.family, tokenizer)


def prompt_encoder(family, tokenizer):
    """``encode(texts) -> ids``: prompts as the family reads them, through the Rust tokenizer directly."""
    encoder = encoder_of(tokenizer)
    return lambda texts: family.encode_inputs(encoder, texts)
