"""Training benchmark on generated data (no download).

    python3 finetuning.py --config tiny --data_parallel 2 --tensor_parallel 2
    python3 finetuning.py --config xl_pod8 --steps 20 --json runs/xl.json

The generated prompts have MultiNLI-like lengths by default (--lengths mnli) and
are packed into rows as training packs them (--packing false pads one example to a
row, as the original). Prints one line per step with the loss, then median step
time, samples (rows)/s, examples/s, non-pad tokens/s and the packing efficiency,
compile time, model TFLOP/s and MFU (where the device's peak is known
or --peak_tflops is given) and peak device memory: the allocator's peak where the
backend reports one (GPU/TPU), and on every backend the bytes of live device arrays
plus the compiled programs' temporaries (XLA's memory analysis). With
--phased true the phased executor runs (host-resident weights and optimizer state);
--profile DIR traces one extra step and prints where the device time went.
"""

from __future__ import annotations

if __name__ == "__main__":  # Ctrl-C during the imports below (seconds: JAX's) is one line too, not a traceback
    from app.entry import exit_on_signals

    exit_on_signals()

import time

from app.args import command_line, config_of
from app.entry import die, entry
from app.runtime import is_main_process, start_devices


def extra_flags(p):
    p.add_argument("--json", default=None, help="write the report to this JSON file")
    p.add_argument("--warmup_iterations", type=int, default=2, help="steps excluded from timing (compilation)")
    p.add_argument("--peak_tflops", type=float, default=None, help="peak TFLOP/s of one device, for MFU")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="trace one extra (untimed) step with the JAX profiler into DIR and print the top device ops")
    p.add_argument("--plan", action="store_true",
                   help="print the memory plan (device and host bytes at their peaks, from shapes; programs compiled "
                        "but nothing allocated) and exit")
    p.add_argument("--plan_exact", action="store_true",
                   help="also report the plan with XLA's count of every program's temporaries (compiles each phase "
                        "program's plan once more; the device peak a GPU's allocator should agree with)")
    p.add_argument("--link_gbps", type=float, default=None, metavar="GB_S",
                   help="phased: the host link's bandwidth each way (GB/s) at which to say how long a step waits on "
                        "it (default: measured on this machine)")
    p.add_argument("--worker", action="store_true", help="after the warm-up steps, run steps - warmup_iterations "
                   "steps at each 'measure' line of stdin and answer with their figures (benchmarks/compare.py "
                   "alternates engines this way: app/alternate.py)")
    p.add_argument("--lengths", choices=("mnli", "uniform", "summaries"), default="mnli",
                   help="prompt lengths of the generated data: mnli (drawn to MultiNLI's statistics, about 52 tokens "
                        "on average with a long tail) or uniform (in [L/2, L]: rows mostly full)")


def build(cfg):
    """The executor of the preset (fused or phased), checked to fit this machine."""
    from graphs.executor import make_executor
    from graphs.graphs import Graphs
    from graphs.plan import check_fits

    executor = make_executor(Graphs(cfg))
    check_fits(executor, cfg)
    return executor


def time_steps(executor, state, batches: list, steps: int, warmup: int, show: bool) -> tuple:
    """Runs ``steps`` optimizer steps over the batches in turn -> (state, timed step seconds (after ``warmup``),
    losses, the first step's seconds (compilation included))."""
    times, losses, compile_s = [], [], None
    for step in range(steps):
        t0 = time.perf_counter()
        state, metrics = executor.train_step(state, batches[step % len(batches)])
        loss = float(metrics["loss"])  # blocks until the step is done
        dt = time.perf_counter() - t0
        compile_s = dt if step == 0 else compile_s
        if step >= warmup:
            times.append(dt)
        losses.append(loss)
        if show:
            print(f"step {step + 1}/{steps} loss {loss:.5f} time {dt * 1e3:.1f} ms", flush=True)
    return state, times, losses, compile_s


def measure(executor, state, batch, profile_dir, primary: bool) -> tuple:
    """(state, device bytes of a step, {phase: bytes} or None, the executor's timing report or None), outside the
    timed steps; with ``profile_dir`` one more step traced by the JAX profiler (process 0 traces its devices)."""
    state, estimate, by_phase = executor.memory_report(state, batch)
    state, timing = executor.timing_report(state, batch)
    if profile_dir:
        from app.profile import trace

        def one_step():
            nonlocal state
            state, m = executor.train_step(state, batch)
            float(m["loss"])

        trace(profile_dir, one_step) if primary else one_step()
    return state, estimate, by_phase, timing


