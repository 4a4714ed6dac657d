"""Every GPU figure the docs report (docs/gpu_suite.md), from one command, in priority order, within a time budget.

    python3 benchmarks/suite.py --out benchmarks/results/h100            # a GPU box: every part, 25 min budget
    python3 benchmarks/suite.py --budget 900 --only xxl_1gpu,xl_mfu      # some parts
    python3 benchmarks/suite.py --smoke --out /tmp/suite                 # CPU, tiny shapes, under two minutes
    python3 benchmarks/suite.py --summarize benchmarks/results/h100/suite --readme docs/gpu_suite.md  # the table

Parts, in priority order (each against its baseline, measured in the same run):
  xxl_1gpu        Flan-T5-XXL phased on one device, packed, encoder 512 / decoder 8: the preset's 16 rows and
                  the issue's 128 rows; step time, losses, device and host peaks against the plan's, and a
                  serialised step's transfer and compute seconds (what the step waits on transfers); and the
                  same 16 rows with LoRA (xxl_lora_1gpu: the frozen bfloat16 base streamed, rank-16 adapters
                  trained) against full fine-tuning's step
  ul2_1gpu        Flan-UL2 (20B) phased on one device, packed, encoder 512 / decoder 8, 128 rows: layers updated in
                  the backward (the preset) against gradients stored in host memory; step times, losses, peaks
  xl_mfu          Flan-T5-XL fused on one device at micro-batch 8 and 16: MFU of the best, with the profile of
                  its step (top ops, GEMM / elementwise / copy shares)
  vs_hf           ours against HF eager and HF torch.compile + fused AdamW at equal work (base, xl), and ours
                  packed / unpacked against HF padded at MNLI-like lengths (base), in examples/s
  xl_phased       xl phased against fused at global batch 64
  decode          greedy decoding against HF generate (base, xl)
  summaries       a long-target task (prompts ~150 tokens, targets ~30 of up to 128, base): ours packed and
                  unpacked against HF padded to each micro-batch's longest, eager and compiled, in examples/s
  beams           beam search with 4 beams against HF generate with the same beams (base), in tokens/s
  gptj_6B         GPT-J 6B phased on one device (gptj_1gpu), and a small GPT-J shape against HF compiled
  plan_check      each one-GPU preset (xxl_1gpu, xxl_lora_1gpu, ul2_lora_1gpu, gptj_1gpu, gptj_lora_1gpu) for 3 steps:
                  the allocator's device peak over the exact plan (goal: within 15%), host RSS over the host plan
  workstation     each LoRA preset trained 10 steps and validated with the device capped at 22 GiB and the host
                  memory at 60 GiB (benchmarks/workstation.py: JAX's memory fraction, a cgroup)

Every phased run's report carries what a step moved over the host link against the floor of its layout
(graphs/transfers.py) and the link-bound step time at the measured bandwidth; xxl_1gpu's figures say how far the
step is from the larger of its compute and its link floor (goal: 1.2x).
  serve           the server (continuous batching, base) against static batching and HF generate one by one on
                  the same Poisson arrivals of mixed lengths (benchmarks/serve.py): tokens/s, TTFT, ITL
  serve_xl        the same for xl

Each part runs its benchmarks as subprocesses (finetuning.py, compare.py, inference.py) and writes
``OUT/<part>.json`` the moment it ends: status (ok, failed, out of memory, timed out, skipped), figures, the
exact commands, every run's raw report, and the environment (device kind and count, host RAM, jax, jaxlib,
CUDA, torch, transformers, the commit). A part whose estimate does not fit what is left of the budget is
skipped, not cut off, and the skip is recorded; a failed part is recorded and the suite goes on.
``OUT/summary.md`` is rewritten after every part, so a killed run leaves every finished figure behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from app.bench import run_child  # noqa: E402  (app/bench.py imports the standard library alone)

PY = sys.executable
# what the benchmarks import; a bare GPU machine has JAX, PyTorch and transformers (datasets and wandb, which
# only the MNLI download and --wandb use, are imported lazily)
NEEDS = {"jax": "jax", "optax": "optax", "orbax.checkpoint": "orbax-checkpoint", "transformers": "transformers",
         "torch": "torch==2.13.0", "tokenizers": "tokenizers", "safetensors": "safetensors", "yaml": "pyyaml",
         "pandas": "pandas", "matplotlib": "matplotlib", "tqdm": "tqdm"}
BEGIN, END = "<!-- suite:begin -->", "<!-- suite:end -->"


@dataclass
class Run:
    """One benchmark process: its command (without --json) and its report's name within the part."""

    name: str
    cmd: list
    required: bool = True  # a required run's failure fails the part; another's is recorded beside it


@dataclass
class Part:
    name: str
    what: str
    estimate_s: float  # on one H100, from a bare start (compilation included)
    runs: list = field(default_factory=list)
    figures: object = None  # fn(reports: {name: report}) -> {figure: value}


# --------------------------------------------------------------------------- the parts


def _finetune(preset, *flags):
    return ["finetuning.py", "--config", preset, *flags]


def _compare(*flags):
    return ["benchmarks/compare.py", *flags]


