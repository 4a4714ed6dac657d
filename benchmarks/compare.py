"""Ours against the engines users would pick instead, same workloads and shapes, each in its own process, measured
in alternation within one invocation (app/alternate.py): every round measures each engine once (A B C, then C B A),
and a ratio is the median of the rounds' own ratios, with its spread.

    python3 benchmarks/compare.py                      # Flan-T5-small shape, float32, CPU, equal work
    python3 benchmarks/compare.py --only decode --int8 --batch 1     # against CTranslate2 and HF, float32 and int8
    python3 benchmarks/compare.py --only train --lengths mnli --sequence_length 512 --batch 8 --micro_batch 4
    python3 benchmarks/compare.py --config xl_pod8 --inference_config xl --precision bfloat16 \\
        --sequence_length 512 --batch 64 --micro_batch 8 --json runs/xl.json     # e.g. on a GPU

Training, two workloads (``--lengths``):
- ``uniform`` (default): prompts of L/2..L tokens, ours one example per row (--packing false) and HF
  padded to the full length: equal work, the same rows;
- ``mnli``: MultiNLI-like prompt lengths (about 52 tokens on average), what users train on: ours packed
  (several examples per row) and ours unpacked (--packing false), HF padded to the longest prompt of each
  micro-batch (DataCollatorForSeq2Seq's default).
HF runs eager and under torch.compile with fused AdamW (``--hf``). Every figure names its peer; ratios are
ours over the peer in examples/s (the same as samples/s when rows hold one example each).

Decoding: greedy (or --decode_flags' search), exactly --output_length tokens, the same prompts for every engine
(data/generated.py's ``generated_prompts``): ours (and with ``--int8`` ours with int8 weights) against HF
``generate`` (eager) and, on a CPU, CTranslate2 float32 and int8 (benchmarks/ct2_baseline.py: the same random HF
model converted; ``--ct2``). Figures: tokens/s of the whole decoding (the prompts read included), the time to the
first token (the prompts read), and the per-token latency.

Where the engines fit beside each other (a CPU), each is one worker started once and measured a repeat at a time
(``--iterations`` decoding batches, ``--steps`` - 2 training steps), ``--repeats`` rounds (default 5); on an
accelerator each round starts each engine anew (its memory holds one at a time; default 1 round).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.alternate import alternate, machine_load, paired_ratio, spread, figures  # noqa: E402

# decoding's engines: their runs' keys in the JSON ("runs") and their names in the figures
OURS, HF, INT8, CT2, CT2_INT8 = "ours_g", "theirs_g", "int8_g", "ct2_g", "ct2_int8_g"
NAMES = {OURS: "ours", INT8: "ours int8", HF: "HF eager", CT2: "CTranslate2 float32", CT2_INT8: "CTranslate2 int8"}
# (ours, peer) pairs of decoding's ratios
PAIRS = ((OURS, CT2), (INT8, CT2_INT8), (OURS, HF), (INT8, HF), (INT8, OURS))
# a decoding's figures: (key, whether higher is better)
DECODE_KEYS = (("generated_tokens_per_s", True), ("first_token_s", False), ("decode_token_latency_s", False))


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small", help="preset of config/finetuning.yml (training)")
    p.add_argument("--inference_config", default=None,
                   help="preset of config/inference.yml for decoding (default: --config; e.g. xl for xl_pod8)")
    p.add_argument("--sequence_length", default="128")
    p.add_argument("--decoder_sequence_length", default="8")
    p.add_argument("--batch", default="8", help="training: global batch (rows); decoding: batch")
    p.add_argument("--micro_batch", default=None, help="training micro-batch (gradient accumulation); "
                   "default: --batch")
    p.add_argument("--precision", default="float32")
    p.add_argument("--steps", default="7", help="training steps a repeat measures, plus 2 (the warm-up's)")
    p.add_argument("--lengths", choices=("uniform", "mnli", "summaries"), default="uniform",
                   help="training lengths: uniform (equal work), mnli or summaries (long targets): ours packed and "
                        "unpacked against HF padded to each micro-batch's longest")
    p.add_argument("--hf", choices=("eager", "compiled", "both"), default="both",
                   help="which HF training baselines to run")
    p.add_argument("--ours_flags", default="--recompute false --unroll_layers true",
                   help="extra flags for our training run: by default no block recomputation (HF's baseline "
                        "recomputes nothing: equal work) and unrolled layers (faster on CPU)")
    p.add_argument("--repeats", type=int, default=None, help="rounds: each engine measured once a round, in "
                   "alternation (default: 5 where the engines' workers stay alive, a CPU; else 1)")
    p.add_argument("--iterations", default="5", help="decoding batches a repeat measures (each engine)")
    p.add_argument("--only", choices=("train", "decode"), default=None, help="run one workload only")
    p.add_argument("--output_length", default=None, help="decoding: tokens generated (default: "
                   "--decoder_sequence_length)")
    p.add_argument("--decode_flags", default="", help="extra flags for every decoding run, e.g. '--num_beams 4'")
    p.add_argument("--int8", action="store_true", help="decoding: also ours with int8 weights (--quantize int8), "
                   "against ours, HF and CTranslate2's int8")
    p.add_argument("--ct2", choices=("auto", "on", "off"), default="auto",
                   help="decoding: CTranslate2 float32 and int8 beside HF (benchmarks/requirements.txt): auto = on a "
                        "CPU, for an encoder-decoder, where it is installed")
    p.add_argument("--persistent", choices=("auto", "yes", "no"), default="auto",
                   help="keep each engine's worker alive over the rounds (auto: on a CPU, where they fit beside "
                        "each other; an accelerator's memory holds one engine at a time)")
    p.add_argument("--timeout", type=float, default=None, help="seconds an engine may take to start or to answer")
    p.add_argument("--json", default=None, help="write the figures and every run's report here")
    return p.parse_args(argv)


def default_platform() -> str:
    """The platform JAX runs on here (cpu, gpu, tpu), asked of a child process (this one stays free of JAX: its
    workers need the devices)."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    p = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"], capture_output=True,
                       text=True, env=env)
    return p.stdout.strip().splitlines()[-1] if p.returncode == 0 and p.stdout.strip() else "unknown"


