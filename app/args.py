"""Command-line arguments shared by the drivers: a preset + one flat flag per config field, resolved into one
validated config (the config's own checks, then its model family's); and the server's own flags (``server_flags``:
run_server.py's, which benchmarks/serve.py parses too; serving/engine.py's ``ServeOptions.of`` reads them)."""

from __future__ import annotations

import argparse
import difflib
import filecmp
import logging
import os
import re
import sys
import tempfile
from typing import Callable, Optional

from app.entry import die
from app.logs import setup_logging
from app.rundir import missing_chain, remove_if_empty
from config.carry import model_shape, saved_value, travelling
from config.fields import _base_type, coerce, get_path
from config.presets import config_from_mapping, load_config, preset_path, read_presets
from config.schema import Config, FIELDS, MODEL_SHAPE, ipu_only_notices
from data.tokenizer import TRAINED
from modelling import registry
from modelling.hf_mapping import model_config_from_hf, read_hf_config, resolve_hf_dir
from utils.errors import ConfigError
from utils.errors import FlanT5Error


logger = logging.getLogger("flan_t5")


def _preset_values(kind: str, argv: list) -> tuple:
    """(preset name, {flag: value}) of the --config named in argv, for --help; ({}) if it cannot be read."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    name = pre.parse_known_args(argv)[0].config
    if name is None:
        return None, {}
    try:
        cfg = config_from_mapping(read_presets(preset_path(kind))[name] or {})
    except (KeyError, ConfigError):
        return name, {}
    return name, {flag: get_path(cfg, ref.path) for flag, ref in FIELDS.items()}


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors as the one line every other error is (no usage dump)."""

    def error(self, message):
        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:  # a close typo gets its likely flag named
            known = [o for a in self._actions for o in a.option_strings]
            hints = [f"{w} (did you mean {c[0]}?)" for w in m.group(1).split() if w.startswith("--")
                     for c in [difflib.get_close_matches(w.split("=")[0], known, n=1, cutoff=0.75)] if c]
            if hints:
                message = "unrecognized arguments: " + ", ".join(hints)
        die(f"{message} (see --help)")


# the fields only training reads (the decoding drivers accept them, a shared preset may set them, but do not list
# them): the training section and what ``config.spec`` marks ``training``
TRAINING_ONLY = tuple(flag for flag, ref in FIELDS.items() if ref.path[0] == "training" or ref.meta.get("training"))


def build_parser(kind: str, description: str, default_preset: str,
                 extra: Optional[Callable[[argparse.ArgumentParser], None]] = None,
                 argv: Optional[list] = None, listed: Optional[tuple] = None,
                 usage: Optional[str] = None) -> argparse.ArgumentParser:
    """An argparse parser with --config and every config field as a flat override flag.

    With ``--config NAME`` in argv, ``--help`` shows that preset's value of every field. ``listed``: the config
    fields ``--help`` shows (a driver that reads few of them: the others are accepted, not listed); ``usage``: the
    usage line, where argparse's cannot say it (one of two flags required).
    """
    presets = list(read_presets(preset_path(kind)))
    preset, values = _preset_values(kind, argv or [])
    p = _Parser(description=description, allow_abbrev=False, usage=usage)
    p.add_argument("--config", default=default_preset, metavar="PRESET",
                   help=f"preset of config/{kind}.yml: {', '.join(presets)} (default: {default_preset})")
    if extra is not None:
        extra(p)
    title = "config fields (override the preset" + (f"; [{preset}: value] is the preset's)" if values else ")")
    group = p.add_argument_group(title)
    for flag, ref in FIELDS.items():
        typ = _base_type(ref.type)
        doc = ref.doc.replace("%", "%%")
        if flag in values:
            shown = values[flag]
            shown = " ".join(str(v) for v in shown) if isinstance(shown, (list, tuple)) else shown
            doc += f" [{preset}: {shown}]"
        # decoding drivers accept the training fields (a shared preset may set them) but do not list them
        hidden = (kind == "inference" and flag in TRAINING_ONLY) or (listed is not None and flag not in listed)
        kwargs = dict(dest=f"cfg__{flag}", default=argparse.SUPPRESS, help=argparse.SUPPRESS if hidden else doc)
        if typ is bool:
            group.add_argument(f"--{flag}", nargs="?", const="true", metavar="BOOL", **kwargs)
        elif typ is tuple:
            items = ref.meta.get("items")
            group.add_argument(f"--{flag}", nargs="+", metavar={str: "WORD", dict: "TASK"}.get(items, "FLOAT"),
                               **kwargs)
        else:
            group.add_argument(f"--{flag}", metavar=typ.__name__.upper(), **kwargs)
    return p