def _smoke_commands() -> dict:
    """The GPU parts' runs at tiny shapes on CPU (``--smoke``): the same commands, small enough for a test."""
    t5 = ["--sequence_length", "32", "--decoder_sequence_length", "4"]
    one = ["--data_parallel", "1", "--tensor_parallel", "1"]
    xxl = _finetune("tiny", "--phased", "true", "--steps", "3", "--warmup_iterations", "1", *t5, "--global_batch_size",
                    "8", "--micro_batch_size", "4", *one)
    # (one round, no CTranslate2: the GPU runs' compare.py, whose accelerator starts each engine once a round)
    cmp_small = ["--config", "tiny", "--inference_config", "tiny", "--sequence_length", "32", "--batch", "4",
                 "--steps", "3", "--hf", "eager", "--repeats", "1", "--ct2", "off", "--decoder_sequence_length", "4"]
    xl = [_finetune("tiny", "--steps", "3", "--warmup_iterations", "1", *t5, "--global_batch_size", "8",
                    "--micro_batch_size", str(mb), *one, "--recompute", "false") for mb in (4, 8)]
    c = {
        "xxl": xxl, "xxl128": xxl,  # (one run: a larger batch at tiny shapes tests nothing more)
        "xxl_lora": xxl + ["--lora_rank", "4"],
        "ul2": xxl + ["--update_in_backward", "true"], "xl": xl,
        "vs_hf": [_compare(*cmp_small, "--only", "train")],
        "vs_hf_mnli": _compare(*cmp_small, "--only", "train", "--lengths", "mnli"),
        "phased_pair": [xl[0], xl[0] + ["--phased", "true"]],
        "decode": [("base", _compare(*cmp_small, "--only", "decode"))],
        "summaries": _compare(*cmp_small[:-2], "--decoder_sequence_length", "16", "--only", "train", "--lengths",
                              "summaries"),
        "beams": _compare(*cmp_small, "--only", "decode", "--decode_flags", "--num_beams 4"),
        "gptj_6B": _finetune("gptj_tiny", "--phased", "true", "--steps", "3", "--warmup_iterations", "1",
                          "--sequence_length", "32", "--global_batch_size", "8", "--micro_batch_size", "4", *one),
        "gptj_cmp": ["--config", "gptj_tiny", "--inference_config", "gptj_tiny", "--sequence_length", "32",
                     "--batch", "4", "--steps", "3", "--hf", "eager", "--repeats", "1", "--only", "train"],
        "plan_check": [("gptj_lora_1gpu", _finetune("gptj_tiny", "--phased", "true", "--steps", "3",
                                                    "--warmup_iterations", "1", "--sequence_length", "32",
                                                    "--global_batch_size", "8", "--micro_batch_size", "4", *one,
                                                    "--plan_exact", "--lora_rank", "4"))],
        "workstation": [("xxl_lora_1gpu", ["benchmarks/workstation.py", "--preset", "tiny", "--smoke", "--quantize",
                                           "int8"])],
        # the fifteen-minute plan's runs (``FIFTEEN``) at the same tiny shapes
        # (the same commands as the other parts' where the figures allow: a run of both is run once)
        "f15_xxl": xxl,
        "f15_workstation": ["benchmarks/workstation.py", "--preset", "tiny", "--smoke", "--quantize", "int8"],
        "f15_xl": xl[0],
        "f15_int8": ["inference.py", *_decode_args("tiny", "32", "float32", "4", "4"), "--quantize", "int8"],
        "f15_hlo": ["benchmarks/int8_hlo.py", "--config", "tiny", "--batch", "4", "--prompt_length", "32",
                    "--output_length", "4"],
        # the decoding plan's runs (``DECODING``) at tiny shapes
        "dec_startup": ["benchmarks/startup.py", "--models", "t5_tiny:tiny:", "gptj_tiny:gptj_tiny:",
                        "--server_args=--slots 4 --output_length 16 --tensor_parallel 1 --data_parallel 1"],
        "dec_serve": ["benchmarks/serve.py", "--configs", "gptj_tiny", "--requests", "6", "--slots", "4", "--max_new", "16",
                      "--steps_per_call", "4", "--repeats", "1", "--hf_requests", "1",
                      "--model_flags=--tensor_parallel 1 --data_parallel 1"],
        "dec_f32": ["benchmarks/serve.py", "--configs", "tiny", "--requests", "6", "--slots", "4", "--max_new", "16",
                    "--steps_per_call", "4", "--repeats", "1", "--hf_requests", "2",
                    "--model_flags=--tensor_parallel 1 --data_parallel 1 --precision float32"],
        "serve": ["benchmarks/serve.py", "--configs", "tiny", "--requests", "6", "--slots", "2", "--min_new", "4",
                  "--max_new", "8", "--min_prompt", "3", "--max_prompt", "8", "--steps_per_call", "8", "--repeats",
                  "1", "--hf_requests", "2"],
    }
    c["serve_xl"] = c["serve"]  # (xl's shapes are tiny's here: one run)
    return c


def _decode_args(config, length, precision, batch, output_length) -> list:
    """The flags benchmarks/compare.py gives inference.py for ``--config CONFIG --sequence_length LENGTH
    --precision P --batch B --output_length N`` (its ``commands``): another run of ours at the same shape."""
    return ["--config", config, "--sequence_length", length, "--precision", precision, "--micro_batch_size", batch,
            "--output_length", output_length, "--tensor_parallel", "1"]


PLAN_CHECK = ("xxl_1gpu", "xxl_lora_1gpu", "ul2_lora_1gpu", "gptj_1gpu", "gptj_lora_1gpu")
LORA_1GPU = ("xxl_lora_1gpu", "ul2_lora_1gpu", "gptj_lora_1gpu")
WORKSTATION_DECODING = {"xxl_lora_1gpu": ["--quantize", "int8"],
                        "ul2_lora_1gpu": ["--quantize", "int8", "--stream_encoder"], "gptj_lora_1gpu": []}