def persistent_workers(choice: str, platform: str) -> bool:
    """Whether the engines' workers stay alive over the rounds: on a CPU (each holds its model in host memory beside
    the others, and the rounds interleave them seconds apart); not on an accelerator, whose memory holds one engine
    at a time."""
    return platform == "cpu" if choice == "auto" else choice == "yes"


def runs_ct2(choice: str, platform: str, encoder_decoder: bool, installed: bool) -> bool:
    """Whether CTranslate2 is a decoding peer: ``on``; or ``auto`` on a CPU for an encoder-decoder, where it is
    installed (else a line says how to install it)."""
    if choice != "auto":
        return choice == "on"
    if platform != "cpu" or not encoder_decoder:
        return False
    if not installed:
        print("CTranslate2 is not installed: its baseline is left out (pip install -r benchmarks/requirements.txt)")
    return installed


def commands(a) -> tuple:
    """({training run name: command}, decoding arguments shared by every decoding engine)."""
    shape = ["--config", a.config, "--sequence_length", a.sequence_length, "--precision", a.precision]
    train = shape + ["--decoder_sequence_length", a.decoder_sequence_length, "--global_batch_size", a.batch,
                     "--micro_batch_size", a.micro_batch or a.batch, "--data_parallel", "1", "--tensor_parallel", "1",
                     "--lengths", a.lengths]
    ours = ["finetuning.py"] + train + a.ours_flags.split() + ["--steps", a.steps]
    trainers = {}  # name -> command
    if a.lengths != "uniform":
        trainers["ours packed"] = ours + ["--packing", "true"]
        trainers["ours unpacked"] = ours + ["--packing", "false"]
        hf_padding = ["--padding", "longest"]
    else:
        trainers["ours"] = ours + ["--packing", "false"]
        hf_padding = ["--padding", "max_length"]
    hf = ["benchmarks/hf_baseline.py", "train"] + train + hf_padding + ["--iterations", str(int(a.steps) - 2)]
    if a.hf in ("eager", "both"):
        trainers["HF eager"] = hf
    if a.hf in ("compiled", "both"):
        trainers["HF torch.compile"] = hf + ["--compile"]
    gen = (["--config", a.inference_config or a.config] + shape[2:]
           + ["--micro_batch_size", a.batch, "--output_length", a.output_length or a.decoder_sequence_length,
              "--tensor_parallel", "1", "--iterations", a.iterations] + a.decode_flags.split())
    return trainers, gen