def serve_steps(cfg, args, executor, state, batches: list, stats: list) -> dict:
    """--worker: the warm-up steps (compilation), then ``steps - warmup_iterations`` steps at each 'measure' line of
    stdin, answered with their median's figures (app/alternate.py) -> what it said when ready."""
    from app.alternate import serve
    from app.bench import device_header, median

    state, _, _, compile_s = time_steps(executor, state, batches, args.warmup_iterations, args.warmup_iterations,
                                        False)
    samples, n = cfg.training.global_batch_size, cfg.training.steps - args.warmup_iterations
    examples = sum(s["examples"] for s in stats) / len(stats)
    tokens = sum(s["tokens"] for s in stats) / len(stats)

    def measure() -> dict:
        nonlocal state
        state, times, losses, _ = time_steps(executor, state, batches, n, 0, False)
        step_s = median(times)
        return {"median_step_s": step_s, "samples_per_s": samples / step_s, "examples_per_s": examples / step_s,
                "nonpad_tokens_per_s": tokens / step_s, "losses": losses}

    header = {**device_header(cfg, args.config), "family": cfg.model.family, "global_batch_size": samples,
              "packing": cfg.data.packing, "lengths": args.lengths, "compile_s": compile_s, "timed_steps": n}
    serve(measure, header)
    return header


def make_report(cfg, args, executor, stats: list, times: list, losses: list, compile_s: float, estimate: int,
                by_phase, timing=None) -> dict:
    """The benchmark's figures: throughput in rows, examples and tokens, model FLOP/s and MFU, memory."""
    from app.bench import device_header, median, peak_rss_bytes
    from app.flops import peak_tflops, train_flops_per_sample
    from modelling.params import count_params
    from modelling.rows import RowShape
    from partitioning.memory import peak_device_bytes

    plan = executor.plan(exact=False)  # the plan's figures from shapes, beside the measured ones
    samples = cfg.training.global_batch_size  # rows of sequence_length tokens
    dec_len = executor.g.family.rows.decoder_row_length(RowShape.of_config(cfg))  # a causal LM: one sequence
    tokens = samples * (cfg.model.sequence_length + dec_len)
    examples = sum(s["examples"] for s in stats) / len(stats)
    real_tokens = sum(s["tokens"] for s in stats) / len(stats)
    step_s = median(times)
    flops = train_flops_per_sample(cfg.model, cfg.model.sequence_length, dec_len) * samples
    tflops = flops / step_s / 1e12
    header = device_header(cfg, args.config)
    peak = peak_tflops(header["device_kind"], args.peak_tflops)
    return {
        **header, "family": cfg.model.family, "parameters": count_params(executor.g.specs),
        "global_batch_size": samples, "encoder_length": cfg.model.sequence_length, "decoder_length": dec_len,
        "packing": cfg.data.packing, "lengths": args.lengths, "examples_per_step": examples,
        "packing_efficiency": sum(s["packing_efficiency"] for s in stats) / len(stats),
        "steps": cfg.training.steps, "timed_steps": len(times), "losses": losses,
        "compile_s": compile_s, "median_step_s": step_s, "samples_per_s": samples / step_s,
        "examples_per_s": examples / step_s, "tokens_per_s": tokens / step_s,
        "nonpad_tokens_per_s": real_tokens / step_s,
        "model_tflops_per_step": flops / 1e12, "model_tflops_per_s": tflops,
        "mfu": tflops / (peak * cfg.devices) if peak else None,
        "phased": cfg.execution.phased, "peak_device_bytes": peak_device_bytes(),
        "device_bytes_estimate": estimate, "device_bytes_by_phase": by_phase,
        "plan_device_bytes": plan.device_peak, "plan_host_bytes": plan.host_peak,
        "plan_device_bytes_exact": executor.plan(exact=True).device_peak if args.plan_exact else None,
        "host_peak_rss_bytes": peak_rss_bytes(), "phase_timing": timing, **link_report(args, plan),
    }