def _gpu_commands() -> dict:
    """The runs of each part on one GPU at the real shapes."""
    enc = ["--sequence_length", "512", "--decoder_sequence_length", "8", "--precision", "bfloat16"]
    one = ["--data_parallel", "1", "--tensor_parallel", "1"]
    xxl = _finetune("xxl_1gpu", "--steps", "4", "--warmup_iterations", "1", "--lengths", "mnli")
    xl = [_finetune("xl_pod8", *one, *enc, "--recompute", "false", "--unroll_layers", "true", "--global_batch_size",
                    "64", "--micro_batch_size", str(mb), "--lengths", "uniform", "--packing", "false", "--steps", "6")
          for mb in (8, 16)]
    hf = ["--precision", "bfloat16", "--sequence_length", "512", "--steps", "7", "--hf", "both"]
    dec = ["--precision", "bfloat16", "--sequence_length", "512", "--batch", "64", "--only", "decode"]
    return {
        "xxl": xxl, "xxl128": xxl + ["--global_batch_size", "128", "--micro_batch_size", "8"],
        "xxl_lora": _finetune("xxl_lora_1gpu", "--steps", "4", "--warmup_iterations", "1", "--lengths", "mnli"),
        "ul2": _finetune("ul2_1gpu", "--steps", "4", "--warmup_iterations", "1", "--lengths", "mnli",
                         "--global_batch_size", "128", "--micro_batch_size", "8"),
        "xl": xl,
        "vs_hf": [_compare("--config", "base", "--inference_config", "base", *hf, "--batch", "64", "--micro_batch",
                           "16", "--only", "train"),
                  _compare("--config", "xl_pod8", "--inference_config", "xl", *hf, "--batch", "64", "--micro_batch",
                           "8", "--only", "train")],
        "vs_hf_mnli": _compare("--config", "base", *hf, "--batch", "64", "--micro_batch", "16", "--only", "train",
                               "--lengths", "mnli"),
        "phased_pair": [xl[0][:-2] + ["--steps", "4"], xl[0][:-2] + ["--steps", "4", "--phased", "true"]],
        "decode": [("base", _compare("--config", "base", "--inference_config", "base", *dec)),
                   ("xl", _compare("--config", "xl_pod8", "--inference_config", "xl", *dec))],
        "summaries": _compare("--config", "base", *hf[:4], "--decoder_sequence_length", "128", "--steps", "7",
                              "--hf", "both", "--batch", "32", "--micro_batch", "8", "--only", "train", "--lengths",
                              "summaries"),
        "beams": _compare("--config", "base", "--inference_config", "base", *dec, "--output_length", "32",
                          "--decode_flags", "--num_beams 4"),
        "gptj_6B": _finetune("gptj_1gpu", "--steps", "3", "--warmup_iterations", "1", "--lengths", "mnli"),
        "gptj_cmp": ["--config", "gptj_small", "--inference_config", "gptj_small", "--precision", "bfloat16",
                     "--sequence_length", "256", "--batch", "64", "--micro_batch", "16", "--steps", "7", "--hf",
                     "compiled", "--only", "train"],
        "plan_check": [(p, _finetune(p, "--steps", "3", "--warmup_iterations", "1", "--lengths", "mnli",
                                     "--plan_exact")) for p in PLAN_CHECK],
        # validated as each fits 22 GiB: int8 weights (XXL), and the encoder streamed from host memory (UL2)
        "workstation": [(p, ["benchmarks/workstation.py", "--preset", p, *WORKSTATION_DECODING[p]]) for p in LORA_1GPU],
        "f15_xxl": _finetune("xxl_1gpu", "--steps", "3", "--warmup_iterations", "1", "--lengths", "mnli",
                             "--plan_exact"),
        "f15_workstation": ["benchmarks/workstation.py", "--preset", "xxl_lora_1gpu", "--steps", "3", "--quantize",
                            "int8"],
        "f15_xl": xl[0],
        "f15_int8": ["inference.py", *_decode_args("base", "512", "bfloat16", "64", "8"), "--quantize", "int8"],
        "f15_hlo": ["benchmarks/int8_hlo.py", "--config", "xl", "--batch", "64", "--prompt_length", "512",
                    "--output_length", "8"],
        # base: 512 requests (128 were 0.66 s of serving on one H100, arrivals still coming in for half of it);
        "serve": ["benchmarks/serve.py", "--configs", "base", "--requests", "512", "--slots", "32",
                  "--steps_per_call", "8", "--repeats", "3", "--hf_requests", "8",
                  "--model_flags=--tensor_parallel 1 --data_parallel 1"],
        "serve_xl": ["benchmarks/serve.py", "--configs", "xl", "--requests", "256", "--slots", "32",
                     "--steps_per_call", "8", "--repeats", "1", "--hf_requests", "2",
                     "--model_flags=--tensor_parallel 1 --data_parallel 1"],
        **DECODING_GPU,
    }


# the decoding plan on one GPU: servers of base and xl started cold and warm; base served against static batching at
# 512 requests; a float32 server's greedy tokens against static batching's and HF's ("highest" precision)
DECODING_GPU = {
    "dec_startup": ["benchmarks/startup.py", "--models", "t5_base:base:", "t5_xl:xl:",
                    "--server_args=--slots 32 --output_length 64 --tensor_parallel 1 --data_parallel 1"],
    "dec_serve": ["benchmarks/serve.py", "--configs", "base", "--requests", "512", "--slots", "32", "--steps_per_call",
                  "8", "--repeats", "1", "--hf_requests", "8", "--model_flags=--tensor_parallel 1 --data_parallel 1"],
    "dec_f32": ["benchmarks/serve.py", "--configs", "base", "--requests", "64", "--slots", "32", "--steps_per_call", "8",
                "--repeats", "1", "--hf_requests", "16",
                "--model_flags=--tensor_parallel 1 --data_parallel 1 --precision float32"],
}


def parts(smoke: bool) -> list:
    """The parts in priority order; ``smoke``: the same runs at tiny shapes on CPU."""
    c = _smoke_commands() if smoke else _gpu_commands()
    xl = [Run(f"mb{cmd[cmd.index('--micro_batch_size') + 1]}", cmd, required=False) for cmd in c["xl"]]
    xl[-1].cmd = xl[-1].cmd + ["--profile", "{dir}/xl_profile"]  # the larger micro-batch's profile
    out = [
        Part("xxl_1gpu", "Flan-T5-XXL phased on one device (packed, 16 and 128 rows; 16 rows with LoRA)", 560,
             [Run("rows16", c["xxl"]), Run("lora16", c["xxl_lora"], required=False),
              Run("rows128", c["xxl128"], required=False)], _xxl_figures),
        Part("ul2_1gpu", "Flan-UL2 phased on one device (packed, 128 rows): updated in the backward or not", 900,
             [Run("in_backward", c["ul2"]), Run("gradients_stored", c["ul2"] + ["--update_in_backward", "false"],
                                                required=False)], _ul2_figures),
        Part("xl_mfu", "Flan-T5-XL fused, one device: MFU at the best micro-batch, with its profile", 300, xl,
             _xl_figures),
        Part("vs_hf", "ours against HF eager and torch.compile (equal work), packed vs unpacked vs HF padded", 420,
             [Run(f"equal_work_{i}", cmd) for i, cmd in enumerate(c["vs_hf"])] + [Run("mnli", c["vs_hf_mnli"])],
             _vs_hf_figures),
        Part("xl_phased", "xl phased against fused at global batch 64", 240,
             [Run("fused", c["phased_pair"][0]), Run("phased", c["phased_pair"][1])], _phased_figures),
        Part("decode", "greedy decoding against HF generate", 120,
             [Run(name, cmd, required=i == 0) for i, (name, cmd) in enumerate(c["decode"])], _decode_figures),
        Part("summaries", "a long-target task (prompts ~150 tokens, targets ~30, up to 128): ours packed and unpacked "
             "against HF padded, eager and compiled", 360, [Run("base", c["summaries"])], _vs_hf_figures),
        Part("beams", "beam search (4 beams) against HF generate with the same beams", 180,
             [Run("base", c["beams"])], _decode_figures),
        Part("gptj_6B", "GPT-J 6B phased on one device; a small GPT-J against HF", 420,
             [Run("gptj_1gpu", c["gptj_6B"]), Run("vs_hf", _compare(*c["gptj_cmp"]), required=False)], _gptj_figures),
        Part("plan_check", "the allocator's device peak and the process's host peak against the plan (exact: with "
             "XLA's temporaries), each one-GPU preset", 900, [Run(n, cmd, required=False) for n, cmd in c["plan_check"]],
             _plan_figures),
        Part("workstation", "each LoRA preset trained 10 steps and validated on a 22 GiB device with 60 GiB of host "
             "memory", 1200, [Run(n, cmd, required=False) for n, cmd in c["workstation"]], _workstation_figures),
        # estimates: base about 250 s on one H100 at 128 requests (106 s of it compiling the slot programs); xl
        # unmeasured (530: its part runs within lent_gpu.sh serve_xl 560, whose budget counts the installs too)
        Part("serve", "the server (continuous batching) against static batching and HF generate one by one, on "
             "Poisson arrivals of mixed lengths (base)", 330, [Run("serve", c["serve"])], _serve_figures),
        Part("serve_xl", "the server against static batching and HF generate for xl (256 requests, one round, 2 join "
             "sizes, 2 requests for HF)", 530, [Run("serve", c["serve_xl"])], _serve_figures),
    ]
    out += fifteen(c) + decoding(c)
    if smoke:  # CPU seconds at tiny shapes: a tenth of the GPU estimates
        for q in out:
            q.estimate_s /= 10
    return out


