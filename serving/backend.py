"""The scheduler's Backend over a model's compiled slot programs (decoder/slots.py), and the engine built on it.

    engine = build_engine(cfg, ServeOptions.of(args, cfg))     # run_server.py

The weights the config names (a checkpoint, LoRA adapters merged into their base, or an HF model), its tokenizer,
and every program compiled before the server listens.
"""

from __future__ import annotations

from app.runtime import start_devices
from data.tasks import encoder_of, load_tokenizer, pad_id
from decoder.engine import Decoder
from decoder.slots import SlotPrograms
from modelling import registry
from serving.engine import Engine, ServeOptions
from utils import checkpoint as ckpt


class SlotBackend:
    """The scheduler's Backend (serving/scheduler.py) over the compiled slot programs (decoder/slots.py)."""

    def __init__(self, programs: SlotPrograms, family):
        p = programs
        self.slots, self.local, self.dp, self.widths, self.joins = p.slots, p.local, p.g.dp, p.widths, p.joins
        self.steps, self.eos_id, self.pad_id, self.top = p.steps, p.eos_id, p.pad_id, p.top
        self.scores_prompts, self.score_rows = family.scores_prompts, p.score_rows
        self.vocab_size = p.opts.vocab_size
        self.layout = family.layout_prompts
        self.insert, self.advance, self.score, self.fetch, self.reset = p.insert, p.advance, p.score, p.fetch, p.reset
        self.first_token_column = p.first_token_column
        self.spans = p.spans  # the attention spans compiled (decoder/slots.py)
        self.platform = p.g.mesh.devices.flat[0].platform


def build_engine(cfg, options: ServeOptions, params=None) -> Engine:
    """The engine over the weights the config names (or ``params``), every program compiled; chat messages rendered
    in the family's prompt format."""
    backend, tokenizer, encode = build_backend(cfg, options, params)
    return Engine(backend, tokenizer, encode, options, prompt_format=registry.checked(cfg).prompt)


def build_backend(cfg, options: ServeOptions, params=None) -> tuple:
    """(SlotBackend over the weights the config names (or ``params``), every program compiled; the tokenizer;
    ``encode(texts) -> ids`` as the model reads prompts)."""
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    decoder = Decoder.of_config(cfg, tokenizer)
    if params is None:
        directory, step = ckpt.resolve(cfg.checkpoint.load)[-1] if cfg.checkpoint.load else (None, None)
        params = decoder.load_params(directory, step, None if directory else cfg.data.hf_model)
    programs = SlotPrograms(decoder, options.slots, options.widths, options.joins, options.max_new_tokens,
                            options.most_steps, tokenizer.eos_token_id, pad_id(tokenizer),
                            options.max_logprobs, options.attention_spans)
    programs.compile(params)
    return SlotBackend(programs, decoder.family), tokenizer, prompt_encoder(decoder.family, tokenizer)


def backend_in_process(cfg, options: ServeOptions) -> SlotBackend:
    """The backend as an engine process builds it (serving/remote.py) from its server's config and options: this
    process's devices set up from the config (as ``start_decoding`` does), every program compiled."""
    start_devices(cfg)
    return build_backend(cfg, options)[0]


def prompt_encoder(family, tokenizer):
    """``encode(texts) -> ids``: prompts as the family reads them, through the Rust tokenizer directly."""
    encoder = encoder_of(tokenizer)
    return lambda texts: family.encode_inputs(encoder, texts)