def _is_number(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return True


def join_negative_values(argv: list) -> list:
    """``--flag -1e-3`` -> ``--flag=-1e-3``: argparse takes a value starting with '-' (other than a plain
    negative integer or decimal) for another option; a number after an option is its value."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--") and "=" not in a and i + 1 < len(argv) and argv[i + 1].startswith("-") \
                and _is_number(argv[i + 1]):
            out.append(f"{a}={argv[i + 1]}")
            i += 2
            continue
        out.append(a)
        i += 1
    return out


def parse_args(kind: str, description: str, default_preset: str, argv=None, extra=None, listed=None,
               usage=None) -> tuple:
    """(namespace of the non-config flags, {flag: value} of the config fields given on the command line)."""
    argv = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(kind, description, default_preset, extra, argv, listed, usage)
    args = parser.parse_args(argv)
    overrides = {k[len("cfg__"):]: v for k, v in vars(args).items() if k.startswith("cfg__")}
    for k in list(vars(args)):
        if k.startswith("cfg__"):
            delattr(args, k)
    return args, overrides


DEFAULT_PRESET = "tiny"  # every driver's preset where --config names none


def command_line(kind: str, doc: str, argv=None, extra=None, logs: bool = True, **how) -> tuple:
    """How every driver starts: the log format set (``logs``: the benchmarks print a report of their own and leave
    logging as Python has it), then the command line parsed, described by the first line of the driver's docstring
    ``doc``, with the preset ``tiny`` where --config names none -> (args, overrides) as ``parse_args`` (``how``: its
    ``listed``, ``usage``). The driver then resolves its config (``config_of``, or ``app.predict.start_decoding``)
    and starts its devices (``app.runtime.start_devices``); ``app.entry.entry`` around its ``main`` turns errors into
    one line and an exit code."""
    if logs:
        setup_logging()
    return parse_args(kind, doc.splitlines()[0], DEFAULT_PRESET, argv, extra, **how)


def make_config(kind: str, preset: str, overrides: dict, fixed: Optional[dict] = None,
                defaults: Optional[dict] = None):
    """The config resolved once, at the edge: preset, then ``defaults`` (a driver's own, where the command line says
    nothing), the command line's ``overrides``, and ``fixed`` (what the driver requires), validated by the config
    and then by its model family; an IPU-only field set to no effect is said once."""
    merged = {**(defaults or {}), **overrides, **(fixed or {})}
    cfg = load_config(kind, preset, merged)
    registry.checked(cfg)
    for notice in ipu_only_notices(cfg):
        logger.warning(notice)
    return cfg


def carried_fields(load, hf_model) -> tuple:
    """({flag: value} of the model's shape, {flag: value} of the task it was trained on (its task section, data,
    tokenizer and output length: a checkpoint's alone), source name) from the latest checkpoint --load names, or the
    --hf_model's config.json (any family: its model_type)."""
    from utils import checkpoint as ckpt  # orbax: --help need not pay for it

    if load:
        directory, step = ckpt.resolve(load)[-1]
        saved = ckpt.read_meta(directory, step).get("config")
        if not saved:
            return {}, {}, directory
        return model_shape(saved), travelling(saved), f"checkpoint {directory}"
    if hf_model:
        m = model_config_from_hf(read_hf_config(resolve_hf_dir(hf_model)))
        shape = model_shape(Config(model=m))  # the model section's (an HF model has no adapters of ours)
        return {k: v for k, v in shape.items() if FIELDS[k].path[0] == "model"}, {}, f"model {hf_model}"
    return {}, {}, None


def carried_model(overrides: dict, load=None, hf_model=None) -> dict:
    """The model fields a checkpoint (--load) or an HF model (--hf_model) carries, as config defaults: the
    shape and variant never need repeating on the command line, and an explicit flag that contradicts them is
    an error naming both values. A checkpoint carries the task it was trained on too (``carried_fields``): those
    are defaults that any flag may change (another dataset, split, template, output length)."""
    carried, task, source = carried_fields(load, hf_model)
    for flag, value in carried.items():
        if flag in overrides and coerce(FIELDS[flag], overrides[flag]) != value:
            raise FlanT5Error(f"--{flag} {overrides[flag]} contradicts the {source}, whose {flag} is {value}: drop "
                              f"--{flag} (the model's shape comes from the {'checkpoint' if load else 'model'})")
    if carried:  # the fields the model's family reads (a GPT-J has no relative-position buckets)
        shown = registry.get(carried["family"]).shape_fields if carried.get("family") in registry.names() else carried
        logger.info("model shape from the %s: %s", source, ", ".join(f"{k}={shown_value(k, carried)}" for k in shown
                                                                    if k in carried))
    return {**task, **carried}


def shown_value(flag: str, values: dict):
    """A field's value as a log line says it: a count whose 0 means "as many as another field" as that count."""
    zero_means = {"decoder_layers": "layers"}  # (config/schema.py: 0, as many as layers)
    if values[flag] == 0 and values.get(zero_means.get(flag)):
        return values[zero_means[flag]]
    return values[flag]


def parse_config(kind: str, description: str, default_preset: str, argv=None, extra=None,
                 fixed: Optional[dict] = None, defaults: Optional[dict] = None, resume: bool = False):
    """Parses argv into (config, namespace of the non-config flags): ``parse_args``, then ``config_of``."""
    args, overrides = parse_args(kind, description, default_preset, argv, extra)
    return config_of(kind, args, overrides, fixed, defaults, resume), args


def config_of(kind: str, args, overrides: dict, fixed: Optional[dict] = None, defaults: Optional[dict] = None,
              resume: bool = False):
    """The config of a parsed command line (``args.config``'s preset, the ``overrides``); a bad config raises
    ConfigError. With --hf_model, the model's shape and variant come from its config.json (``carried_model``); with
    ``resume`` and --load, every field the checkpoint saved is a default (``resumed_fields``: a resume continues the
    run)."""
    if resume and overrides.get("load"):
        carried, overrides = resumed_fields(overrides)
        defaults = {**carried, **(defaults or {})}
    elif overrides.get("hf_model"):
        defaults = {**carried_model(overrides, hf_model=overrides["hf_model"]), **(defaults or {})}
    return make_config(kind, args.config, overrides, fixed, defaults)


def resumed_fields(overrides: dict) -> tuple:
    """({flag: value} a --load resume takes from its checkpoint, as defaults: every field its saved config holds (the
    model's shape, where a flag that contradicts it is an error as in validation; the task; the data order; the
    optimizer, schedule, layout and checkpointing), so that a resume continues the run as it was and a flag changes
    only what it names; the overrides, with ``--tokenizer train`` meaning the tokenizer that run learnt). A flag that
    changes the task or the data order is refused by ``app.resume.resume_point``, every one named at once."""
    from utils import checkpoint as ckpt

    directory, step = ckpt.resolve(overrides["load"])[-1]
    saved = ckpt.read_meta(directory, step).get("config") or {}
    shape = carried_model({k: v for k, v in overrides.items() if k in MODEL_SHAPE}, load=overrides["load"])
    run = {flag: saved_value(saved, flag) for flag in FIELDS if flag not in ("load", "save") and _saved(saved, flag)}
    overrides = dict(overrides)
    if overrides.get("tokenizer") == TRAINED and run.get("tokenizer", TRAINED) != TRAINED:
        logger.info("--tokenizer train: resuming with the tokenizer %s learnt, %s", directory, run["tokenizer"])
        del overrides["tokenizer"]
    elif same_files(overrides.get("tokenizer"), run.get("tokenizer")):  # the directory its checkpoint holds a copy of
        del overrides["tokenizer"]
    return {**run, **shape}, overrides


def same_files(a, b) -> bool:
    """Whether two local directories hold the same files, byte for byte (a tokenizer and its copy)."""
    if not (isinstance(a, str) and isinstance(b, str) and os.path.isdir(a) and os.path.isdir(b)):
        return False
    names = sorted(set(os.listdir(a)) | set(os.listdir(b)))
    match, _, _ = filecmp.cmpfiles(a, b, names, shallow=False)
    return len(match) == len(names)


def _saved(saved: dict, flag: str) -> bool:
    """Whether a saved config holds the field (a checkpoint older than a field has nothing to say of it)."""
    value = saved
    for p in FIELDS[flag].path:
        if not (isinstance(value, dict) and p in value):
            return False
        value = value[p]
    return True


def local_path(value):
    """A value naming a local file or directory (relative to this directory) as its absolute path; a mixture task's
    mapping with its data set's so; a list of them each; anything else (a hub name, a generated data set's name, a
    number) as it is."""
    if isinstance(value, str):
        return os.path.abspath(value) if value and os.path.exists(value) else value
    if isinstance(value, dict) and "dataset" in value:
        return {**value, "dataset": local_path(value["dataset"])}
    if isinstance(value, (list, tuple)):
        return type(value)(local_path(v) for v in value)
    return value


def local_paths_absolute(cfg) -> None:
    """A training run's local paths (its data set, tokenizer, HF model, data cache, each mixture task's data set) made
    absolute, as its checkpoints then record them: validated, resumed or exported from another directory, a
    checkpoint finds its files (a relative data set was read there as a hub name: "cannot download data set
    weather.csv ... no network")."""
    data = cfg.data
    for name in ("dataset", "tokenizer", "hf_model"):
        setattr(data, name, local_path(getattr(data, name)))
    data.cache_dir = os.path.abspath(data.cache_dir) if data.cache_dir else data.cache_dir
    cfg.mixture.tasks = local_path(cfg.mixture.tasks)


def ensure_writable(path: str, flag: str, is_dir: bool = True) -> None:
    """Fails early (before any work) if ``path`` (a directory, or a file's directory) cannot be written."""
    directory = os.path.abspath(path if is_dir else (os.path.dirname(path) or "."))
    if not is_dir and os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory: pass a file path")
    made = missing_chain(directory)  # made for the check and removed after it: a refused run leaves no folder
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be written ({e.strerror or e}): choose a path you can write to") from None
    finally:
        remove_if_empty(made)


# --------------------------------------------------------------------------- run_server.py's own flags

KEY_VARIABLE = "FLAN_T5_API_KEY"  # the API key's environment variable (--api_key's default)


def server_flags(p) -> None:
    """run_server.py's own flags (ServeOptions.of reads them; benchmarks/serve.py --profile parses the same)."""
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="the address to listen on (default 127.0.0.1: this machine "
                                                       "only)")
    s.add_argument("--port", type=int, default=8000, help="the port (0: any free one; the start-up line names it)")
    s.add_argument("--api_key", default=None, metavar="KEY",
                   help=f"the key every endpoint but /health requires (Authorization: Bearer KEY); default: the "
                        f"{KEY_VARIABLE} environment variable, which keeps it out of the process list")
    s.add_argument("--model_name", default=None, help="the model id clients name (default: the checkpoint "
                                                       "directory's name, or the --hf_model)")
    s.add_argument("--slots", type=int, default=None,
                   help="decoding slots: requests decoded at once (default: micro_batch_size * data_parallel)")
    s.add_argument("--max_queue", type=int, default=None,
                   help="sequences that may wait for a slot; while that many wait a request gets 429 with "
                        "Retry-After, which the openai client retries (default: 256, or 4 x slots where more)")
    s.add_argument("--prompt_width", type=int, default=None, metavar="N",
                   help="the longest prompt taken, in tokens: joining prompts are read packed several to a row this "
                        "wide (default: the longest prompt of the rows the checkpoint's task was trained on, and at "
                        "least sequence_length, rounded up to a multiple of 8)")
    s.add_argument("--insert_rows", type=int, nargs="+", default=None, metavar="N",
                   help="packed rows (per dp shard) one insert reads, a program compiled for each: joining prompts "
                        "take the fewest that hold them (default: 1, 4, 16 ... and the slots per shard)")
    s.add_argument("--steps_per_call", type=int, default=8,
                   help="decoding steps per call of the slots' program (default 8: the host's work per call spread "
                        "over 8 tokens; 1 with --max_steps_per_call 1: a token streamed at a time and joins at every "
                        "step, at more host work per token)")
    s.add_argument("--max_steps_per_call", type=int, default=None,
                   help="the most decoding steps one call may take while every slot is taken: as many as the fewest "
                        "tokens any slot has left, so that no request waits for a slot it could have had (default: 4 "
                        "x --steps_per_call; a slot whose request ends inside a call, by its end-of-text token, a "
                        "stop string or a cancel, is refilled after the next call)")
    s.add_argument("--attention_spans", type=int, default=None,
                   help="decoding programs compiled, each attending over a prefix of the slots' cache: 1/N, 2/N ... "
                        "of it (default 1: every call attends over all of it). A call runs in the one whose prefix "
                        "holds every running request's tokens and whose steps were timed fastest at start-up (a "
                        "narrower prefix attends over fewer positions but copies them in and out once a call; the "
                        "timing costs start-up time: a base-sized T5's server on a 2-core CPU took 110 s to start "
                        "with 4, 20 s with 1)")
    s.add_argument("--cpu_threads", type=int, default=None,
                   help="threads of XLA's CPU thread pool (default: all the cores but one, which is left to the "
                        "server's own threads: HTTP, scheduling, text; all of them where the CPU decodes and a "
                        "decoding step of every slot is 40 MFLOP or more; at least one a simulated device; 0: XLA's "
                        "own default, all the cores, or PJRT_NPROC or NPROC where the environment sets them, "
                        "which the default leaves too); docs/serving.md")
    s.add_argument("--min_join", type=int, default=None,
                   help="free slots that wait (two decoding calls at most) for others to free, so that waiting prompts "
                        "join together in one insert (default: 1 on a CPU, where a free slot joins at once; else half "
                        "the slots)")
    s.add_argument("--max_logprobs", type=int, default=20,
                   help="the most likely tokens a request may ask to see beside each token (logprobs, top_logprobs; "
                        "default 20, as vLLM's)")
    s.add_argument("--chat_template", default=None, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (default: the tokenizer's, else the last "
                        "message with the earlier ones as 'Role: text' lines before it)")
    lora_flags(s)
    limit_flags(s)


def lora_flags(s) -> None:
    """The LoRA adapters served side by side over the base (docs/serving.md, "Many adapters, one base")."""
    s.add_argument("--lora", nargs="+", default=None, metavar="NAME=CKPT",
                   help="LoRA adapters served unmerged over the --load (or --hf_model) base, each under its own model "
                        "id NAME (a request's model picks it; GET /v1/models lists them): CKPT a --save directory of "
                        "run_finetuning.py --lora_rank N trained on that base, or an adapter directory in PEFT's "
                        "format")
    s.add_argument("--max_loras", type=int, default=None, metavar="N",
                   help="adapter slots on the devices (default: as many as --lora names); more leave room to load "
                        "adapters while the server runs (POST /v1/load_lora_adapter) without compiling again")
    s.add_argument("--max_lora_rank", type=int, default=None, metavar="R",
                   help="the largest adapter rank served (every adapter's rank is padded to it; default: the largest "
                        "of the --lora adapters', else 16)")
    s.add_argument("--lora_target_modules", nargs="+", default=None, metavar="NAME",
                   help="the layer weights the adapter stack holds adapters of, named as --lora_targets names them "
                        "(default: those the --lora adapters adapt, else the family's default)")


def limit_flags(s) -> None:
    """The server's limits, its shutdown and --plan."""
    s.add_argument("--header_timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's head before it is closed")
    s.add_argument("--body_timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive (408 past it)")
    s.add_argument("--max_connections", type=int, default=1024,
                   help="open connections served at once: while more are open a request is a 503 with "
                        "Retry-After, and its connection is closed")
    s.add_argument("--max_header_bytes", type=int, default=16384,
                   help="the largest request head, its line and headers (431 past it; default 16384, h11's)")
    s.add_argument("--log_requests", choices=("off", "debug", "info", "warning"), default="info",
                   help="the level of the one log line each refusal (a response of status 400 or more) gets, saying "
                        "whose request it was and why (default info; off: none; vLLM's --disable-log-requests is "
                        "the inverse convention)")
    s.add_argument("--access_log", action="store_true",
                   help="uvicorn's access log: a line for every request (client, method, path, status)")
    s.add_argument("--grace_period", type=float, default=30.0,
                   help="seconds a SIGTERM leaves the held requests to finish before they end with an error")
    s.add_argument("--max_body_bytes", type=int, default=1 << 20, help="the largest request body (413 past it)")
    s.add_argument("--max_prompt_chars", type=int, default=None,
                   help="the longest prompt in characters (413 past it; default 64 x the widest prompt width)")
    s.add_argument("--plan", action="store_true",
                   help="print the memory plan of serving (device and host bytes: the weights, the KV cache of --slots "
                        "rows of the widest prompt width and output_length new tokens, activations; from shapes, "
                        "nothing loaded) and exit")
    s.add_argument("--plan_exact", action="store_true",
                   help="with --plan: count decoding's temporaries as XLA compiles them for this backend (a batch of "
                        "--slots rows)")
