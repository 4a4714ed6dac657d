"""The model behind the server, as the HTTP layer (serving/http.py) uses it: ``generate`` (a checked request in, a
``Generation`` out: its sequences submitted, the events of its answer as they come), ``drain``, ``abort``; its
tokenizer, chat template and limits. A request's ``n`` and ``best_of`` candidates, each prompt's, are sequences of
their own, built here (each with its own seed: ``choice_seed``), and ranked here (``Generation.chosen``). Below it, the scheduler (serving/scheduler.py) drives a
``Backend`` (decoder/slot_programs.py's SlotPrograms: a checkpoint's, or an HF model's, compiled slot programs; the tests'
fake) and the output processor (serving/output.py) turns its tokens into text. No JAX here.

    engine = build.build_engine(cfg, ServeOptions.of(args, cfg))     # run_server.py: everything compiled

What a request may ask (serving/api.py's Limits): /v1/completions prompts as given (the whole text the model reads,
a raw continuation as OpenAI's: T5 ends it with its end-of-text token, GPT-J continues it; a list of token ids is read
as it is) of at most ``--prompt_width`` tokens, and at most ``--output_length`` new tokens (the checkpoint's
task's by default, as ``run_inference.py`` takes it), which is also a request's default ``max_tokens``.

Chat: the messages are the task's input: they become one text through a chat template (Jinja, as
``apply_chat_template`` reads it: ``--chat_template FILE``, else the tokenizer's own, else ``DEFAULT_CHAT_TEMPLATE``,
for instruction-tuned models without one, as Flan-T5: the last message, the earlier turns before it as ``Role: text``
lines), then the family's prompt format (``prompt_format``: ``Family.prompt``, GPT-J's `` target:`` after it, T5's
nothing) as training, validation and ``run_inference.py --prompt`` render an input, so the answer is the target
alone. A single user message is read as that text rendered by ``Family.prompt`` and sent to /v1/completions.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Optional

from decoder.grammar import GrammarError, Grammars
from serving.api import Limits
from serving.controls import NONE, Controls
from serving.metrics import Metrics
from serving.output import Output, OutputProcessor
from serving.scheduler import Scheduler, SchedulerError, Sequence
from utils.errors import ConfigError, FlanT5Error

logger = logging.getLogger("flan_t5")
CONTEXT = 6  # a prompt's last tokens a completion's text is read after (vLLM's incremental detokenizer reads 5)
MAX_STEPS_FACTOR = 4  # the most steps a call takes with every slot taken, by default: 4 x --steps_per_call
DEFAULT_SPANS = 1  # advance programs (N: each attending over a prefix of the cache, 1/N ... N/N of it)
DEFAULT_QUEUE = 256  # sequences waiting for a slot (at least; 4 x slots where more): a burst waits, not a 429
DEFAULT_CHAT_TEMPLATE = (
    "{%- for m in messages[:-1] %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor -%}"
    "{{ messages[-1]['content'] }}")


class PromptError(Exception):
    """A prompt the model cannot read (the HTTP layer answers 400): the field, why, OpenAI's error code."""

    def __init__(self, field: str, message: str, code: str = "invalid_value"):
        super().__init__(f"{field} {message}")
        self.field, self.code = field, code


class AdapterRequestError(Exception):
    """A LoRA adapter that cannot be loaded or unloaded: why, and OpenAI's error code (the HTTP layer answers 404 for
    ``model_not_found``, 400 otherwise)."""

    def __init__(self, message: str, code: str = "invalid_lora"):
        super().__init__(message)
        self.code = code


def powers_of_two(low: int, high: int) -> list:
    """low, 2 low, 4 low ... up to the first at or above ``high``."""
    out = [low]
    while out[-1] < high:
        out.append(out[-1] * 2)
    return out