def decoders(a, gen: list, ct2: bool) -> dict:
    """{decoding engine's key: command}, ours first: ours, HF eager, (ours int8), (CTranslate2 float32 and int8)."""
    out = {OURS: ["inference.py"] + gen, HF: ["benchmarks/hf_baseline.py", "generate"] + gen}
    if a.int8:
        out[INT8] = ["inference.py"] + gen + ["--quantize", "int8"]
    if ct2:
        for key, compute in ((CT2, "float32"), (CT2_INT8, "int8")):
            if compute == "float32" or a.int8:
                out[key] = ["benchmarks/ct2_baseline.py"] + gen + ["--compute_type", compute]
    return out


def encoder_decoder(preset: str) -> bool:
    """Whether the inference preset's model has an encoder (CTranslate2's Translator runs it)."""
    from config import load_config
    from modelling import registry

    return not registry.of_config(load_config("inference", preset, {})).left_pad_prompts


def _median(runs: dict, name: str, key: str):
    s = spread(figures(runs.get(name, []), key))
    return None if s is None else s["median"]


def training_figures(a, trainers: dict, runs: dict) -> dict:
    """{"training": {run: medians}, "ratios": {ours / peer: the rounds' median ratio of examples/s}, "ratio_spread":
    {ours / peer: ``paired_ratio``}}, printed."""
    from app.flops import peak_tflops, train_flops_per_sample
    from config import load_config

    cfg = load_config("finetuning", a.config, {"sequence_length": a.sequence_length,
                                               "decoder_sequence_length": a.decoder_sequence_length, "packing": False})
    flops = train_flops_per_sample(cfg.model, cfg.model.sequence_length, cfg.model.decoder_sequence_length) * int(a.batch)
    kind = next((r.get("device_kind") or r.get("device") for rs in runs.values() for r in rs if r), "")
    peak = peak_tflops(kind)
    training = {}
    for name in trainers:
        t = training[name] = {k: _median(runs, name, k) for k in ("samples_per_s", "examples_per_s",
                                                                   "nonpad_tokens_per_s", "median_step_s")}
        t["examples_per_s_spread"] = spread(figures(runs[name], "examples_per_s"))
        if a.lengths == "uniform" and t["median_step_s"]:  # equal, full rows: model FLOPs and MFU of both sides
            t["model_tflops_per_s"] = flops / t["median_step_s"] / 1e12
            t["mfu"] = t["model_tflops_per_s"] / peak if peak else None
    print(f"training ({a.lengths} lengths; medians of {a.repeats} rounds; {kind or 'device unknown'}):")
    for name, t in training.items():
        ex, extra = t["examples_per_s"], ""
        if t.get("model_tflops_per_s"):
            extra = f" | {t['model_tflops_per_s']:.3f} model TFLOP/s" + (f" (MFU {t['mfu']:.1%})" if t["mfu"] else "")
        print(f"  {name:18s} " + ("failed" if ex is None else
                                  f"{ex:9.2f} examples/s | {t['samples_per_s']:8.2f} samples (rows)/s | "
                                  f"{t['nonpad_tokens_per_s']:9.0f} non-pad tokens/s") + extra)
    pairs = [(o, h) for o in trainers if o.startswith("ours") for h in trainers if h.startswith("HF")]
    if a.lengths != "uniform" and "ours unpacked" in trainers:
        pairs.append(("ours packed", "ours unpacked"))
    ratios, spreads = {}, {}
    for o, h in pairs:
        r = spreads[f"{o} / {h}"] = paired_ratio(runs[o], runs[h], "examples_per_s")
        ratios[f"{o} / {h}"] = None if r is None else r["median"]
        print(f"  {o} / {h}: " + ("-" if r is None else f"{r['median']:.2f}x examples/s (rounds {r['min']:.2f}x to "
                                                         f"{r['max']:.2f}x)"))
    return {"training": training, "ratios": ratios, "ratio_spread": spreads}


