"""Command-line setup shared by the drivers: preset + one flat flag per config field."""

from __future__ import annotations

import argparse
import functools
import logging
import os
import signal
import sys
import threading
import typing
from typing import Callable, Optional

from config.config import (FIELDS, ConfigError, _base_type, config_from_mapping, get_path, load_config, read_presets,
                           preset_path)
from utils.errors import FlanT5Error, OutOfMemory

logger = logging.getLogger("flan_t5")


def die(message: str, code: int = 2) -> typing.NoReturn:
    """Prints a one-line error and exits non-zero."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


# --------------------------------------------------------------------------- arguments


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
        import difflib
        import re

        m = re.match(r"unrecognized arguments: (.*)", message)
        if m:  # a close typo gets its likely flag named
            known = [o for a in self._actions for o in a.option_strings]
            hints = [f"{w} (did you mean {c[0]}?)" for w in m.group(1).split() if w.startswith("--")
                     for c in [difflib.get_close_matches(w.split("=")[0], known, n=1, cutoff=0.75)] if c]
            if hints:
                message = "unrecognized arguments: " + ", ".join(hints)
        die(f"{message} (see --help)")


# fields that only training reads, outside the training section
TRAINING_ONLY = ("save", "checkpoint_steps", "to_keep", "optim_state", "phased", "recompute", "remat_policy", "rts",
                 "loss_scaling", "packing", "packed_decoder_length", "causal_packing", "loss_tokens", "dropout_prob",
                 "unroll_layers", "decoder_sequence_length")


def build_parser(kind: str, description: str, default_preset: str,
                 extra: Optional[Callable[[argparse.ArgumentParser], None]] = None,
                 argv: Optional[list] = None) -> argparse.ArgumentParser:
    """An argparse parser with --config and every config field as a flat override flag.

    With ``--config NAME`` in argv, ``--help`` shows that preset's value of every field.
    """
    presets = list(read_presets(preset_path(kind)))
    preset, values = _preset_values(kind, argv or [])
    p = _Parser(description=description, allow_abbrev=False)
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
        hidden = kind == "inference" and (ref.path[0] == "training" or flag in TRAINING_ONLY)
        kwargs = dict(dest=f"cfg__{flag}", default=argparse.SUPPRESS, help=argparse.SUPPRESS if hidden else doc)
        if typ is bool:
            group.add_argument(f"--{flag}", nargs="?", const="true", metavar="BOOL", **kwargs)
        elif typ is tuple:
            group.add_argument(f"--{flag}", nargs="+", metavar="FLOAT", **kwargs)
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


def parse_args(kind: str, description: str, default_preset: str, argv=None, extra=None) -> tuple:
    """(namespace of the non-config flags, {flag: value} of the config fields given on the command line)."""
    argv = join_negative_values(list(sys.argv[1:] if argv is None else argv))
    parser = build_parser(kind, description, default_preset, extra, argv)
    args = parser.parse_args(argv)
    overrides = {k[len("cfg__"):]: v for k, v in vars(args).items() if k.startswith("cfg__")}
    for k in list(vars(args)):
        if k.startswith("cfg__"):
            delattr(args, k)
    return args, overrides


def make_config(kind: str, preset: str, overrides: dict, fixed: Optional[dict] = None,
                defaults: Optional[dict] = None):
    """The validated config: preset, then ``defaults`` (a driver's own, where the command line says nothing),
    the command line's ``overrides``, and ``fixed`` (what the driver requires) - all before ``validate()``."""
    merged = {**(defaults or {}), **overrides, **(fixed or {})}
    return load_config(kind, preset, merged)


def carried_fields(load, hf_model) -> tuple:
    """({flag: value} the model carries: its shape, and the tokenizer it was trained with; source name)
    from the latest checkpoint --load names, or the --hf_model's config.json (any family: its model_type)."""
    from config.config import T5Config, model_shape
    from utils import checkpoint as ckpt

    if load:
        directory, step = ckpt.resolve(load)[-1]
        saved = ckpt.read_meta(directory, step).get("config")
        if not saved:
            return {}, directory
        fields = model_shape(saved)
        fields["tokenizer"] = saved.get("data", {}).get("tokenizer")
        return {k: v for k, v in fields.items() if v is not None}, f"checkpoint {directory}"
    if hf_model:
        from modelling.hf_mapping import model_config_from_hf, read_hf_config, resolve_hf_dir

        m = model_config_from_hf(read_hf_config(resolve_hf_dir(hf_model)))
        return model_shape(T5Config(model=m)), f"model {hf_model}"
    return {}, None


def carried_model(overrides: dict, load=None, hf_model=None) -> dict:
    """The model fields a checkpoint (--load) or an HF model (--hf_model) carries, as config defaults: the
    shape and variant never need repeating on the command line, and an explicit flag that contradicts them is
    an error naming both values."""
    from config.config import coerce

    carried, source = carried_fields(load, hf_model)
    for flag, value in carried.items():
        if flag in overrides and flag != "tokenizer" and coerce(FIELDS[flag], overrides[flag]) != value:
            raise FlanT5Error(f"--{flag} {overrides[flag]} contradicts the {source}, whose {flag} is {value}: drop "
                              f"--{flag} (the model's shape comes from the {'checkpoint' if load else 'model'})")
    if carried:
        logging.getLogger("flan_t5").info("model shape from the %s: %s", source,
                                         ", ".join(f"{k}={v}" for k, v in carried.items()))
    return carried


def parse_config(kind: str, description: str, default_preset: str, argv=None, extra=None,
                 fixed: Optional[dict] = None, defaults: Optional[dict] = None):
    """Parses argv into (config, namespace of the non-config flags); a bad config raises ConfigError. With
    --hf_model, the model's shape and variant come from its config.json (``carried_model``)."""
    args, overrides = parse_args(kind, description, default_preset, argv, extra)
    if overrides.get("hf_model"):
        defaults = {**carried_model(overrides, hf_model=overrides["hf_model"]), **(defaults or {})}
    return make_config(kind, args.config, overrides, fixed, defaults), args


# --------------------------------------------------------------------------- the entry wrapper


def entry(main: Callable) -> Callable:
    """Every driver's ``main``: an expected error (``utils.errors.FlanT5Error``) becomes one line on stderr
    and its exit code; Ctrl-C outside the training loop (which handles it itself) exits 130 without a
    traceback; a device out of memory becomes one line with the knobs that lower memory."""

    @functools.wraps(main)
    def run(argv=None):
        old = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                old[sig] = signal.signal(sig, exit_on_signal)
        try:
            return main(argv)
        except FlanT5Error as e:
            die(str(e), e.exit_code)
        except KeyboardInterrupt:
            die("interrupted", 130)
        except Exception as e:  # XLA's out-of-memory errors carry no type of their own
            oom = out_of_memory_message(e)
            if oom is None:
                raise
            die(oom, OutOfMemory.exit_code)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    return run


def exit_on_signal(signum, frame=None) -> None:
    """Ctrl-C or SIGTERM at any moment outside the training loop's own handling (start-up, compilation, loading,
    validation, decoding): one line and exit 130 / 143 at once. No Python exception is raised into a program
    that XLA's threads are running (that is what ended in segmentation faults, or in an interrupt swallowed by a
    garbage-collection callback); files are written atomically, so what was saved before stays intact."""
    name = signal.Signals(signum).name
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        pass
    os.write(2, f"\n{name}: stopped; the work in progress was not saved (earlier checkpoints and reports are "
                f"intact)\n".encode())
    os._exit(128 + signum)


def out_of_memory_message(e: BaseException) -> Optional[str]:
    """One line for an XLA RESOURCE_EXHAUSTED error (bytes asked for, and the knobs), else None."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "Out of memory" not in text:
        return None
    import re

    m = re.search(r"allocat\w* ([0-9.]+)\s*(bytes|[KMGT]i?B)", text)
    need = ""
    if m:
        scale = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6,
                 "GB": 1e9, "TB": 1e12}.get(m.group(2), 1)
        need = f" allocating {float(m.group(1)) * scale / 2**30:.1f} GiB"
    return (f"a device ran out of memory{need}: lower --micro_batch_size, pass --recompute true (--remat_policy "
            "full), raise --tensor_parallel (more devices), or pass --phased true (weights and optimizer state in "
            "host memory); --plan prints what the run needs")


def ensure_writable(path: str, flag: str, is_dir: bool = True) -> None:
    """Fails early (before any work) if ``path`` (a directory, or a file's directory) cannot be written."""
    import tempfile

    directory = os.path.abspath(path if is_dir else (os.path.dirname(path) or "."))
    if not is_dir and os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory: pass a file path")
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".write-check-"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path} cannot be written ({e.strerror or e}): choose a path you can write to") from None


class _ProgressFriendly(logging.StreamHandler):
    """On a terminal, log lines are written above the progress bar (tqdm.write) instead of through it."""

    def emit(self, record):
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=self.stream)
        except Exception:
            self.handleError(record)