@dataclass(frozen=True)
class ServeOptions:
    """How the server runs (run_server.py's flags: app/args.py's ``server_flags``, resolved against the config)."""

    slots: int  # decoding slots (rows decoded together)
    max_queue: int  # sequences waiting for a slot beyond the slots (429 past it)
    width: int  # the longest prompt taken (tokens): inserts read prompts packed into rows this wide
    insert_rows: tuple  # packed rows per dp shard an insert reads, compiled, ascending
    steps: int  # decoding steps per call of the slots' program (while a slot is free)
    max_new_tokens: int  # the most tokens a request may ask for
    max_prompt_chars: int
    max_body_bytes: int
    model_id: str
    max_logprobs: int = 20  # the most likely tokens shown beside each token, at most
    min_join: Optional[int] = None  # free slots that wait (two calls at most) for a group (None: by the device)
    chat_template: Optional[str] = None  # --chat_template's text
    max_steps: int = 0  # the most steps per call, taken while every slot is taken (0: ``steps``)
    attention_spans: int = 1  # advance programs, each attending over a prefix of the cache (decoder/slot_programs.py)
    loras: tuple = ()  # ((name, path), ...): LoRA adapters served side by side over the base from the start
    max_loras: int = 0  # adapter slots (0: no adapter stack: the base alone)
    max_lora_rank: int = 0  # the stack's rank (0: the largest of the start-up adapters', else DEFAULT_LORA_RANK)
    lora_targets: tuple = ()  # the weights the stack holds adapters of (): the start-up adapters', else the family's

    @property
    def most_steps(self) -> int:
        """The most steps a call takes (the slot programs compile this many)."""
        return max(self.steps, self.max_steps)

    @classmethod
    def of(cls, args, cfg, longest_prompt: Optional[int] = None) -> "ServeOptions":
        """The options of run_server.py's flags ``args`` over ``cfg``; ``longest_prompt``: the longest prompt (tokens)
        of the rows the checkpoint was trained on, which the default --prompt_width reads (``default_width``)."""
        if cfg.inference.stream_encoder:
            raise ConfigError("--stream_encoder reads the encoder from host memory a batch of prompts at a time "
                              "(run_validation.py, run_inference.py); the server keeps every weight on the devices: "
                              "leave it out (--quantize int8 halves the weights' bytes)")
        ex = cfg.execution
        slots = args.slots or ex.rows_per_micro_batch
        local = slots // ex.data_parallel if slots % ex.data_parallel == 0 else slots
        width = args.prompt_width or default_width(cfg.model.sequence_length, longest_prompt)
        rows = sorted({min(r, local) for r in args.insert_rows} | {local}) if args.insert_rows else \
            default_insert_rows(local)
        for flag, value, low in (("--slots", args.slots, 1), ("--header_timeout", args.header_timeout, 0.1),
                                 ("--body_timeout", args.body_timeout, 0.1),
                                 ("--max_connections", args.max_connections, 1),
                                 ("--max_queue", args.max_queue, 0), ("--steps_per_call", args.steps_per_call, 1),
                                 ("--max_steps_per_call", args.max_steps_per_call, args.steps_per_call),
                                 ("--prompt_width", width, 1), ("--insert_rows", min(rows), 1),
                                 ("--max_prompt_chars", args.max_prompt_chars, 1),
                                 ("--max_body_bytes", args.max_body_bytes, 1024),
                                 ("--max_header_bytes", args.max_header_bytes, 1024),
                                 ("--max_logprobs", args.max_logprobs, 0), ("--min_join", args.min_join, 1),
                                 ("--attention_spans", args.attention_spans, 1),
                                 ("--max_lora_rank", getattr(args, "max_lora_rank", None), 1)):
            if value is not None and value < low:
                raise ConfigError(f"{flag} {value} must be at least {low}")
        load = cfg.checkpoint.load
        model_id = args.model_name or (os.path.basename(os.path.normpath(load)) if load else cfg.data.hf_model)
        return cls(slots, max(DEFAULT_QUEUE, 4 * slots) if args.max_queue is None else args.max_queue,
                   width, tuple(rows), args.steps_per_call, cfg.inference.output_length,
                   args.max_prompt_chars or 64 * width, args.max_body_bytes, model_id, args.max_logprobs,
                   args.min_join,
                   read_template(args.chat_template), args.max_steps_per_call or MAX_STEPS_FACTOR * args.steps_per_call,
                   DEFAULT_SPANS if args.attention_spans is None else args.attention_spans,
                   **lora_options(args, model_id))