def decode_figures(runs: dict) -> dict:
    """Every decoding engine's medians (with their spreads) and ours over each peer in tokens/s, the first token's
    time and the per-token latency (each > 1 where ours is faster: the rounds' median ratio, with its spread),
    printed; the HF figures also in their earlier keys (decode_tokens_per_s ...)."""
    engines = {NAMES[k]: {key: spread(figures(rs, key)) for key, _ in DECODE_KEYS} for k, rs in runs.items() if rs}
    ratios = {}
    for o, p in PAIRS:
        if runs.get(o) and runs.get(p):
            ratios[f"{NAMES[o]} / {NAMES[p]}"] = {key: paired_ratio(runs[o], runs[p], key, up)
                                                  for key, up in DECODE_KEYS}
    out = {"engines": engines, "decode_ratios": ratios}
    for name, key, _ in (("decode_tokens_per_s", *DECODE_KEYS[0]), ("first_token_s", *DECODE_KEYS[1]),
                         ("decode_token_latency_s", *DECODE_KEYS[2])):
        r = (ratios.get("ours / HF eager") or {}).get(key)
        out[name] = {"ours": _median(runs, OURS, key), "hf": _median(runs, HF, key),
                     "ratio": None if r is None else r["median"], "runs": [len(runs[OURS]), len(runs[HF])]}
    if runs.get(INT8):
        over = ratios.get("ours int8 / ours", {}).get("generated_tokens_per_s")
        over_hf = ratios.get("ours int8 / HF eager", {}).get("generated_tokens_per_s")
        out["int8_tokens_per_s"] = {"int8": _median(runs, INT8, "generated_tokens_per_s"),
                                    "over_ours": over and over["median"], "over_hf": over_hf and over_hf["median"],
                                    "runs": len(runs[INT8])}
    out["same_tokens_as_hf"] = {NAMES[k]: same_tokens(runs.get(k), runs[HF]) for k in (CT2, CT2_INT8) if runs.get(k)}
    print_decoding(engines, ratios, out["same_tokens_as_hf"])
    return out


def same_tokens(peer: list | None, hf: list) -> float | None:
    """The share of the tokens a peer generated (its last round's) that HF ``generate`` generated too, from the same
    weights and prompts: 1.0 where they read the same ids (float32; int8 may differ where logits are close)."""
    a = next((r["tokens"] for r in reversed(peer or []) if r and r.get("tokens")), None)
    b = next((r["tokens"] for r in reversed(hf) if r and r.get("tokens")), None)
    if a is None or b is None or len(a) != len(b):
        return None
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def print_decoding(engines: dict, ratios: dict, same: dict) -> None:
    show = lambda s, f=1.0, u="": "failed" if s is None else f"{s['median'] * f:.4g}{u} (spread {s['relative_spread']:.0%})"  # noqa: E731
    for name, e in engines.items():
        print(f"{name:20s} {show(e['generated_tokens_per_s'])} tokens/s | first token "
              f"{show(e['first_token_s'], 1e3, ' ms')} | per token {show(e['decode_token_latency_s'], 1e3, ' ms')}")
    for pair, r in ratios.items():
        print(f"{pair}: " + " | ".join(
            f"{label} " + ("-" if r[k] is None else f"{r[k]['median']:.2f}x ({r[k]['min']:.2f}-{r[k]['max']:.2f})")
            for label, k in (("tokens/s", "generated_tokens_per_s"), ("first token", "first_token_s"),
                             ("per token", "decode_token_latency_s"))))
    for name, share in same.items():
        print(f"{name}: {'-' if share is None else f'{share:.0%}'} of its tokens as HF generate's")


def main(argv=None) -> dict:
    from app.bench import write_json

    a = parse(argv)
    platform = default_platform()
    persistent = persistent_workers(a.persistent, platform)
    a.repeats = a.repeats or (5 if persistent else 1)
    trainers, gen = commands(a)
    result = {"args": vars(a), "platform": platform, "persistent_workers": persistent, "load_before": machine_load()}
    runs = {}
    if a.only != "decode":
        runs.update(alternate(trainers, a.repeats, persistent, timeout=a.timeout))
        result.update(training_figures(a, trainers, runs))
    if a.only != "train":
        ct2 = runs_ct2(a.ct2, platform, encoder_decoder(a.inference_config or a.config),
                       importlib.util.find_spec("ctranslate2") is not None)
        dec = alternate(decoders(a, gen, ct2), a.repeats, persistent, timeout=a.timeout)
        dec = {OURS: [], HF: [], INT8: [], **dec}
        runs.update(dec)
        result.update(decode_figures(dec))
    result["load_after"] = machine_load()
    print(f"load averages (1, 5, 15 min): before {result['load_before']}, after {result['load_after']}")
    write_json(a.json, {**result, "runs": runs})
    return result


if __name__ == "__main__":
    main()
