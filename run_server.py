"""An OpenAI-compatible HTTP server for a fine-tuned model, with continuous batching, for both families.

    python3 run_server.py --load ckpt/tiny                                  # http://127.0.0.1:8000/v1
    python3 run_server.py --hf_model google/flan-t5-base --config base --slots 32
    FLAN_T5_API_KEY=secret python3 run_server.py --load ckpt/gptj --host 0.0.0.0 --port 8080

Then any OpenAI client: ``OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="secret").completions.create(
model=..., prompt=..., max_tokens=32, temperature=0)``. Endpoints: POST /v1/completions, POST /v1/chat/completions,
GET /v1/models, GET /health, GET /metrics (Prometheus); docs/serving.md is the reference. The weights (a checkpoint, LoRA adapters merged into their base, or an HF
model), the tokenizer and the output length come from the checkpoint as run_inference.py takes them; prompts are
read as given (as ``run_inference.py --prompt``), and greedy decoding (temperature 0) gives its tokens.

Decoding runs in ``--slots`` rows at once, each request in its own row at its own position: requests join and leave
between steps (serving/scheduler.py). Every program is compiled before the server listens; the line
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

from app.args import command_line
from app.entry import entry

logger = logging.getLogger("flan_t5")
KEY_VARIABLE = "FLAN_T5_API_KEY"


def extra_flags(p):
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
                   help="sequences that may wait for a slot; more get 429 with Retry-After, which the openai client "
                        "retries (default: 256, or 4 x slots where more)")
    s.add_argument("--prompt_widths", type=int, nargs="+", default=None, metavar="N",
                   help="prompt widths compiled (a prompt is padded to the first that holds it; the widest is the "
                        "longest prompt taken); default: 16, 32, ... up to sequence_length")
    s.add_argument("--join_sizes", type=int, nargs="+", default=None, metavar="N",
                   help="how many prompts (per dp shard) one insert reads, compiled (default: 1, 4, 16 ... and the "
                        "slots per shard)")
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
                        "of it (default 4). A call runs in the one whose prefix holds every running request's tokens "
                        "and whose steps were timed fastest at start-up (a narrower prefix attends over fewer "
                        "positions but copies them in and out once a call); 1: every call attends over all of it")
    s.add_argument("--cpu_threads", type=int, default=None,
                   help="threads of XLA's CPU thread pool (default: all the cores but one, which is left to the "
                        "server's own threads: HTTP, scheduling, text; at least one a simulated device; 0: XLA's "
                        "own default, all the cores, or PJRT_NPROC or NPROC where the environment sets them, "
                        "which the default leaves too); docs/serving.md")
    s.add_argument("--min_join", type=int, default=None,
                   help="free slots that wait (two decoding calls at most) for others to free, so that waiting prompts "
                        "join together in one insert (default: half the slots, at most the rows one insert takes: "
                        "data_parallel x the widest join; 1: a free slot joins at once)")
    s.add_argument("--max_logprobs", type=int, default=20,
                   help="the most likely tokens a request may ask to see beside each token (logprobs, top_logprobs; "
                        "default 20, as vLLM's)")
    s.add_argument("--chat_template", default=None, metavar="FILE",
                   help="a Jinja chat template for /v1/chat/completions (default: the tokenizer's, else the last "
                        "message with the earlier ones as 'Role: text' lines before it)")
    limit_flags(s)


def limit_flags(s) -> None:
    """The server's limits, its shutdown and --plan."""
    s.add_argument("--header_timeout", type=float, default=10.0,
                   help="seconds a connection may take to send a request's head before it is closed")
    s.add_argument("--body_timeout", type=float, default=30.0,
                   help="seconds a request's body may take to arrive (408 past it)")
    s.add_argument("--max_connections", type=int, default=1024,
                   help="open connections at most (uvicorn answers 503 past it)")
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


@entry
def main(argv=None) -> None:
    args, overrides = command_line("inference", __doc__, argv, extra_flags)
    from app.predict import start_decoding
    from app.runtime import server_cpu_threads, set_cpu_threads

    threads = server_cpu_threads(args.cpu_threads)
    set_cpu_threads(threads)  # (before JAX starts)
    if threads:
        logger.info("XLA's CPU pool: %d thread(s) (--cpu_threads; at least one a simulated device)", threads)

    cfg = start_decoding(args, overrides, "serve")
    from serving.backend import build_engine
    from serving.engine import ServeOptions, check_exposure
    from serving.http import serve

    options = ServeOptions.of(args, cfg)
    if args.plan or args.plan_exact:
        from app.predict import print_plan

        print_plan(cfg, options.slots, exact=args.plan_exact, prompt_length=options.widths[-1])
        return

    api_key = args.api_key or os.environ.get(KEY_VARIABLE) or None
    exposed = check_exposure(args.host, api_key)
    if exposed:
        logger.warning(exposed)
    engine = build_engine(cfg, options)
    serve(engine, args.host, args.port, api_key, args.grace_period,
          lambda host, port: print(engine.describe(host, port), flush=True), args.header_timeout, args.body_timeout,
          max_connections=args.max_connections)


if __name__ == "__main__":
    main(sys.argv[1:])