def lora_options(args, model_id: str) -> dict:
    """ServeOptions' LoRA fields from run_server.py's --lora NAME=CKPT..., --max_loras, --max_lora_rank and
    --lora_target_modules (app/args.py's ``lora_flags``); ConfigError (one line) for a malformed or repeated NAME=CKPT,
    a name that is the base's, or fewer slots than adapters."""
    loras = []
    for item in getattr(args, "lora", None) or ():
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ConfigError(f"--lora {item}: give each adapter as NAME=CKPT (a model id, and the --save directory "
                              "of its LoRA run)")
        if name == model_id or name in dict(loras):
            raise ConfigError(f"--lora {item}: the model id {name!r} is already served ("
                              f"{'the base' if name == model_id else 'another adapter'}): give each adapter a name of "
                              "its own (the base's is --model_name)")
        loras.append((name, path))
    slots = getattr(args, "max_loras", None)
    if slots is not None and slots < max(1, len(loras)):
        raise ConfigError(f"--max_loras {slots}: at least 1, and at least the {len(loras)} adapters --lora names")
    rank, targets = getattr(args, "max_lora_rank", None) or 0, tuple(getattr(args, "lora_target_modules", None) or ())
    if (rank or targets) and not (loras or slots):
        raise ConfigError(f"{'--max_lora_rank' if rank else '--lora_target_modules'} shapes the stack of LoRA adapters, "
                          "and this server has none: pass --lora NAME=CKPT or --max_loras N too")
    return {"loras": tuple(loras), "max_loras": slots if slots is not None else len(loras), "max_lora_rank": rank,
            "lora_targets": targets}