# The fifteen-minute plan (``--only fifteen``; bash benchmarks/lent_gpu.sh fifteen): what decides the open GPU claims,
# in priority order, within 480 s of one command on a bare one-GPU machine (its compilations included). Its parts are
# run only when named: a whole-suite run has the same measurements in its own parts.
FIFTEEN = ("f15_xxl_1gpu", "f15_workstation", "f15_xl_mfu", "f15_decode", "f15_int8_fusion")


def fifteen(c: dict) -> list:
    """The fifteen-minute plan's parts (estimates from the 2026-11-25 H100 suite: xxl_1gpu rows16 194 s with 4
    steps, lora16 69 s, xl mb8 73 s, decode base 49 s)."""
    return [
        Part("f15_xxl_1gpu", "(a) Flan-T5-XXL phased on one device at 16 rows: step time against the larger of its "
             "compute and its link floor, the allocator's peak against the exact plan, host RSS against the host plan",
             190, [Run("rows16", c["f15_xxl"])], _f15_xxl_figures),
        Part("f15_workstation", "(b) xxl_lora_1gpu on a 22 GiB device with 60 GiB of host memory: 3 steps, then "
             "validation of 64 rows with int8 weights", 150, [Run("xxl_lora_1gpu", c["f15_workstation"])],
             _f15_workstation_figures),
        Part("f15_xl_mfu", "(c) Flan-T5-XL fused on one device at micro-batch 8: MFU", 75,
             [Run("mb8", c["f15_xl"])], _xl_figures),
        Part("f15_decode", "(d) greedy decoding against HF generate (base), and ours with int8 weights", 60,
             [Run("base", c["decode"][0][1]), Run("int8", c["f15_int8"], required=False)], _f15_decode_figures),
        Part("f15_int8_fusion", "whether int8 decoding forms a dequantized copy of a weight per call (xl's greedy "
             "program, optimized HLO)", 40, [Run("xl", c["f15_hlo"])], lambda r: r["xl"]),
    ]


# The decoding plan (``--only decoding``; bash benchmarks/lent_gpu.sh decoding): the decoder's GPU figures, within 480 s
# of one command on a bare one-GPU machine: how fast a server starts (base and xl, cold and from the compilation
# cache), the server against static batching at 512 requests (base), and a float32 server's greedy tokens against
# static batching's and HF's on every request.
DECODING = ("dec_startup", "dec_serve", "dec_f32")


def decoding(c: dict) -> list:
    """The decoding plan's parts (estimates: a base server starts in about 20 s on the 2-core CPU, most of it the
    weights; on a GPU the xl checkpoint's saving and loading dominate)."""
    return [
        Part("dec_startup", "(a) run_server.py to /health 200, cold and warm: base and xl, 32 slots, 64 new tokens",
             150, [Run("startup", c["dec_startup"])], _startup_figures),
        Part("dec_serve", "(b) the server against static batching and HF generate one by one: base, 512 Poisson "
             "requests, one round", 180, [Run("serve", c["dec_serve"])], _serve_figures),
        Part("dec_f32", "(c) float32 (matmuls at 'highest'): the server's greedy tokens against static batching's and "
             "HF's on every request (base, 64 requests, 16 of them for HF)", 100, [Run("serve", c["dec_f32"])],
             _serve_figures),
    ]


# --------------------------------------------------------------------------- figures of each part


def _startup_figures(reports: dict) -> dict:
    """{model: cold and warm seconds to healthy, the programs compiled} of benchmarks/startup.py's report."""
    return {name: {k: m[k] for k in ("cold_s", "warm_s", "programs", "cold_compile_s", "warm_compile_s")}
            for name, m in reports["startup"]["models"].items()}



def _step_figures(r: dict) -> dict:
    keys = ("global_batch_size", "median_step_s", "samples_per_s", "examples_per_s", "mfu", "losses", "peak_device_bytes",
            "device_bytes_estimate", "plan_device_bytes", "plan_device_bytes_exact", "plan_host_bytes",
            "host_peak_rss_bytes", "phase_timing", "link", "link_bound_step_s", "link_floor_step_s")
    out = {k: r.get(k) for k in keys}
    t, f = r.get("transfers"), r.get("transfer_floor")
    if t and f:  # what a step moved over the host link against the floor of its layout
        out.update(load_bytes=t["load_bytes"], store_bytes=t["store_bytes"], floor_load_bytes=f["load_bytes"],
                   floor_store_bytes=f["store_bytes"])
    return out


