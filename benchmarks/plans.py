"""The one-GPU presets' memory plans as the drivers' `--plan` prints them, into one JSON: the source of every plan
figure the manual states (docs/results.md, "Memory plans", generated from it by benchmarks/results_page.py).

    python3 benchmarks/plans.py --json benchmarks/results/cpu/plans.json     # about 4 minutes on the 2-core CPU

Each plan is the driver's own command run as a user runs it (on the CPU: shapes alone, with XLA:CPU's count of the
programs' temporaries) and its printed lines read back: the device and host peaks with their items, the bytes a
phased step moves over the host link and its time on the link at 52 GB/s. Training's plans are
`run_finetuning.py --config PRESET --plan`'s; decoding's (validation's and the server's) are those of a LoRA
checkpoint of the preset, whose plan needs the checkpoint's metadata alone (its config and where its base comes
from), which this script writes in a temporary directory. A plan is a function of the code, not of the machine: a
fresh run writes the same file (tests/benchmarks/test_results_page.py, a long test, checks it)."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (preset, flags) of every plan the manual states: the one-GPU presets, and the layouts phased.md and numerics.md
# set beside them (gradients stored instead of updated in the backward, no compute copy, bfloat16 weights, AdamW)
PLANS = [
    ("xxl_1gpu", ""),
    ("xxl_1gpu", "--update_in_backward false"),
    ("xxl_1gpu", "--compute_copy false"),
    ("xxl_1gpu", "--compute_copy false --update_in_backward false"),
    ("xxl_1gpu", "--stochastic_rounding true"),
    ("xxl_1gpu", "--stochastic_rounding true --update_in_backward false"),
    ("xxl_1gpu", "--optimizer adamw"),
    ("ul2_1gpu", ""),
    ("ul2_1gpu", "--update_in_backward false"),
    ("ul2_1gpu", "--stochastic_rounding false"),
    ("ul2_1gpu", "--stochastic_rounding false --update_in_backward false"),
    ("gptj_1gpu", ""),
    ("gptj_1gpu", "--compute_copy false"),
    ("xxl_lora_1gpu", ""),
    ("ul2_lora_1gpu", ""),
    ("gptj_lora_1gpu", ""),
]

# (driver, preset, flags) of decoding's plans: a LoRA checkpoint of the preset decoded (32 rows of 512-token prompts,
# 128 new tokens) or served (8 slots), in bfloat16 on one device
DECODE_PLANS = [
    ("run_validation.py", "xxl_lora_1gpu", ""),
    ("run_validation.py", "xxl_lora_1gpu", "--quantize int8"),
    ("run_validation.py", "ul2_lora_1gpu", "--quantize int8"),
    ("run_validation.py", "ul2_lora_1gpu", "--quantize int8 --stream_encoder"),
    ("run_server.py", "ul2_lora_1gpu", "--quantize int8"),
]
# the server's plans with LoRA adapters served side by side (``--adapters``): xxl's base alone, and with 8 adapters
# of rank 16, of the family's default weights (q, v, cq, cv) and of every weight; each over a full checkpoint's meta
ADAPTER_PLANS = [
    ("run_server.py", "xxl_lora_1gpu", ""),
    ("run_server.py", "xxl_lora_1gpu", "--max_loras 8 --max_lora_rank 16"),
    ("run_server.py", "xxl_lora_1gpu", "--max_loras 8 --max_lora_rank 16 --lora_target_modules q k v o cq ck cv co "
                                       "wi_0 wi_1 wo"),
]
ONE_DEVICE = "--precision bfloat16 --tensor_parallel 1 --data_parallel 1 --output_length 128"
DECODE_FLAGS = {"run_validation.py": f"{ONE_DEVICE} --micro_batch_size 32 --sequence_length 512",
                "run_server.py": f"{ONE_DEVICE} --slots 8 --prompt_width 512"}

_UNITS = {"B": 1, "KiB": 2 ** 10, "MiB": 2 ** 20, "GiB": 2 ** 30}


def plan_name(preset: str, flags: str, driver: str = "run_finetuning.py") -> str:
    """The key of a plan in the JSON: the preset and its flags as the command gives them (decoding's led by the
    driver's name: `run_validation.py xxl_lora_1gpu --quantize int8`)."""
    lead = "" if driver == "run_finetuning.py" else driver + " "
    return f"{lead}{preset} {flags}".strip()


def command(preset: str, flags: str, driver: str = "run_finetuning.py", lora: bool = True) -> str:
    if driver == "run_finetuning.py":
        return f"python3 run_finetuning.py --config {preset} {flags} --plan".replace("  ", " ")
    return (f"python3 {driver} --load CKPT {DECODE_FLAGS[driver]} {flags} --plan (CKPT: a "
            f"{'LoRA' if lora else 'full'} checkpoint of {preset})").replace("  ", " ")


def _bytes(text: str) -> int:
    """'4.57 GiB' -> bytes (as printed: the figure's own rounding)."""
    value, unit = text.split()
    return round(float(value) * _UNITS[unit])


def _items(text: str) -> dict:
    """'master weights 41.5 GiB, compute copy 20.7 GiB' -> {name: printed figure}."""
    out, parts, depth, start = {}, [], 0, 0
    for i, ch in enumerate(text):  # split at ", " outside brackets ("step temporaries (gradients, activations)")
        depth += (ch == "(") - (ch == ")")
        if depth == 0 and text.startswith(", ", i):
            parts.append(text[start:i])
            start = i + 2
    for part in parts + [text[start:]]:
        m = re.match(r"^(.*\S) (\d[\d.]* (?:B|KiB|MiB|GiB))$", part.strip())
        if m:
            out[m.group(1)] = m.group(2)
    return out


def parse(output: str) -> dict:
    """A `--plan`'s printed lines -> its figures, each as printed ('7.97 GiB', '70.591 GB')."""
    plan = {}
    for side in ("device", "host"):
        m = re.search(rf"^\s*{side}:\s+(\d[\d.]* (?:B|KiB|MiB|GiB)) per \w+ at its peak \(([^)]*)\): (.*)$", output,
                      re.M)
        if m:
            plan[side] = {"peak": m.group(1), "peak_bytes": _bytes(m.group(1)), "phase": m.group(2),
                          "items": _items(m.group(3))}
    m = re.search(r"^host link per step \(per device\): loads ([\d.]+) GB, stores ([\d.]+) GB", output, re.M)
    if m:
        plan["link"] = {"loads_gb": m.group(1), "stores_gb": m.group(2)}
        s = re.search(r"at ([\d.]+) GB/s each way: ([\d.]+) s a step on the link", output)
        if s:
            plan["link"].update(gb_per_s=s.group(1), seconds=s.group(2))
    return plan


def lora_checkpoint(preset: str, directory: str, lora: bool = True) -> str:
    """The metadata of a LoRA checkpoint of ``preset`` (step 1: its config and its base's source), as a run of the
    preset saves it, in ``directory``, without its weights: what decoding's plan reads of a checkpoint; with
    ``lora`` False, of a full checkpoint of its shape (a base LoRA adapters are served over)."""
    sys.path.insert(0, ROOT)
    import modelling.registry  # noqa: F401 (the families' own fields are config keys)
    from config import load_config
    from config.presets import to_dict

    cfg = load_config("finetuning", preset, {} if lora else {"lora_rank": 0})
    step = os.path.join(directory, "1")
    os.makedirs(os.path.join(step, "meta"), exist_ok=True)
    meta = {"step": 1, "seed": cfg.model.seed, "config": to_dict(cfg)}
    if lora:
        meta["lora_base"] = {"source": cfg.data.hf_model or "random", "fingerprint": "-"}
    with open(os.path.join(step, "meta", "metadata"), "w") as f:
        json.dump(meta, f)
    for done in (step, os.path.join(step, "meta")):
        open(os.path.join(done, "commit_success.txt"), "w").close()
    return directory


def run_plan(preset: str, flags: str, driver: str = "run_finetuning.py", lora: bool = True) -> dict:
    """The plan of ``preset`` with ``flags`` as ``driver``'s `--plan` prints it on this machine's CPU (decoding's: of
    a LoRA checkpoint of the preset; ``lora`` False: of a full checkpoint of its shape)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    with tempfile.TemporaryDirectory() as tmp:
        if driver == "run_finetuning.py":
            argv = ["--config", preset, *flags.split()]
        else:
            argv = ["--load", lora_checkpoint(preset, os.path.join(tmp, preset), lora), *DECODE_FLAGS[driver].split(),
                    *flags.split()]
        p = subprocess.run([sys.executable, driver, *argv, "--plan"], cwd=ROOT, env=env, capture_output=True,
                           text=True)
    lines = [line for line in p.stdout.splitlines() if line.strip() and not line.startswith("does not fit")]
    if p.returncode != 0 or not lines:
        raise RuntimeError(f"{command(preset, flags, driver, lora)} exited {p.returncode}: {p.stderr.strip()[-500:]}")
    return {"command": command(preset, flags, driver, lora), "output": lines, **parse(p.stdout)}


def every_plan() -> list:
    """(driver, preset, flags) of every plan the JSON holds, in its order."""
    return [("run_finetuning.py", p, f) for p, f in PLANS] + DECODE_PLANS


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=os.path.join(ROOT, "benchmarks", "results", "cpu", "plans.json"))
    p.add_argument("--only", nargs="*", default=None, help="plan names (the preset and its flags) to run alone")
    p.add_argument("--adapters", action="store_true",
                   help="the server's plans with LoRA adapters served side by side instead (ADAPTER_PLANS): xxl alone "
                        "and with 8 adapters of rank 16, each one's device peak over the base alone's")
    args = p.parse_args(argv)
    if args.adapters:
        return adapter_plans(args.json)
    plans = {}
    for driver, preset, flags in every_plan():
        name = plan_name(preset, flags, driver)
        if args.only is None or name in args.only:
            plans[name] = run_plan(preset, flags, driver)
            print(name, plans[name].get("device", {}).get("peak"), plans[name].get("host", {}).get("peak"), flush=True)
    report = {"command": "python3 benchmarks/plans.py --json benchmarks/results/cpu/plans.json",
              "what": "the drivers' --plan of each preset and layout, on the CPU (shapes alone; XLA:CPU's count of "
                      "the programs' temporaries)", "plans": plans}
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")


def adapter_plans(path: str) -> dict:
    """``ADAPTER_PLANS`` (over a full checkpoint of the preset's shape), each with its device peak over the first's
    (the base alone), into ``path``."""
    plans = {plan_name(preset, flags, driver): run_plan(preset, flags, driver, lora=False)
             for driver, preset, flags in ADAPTER_PLANS}
    alone = next(iter(plans.values()))["device"]["peak_bytes"]
    for name, plan in plans.items():
        plan["device_peak_over_the_base_alone"] = plan["device"]["peak_bytes"] / alone
        print(name, plan["device"]["peak"], f"{plan['device_peak_over_the_base_alone']:.3f}x", flush=True)
    report = {"command": f"python3 benchmarks/plans.py --adapters --json {os.path.relpath(path, ROOT)}",
              "what": "run_server.py --plan of xxl's shape (CKPT: a full checkpoint) alone and with 8 LoRA adapters of "
                      "rank 16 served side by side (their stack on the device beside the weights)", "plans": plans}
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
        f.write("\n")
    return report


if __name__ == "__main__":
    main()