def default_width(sequence_length: int, longest_prompt: Optional[int] = None) -> int:
    """The default --prompt_width: every prompt of the rows the checkpoint's task was trained on (``longest_prompt``,
    which validation and inference decode whole), and at least ``sequence_length``, rounded up to a multiple of 8.
    (It was sequence_length alone: a server of a checkpoint trained at 64 refused the task's own longer rows.)"""
    return -(-max(sequence_length, longest_prompt or 0) // 8) * 8


def default_insert_rows(local: int) -> list:
    """Packed rows per dp shard an insert reads, compiled by default: 1, 4, 16 ... and the slots per shard (each
    prompt fits a row: every free slot of a shard can join in one insert)."""
    return sorted({j for j in powers_of_two(1, local)[::2] if j <= local} | {local})


def default_min_join(slots: int, platform: str) -> int:
    """Free slots that wait for a group by default, on the devices of ``platform``: on a CPU 1 (a free slot joins at
    once: an insert's cost grows with its prompts there, so a group saves little while the free slots idle);
    elsewhere half the slots (on an accelerator an insert of a few prompts costs about what one costs, reading every
    weight once)."""
    return 1 if platform == "cpu" else max(1, slots // 2)


def read_template(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ConfigError(f"--chat_template {path} is not a file: pass a Jinja chat template file (as a tokenizer's "
                          "chat_template, which apply_chat_template reads)")
    with open(path) as f:
        return f.read()


def choice_seed(seed: Optional[int], j: int) -> Optional[int]:
    """The seed of a prompt's j-th candidate: the request's for the first (n=1 is the request alone), then a 64-bit
    mix of (seed, j) (SplitMix64's finalizer), so that each choice is reproducible on its own."""
    if seed is None or j == 0:
        return seed
    z = (seed + j * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return z ^ (z >> 31)


def context(engine, ids: list) -> list:
    """The prompt's tokens a completion's text is read after (its last ``CONTEXT``; none where the engine's model
    does not continue its prompt): so a word-level or Metaspace tokenizer's first new word keeps its space."""
    return list(ids[-CONTEXT:]) if getattr(engine, "continues_prompt", False) else []


class Generation:
    """One request in flight (``Engine.generate``): its sequences (each prompt's best_of candidates, in that order),
    the queue their events arrive on (serving/output.py's ``Event``; the HTTP layer's own marks too), and what the
    events said so far of each candidate: its text, token ids, log-probabilities, finish reason, token count and
    cumulative log-probability."""

    def __init__(self, engine, req, prompts: list, controls: Controls = NONE):
        self.engine, self.req = engine, req
        self.gone = False  # its client went away
        self.prompt_ids = [ids for ids, _ in prompts]
        self.queue: asyncio.Queue = asyncio.Queue()
        ranked = req.best_of > req.n
        wants = req.logprobs if req.logprobs is not None else (0 if ranked else None)
        self.seqs = []
        for i, (ids, text) in enumerate(prompts):
            for j in range(req.best_of):
                out = Output(i * req.best_of + j, self.queue, req.stop, req.stream, req.logprobs,
                             text if req.echo else None,
                             ids if req.echo and req.logprobs is not None and not req.chat else None,
                             distinct=not req.chat,  # (the legacy top_logprobs: keyed by text)
                             skip_special=req.skip_special_tokens, include_stop=req.include_stop_str_in_output,
                             min_tokens=req.min_tokens, context=context(engine, ids),
                             spaces_between_special=req.spaces_between_special_tokens)
                self.seqs.append(Sequence(ids, req.max_tokens, req.temperature, req.top_p, req.top_k,
                                          choice_seed(req.seed, j), wants, out.echo_ids is not None, out,
                                          controls=controls))
        self.id = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        n = len(self.seqs)
        self.texts, self.token_ids, self.logprobs = [""] * n, [[] for _ in range(n)], [None] * n
        self.reasons: list = [None] * n
        self.counts, self.cumulative = [0] * n, [0.0] * n

    def pending(self) -> int:
        """Candidates not finished."""
        return sum(r is None for r in self.reasons)

    def take(self, ev) -> None:
        """An event without an error (an error ends the request: the HTTP layer answers it)."""
        i = ev.index
        self.texts[i] += ev.text
        self.token_ids[i] += ev.token_ids
        if ev.logprobs is not None:
            self.logprobs[i] = (self.logprobs[i] or []) + ev.logprobs
        self.counts[i], self.cumulative[i] = ev.completion_tokens, ev.cumulative_logprob
        if ev.finish_reason:
            self.reasons[i] = ev.finish_reason

    def chosen(self) -> list:
        """The candidates answered, in choice order: each prompt's n most likely (all of them without best_of; ties
        in candidate order)."""
        req, out = self.req, []
        for p in range(len(self.prompt_ids)):
            group = list(range(p * req.best_of, (p + 1) * req.best_of))
            if req.best_of > req.n:
                group = sorted(group, key=lambda i: -self.cumulative[i])[:req.n]
            out += group
        return out

    def cancel(self) -> None:
        """Its client went away or its answer was cut short: the candidates still running leave their slots before
        the next decoding call."""
        if self.pending():
            self.engine.cancel(self.seqs)


class Engine:
    """The model served (see the module docstring): ``encode(texts) -> ids`` reads prompts as the model does;
    ``prompt_format(text) -> text`` renders a task's input as the model was trained to read it (``Family.prompt``:
    chat messages are one)."""

    def __init__(self, backend, tokenizer, encode: Callable, options: ServeOptions,
                 prompt_format: Callable = lambda text: text, continues_prompt: bool = False):
        self.backend, self.tokenizer, self.encode, self.options = backend, tokenizer, encode, options
        self.prompt_format = prompt_format
        # a causal LM's output continues its prompt: its tokens' text is read after the prompt's last tokens
        # (``context``), as the grammars match it (an encoder-decoder's answer is a text of its own)
        self.continues_prompt = continues_prompt
        self.grammars = Grammars(tokenizer, getattr(backend, "n_tokens", backend.vocab_size), backend.eos_id,
                                 optional_space=False if continues_prompt else None)
        self.model_id, self.created = options.model_id, int(time.time())
        self.limits = Limits(max_tokens=options.max_new_tokens, default_max_tokens=options.max_new_tokens,
                             max_prompt_tokens=backend.max_prompt, max_prompt_chars=options.max_prompt_chars,
                             max_prompts=options.slots + options.max_queue, max_body_bytes=options.max_body_bytes,
                             vocab_size=backend.vocab_size,
                             max_logprobs=min(options.max_logprobs, backend.top),
                             scores_prompts=backend.scores_prompts)
        self.chat_template = options.chat_template or getattr(tokenizer, "chat_template", None) or None
        self.metrics = Metrics(options.slots)
        self.min_join = options.min_join or default_min_join(options.slots, backend.platform)
        self.scheduler = Scheduler(backend, options.max_queue, self.metrics, self.min_join, options.steps)
        self.output = OutputProcessor(tokenizer, self.metrics, self.scheduler.finish)
        # the model ids served: the base (-1) and each LoRA adapter in the backend's stack (its slot)
        self.stack = getattr(backend, "adapters", None)
        self.served = {self.model_id: -1}
        self.paths: dict = {}  # adapter name -> the path it was read from
        for slot, adapter in enumerate(self.stack.held if self.stack is not None else ()):
            if adapter is not None:
                self.add_adapter(adapter.name, adapter.path, slot)
        self.changing: set = set()  # adapter names being loaded or unloaded

    # ------------------------------------------------------------------ prompts

    def tokenize(self, prompt) -> list:
        """A prompt's token ids as the model reads a prompt given whole (a text), or as given (token ids);
        PromptError for one past the widest prompt compiled."""
        ids = list(prompt) if isinstance(prompt, tuple) else self.encode([prompt])[0]
        if not ids:
            raise PromptError("prompt", "has no tokens: give it some text", "empty_prompt")
        if len(ids) > self.limits.max_prompt_tokens:
            raise PromptError("prompt", f"is {len(ids)} tokens long: this server reads at most "
                                        f"{self.limits.max_prompt_tokens} (--prompt_width)",
                              "context_length_exceeded")
        return list(ids)

    def controls(self, req) -> Controls:
        """A request's processors (serving/controls.py), its structured output compiled (or from the cache):
        PromptError naming the field where the grammar library refuses it, or no token can start it."""
        if req.constraint is not None:
            kind, spec, field = req.constraint
            try:
                constraint = self.grammars.compile(kind, spec, field)
            except GrammarError as e:
                raise PromptError(e.field, f"cannot be followed: {e.reason}", "invalid_grammar") from None
        elif req.allowed_token_ids:
            constraint = self.grammars.allowed(req.allowed_token_ids)
        else:
            constraint = None
        controls = Controls(req.presence_penalty, req.frequency_penalty, req.repetition_penalty, req.min_p,
                            req.min_tokens, req.ignore_eos, req.stop_token_ids, req.logit_bias, constraint)
        return NONE if controls == NONE else controls

    def prompt_text(self, prompt) -> str:
        """What a prompt says: the text as given, or its token ids decoded."""
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(list(prompt), skip_special_tokens=True)

    def render_chat(self, messages: tuple, add_generation_prompt: bool = True) -> str:
        """Chat messages -> the one prompt the model reads: the chat template's text in the family's prompt format
        (see the module docstring); ``add_generation_prompt``: the template's (vLLM's field)."""
        if self.chat_template is None and messages[-1]["role"] != "user":
            raise PromptError("messages", "must end with a user message: the model answers it (this model has no "
                                          "chat template; pass --chat_template FILE for another format)")
        try:
            out = self.tokenizer.apply_chat_template(list(messages), chat_template=self.chat_template or
                                                     DEFAULT_CHAT_TEMPLATE, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
        except Exception as e:  # noqa: BLE001 (a template's own raise_exception, or one that fails on these messages)
            raise PromptError("messages", f"could not be rendered by the chat template: {str(e)[:200]}") from None
        if not out.strip():
            raise PromptError("messages", "render an empty prompt: give the model some text", "empty_prompt")
        return self.prompt_format(out)

    # ------------------------------------------------------------------ the scheduler, as the HTTP layer uses it

    def start(self, deliver: Callable, on_fatal: Callable = lambda error: None) -> None:
        """The output thread (``deliver([(sink, Event)])`` from it) and the decoding thread."""
        self.output.start(deliver)
        self.scheduler.start(self.output.put, on_fatal)

    def stop(self) -> None:
        self.scheduler.stop()
        self.output.stop()

    def generate(self, req, prompts: list) -> Generation:
        """A checked request (serving/api.py's) of ``prompts`` [(ids, text)] -> its Generation, every candidate
        submitted, each reading the LoRA adapter its ``model`` names (the base: none): its events come on
        ``Generation.queue`` (``start``'s ``deliver`` puts them there). Raises AdapterRequestError for a model no
        longer served (an adapter unloaded), the scheduler's QueueFull, ShuttingDown or Failed (nothing submitted)."""
        model = req.model or self.model_id
        if model not in self.served:
            raise AdapterRequestError(f"the model {model!r} does not exist (any more): GET /v1/models lists those "
                                      "served", "model_not_found")
        generation = Generation(self, req, prompts, self.controls(req))
        for s in generation.seqs:
            s.adapter = self.served[model]
        self.submit(generation.seqs)
        return generation

    def submit(self, seqs: list) -> None:
        """Queues sequences (scheduler.Sequence, each with its output.Output), all or none; raises the scheduler's
        QueueFull, ShuttingDown or Failed."""
        self.scheduler.submit(seqs)

    def cancel(self, seqs: list) -> None:
        self.scheduler.cancel(seqs)

    def drain(self) -> None:
        """No new requests (ShuttingDown); the held ones go on."""
        self.scheduler.stop_admitting()

    def abort(self, error: SchedulerError) -> None:
        """Every held sequence ends with ``error``."""
        self.scheduler.abort_all(error)

    def held(self) -> int:
        """Sequences held (a request holds one per candidate: its prompts x best_of)."""
        return self.scheduler.held()

    def held_requests(self) -> int:
        """Requests held: their sequences counted by the request they answer (its Generation's queue)."""
        with self.scheduler.cv:
            return len({id(s.out.sink) for s in self.scheduler.held_seqs})

    # ------------------------------------------------------------------ LoRA adapters (the HTTP layer's awaits)

    @property
    def model_ids(self) -> tuple:
        """The model ids a request may name: the base's, then each adapter's."""
        return tuple(self.served)

    def models(self) -> list:
        """[(adapter name, path)] of every adapter served."""
        return [(name, self.paths[name]) for name in self.served if name != self.model_id]

    def add_adapter(self, name: str, path: str, slot: int) -> None:
        self.served[name], self.paths[name] = slot, path

    async def load_adapter(self, name: str, path: str) -> None:
        """The LoRA adapter at ``path`` read and checked (a worker thread), written into a free slot of the stack (the
        decoding thread, between its calls: the programs are not compiled again) and served as ``name``.
        AdapterRequestError: no stack, a name served or being changed, an adapter the stack refuses (its
        message)."""
        if self.stack is None:
            raise AdapterRequestError("this server serves no LoRA adapters: start it with --max_loras N (and --lora "
                                      "NAME=CKPT) to load them", "lora_not_enabled")
        if name in self.served or name in self.changing:
            raise AdapterRequestError(f"the LoRA adapter {name!r} has already been loaded (or is being loaded or "
                                      "unloaded): unload it first, or choose another name", "lora_exists")
        self.changing.add(name)
        try:
            adapter = await asyncio.to_thread(self.stack.read, name, path)
            slot = await asyncio.wrap_future(self.scheduler.between_calls(lambda: self.stack.install(adapter)))
        except FlanT5Error as e:
            raise AdapterRequestError(str(e)) from None
        finally:
            self.changing.discard(name)
        self.add_adapter(name, path, slot)

    async def unload_adapter(self, name: str, poll: float = 0.02) -> None:
        """The LoRA adapter ``name`` no longer served: a request naming it from now on is a 404, the requests that
        hold it finish first (this waits for them), then its slot is emptied and free. AdapterRequestError
        (``model_not_found``) for a name not served."""
        if name not in self.served or name == self.model_id:
            raise AdapterRequestError(f"the LoRA adapter {name!r} cannot be found: GET /v1/models lists the "
                                      "adapters served", "model_not_found")
        slot = self.served.pop(name)
        self.paths.pop(name)
        self.changing.add(name)
        try:
            while self.scheduler.holds_adapter(slot):
                await asyncio.sleep(poll)
            await asyncio.wrap_future(self.scheduler.between_calls(lambda: self.stack.remove(slot)))
        finally:
            self.changing.discard(name)

    @property
    def healthy(self) -> bool:
        return self.scheduler.admitting and self.scheduler.failure is None

    def describe(self, host: str, port: int) -> str:
        o = self.options
        return (f"serving {self.model_id} on http://{host}:{port} ({o.slots} slots, a queue of {o.max_queue}, "
                f"prompts up to {o.width} tokens, up to {o.max_new_tokens} new tokens, {o.steps} step(s) a "
                f"call, up to {o.most_steps} with every slot taken, "
                + ("a free slot joins at once)" if self.min_join == 1 else
                   f"free slots wait for {self.min_join} to join together)"))


def check_exposure(host: str, api_key: Optional[str]) -> Optional[str]:
    """The one line a server on a non-local address without a key says at start-up (None otherwise)."""
    if api_key or host in ("127.0.0.1", "localhost", "::1"):
        return None
    return (f"serving on {host} without an API key: anyone who reaches this address can use the model; pass "
            "--api_key KEY (or set FLAN_T5_API_KEY)")
