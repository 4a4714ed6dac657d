"""The model behind the server: a checkpoint's (or an HF model's) weights, its tokenizer and prompt format, and the
slots' compiled programs (graphs/slots.py), as the scheduler (serving/scheduler.py) and the HTTP layer
(serving/http.py) ask for them. Built once, everything compiled before the first request.

    engine = Engine.build(cfg, ServeOptions.of(args, cfg))     # run_server.py

What a request may ask (serving/api.py's Limits): prompts as given (the whole text the model reads, as
``run_inference.py --prompt`` reads it: T5 ends it with its end-of-text token, GPT-J continues it) of at most the
widest prompt width compiled, and at most ``--output_length`` new tokens (the checkpoint's task's by default, as
``run_inference.py`` takes it), which is also a request's default ``max_tokens``.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Optional

from app.predict import Predictor
from data.tasks import load_tokenizer, pad_id
from graphs.slots import SlotPrograms
from serving.api import ApiError, Limits
from serving.metrics import Metrics
from serving.scheduler import Scheduler
from utils import checkpoint as ckpt
from utils.errors import ConfigError

logger = logging.getLogger("flan_t5")
SMALLEST_WIDTH = 16


def powers_of_two(low: int, high: int) -> list:
    """low, 2 low, 4 low ... up to the first at or above ``high``."""
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return out


@dataclass(frozen=True)
class ServeOptions:
    """How the server runs (run_server.py's flags, resolved against the config)."""

    slots: int  # decoding slots (rows decoded together)
    max_queue: int  # requests waiting for a slot beyond the slots (429 past it)
    widths: tuple  # prompt widths compiled, ascending: a prompt is padded to the first that holds it
    joins: tuple  # joining rows per dp shard compiled, ascending
    steps: int  # decoding steps per call of the slots' program
    max_new_tokens: int  # the most tokens a request may ask for
    max_prompt_chars: int
    max_body_bytes: int
    model_id: str

    @classmethod
    def of(cls, args, cfg) -> "ServeOptions":
        ex = cfg.execution
        slots = args.slots or ex.micro_batch_size * ex.data_parallel
        local = slots // ex.data_parallel if slots % ex.data_parallel == 0 else slots
        widths = sorted(set(args.prompt_widths or powers_of_two(SMALLEST_WIDTH, cfg.model.sequence_length)))
        joins = sorted({j for j in (args.join_sizes or powers_of_two(1, local)[::2]) if j <= local} | {local})
        for flag, value, low in (("--max_queue", args.max_queue, 0), ("--steps_per_call", args.steps_per_call, 1),
                                 ("--prompt_widths", min(widths), 1), ("--join_sizes", min(joins), 1),
                                 ("--max_prompt_chars", args.max_prompt_chars, 1),
                                 ("--max_body_bytes", args.max_body_bytes, 1024)):
            if value is not None and value < low:
                raise ConfigError(f"{flag} {value} must be at least {low}")
        load = cfg.checkpoint.load
        model_id = args.model_name or (os.path.basename(os.path.normpath(load)) if load else cfg.data.hf_model)
        return cls(slots, slots * 4 if args.max_queue is None else args.max_queue, tuple(widths), tuple(joins),
                   args.steps_per_call, cfg.inference.output_length, args.max_prompt_chars or 64 * widths[-1],
                   args.max_body_bytes, model_id)


class Backend:
    """The scheduler's view of the slots (serving/scheduler.py's module docstring names what it asks)."""

    def __init__(self, programs: SlotPrograms, family, tokenizer):
        self.p, self.family, self.tokenizer = programs, family, tokenizer
        self.slots, self.local, self.dp = programs.slots, programs.local, programs.g.dp
        self.widths, self.joins = programs.widths, programs.joins
        self.eos_id, self.pad_id = programs.eos_id, programs.pad_id
        self.insert, self.advance, self.set_sampling = programs.insert, programs.advance, programs.set_sampling

    def layout(self, ids, mask) -> tuple:
        return self.family.layout_prompts(ids, mask)

    def decode(self, tokens: list) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)


class Engine:
    """The model served: its tokenizer, limits, metrics and the scheduler over its slots."""

    def __init__(self, family, tokenizer, options: ServeOptions, programs: SlotPrograms):
        self.family, self.tokenizer, self.options = family, tokenizer, options
        self.model_id, self.created = options.model_id, int(time.time())
        self.limits = Limits(max_tokens=options.max_new_tokens, default_max_tokens=options.max_new_tokens,
                             max_prompt_tokens=options.widths[-1], max_prompt_chars=options.max_prompt_chars,
                             max_prompts=options.slots + options.max_queue, max_body_bytes=options.max_body_bytes)
        self.metrics = Metrics(options.slots)
        self.scheduler = Scheduler(Backend(programs, family, tokenizer), options.max_queue, self.metrics)

    @classmethod
    def build(cls, cfg, options: ServeOptions, params=None) -> "Engine":
        """The weights the config names (a checkpoint, LoRA adapters merged into their base, or an HF model; or
        ``params``), the tokenizer, and every program compiled."""
        predictor = Predictor(cfg)
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        if params is None:
            directory, step = ckpt.resolve(cfg.checkpoint.load)[-1] if cfg.checkpoint.load else (None, None)
            params = predictor.load_params(directory, step, None if directory else cfg.data.hf_model)
        programs = SlotPrograms(predictor.graphs, options.slots, options.widths, options.joins,
                                options.max_new_tokens, options.steps, tokenizer.eos_token_id, pad_id(tokenizer))
        programs.compile(params)
        return cls(predictor.family, tokenizer, options, programs)

    def tokenize(self, text: str) -> list:
        """A prompt's token ids as the model reads a prompt given whole; ApiError 400 for an empty one or one past
        the widest prompt compiled."""
        ids = self.family.encode_inputs(self.tokenizer, [text])[0]
        if not ids:
            raise ApiError(400, "prompt has no tokens: give it some text", param="prompt", code="empty_prompt")
        if len(ids) > self.limits.max_prompt_tokens:
            raise ApiError(400, f"prompt is {len(ids)} tokens long: this server reads at most "
                                f"{self.limits.max_prompt_tokens} (the widest of --prompt_widths)", param="prompt",
                           code="context_length_exceeded")
        return list(ids)

    def describe(self, host: str, port: int) -> str:
        o = self.options
        return (f"serving {self.model_id} on http://{host}:{port} ({o.slots} slots, a queue of {o.max_queue}, "
                f"prompts up to {o.widths[-1]} tokens, up to {o.max_new_tokens} new tokens, {o.steps} step(s) a "
                "call)")


def check_exposure(host: str, api_key: Optional[str]) -> Optional[str]:
    """The one line a server on a non-local address without a key says at start-up (None otherwise)."""
    if api_key or host in ("127.0.0.1", "localhost", "::1"):
        return None
    return (f"serving on {host} without an API key: anyone who reaches this address can use the model; pass "
            "--api_key KEY (or set FLAN_T5_API_KEY)")
