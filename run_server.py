"""An OpenAI-compatible HTTP server for a fine-tuned model, with continuous batching, for both families.

    python3 run_server.py --load ckpt/tiny                                  # http://127.0.0.1:8000/v1
    python3 run_server.py --hf_model google/flan-t5-base --config base --slots 32
    FLAN_T5_API_KEY=secret python3 run_server.py --load ckpt/gptj --host 0.0.0.0 --port 8080

Then any OpenAI client: ``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret").completions.create(
model=..., prompt=..., max_tokens=32, temperature=0)``. Endpoints: POST /v1/completions, POST /v1/chat/completions,
GET /v1/models, GET /health, GET /metrics (Prometheus); docs/serving.md is the reference. The weights (a checkpoint, LoRA adapters merged into their base, or an HF
model), the tokenizer and the output length come from the checkpoint as run_inference.py takes them. A
/v1/completions prompt is read as given (a raw continuation, as OpenAI's); a chat message is the task's input,
rendered in the task's prompt format as ``run_inference.py --prompt`` renders it (GPT-J: ``TEXT target:``), and
greedy decoding (temperature 0) gives its tokens.

Decoding runs in ``--slots`` rows at once, each request in its own row at its own position: requests join and leave
between steps (serving/scheduler.py). Every program is compiled before the server listens (a handful, whatever the
slots and prompt lengths; JAX's compilation cache makes a second start quick); the line
``serving MODEL on http://HOST:PORT ...`` says it is ready. SIGTERM or Ctrl-C: no new requests, the held ones
finished (ended with an error after --grace_period seconds), exit 0.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below (seconds: JAX's) is one line too, not a traceback
    from app.entry import exit_on_signals

    exit_on_signals()

import logging
import os
import sys

from app.args import KEY_VARIABLE, command_line, server_flags
from app.entry import entry

logger = logging.getLogger("flan_t5")


@entry
def main(argv=None) -> None:
    args, overrides = command_line("inference", __doc__, argv, server_flags)
    from app.flops import decode_step_flops
    from app.predict import decoding_config, print_plan, trained_prompt_length
    from app.runtime import check_cpu_threads, server_cpu_threads, set_cpu_threads, start_devices
    from serving.engine import ServeOptions, check_exposure

    check_cpu_threads(args.cpu_threads)  # (a bad value named before anything is read)
    cfg = decoding_config(args, overrides, "serve")
    options = ServeOptions.of(args, cfg, trained_prompt_length(cfg))
    plan = args.plan or args.plan_exact
    # (a core is left to the server's threads where it serves, unless the CPU decodes heavy steps; --plan serves
    # nothing: the flag as given)
    step = options.slots * decode_step_flops(cfg.model)  # (a decoding step of every slot: the config's count)
    threads = (args.cpu_threads or 0) if plan else server_cpu_threads(args.cpu_threads, step)
    set_cpu_threads(threads)  # (before JAX starts)
    if plan:
        start_devices(cfg)
        print_plan(cfg, options.slots, exact=args.plan_exact, prompt_length=options.width, adapters=options)
        return
    from serving.http import check_port

    check_port(args.host, args.port)  # (before anything is loaded or compiled)
    logger.info("XLA's CPU pool: %s (%s; a decoding step of the %d slots: %.1f MFLOP)",
                f"{threads} thread(s)" if threads else "XLA's default size (the cores, or PJRT_NPROC or NPROC)",
                "--cpu_threads" if args.cpu_threads is not None else "the default: --cpu_threads to choose",
                options.slots, step / 1e6)
    start_devices(cfg)
    from serving.build import build_engine
    from serving.http import LOG_LEVELS, serve

    api_key = args.api_key or os.environ.get(KEY_VARIABLE) or None
    exposed = check_exposure(args.host, api_key)
    if exposed:
        logger.warning(exposed)
    engine = build_engine(cfg, options)

    def ready(host, port):
        print(engine.describe(host, port), flush=True)
        engine.backend.compile_constrained()  # (structured outputs' programs, once it serves: serving/build.py)

    serve(engine, args.host, args.port, api_key, args.grace_period, ready, args.header_timeout, args.body_timeout,
          max_connections=args.max_connections, max_header_bytes=args.max_header_bytes,
          log_requests=LOG_LEVELS[args.log_requests], access_log=args.access_log)


if __name__ == "__main__":
    main(sys.argv[1:])
