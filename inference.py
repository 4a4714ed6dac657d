"""Greedy-decoding benchmark on generated prompts (no download).

    python3 inference.py --config tiny
    python3 inference.py --config xl --micro_batch_size 16 --json runs/xl_inference.json

Reports encoder time, time to the first token (encoder, cross-attention keys/values
and one decoder step), per-token decode latency (the marginal cost of each further
token: (T(n) - T(1)) / (n - 1), or (T(n) - encoder) / n where timing noise hides it),
generated tokens/s and samples/s.
"""

from __future__ import annotations

import time

from utils.cli import die, ensure_host_devices, entry, is_main_process, parse_config, setup_jax


def extra_flags(p):
    p.add_argument("--json", default=None, help="write the report to this JSON file")
    p.add_argument("--iterations", type=int, default=5, help="timed batches (after one warm-up batch)")


@entry
def main(argv=None) -> dict:
    cfg, args = parse_config("inference", __doc__.splitlines()[0], "tiny", argv, extra_flags,
                             fixed={"eval": True, "rts": False})
    if args.iterations < 1:
        die(f"--iterations={args.iterations} must be at least 1")
    ensure_host_devices(cfg.devices)
    setup_jax()

    import jax
    from jax.sharding import PartitionSpec as P

    from data.generated import generated_batch
    from graphs import sharding as S
    from graphs.graphs import Graphs
    from utils.bench import device_header, median, peak_device_bytes, write_json

    g = Graphs(cfg)
    n = cfg.inference.output_length
    opts = g.opts
    params = g.init_params()
    rows = g.row_sharding
    gen = g.generate_phase(n, eos_id=-1)  # never stops early: every step of output_length is timed
    gen1 = g.generate_phase(1, eos_id=-1)
    if cfg.model.family == "t5":
        from modelling import t5

        enc = g.phase(lambda p, i, m: t5.encode(t5.cast_params(p, opts.compute_dtype), i, m, opts, S.TP),
                      (g.compute_specs(), P(S.DP, None), P(S.DP, None)), P(S.DP, None, None))
    else:  # a causal LM has no encoder: its prompt's prefill is part of the first token's time
        enc = None
    b = g.dp * cfg.execution.micro_batch_size
    data = generated_batch(cfg, seed=0, packing=False)  # one prompt per row, as validation decodes
    L = cfg.model.sequence_length
    ids, mask = data["input_ids"].reshape(-1, L)[:b], data["attention_mask"].reshape(-1, L)[:b]
    if getattr(g.family, "left_pad_prompts", False):  # a causal LM continues each prompt from its last token
        from data.packing import left_align

        ids, mask = left_align(ids, mask)
    ids, mask = S.put_global(ids, rows), S.put_global(mask, rows)

    t0 = time.perf_counter()
    jax.block_until_ready(gen(params, ids, mask))
    if enc is not None:
        jax.block_until_ready(enc(params, ids, mask))
    compile_s = time.perf_counter() - t0
    jax.block_until_ready(gen1(params, ids, mask))
    enc_t, gen_t, first_t = [], [], []
    for _ in range(args.iterations):
        t = time.perf_counter()
        if enc is not None:
            jax.block_until_ready(enc(params, ids, mask))
        enc_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(gen1(params, ids, mask))
        first_t.append(time.perf_counter() - t)
        t = time.perf_counter()
        out = S.fetch(gen(params, ids, mask))
        gen_t.append(time.perf_counter() - t)
    total, encoder, first = median(gen_t), median(enc_t), median(first_t)
    per_token = (total - first) / (n - 1) if n > 1 else 0.0
    if per_token <= 0:  # below the timing noise (tiny models): the average over all tokens instead
        per_token = max(total - encoder, 1e-9) / n
    report = {
        **device_header(cfg, args.config), "family": cfg.model.family, "batch_size": b,
        "encoder_length": cfg.model.sequence_length, "output_length": n, "compile_s": compile_s,
        "encoder_s": encoder, "first_token_s": first, "generate_s": total,
        "decode_token_latency_s": per_token,
        "generated_tokens_per_s": out.size / total, "samples_per_s": b / total,
        "peak_device_bytes": peak_device_bytes(),
    }
    if not is_main_process():  # process 0 of a multi-process run prints and writes the report
        return report
    print(f"batch {b} | encoder {encoder * 1e3:.1f} ms | first token {first * 1e3:.1f} ms | per-token decode {report['decode_token_latency_s'] * 1e3:.2f} ms"
          f" | {report['generated_tokens_per_s']:.0f} generated tokens/s | {report['samples_per_s']:.1f} samples/s"
          f" | compile {compile_s:.1f} s")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
