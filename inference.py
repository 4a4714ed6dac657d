"""Greedy-decoding benchmark on generated prompts (no download).

    python3 inference.py --config tiny
    python3 inference.py --config xl --micro_batch_size 16 --json runs/xl_inference.json

Reports the time to read the prompts (``encoder_s``: an encoder-decoder's encoder, cross-attention keys/values
and first decoder position, or a causal LM's prefill: the family's ``decode_start``), time to the first token,
per-token decode latency (the marginal cost of each further token: (T(n) - T(1)) / (n - 1), or
(T(n) - encoder_s) / n where timing noise hides it), generated tokens/s and samples/s.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below (seconds: JAX's) is one line too, not a traceback
    from app.entry import exit_on_signals

    exit_on_signals()

import dataclasses
import time

from app.args import command_line, config_of
from app.entry import die, entry
from app.runtime import is_main_process, start_devices


def extra_flags(p):
    p.add_argument("--json", default=None, help="write the report to this JSON file")
    p.add_argument("--iterations", type=int, default=5, help="timed batches (after one warm-up batch)")
    p.add_argument("--worker", action="store_true", help="after compiling, measure --iterations batches at each "
                   "'measure' line of stdin (benchmarks/compare.py alternates engines this way: app/alternate.py)")


def programs(g, n: int) -> tuple:
    """(the decoding of n tokens, of one token, the prompts' reading alone: decode_start, the encoder and the first
    decoder position of an encoder-decoder, a causal LM's prefill), each compiled for this mesh. The decodings
    (greedy, beam search or sampling, as the config's inference section says) never stop early (eos -1): every step
    of output_length is timed."""
    from jax.sharding import PartitionSpec as P

    from partitioning import sharding as S

    family, opts = g.family, g.opts
    options = g.options
    start = g.phase(lambda p, i, m: family.decode_start(family.decoding_params(p, opts), i, m, opts, n, S.TP)[0],
                    (g.decode_specs(), P(S.DP, None), P(S.DP, None)), P(S.DP, S.TP))  # logits: vocab over tp
    one = dataclasses.replace(options, max_new_tokens=1)
    return g.search(options), g.search(one), start


def compile_decoding(params, ids, mask, gen, gen1, start, g) -> tuple:
    """(seconds of the first call of each program: their compilation, the prompts placed as ``start`` reads them)."""
    import jax

    from partitioning import sharding as S

    placed = S.put_global(ids, g.row_sharding), S.put_global(mask, g.row_sharding)
    t0 = time.perf_counter()
    jax.block_until_ready((gen(params, ids, mask), start(params, *placed), gen1(params, ids, mask)))
    return time.perf_counter() - t0, placed


def time_decoding(params, ids, mask, placed, gen, gen1, start, iterations: int) -> tuple:
    """([prompt-reading seconds], [first-token seconds], [whole decoding seconds], tokens) of ``iterations`` batches,
    compiled already. The prompt reading (``start``: the family's decode_start) reads them padded, as placed; the
    decodings as validation reads them."""
    import jax

    from partitioning import sharding as S

    start_t, first_t, gen_t = [], [], []
    for _ in range(iterations):
        for times, fn, args in ((start_t, start, placed), (first_t, gen1, (ids, mask))):
            t = time.perf_counter()
            jax.block_until_ready(fn(params, *args))
            times.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = S.fetch(gen(params, ids, mask))
        gen_t.append(time.perf_counter() - t)
    return start_t, first_t, gen_t, out


def timing_report(start_t: list, first_t: list, gen_t: list, out, n: int) -> dict:
    """The medians of one run's timings -> prompt reading, first token, per-token latency, tokens/s."""
    from app.bench import median

    total, encoder, first = median(gen_t), median(start_t), median(first_t)
    per_token = (total - first) / (n - 1) if n > 1 else 0.0
    if per_token <= 0:  # below the timing noise (tiny models): the average over all tokens instead
        per_token = max(total - encoder, 1e-9) / n
    return {"encoder_s": encoder, "first_token_s": first, "generate_s": total, "decode_token_latency_s": per_token,
            "generated_tokens_per_s": out.size / total, "samples_per_s": out.shape[0] / total}


def weight_bytes(params) -> int:
    """Bytes of the weights as placed (every device's shards together)."""
    import jax

    return sum(s.data.nbytes for x in jax.tree.leaves(params) for s in x.addressable_shards)


@entry
def main(argv=None) -> dict:
    args, overrides = command_line("inference", __doc__, argv, extra_flags, logs=False)
    cfg = config_of("inference", args, overrides, fixed={"eval": True, "rts": False})
    if args.iterations < 1:
        die(f"--iterations={args.iterations} must be at least 1")
    start_devices(cfg)
    from app.bench import device_header, write_json
    from data.generated import generated_prompts
    from decoder.decoder import Decoder
    from partitioning.memory import peak_device_bytes

    g = Decoder.of_config(cfg, eos=-1)  # (never stopping early: every step of output_length is timed)
    n = cfg.inference.output_length
    ids, mask = generated_prompts(cfg)
    params = g.weights.convert(g.place.init_params())  # as decoding holds them: the compute dtype, or int8 (--quantize)
    gen, gen1, start = programs(g, n)
    compile_s, placed = compile_decoding(params, ids, mask, gen, gen1, start, g)
    packed = g.pack(ids, mask) if g.family.packs_prompts and not g.prompt_stacks else None
    header = {
        **device_header(cfg, args.config), "family": cfg.model.family, "batch_size": ids.shape[0],
        "num_beams": cfg.inference.num_beams, "do_sample": cfg.inference.do_sample,
        "quantize": cfg.inference.quantize, "weight_bytes": weight_bytes(params),
        "prompt_tokens": int((mask > 0).sum()), "encoder_rows": ids.shape[0] if packed is None else
        int(packed[0].shape[0]), "encoder_length": cfg.model.sequence_length, "output_length": n,
        "compile_s": compile_s}

    def measure() -> dict:
        return timing_report(*time_decoding(params, ids, mask, placed, gen, gen1, start, args.iterations), n)

    if args.worker:  # measured on demand, alternated with other engines (benchmarks/compare.py: app/alternate.py)
        from app.alternate import serve

        serve(measure, header)
        return header
    report = {**header, **measure(), "peak_device_bytes": peak_device_bytes()}
    if not is_main_process():  # process 0 of a multi-process run prints and writes the report
        return report
    print(f"batch {ids.shape[0]} | prompts read {report['encoder_s'] * 1e3:.1f} ms | first token "
          f"{report['first_token_s'] * 1e3:.1f} ms | per-token decode {report['decode_token_latency_s'] * 1e3:.2f} ms"
          f" | {report['generated_tokens_per_s']:.0f} generated tokens/s | {report['samples_per_s']:.1f} samples/s | "
          f"encoder rows {report['encoder_rows']} of {ids.shape[0]} (packed prompts) | compile {compile_s:.1f} s")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