def _xxl_figures(reports: dict) -> dict:
    out = {}
    for name, r in reports.items():
        f = _step_figures(r)
        t = r.get("phase_timing") or {}
        if t.get("compute_s") is not None:  # the overlapped step against its programs' own time
            f["transfer_wait_s"] = max(r["median_step_s"] - t["compute_s"], 0.0)
            if r.get("link_floor_step_s") is not None:  # the goal: at most 1.2x the larger of compute and the link
                f["over_bound"] = r["median_step_s"] / max(t["compute_s"], r["link_floor_step_s"])
        losses = r.get("losses") or []
        f["losses_decrease"] = len(losses) > 1 and losses[-1] < losses[0]
        out[name] = f
    full, lora = out.get("rows16", {}), out.get("lora16", {})
    if full.get("median_step_s") and lora.get("median_step_s"):  # < 1: a LoRA step is cheaper than a full one
        out["lora_over_full_step_s"] = lora["median_step_s"] / full["median_step_s"]
    return out


def _ul2_figures(reports: dict) -> dict:
    out = _xxl_figures(reports)
    a, b = out.get("in_backward", {}), out.get("gradients_stored", {})
    if a.get("median_step_s") and b.get("median_step_s"):  # > 1: updating in the backward is faster
        out["stored_over_in_backward_step_s"] = b["median_step_s"] / a["median_step_s"]
    return out


def _xl_figures(reports: dict) -> dict:
    best = max(reports, key=lambda n: reports[n].get("samples_per_s") or 0)
    out = {"best": best, **{n: _step_figures(r) for n, r in reports.items()}}
    profiled = [n for n, r in reports.items() if r.get("profile")]
    if profiled:  # where the device time of a step went: top ops, GEMM / elementwise / copy shares
        out["profile"] = {"run": profiled[0], **reports[profiled[0]]["profile"]}
    return out


def _vs_hf_figures(reports: dict) -> dict:
    return {n: {"training": r.get("training"), "ratios": r.get("ratios")} for n, r in reports.items()}


def _phased_figures(reports: dict) -> dict:
    f, p = reports.get("fused"), reports.get("phased")
    out = {n: _step_figures(r) for n, r in reports.items()}
    if f and p and f.get("samples_per_s"):
        out["phased_over_fused_samples_per_s"] = p["samples_per_s"] / f["samples_per_s"]
    return out


def _plan_figures(reports: dict) -> dict:
    """Each preset's allocator peak over its exact plan (goal: within 15%) and host RSS over its host plan (goal:
    within 10% + a few GiB)."""
    out = {}
    for n, r in reports.items():
        f = _step_figures(r)
        plan = r.get("plan_device_bytes_exact") or r.get("plan_device_bytes")
        peak = r.get("peak_device_bytes") or r.get("device_bytes_estimate")
        f["device_over_plan"] = peak / plan if peak and plan else None
        f["host_rss_over_plan"] = (r["host_peak_rss_bytes"] / r["plan_host_bytes"]
                                   if r.get("host_peak_rss_bytes") and r.get("plan_host_bytes") else None)
        out[n] = f
    return out


def _workstation_figures(reports: dict) -> dict:
    """Each LoRA preset's status, step seconds and peaks under the caps (the caps and how they were enforced)."""
    return {n: {"status": r.get("status"), "step_s": r.get("step_s"), "device_cap": r.get("device_cap"),
                "host_cap": r.get("host_cap"),
                **{f"{k}_peak_rss_bytes": (r.get(k) or {}).get("peak_rss_bytes") for k in ("train", "validate")},
                **{f"{k}_status": (r.get(k) or {}).get("status") for k in ("train", "validate")}}
            for n, r in reports.items()}


def _f15_xxl_figures(reports: dict) -> dict:
    """xxl_1gpu's step figures with the plan's: over_bound, device_over_plan, host_rss_over_plan."""
    return {"rows16": {**_xxl_figures(reports)["rows16"], **_plan_figures(reports)["rows16"]}}


def _f15_workstation_figures(reports: dict) -> dict:
    r = reports["xxl_lora_1gpu"]
    return {**_workstation_figures(reports), "validation": r.get("validation"), "quantize": r.get("quantize")}


def _f15_decode_figures(reports: dict) -> dict:
    """Ours against HF generate, and ours with int8 weights against ours with the compute dtype's (the same shape:
    compare.py's own run of inference.py)."""
    out = _decode_figures({"base": reports["base"]})
    ours = ((reports["base"].get("runs") or {}).get("ours_g") or [None])[0] or {}
    int8 = reports.get("int8") or {}
    if ours.get("generated_tokens_per_s") and int8.get("generated_tokens_per_s"):
        out["int8_over_ours_tokens_per_s"] = int8["generated_tokens_per_s"] / ours["generated_tokens_per_s"]
        out["weight_bytes"] = {"ours": ours.get("weight_bytes"), "int8": int8.get("weight_bytes")}
    return out


def _decode_figures(reports: dict) -> dict:
    return {n: {k: r.get(k) for k in ("decode_tokens_per_s", "first_token_s", "decode_token_latency_s")}
            for n, r in reports.items()}


def _gptj_figures(reports: dict) -> dict:
    out = {}
    if "gptj_1gpu" in reports:
        out["gptj_1gpu"] = _xxl_figures({"x": reports["gptj_1gpu"]})["x"]
    if "vs_hf" in reports:
        out["vs_hf"] = _vs_hf_figures({"x": reports["vs_hf"]})["x"]
    return out


def _serve_figures(reports: dict) -> dict:
    """{model: tokens/s of each method, TTFT and ITL p50/p99, the ratios} of benchmarks/serve.py's report."""
    out = {}
    for model, m in reports["serve"]["models"].items():
        methods = {k: v for k, v in m.items() if isinstance(v, dict) and "tokens_per_s" in v}
        out[model] = {"tokens_per_s": {k: v["tokens_per_s"] for k, v in methods.items()},
                      "ttft_s": {k: v["ttft_s"] for k, v in methods.items()},
                      "itl_s": {k: v["itl_s"] for k, v in methods.items()}, "ratios": m["ratios"],
                      "same_tokens": {k: v.get("same_tokens_as_server") for k, v in methods.items()
                                      if "same_tokens_as_server" in v}}
    return out


# --------------------------------------------------------------------------- environment and installs