def link_report(args, plan) -> dict:
    """Phased: what a step moves over the host link (counted from the schedule) and the least its layout moves
    (graphs/transfers.py), and how long a step waits on the link at its bandwidth (--link_gbps, else measured)."""
    from app.bench import link_bandwidth
    from graphs.transfers import link_seconds

    if not plan.transfers:
        return {}
    link = ({"load_gb_per_s": args.link_gbps, "store_gb_per_s": args.link_gbps, "measured": False}
            if args.link_gbps else {**link_bandwidth(), "measured": True})
    t, f = plan.transfers, plan.transfer_floor
    seconds = lambda x: max(x["load_bytes"] / (link["load_gb_per_s"] * 1e9),  # noqa: E731
                            x["store_bytes"] / (link["store_gb_per_s"] * 1e9))
    return {"transfers": t, "transfer_floor": f, "link": link, "link_bound_step_s": seconds(t),
            "link_floor_step_s": seconds(f), "link_seconds_at_52": link_seconds(t["load_bytes"], t["store_bytes"], 52)}


def print_report(report: dict, cfg) -> None:
    tflops, estimate = report["model_tflops_per_s"], report["device_bytes_estimate"]
    print(f"median step {report['median_step_s'] * 1e3:.1f} ms | {report['samples_per_s']:.2f} samples (rows)/s | "
          f"{report['examples_per_s']:.2f} examples/s ({report['examples_per_step']:.0f} a step, "
          f"{'packed' if cfg.data.packing else 'padded'}, {report['packing_efficiency']:.0%} of token slots used) | "
          f"{report['nonpad_tokens_per_s']:.0f} non-pad tokens/s | compile {report['compile_s']:.1f} s | "
          f"{tflops:.3f} model TFLOP/s"
          + (f" | MFU {report['mfu']:.1%}" if report["mfu"] else "")
          + (f" | peak device memory {report['peak_device_bytes'] / 2**30:.2f} GiB" if report["peak_device_bytes"] else "")
          + f" | device bytes (live arrays + XLA temporaries) {estimate / 2**30:.3f} GiB")
    if report.get("transfers"):
        from graphs.transfers import format_bytes_table

        link = report["link"]
        print(format_bytes_table(report["transfers"], report["transfer_floor"]))
        print(f"host link {'measured' if link['measured'] else 'given'}: {link['load_gb_per_s']:.1f} GB/s in, "
              f"{link['store_gb_per_s']:.1f} GB/s out: a step waits at least {report['link_bound_step_s']:.3f} s on "
              f"it (its layout's floor: {report['link_floor_step_s']:.3f} s) against {report['median_step_s']:.3f} s "
              "measured")


@entry
def main(argv=None) -> dict:
    args, overrides = command_line("finetuning", __doc__, argv, extra_flags, logs=False)
    cfg = config_of("finetuning", args, overrides, defaults={"steps": 10})  # a benchmark's default; --steps for more
    if cfg.training.steps <= args.warmup_iterations:
        die(f"steps={cfg.training.steps} must exceed --warmup_iterations={args.warmup_iterations}: pass a larger --steps")
    start_devices(cfg, pinned=True)
    primary = is_main_process()

    from data.generated import generated_batch
    from app.bench import write_json

    if args.plan:
        from graphs.executor import make_executor
        from graphs.graphs import Graphs

        print(make_executor(Graphs(cfg)).plan(exact=True).format())
        return {}
    executor = build(cfg)
    state = executor.init_state()
    host_batches = [generated_batch(cfg, seed=i, lengths=args.lengths) for i in range(2)]
    stats = [executor.g.family.rows.stats(b) for b in host_batches]
    batches = [executor.g.shard_batch(b) for b in host_batches]
    if args.worker:
        return serve_steps(cfg, args, executor, state, batches, stats)
    state, times, losses, compile_s = time_steps(executor, state, batches, cfg.training.steps,
                                                 args.warmup_iterations, primary)
    state, estimate, by_phase, timing = measure(executor, state, batches[0], args.profile, primary)
    report = make_report(cfg, args, executor, stats, times, losses, compile_s, estimate, by_phase, timing)
    if not primary:  # process 0 of a multi-process run prints and writes the report
        return report
    print_report(report, cfg)
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
