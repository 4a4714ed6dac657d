"""Device memory of fused and phased execution as the model grows in depth.

    python3 benchmarks/phased_memory.py                        # small shape, 8/16/32 layers, on this machine
    python3 benchmarks/phased_memory.py --config base --layers 12 24 48 --json runs/phased_memory.json \\
        -- --precision bfloat16 --sequence_length 512

Runs ``finetuning.py`` once per (layers, executor) in its own process and prints,
for each, the device bytes (live device arrays plus the compiled programs'
temporaries, from XLA's memory analysis; the allocator's peak too where the
backend reports one), the step time, and phased / fused ratios. Arguments after
``--`` go to finetuning.py unchanged.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app.bench import run_script, split_passthrough, write_json  # noqa: E402


def run(config: str, layers: int, phased: bool, steps: int, extra: list) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        run_script(["finetuning.py", "--config", config, "--layers", str(layers), "--phased", str(phased).lower(),
                    "--steps", str(steps), "--json", out] + extra)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> list:
    argv, extra = split_passthrough(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small")
    p.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    p.add_argument("--steps", type=int, default=3, help="steps per run (the first two are warm-up)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not extra:  # CPU-sized defaults for the small shape: encoder 128 / decoder 8 tokens, batch 8
        extra = ["--sequence_length", "128", "--decoder_sequence_length", "8", "--global_batch_size", "8",
                 "--micro_batch_size", "4", "--data_parallel", "1", "--tensor_parallel", "1"]
    rows = []
    for n in args.layers:
        fused, phased = run(args.config, n, False, args.steps, extra), run(args.config, n, True, args.steps, extra)
        row = {"layers": n, "parameters": fused["parameters"],
               "fused_device_bytes": fused["device_bytes_estimate"], "phased_device_bytes": phased["device_bytes_estimate"],
               "fused_peak_bytes": fused["peak_device_bytes"], "phased_peak_bytes": phased["peak_device_bytes"],
               "fused_step_s": fused["median_step_s"], "phased_step_s": phased["median_step_s"],
               "phased_by_phase": phased["device_bytes_by_phase"], "device_kind": fused["device_kind"]}
        rows.append(row)
        peak = ""
        if row["fused_peak_bytes"]:
            peak = (f" | allocator peak fused {row['fused_peak_bytes'] / 2**20:.0f} MiB, "
                    f"phased {row['phased_peak_bytes'] / 2**20:.0f} MiB")
        print(f"{n:3d} layers ({row['parameters'] / 1e6:.0f}M params): device bytes fused "
              f"{row['fused_device_bytes'] / 2**20:8.1f} MiB, phased {row['phased_device_bytes'] / 2**20:8.1f} MiB "
              f"(phased/fused {row['phased_device_bytes'] / row['fused_device_bytes']:.2f}) | step fused "
              f"{row['fused_step_s']:.2f} s, phased {row['phased_step_s']:.2f} s "
              f"(phased/fused {row['phased_step_s'] / row['fused_step_s']:.2f}){peak}", flush=True)
    write_json(args.json, {"config": args.config, "finetuning_args": extra, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