def environment() -> dict:
    """Device kind and count, host RAM, versions, the commit: read in a subprocess, so that this process never
    takes the accelerator (JAX preallocates most of a GPU's memory in the first process that starts it)."""
    probe = r"""
import json, os, platform
out = {"python": platform.python_version()}
try:
    import jax, jaxlib
    d = jax.devices()
    out.update(jax=jax.__version__, jaxlib=jaxlib.__version__, platform=d[0].platform, device_kind=d[0].device_kind,
               device_count=len(d))
except Exception as e:
    out["jax_error"] = repr(e)
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda)
except Exception:
    pass
try:
    import transformers
    out["transformers"] = transformers.__version__
except Exception:
    pass
try:
    out["host_ram_bytes"] = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
except Exception:
    pass
print(json.dumps(out))
"""
    env = {"error": "probe failed"}
    try:
        p = subprocess.run([PY, "-c", probe], capture_output=True, text=True, timeout=300, cwd=ROOT)
        env = json.loads(p.stdout.strip().splitlines()[-1])
    except Exception as e:  # the suite still runs and records what it could not read
        env = {"error": f"{type(e).__name__}: {e}"}
    try:
        env["commit"] = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                                       timeout=30).stdout.strip() or None
    except Exception:
        env["commit"] = None
    env["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return env


def ensure_packages() -> dict:
    """Installs, in one step, what the benchmarks import and this machine lacks: from wheels in ``.whl/`` when
    the machine reaches no package index (a lent GPU box), else from PyPI. -> {installed, missing}."""
    missing = [pkg for mod, pkg in NEEDS.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return {"installed": [], "missing": []}
    wheels = os.path.join(ROOT, ".whl")
    cmd = [PY, "-m", "pip", "install", "-q", *missing]
    if os.path.isdir(wheels):
        cmd[4:4] = ["--no-index", "--find-links", wheels]
    ok = subprocess.run(cmd, cwd=ROOT).returncode == 0
    still = [pkg for mod, pkg in NEEDS.items() if importlib.util.find_spec(mod) is None]
    print(f"installed {', '.join(missing)}" if ok and not still else f"could not install {', '.join(still)}",
          flush=True)
    return {"installed": [p for p in missing if p not in still], "missing": still}


# --------------------------------------------------------------------------- running


_DONE: dict = {}  # {command: Future of its result}: a part that runs a command another part ran (or is running) reuses it
_DONE_LOCK = threading.Lock()


def run_one(run: Run, out_dir: str, part: str, timeout: float) -> dict:
    """One benchmark process -> its report (``status`` ok, failed, out_of_memory or timed_out), its output kept; a
    command another part of this invocation ran ok is not run again, nor one it is running (parts run concurrently
    with ``--jobs``): its result is reused, and says so. A failed run is forgotten: the next part to ask runs it.
    ``timeout``: seconds from the call, the wait for another part's run counted in them (none left: timed_out)."""
    key = tuple(run.cmd)
    deadline = time.monotonic() + timeout
    while True:
        with _DONE_LOCK:
            first = _DONE.get(key)
            if first is None:
                mine = _DONE[key] = Future()
        if first is None:
            break
        done = first.result()
        if done["status"] == "ok":
            return {**done, "reused": True}
    result = {"status": "failed"}
    try:
        left = deadline - time.monotonic()
        result = (_run_process(run, out_dir, part, left) if left > 0 else
                  {"status": "timed_out", "reason": "no time left after waiting for another part's run of it"})
        return result
    finally:
        if result["status"] != "ok":
            with _DONE_LOCK:
                del _DONE[key]
        mine.set_result(result)


def _run_process(run: Run, out_dir: str, part: str, timeout: float) -> dict:
    path = os.path.join(out_dir, f"{part}__{run.name}.run.json")
    cmd = [c.replace("{dir}", out_dir) for c in run.cmd] + ["--json", path]
    log = os.path.join(out_dir, f"{part}__{run.name}.log")
    if os.path.exists(path):
        os.remove(path)
    t0 = time.perf_counter()
    code, usage = run_child(cmd, log, timeout=timeout)
    cpu_s = usage.ru_utime + usage.ru_stime
    seconds = time.perf_counter() - t0
    text = open(log).read() if os.path.exists(log) else ""
    report = json.load(open(path)) if code == 0 and os.path.exists(path) else {}
    if code == 0 and report:
        status = "ok"
    elif code is None:
        status = "timed_out"
    elif code == 4 or "out of memory" in text.lower() or "RESOURCE_EXHAUSTED" in text:
        status = "out_of_memory"
    else:
        status = "failed"
    profile = os.path.join(out_dir, "xl_profile", "summary.json")
    if status == "ok" and "--profile" in run.cmd and os.path.exists(profile):
        report["profile"] = json.load(open(profile))
    tail = "\n".join(text.strip().splitlines()[-5:]) if status != "ok" else None
    return {"status": status, "seconds": seconds, "cpu_s": cpu_s, "command": "python3 " + " ".join(cmd),
            "report": report, "log_tail": tail}


def run_part(part: Part, out_dir: str, left: float, env: dict) -> dict:
    """Runs a part's benchmarks (skipped whole when its estimate does not fit ``left`` seconds)."""
    base = {"part": part.name, "what": part.what, "env": env, "estimate_s": part.estimate_s,
            "commands": ["python3 " + " ".join(r.cmd) for r in part.runs]}
    if part.estimate_s > left:
        return {**base, "status": "skipped", "reason": f"needs about {part.estimate_s:.0f} s, {left:.0f} s left",
                "figures": None, "runs": {}}
    t0, runs = time.perf_counter(), {}
    for r in part.runs:
        runs[r.name] = run_one(r, out_dir, part.name, left - (time.perf_counter() - t0))
    required = [runs[r.name]["status"] for r in part.runs if r.required]
    bad = [s for s in required if s != "ok"]
    status = "ok" if not bad else ("out_of_memory" if "out_of_memory" in bad else
                                   "timed_out" if "timed_out" in bad else "failed")
    ok_reports = {n: r["report"] for n, r in runs.items() if r["status"] == "ok"}
    figures = None
    if ok_reports:
        try:
            figures = part.figures(ok_reports)
        except Exception as e:  # a figure that cannot be read is recorded; the raw reports stay
            figures = {"error": f"{type(e).__name__}: {e}"}
    return {**base, "status": status, "seconds": time.perf_counter() - t0, "figures": figures, "runs": runs}


# --------------------------------------------------------------------------- summary


def _fmt(x, unit=""):
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.3g}{unit}"
    return f"{x}{unit}"


def _gib(x: dict, *keys) -> str:
    """The first of ``keys`` that ``x`` has a value for, in GiB (0 when none has)."""
    return _fmt(next((x[k] for k in keys if x.get(k)), 0) / 2**30, " GiB")


def _host(x: dict) -> str:
    """A run's measured host peak beside its plan's: the process's peak resident memory (JAX, the libraries and
    the model's host-resident state) against the plan's host-resident state alone."""
    return (f"host peak RSS {_gib(x, 'host_peak_rss_bytes')} (the plan's host-resident state "
            f"{_gib(x, 'plan_host_bytes')})")


def _rows(x: dict) -> str:
    return f"{x.get('global_batch_size', '?')} rows"


def _mfu(x: dict) -> str:
    return _fmt(x.get("mfu")) if x.get("mfu") is not None else "- (no peak FLOP/s known for this device)"


def _memory_head(part: str, f: dict) -> str:
    """The headline figures of a one-GPU memory part ("" for any other part)."""
    head = ""
    if part == "xxl_1gpu" and f.get("rows16"):
        x = f["rows16"]
        big = f.get("rows128") or {}
        head = (f"step {_fmt(x['median_step_s'], ' s')} ({_rows(x)}), "
                f"{_fmt(big.get('median_step_s'), ' s')} ({_rows(big)}); device "
                f"{_gib(x, 'peak_device_bytes', 'device_bytes_estimate')} (plan {_gib(x, 'plan_device_bytes')}), "
                f"{_host(x)}; transfer wait "
                f"{_fmt(x.get('transfer_wait_s'), ' s')}; with LoRA "
                f"{_fmt((f.get('lora16') or {}).get('median_step_s'), ' s')} "
                f"({_fmt(f.get('lora_over_full_step_s'), 'x')} of the full step)")
    elif part == "ul2_1gpu" and f.get("in_backward"):
        x = f["in_backward"]
        head = (f"step {_fmt(x['median_step_s'], ' s')} updated in the backward, "
                f"{_fmt((f.get('gradients_stored') or {}).get('median_step_s'), ' s')} with the gradients "
                f"stored; {_host(x)}; losses decrease: "
                f"{x.get('losses_decrease')}")
    elif part == "f15_xxl_1gpu" and f.get("rows16"):
        x = f["rows16"]
        head = (f"step {_fmt(x.get('median_step_s'), ' s')} ({_rows(x)}), {_fmt(x.get('over_bound'), 'x')} the "
                f"larger of compute and the link floor; device peak {_fmt(x.get('device_over_plan'), 'x')} the "
                f"exact plan; host RSS {_fmt(x.get('host_rss_over_plan'), 'x')} the host plan")
    elif part == "f15_workstation" and f:
        w, v = f.get("xxl_lora_1gpu") or {}, f.get("validation") or {}
        head = (f"train {w.get('train_status')}, step {_fmt(min((w.get('step_s') or [None])[1:] or [None]), ' s')}"
                f"; validation ({f.get('quantize')}) {w.get('validate_status')}, device peak "
                f"{_gib(v, 'peak_device_bytes')}, {_fmt(v.get('seconds'), ' s')}")
    return head


def _other_head(part: str, f: dict) -> str:
    """The headline figures of every other part ("" where it has none)."""
    head = ""
    if part == "f15_decode" and f:
        head = (f"ours / HF {_fmt(((f.get('base') or {}).get('decode_tokens_per_s') or {}).get('ratio'), 'x')} "
                f"tokens/s; int8 / ours {_fmt(f.get('int8_over_ours_tokens_per_s'), 'x')}")
    elif part == "f15_int8_fusion" and f:
        head = (f"{f.get('backend')}: a weight materialised per call: {f.get('weights_materialised')} "
                f"({len(f.get('materialised') or [])} arrays); temporaries {_gib(f, 'temp_bytes_int8')} with "
                f"int8, {_gib(f, 'temp_bytes_bf16_weights')} without")
    elif part in ("xl_mfu", "f15_xl_mfu") and f.get("best"):
        b = f[f["best"]]
        head = f"{f['best']}: MFU {_mfu(b)}, {_fmt(b.get('samples_per_s'))} samples/s"
    elif part in ("vs_hf", "summaries") and f:
        head = "; ".join(f"{k} {_fmt(v, 'x')}" for n in f.values() for k, v in (n.get("ratios") or {}).items())
    elif part == "xl_phased" and f:
        head = f"phased / fused samples/s {_fmt(f.get('phased_over_fused_samples_per_s'))}"
    elif part in ("decode", "beams") and f:
        head = "; ".join(f"{n}: {_fmt((v.get('decode_tokens_per_s') or {}).get('ratio'), 'x')} tokens/s"
                         for n, v in f.items())
    elif part == "gptj_6B" and f:
        g = f.get("gptj_1gpu") or {}
        ratios = ((f.get("vs_hf") or {}).get("ratios") or {})
        head = f"step {_fmt(g.get('median_step_s'), ' s')}, MFU {_mfu(g)}; " + "; ".join(
            f"{k} {_fmt(v, 'x')}" for k, v in ratios.items())
    elif part == "plan_check" and f:
        head = "; ".join(f"{n}: device {_fmt(v.get('device_over_plan'), 'x')} of the plan, host RSS "
                         f"{_fmt(v.get('host_rss_over_plan'), 'x')}" for n, v in f.items())
    elif part == "workstation" and f:
        head = "; ".join(f"{n}: {v['status']}, step {_fmt(min(v['step_s'][1:] or v['step_s'] or [None]), ' s')}"
                         for n, v in f.items())
    elif part in ("serve", "serve_xl", "dec_serve", "dec_f32") and f:
        head = "; ".join(f"{model}: " + ", ".join(f"{k} {_fmt(v, 'x')}" for k, v in m["ratios"].items())
                         + "".join(f", {k}'s tokens the server's on {_fmt(100 * v, '%')} of requests"
                                   for k, v in m.get("same_tokens", {}).items() if v is not None)
                         for model, m in f.items() if isinstance(m, dict) and "ratios" in m)
    elif part == "dec_startup" and f:
        head = "; ".join(f"{n}: cold {_fmt(v['cold_s'], ' s')}, warm {_fmt(v['warm_s'], ' s')} ({v['programs']} "
                         "programs)" for n, v in f.items())
    return head


def summary_rows(results: list) -> list:
    """(part, status, headline figures, baseline) rows of the summary table."""
    rows = []
    for r in results:
        f = r.get("figures") or {}
        head = _memory_head(r["part"], f) or _other_head(r["part"], f)
        if (r.get("env") or {}).get("smoke") and head:
            head = "smoke (tiny shapes on CPU; not the part's figures): " + head
        rows.append((r["part"], r["status"] + (f" ({r['reason']})" if r.get("reason") else ""), head or "-"))
    return rows


def write_summary(results: list, out_dir: str) -> str:
    env = next((r["env"] for r in results if r.get("env")), {})
    smoke = ["SMOKE RUN (--smoke): every part at tiny shapes on CPU, to check that it runs; its numbers are not "
             "the parts' figures.", ""] if env.get("smoke") else []
    lines = smoke + [f"Benchmark suite, {env.get('date', '?')}: {env.get('device_count', '?')} x "
             f"{env.get('device_kind', '?')}, commit {str(env.get('commit'))[:10]}, jax {env.get('jax')}, "
             f"torch {env.get('torch')}, transformers {env.get('transformers')}", "",
             "| part | status | figures (each against its baseline in the part's JSON) |", "|---|---|---|"]
    lines += [f"| {p} | {s} | {h} |" for p, s, h in summary_rows(results)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    return text


def draw_figures(out_dir: str, imgs: str | None = None) -> list:
    """The README's figures that the suite's results feed, drawn into ``out_dir`` (and into ``imgs``, the tracked
    folder, only when asked: regenerating the committed figures is done on purpose)."""
    from benchmarks import figures

    made = []
    mnli = os.path.join(out_dir, "vs_hf__mnli.run.json")
    if os.path.exists(mnli):
        for folder in [out_dir] + ([imgs] if imgs else []):
            made.append(figures.throughput(mnli, os.path.join(folder, "throughput.png")))
    return made


def load_results(out_dir: str) -> list:
    order = [p.name for p in parts(False)]
    found = {}
    for name in order:
        path = os.path.join(out_dir, f"{name}.json")
        if os.path.exists(path):
            found[name] = json.load(open(path))
    return [found[n] for n in order if n in found]


def update_readme(readme: str, out_dir: str) -> None:
    """Replaces the text between the suite markers of ``readme`` (docs/gpu_suite.md) with the summary of
    ``out_dir``'s results."""
    results = load_results(out_dir)
    text = write_summary(results, out_dir) if results else "No suite results yet.\n"
    src = open(readme).read()
    if BEGIN not in src or END not in src:
        raise SystemExit(f"{readme} has no {BEGIN} ... {END} markers: add them where the suite's table goes")
    head, rest = src.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    with open(readme, "w") as f:
        f.write(f"{head}{BEGIN}\n(generated by `python3 benchmarks/suite.py --summarize {os.path.relpath(out_dir, ROOT)} "
                f"--readme {os.path.relpath(readme, ROOT)}`)\n\n{text}{END}{tail}")


def chosen_parts(available: list, only: str | None) -> list:
    """The parts ``--only`` names (``fifteen``: the fifteen-minute plan's), in the suite's order; without it every
    part but the fifteen-minute plan's (their measurements are the whole suite's)."""
    if not only:
        return [q for q in available if q.name not in FIFTEEN + DECODING]
    plans = {"fifteen": FIFTEEN, "decoding": DECODING}
    names = [n for x in only.split(",") for n in plans.get(x, (x,))]
    unknown = set(names) - {q.name for q in available}
    if unknown:
        raise SystemExit(f"unknown part(s) {', '.join(sorted(unknown))}: choose among "
                         f"{', '.join(q.name for q in available)}")
    return [q for q in available if q.name in names]


def main(argv=None) -> list:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results/suite, or with "
                                              "--smoke runs/suite_smoke)")
    p.add_argument("--budget", type=float, default=1500.0, help="seconds for the whole suite (default 25 min)")
    p.add_argument("--only", default=None, help="comma-separated part names")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: every part runs, quickly")
    p.add_argument("--summarize", default=None, metavar="DIR", help="only rewrite DIR/summary.md from its JSONs")
    p.add_argument("--readme", default=None, metavar="MARKDOWN",
                   help="with --summarize: also rewrite the suite table between the markers of this Markdown file "
                        "(docs/gpu_suite.md holds them)")
    p.add_argument("--jobs", type=int, default=None, help="parts run side by side (default: 1; 2 with --smoke)")
    p.add_argument("--imgs", action="store_true", help="with --summarize: also redraw the tracked figures in imgs/")
    a = p.parse_args(argv)
    if a.summarize:
        if a.readme:
            update_readme(a.readme, a.summarize)
        draw_figures(a.summarize, os.path.join(ROOT, "imgs") if a.imgs else None)
        print(write_summary(load_results(a.summarize), a.summarize))
        return []
    out_dir = os.path.abspath(a.out or os.path.join(ROOT, "runs/suite_smoke" if a.smoke else "benchmarks/results/suite"))
    os.makedirs(out_dir, exist_ok=True)
    # one persistent compilation cache for every benchmark process: programs of equal shapes compile once
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(out_dir, "jax_cache"))
    # JAX takes 75% of a GPU's memory by default; the benchmarks are alone on the device (xl at micro-batch 16
    # ran out of memory at 75% on an H100, 2026-11-25)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    t_start = time.perf_counter()
    installs = ensure_packages()
    env = {**environment(), "installs": installs, "smoke": a.smoke}
    chosen = chosen_parts(parts(a.smoke), a.only)
    results, lock = {}, threading.Lock()

    def one(part):
        left = a.budget - (time.perf_counter() - t_start)
        print(f"== {part.name}: {part.what} ({left:.0f} s of the budget left)", flush=True)
        result = run_part(part, out_dir, left, env)
        with open(os.path.join(out_dir, f"{part.name}.json"), "w") as f:  # each part's JSON the moment it ends
            json.dump(result, f, indent=1)
        with lock:
            results[part.name] = result
            write_summary([results[q.name] for q in chosen if q.name in results], out_dir)
        print(f"   {part.name}: {result['status']}" + (f" in {result['seconds']:.0f} s" if "seconds" in result else "")
              + (f": {result.get('reason')}" if result.get("reason") else ""), flush=True)

    jobs = a.jobs or (2 if a.smoke else 1)  # an accelerator runs one benchmark at a time; CPU cores share out
    with ThreadPoolExecutor(jobs) as pool:
        list(pool.map(one, chosen))
    ordered = [results[q.name] for q in chosen]
    draw_figures(out_dir)
    print(write_summary(ordered, out_dir))
    return ordered


if __name__ == "__main__":
    main()