def setup_logging(level: int = logging.INFO) -> None:
    handlers = [_ProgressFriendly(sys.stderr)] if sys.stderr.isatty() else None
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S",
                        handlers=handlers)
    if distributed_requested() and rank_from_env() > 0:  # from the start, before JAX knows the process index
        logger.setLevel(logging.WARNING)
    for noisy in ("absl", "orbax", "jax", "matplotlib"):
        logging.getLogger(noisy).setLevel(logging.ERROR)


def ensure_host_devices(n: int) -> None:
    """Lets the CPU backend simulate ``n`` devices in all (must run before JAX starts).

    In a multi-process run each process simulates its share, n / processes
    (process_count_from_env). Only the host (CPU) platform is affected: on a GPU or TPU machine
    the accelerators are used and this flag is inert.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    procs = process_count_from_env()
    local = -(-n // procs)
    if "xla_force_host_platform_device_count" not in flags and local > 1:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local}".strip()


def process_count_from_env() -> int:
    """The number of processes this run will have, read before JAX starts: JAX_NUM_PROCESSES, or
    under FLAN_T5_DISTRIBUTED=1 the scheduler's count (SLURM_NTASKS, OMPI_COMM_WORLD_SIZE); else 1."""
    names = ["JAX_NUM_PROCESSES"]
    if os.environ.get("FLAN_T5_DISTRIBUTED") == "1":
        names += ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"]
    for name in names:
        n = _env_int(name)
        if n:
            return n
    return 1


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        die(f"{name}={value!r} is not an integer: set it to a whole number (or unset it)")


def ensure_pinned_host_memory(phased: bool) -> None:
    """Phased execution keeps weights and optimizer state in pinned host memory. JAX's GPU
    client caps that at 64 GB unless XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB says otherwise (an XL
    model's float32 weights, AdamW state and gradients need more); raise the cap to 90% of
    this host's RAM when the user has not set it. Must run before JAX starts; inert on CPU."""
    if not phased or "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in os.environ:
        return
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    os.environ["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"] = str(max(int(0.9 * ram / 2**30), 1))


def rank_from_env() -> int:
    """This process's rank as the launcher or scheduler set it (JAX_PROCESS_ID, SLURM_PROCID, OMPI_COMM_WORLD_RANK),
    read before JAX starts; 0 where none is set."""
    for name in ("JAX_PROCESS_ID", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        value = _env_int(name)
        if value is not None:
            return value
    return 0


def distributed_requested() -> bool:
    """Whether this run is one of several processes (the environment asks for jax.distributed)."""
    return bool(os.environ.get("JAX_COORDINATOR_ADDRESS")) or os.environ.get("FLAN_T5_DISTRIBUTED") == "1"


def maybe_initialize_distributed() -> None:
    """Multi-process runs (the original's poprun): jax.distributed.initialize() when a cluster is set up.

    Set JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES and
    JAX_PROCESS_ID in every process (``python3 -m utils.launch`` does this for processes
    on one machine), or set FLAN_T5_DISTRIBUTED=1 under SLURM / Open MPI / on a TPU pod
    to let JAX detect them. One process otherwise.
    """
    if not distributed_requested():
        return
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    detect = os.environ.get("FLAN_T5_DISTRIBUTED") == "1"  # the scheduler fills in what is not set
    procs, pid = _env_int("JAX_NUM_PROCESSES"), _env_int("JAX_PROCESS_ID")
    missing = [n for n, v in (("JAX_NUM_PROCESSES", procs), ("JAX_PROCESS_ID", pid)) if v is None]
    if missing and not detect:
        die(f"JAX_COORDINATOR_ADDRESS is set but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
            "not: set all three in every process (or FLAN_T5_DISTRIBUTED=1 under SLURM / on a TPU pod)")
    if procs is not None and pid is not None and not 0 <= pid < procs:
        die(f"JAX_PROCESS_ID={pid} is outside 0..{procs - 1} (JAX_NUM_PROCESSES={procs}): number the processes "
            "0, 1, ... JAX_NUM_PROCESSES-1")
    import jax

    jax.distributed.initialize(address, procs, pid)


def filter_stdout_lines(drop) -> None:
    """Drops the lines of this process's standard output (file descriptor 1, so native libraries' prints too)
    for which ``drop(line: bytes)`` is true. The filter is a pipe and a thread; at exit the descriptor is
    restored and the thread drained, so no line is lost."""
    import atexit
    import threading

    read_end, write_end = os.pipe()
    original = os.dup(1)
    sys.stdout.flush()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump():
        with os.fdopen(read_end, "rb") as src, os.fdopen(os.dup(original), "wb", buffering=0) as dst:
            for line in src:
                if not drop(line):
                    dst.write(line)

    thread = threading.Thread(target=pump, name="stdout-filter", daemon=True)
    thread.start()

    def restore():
        sys.stdout.flush()
        os.dup2(original, 1)  # the pipe's last writer closes: the pump reads to its end
        thread.join(timeout=5)

    atexit.register(restore)


def _gloo_line(line: bytes) -> bool:
    # gloo prints "[Gloo] Rank N is connected to M peer ranks..." from several threads at once; fragments
    # of interleaved lines carry one of the two marks
    return b"[Gloo]" in line or b"connected peer ranks" in line


def setup_jax() -> Optional[str]:
    """Starts multi-process JAX when configured, and switches on the persistent compilation
    cache from JAX_COMPILATION_CACHE_DIR (or the original's POPXL_CACHE_DIR); returns its path.

    In a multi-process run only process 0 logs at INFO; the others log warnings and errors.
    """
    maybe_initialize_distributed()
    if not is_main_process():
        logger.setLevel(logging.WARNING)
    if distributed_requested():
        import jax

        if jax.process_count() > 1 and jax.local_devices()[0].platform == "cpu":
            filter_stdout_lines(_gloo_line)  # CPU collectives (gloo) announce every connection on stdout
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or os.environ.get("POPXL_CACHE_DIR")
    if not path:
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    return path


def is_main_process() -> bool:
    """True in process 0 of a multi-process run (the one that prints and writes reports), and in a
    single-process run."""
    if not distributed_requested():
        return True
    import jax

    return jax.process_index() == 0
