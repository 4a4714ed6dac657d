"""docs/results.md: every measured figure the manual states, each read from the JSON under benchmarks/results/ that its
command wrote, with that command and the file, in one place (the other pages link to a figure's row here, as
docs/configuration.md is generated from the config's own declarations).

    python3 benchmarks/results_page.py --output docs/results.md     # a test checks it is current

A figure has an id (the anchor a page links to: ``[2.68 s](results.md#xxl-step)``) and is rendered from its JSON by
the format given here, so a page's link text can be checked against it: tests/benchmarks/test_results_page.py fails
where a page states a figure (a number with a unit of measure) that is neither such a link with the rendered value
nor a quantity the test lists as no measurement (a limit, a size, a goal). A figure superseded by a newer run of the
same measurement leaves the manual for benchmarks/results/LOG.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Callable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
GIB = 2 ** 30
GB = 1e9


# ------------------------------------------------------------------------------------------------- figures, tables

def at(*path) -> Callable:
    """The value at ``path`` in a JSON document (keys, and indices into lists)."""
    def get(doc):
        for key in path:
            doc = doc[key]
        return doc
    return get


@dataclasses.dataclass(frozen=True)
class Figure:
    """One measured figure: ``id`` the anchor pages link to, ``get`` reads it from its JSON (``json``, a path under
    benchmarks/results/; None: its table's first), ``fmt`` renders it after multiplying by ``scale``."""
    id: str
    get: Callable
    fmt: str
    scale: float = 1.0
    json: Optional[str] = None

    def render(self, doc) -> str:
        value = self.get(doc)
        return self.fmt.format(value * self.scale if self.scale != 1.0 else value)


def ratio(id, get, digits=2, json=None):
    return Figure(id, get, f"{{:.{digits}f}}x", json=json)


def pct(id, get, digits=1, json=None):
    return Figure(id, get, f"{{:.{digits}f}}%", 100.0, json=json)


def sec(id, get, digits=2, json=None):
    return Figure(id, get, f"{{:.{digits}f}} s", json=json)


def ms(id, get, digits=1, json=None):
    return Figure(id, get, f"{{:.{digits}f}} ms", 1e3, json=json)


def gib(id, get, digits=1, json=None):
    return Figure(id, get, f"{{:.{digits}f}} GiB", 1 / GIB, json=json)


def rate(id, get, unit, digits=1, json=None):
    return Figure(id, get, f"{{:,.{digits}f}} {unit}", json=json)


def span(id, get, digits=2, json=None):
    """The range of a ratio over its rounds (``get`` reads app/alternate.py's spread: its ``min`` and ``max``)."""
    return Figure(id, lambda d: (get(d)["min"], get(d)["max"]), f"{{0[0]:.{digits}f}}x-{{0[1]:.{digits}f}}x",
                  json=json)


def load_average(id, when, json=None):
    """The machine's 1-minute load average ``when`` ("before" or "after") an invocation, as compare.py records it."""
    return Figure(id, at(f"load_{when}", 0), "{:.2f}", json=json)


@dataclasses.dataclass
class Table:
    """A table of figures from ``sources`` (paths under benchmarks/results/), written by ``command`` (None: the first
    source's own ``command``), measured as ``note`` says; each row a tuple of cells, text or a Figure."""
    anchor: str
    title: str
    sources: tuple
    command: Optional[str]
    note: str
    header: tuple
    rows: list


def load(path: str, results: str = RESULTS):
    with open(os.path.join(results, path)) as f:
        return json.load(f)


def _date(doc: dict) -> Optional[str]:
    return doc.get("date") or (doc.get("env") or {}).get("date")


# ------------------------------------------------------------------------------------------------ the 2-core CPU

QS, MT = "cpu/quickstart.json", "cpu/make_test.json"
CT, CT1, CT3 = "cpu/compare_train.json", "archive/cpu/compare_train_1.json", "archive/cpu/compare_train_3.json"
TAB = "archive/cpu/ab_train_clip_attention.json"


def _train_run(i, path):
    p = f"train-{i}-"
    return (str(i), ratio(p + "vs-hf-compiled", at("ratios", "ours / HF torch.compile"), json=path),
            span(p + "vs-hf-compiled-range", at("ratio_spread", "ours / HF torch.compile"), json=path),
            ratio(p + "vs-hf-eager", at("ratios", "ours / HF eager"), json=path),
            span(p + "vs-hf-eager-range", at("ratio_spread", "ours / HF eager"), json=path),
            load_average(p + "load-before", "before", path), load_average(p + "load-after", "after", path))


CPU_TABLES = [
    Table("quickstart", "The quickstart and the test suite", (QS, MT), "make quickstart",
          "`make quickstart` from a fresh clone (a new `.venv` from the system's packages, no data or compilation "
          "cache) on a 2-core CPU shared with other work; `make test` (CI's command, in `make_test.json`) on the "
          "2-core development CPU; each timed by hand, as its file says. The time is the CPU's: a quieter or faster "
          "machine takes less.",
          ("what", "figure"), [
              ("`make quickstart`, wall time", Figure("quickstart-minutes", at("wall_s"), "{:.1f} minutes", 1 / 60)),
              ("`make quickstart`, CPU time", sec("quickstart-cpu", at("cpu_s"), 0)),
              ("`make quickstart`, peak RSS", Figure("quickstart-rss", at("peak_rss_gb"), "{:.2f} GB")),
              ("`tiny` trains (1000 steps)", Figure("tiny-train", at("runs", "tiny", "train_minutes"),
                                                      "{:.1f} minutes")),
              ("`tiny` validation accuracy (1000 samples)", pct("tiny-accuracy",
                                                                 at("runs", "tiny", "validation_accuracy"))),
              ("`gptj_tiny` trains (1500 steps)", Figure("gptj-tiny-train", at("runs", "gptj_tiny", "train_minutes"),
                                                           "{:.1f} minutes")),
              ("`gptj_tiny` validation accuracy (1000 samples)", pct("gptj-tiny-accuracy",
                                                                      at("runs", "gptj_tiny", "validation_accuracy"))),
              ("each validation, under", sec("quickstart-validation", at("runs", "tiny", "validation_s_under"), 0)),
              ("`make test`, wall time", Figure("ci-minutes", at("latest", "wall_minutes"), "{:.1f} minutes", json=MT)),
              ("`make test`, tests passed", Figure("ci-tests", at("latest", "tests"), "{} tests", json=MT)),
          ]),
    Table("packing", "Packing: examples per second against HF", ("cpu/compare_mnli.json",),
          "python3 benchmarks/compare.py --only train --lengths mnli --sequence_length 512 --batch 8 --micro_batch 4 "
          "--repeats 2",
          "Flan-T5-small's shape (8 layers, hidden 512, vocab 32128), rows of 512 tokens, MultiNLI-like prompt "
          "lengths, batch 8 rows in micro-batches of 4, float32, random weights, AdamW, one CPU device; medians of 2 "
          "alternated runs. HF pads to the longest prompt of each micro-batch (`DataCollatorForSeq2Seq`'s default).",
          ("run", "examples/s", "non-pad tokens/s", "ours packed / this"), [
              ("ours, packed (`--packing true`)",
               rate("packing-packed", at("training", "ours packed", "examples_per_s"), "examples/s", 2),
               rate("packing-packed-tokens", at("training", "ours packed", "nonpad_tokens_per_s"), "tokens/s", 0), ""),
              ("ours, unpacked (the original's layout)",
               rate("packing-unpacked", at("training", "ours unpacked", "examples_per_s"), "examples/s", 2),
               rate("packing-unpacked-tokens", at("training", "ours unpacked", "nonpad_tokens_per_s"), "tokens/s", 0),
               ratio("packing-x", at("ratios", "ours packed / ours unpacked"))),
              ("HF PyTorch eager",
               rate("packing-hf-eager", at("training", "HF eager", "examples_per_s"), "examples/s", 2),
               rate("packing-hf-eager-tokens", at("training", "HF eager", "nonpad_tokens_per_s"), "tokens/s", 0),
               ratio("packing-vs-hf-eager", at("ratios", "ours packed / HF eager"))),
              ("HF PyTorch + `torch.compile`, fused AdamW",
               rate("packing-hf-compiled", at("training", "HF torch.compile", "examples_per_s"), "examples/s", 2),
               rate("packing-hf-compiled-tokens", at("training", "HF torch.compile", "nonpad_tokens_per_s"),
                    "tokens/s", 0),
               ratio("packing-vs-hf-compiled", at("ratios", "ours packed / HF torch.compile"))),
              ("examples a packed row held, on average",
               Figure("packing-per-row", lambda d: d["runs"]["ours packed"][0]["examples_per_step"] / 8, "{:.1f}"),
               "", ""),
              ("token slots a packed row used",
               pct("packing-efficiency", at("runs", "ours packed", 0, "packing_efficiency"), 0), "", ""),
          ]),
    Table("train-vs-hf", "Training at equal work against HF", (CT,), "python3 benchmarks/compare.py --only train",
          "Flan-T5-small's shape, encoder 128 / decoder 8 tokens, batch 8, float32, random weights, AdamW with "
          "global-norm clipping, one device, prompts of 64..128 tokens: ours one example a row (`--recompute false "
          "--unroll_layers true`), HF padded to the full length, the same rows. Each engine a worker of its own, "
          "measured 5 steps at a time in alternation over 5 rounds (`app/alternate.py`): examples/s and TFLOP/s the "
          "median round's, a ratio the median of the rounds' own ratios, with their range; the machine shared with "
          "other work.",
          ("run", "examples/s", "model TFLOP/s", "ours / this", "rounds' range"), [
              ("ours", rate("train-ours", at("training", "ours", "examples_per_s"), "examples/s", 2),
               Figure("train-ours-tflops", at("training", "ours", "model_tflops_per_s"), "{:.3f} TFLOP/s"), "", ""),
              ("HF PyTorch eager",
               rate("train-hf-eager", at("training", "HF eager", "examples_per_s"), "examples/s", 2),
               Figure("train-hf-eager-tflops", at("training", "HF eager", "model_tflops_per_s"), "{:.3f} TFLOP/s"),
               ratio("train-vs-hf-eager", at("ratios", "ours / HF eager")),
               span("train-vs-hf-eager-range", at("ratio_spread", "ours / HF eager"))),
              ("HF PyTorch + `torch.compile`, fused AdamW",
               rate("train-hf-compiled", at("training", "HF torch.compile", "examples_per_s"), "examples/s", 2),
               Figure("train-hf-compiled-tflops", at("training", "HF torch.compile", "model_tflops_per_s"),
                      "{:.3f} TFLOP/s"),
               ratio("train-vs-hf-compiled", at("ratios", "ours / HF torch.compile")),
               span("train-vs-hf-compiled-range", at("ratio_spread", "ours / HF torch.compile"))),
          ]),
    Table("train-runs", "Training against HF: three invocations in a row", (CT1, CT, CT3),
          "python3 benchmarks/compare.py --only train (three times, one after the other)",
          "The same command three times in a row; the second is the table above. The 1-minute load average before "
          "and after each (2 cores).",
          ("invocation", "ours / HF `torch.compile`", "rounds' range", "ours / HF eager", "rounds' range",
           "load average before", "after"),
          [_train_run(i, path) for i, path in enumerate((CT1, CT, CT3), 1)]),
    Table("train-choices", "The CPU training step's two choices, each undone", (TAB,), None,
          "Alternated `finetuning.py` workers of one tree and of the same tree with one change undone (6 rounds, 5 "
          "steps a repeat, the step of the table above): the step's examples/s with the change over without it, the "
          "median of the rounds' own ratios and their range.",
          ("the change (undone: the step without it)", "kept / undone", "rounds' range"), [
              ("gradient clipping as one scalar factor (undone: the clipped gradients formed by a select)",
               ratio("train-clip-factor", at("base_over", "old_clip", "median")),
               span("train-clip-factor-range", at("base_over", "old_clip"))),
              ("attention's products over [b, h, l, kv] (undone: over [b, l, h, kv])",
               ratio("train-heads-major", at("base_over", "positions_major", "median")),
               span("train-heads-major-range", at("base_over", "positions_major"))),
          ]),
    Table("gptj-train-vs-hf", "GPT-J training against HF", ("cpu/compare_gptj_train.json",),
          "python3 benchmarks/compare.py --config gptj_small --sequence_length 128 --batch 8 --precision float32 "
          "--only train",
          "GPT-J's architecture at GPT-2-small's size (`gptj_small`: 12 layers, hidden 768, vocab 50400), rows of "
          "128, batch 8, float32, one device, one repeat each.",
          ("run", "examples/s", "ours / this"), [
              ("ours", rate("gptj-train-ours", at("training", "ours", "examples_per_s"), "examples/s", 2), ""),
              ("HF `GPTJForCausalLM` eager",
               rate("gptj-train-hf-eager", at("training", "HF eager", "examples_per_s"), "examples/s", 2),
               ratio("gptj-train-vs-hf-eager", at("ratios", "ours / HF eager"))),
              ("HF under `torch.compile`, fused AdamW",
               rate("gptj-train-hf-compiled", at("training", "HF torch.compile", "examples_per_s"), "examples/s", 2),
               ratio("gptj-train-vs-hf-compiled", at("ratios", "ours / HF torch.compile"))),
          ]),
    Table("beams", "Beam search against HF `generate`", ("cpu/greedy.json", "cpu/beams4.json", "cpu/beams4_gptj.json"),
          "python3 benchmarks/compare.py --config small --inference_config small --only decode --batch 8 "
          "--sequence_length 128 --output_length 16 --repeats 3 [--decode_flags \"--num_beams 4\"] (and "
          "--config gptj_small --inference_config gptj_small)",
          "Flan-T5-small's shape (and `gptj_small`), float32, batch 8, prompts of 128 tokens, 16 new tokens, medians "
          "of 3; each row one invocation.",
          ("decoding", "ours", "HF `generate`", "ours / HF"), [
              ("T5, greedy", rate("greedy-ours", at("decode_tokens_per_s", "ours"), "tokens/s"),
               rate("greedy-hf", at("decode_tokens_per_s", "hf"), "tokens/s"),
               ratio("greedy-vs-hf", at("decode_tokens_per_s", "ratio"))),
              ("T5, 4 beams", rate("beams-ours", at("decode_tokens_per_s", "ours"), "tokens/s", json="cpu/beams4.json"),
               rate("beams-hf", at("decode_tokens_per_s", "hf"), "tokens/s", json="cpu/beams4.json"),
               ratio("beams-vs-hf", at("decode_tokens_per_s", "ratio"), json="cpu/beams4.json")),
              ("GPT-J small, 4 beams",
               rate("gptj-beams-ours", at("decode_tokens_per_s", "ours"), "tokens/s", json="cpu/beams4_gptj.json"),
               rate("gptj-beams-hf", at("decode_tokens_per_s", "hf"), "tokens/s", json="cpu/beams4_gptj.json"),
               ratio("gptj-beams-vs-hf", at("decode_tokens_per_s", "ratio"), json="cpu/beams4_gptj.json")),
          ]),
]

B8, B1 = "cpu/decode_b8.json", "cpu/decode_b1.json"
# each precision's engines in compare.py's JSON: ours, CTranslate2's, and their ratios to CTranslate2 and to HF eager
ENGINES = {"float32": ("ours", "CTranslate2 float32", "ours / CTranslate2 float32", "ours / HF eager"),
           "int8": ("ours int8", "CTranslate2 int8", "ours int8 / CTranslate2 int8", "ours int8 / HF eager")}
# a measure, its figure's id part, and how it renders (a time's ratio is theirs over ours: over 1 where ours is faster)
MEASURES = (("generated_tokens_per_s", "", lambda id, get, path: rate(id, get, "tokens/s", 0, json=path)),
            ("first_token_s", "first-", lambda id, get, path: ms(id, get, 0, json=path)),
            ("decode_token_latency_s", "next-", lambda id, get, path: ms(id, get, 1, json=path)))


def _ratio_cells(id, path, pair, measure):
    spread = at("decode_ratios", pair, measure)
    return (ratio(id, lambda d: spread(d)["median"], json=path), span(id + "-range", spread, json=path))


def _ct2_row(batch, precision):
    path = B8 if batch == 8 else B1
    ours, theirs, vs_ct2, vs_hf = ENGINES[precision]
    p = f"b{batch}-" + ("int8-" if precision == "int8" else "")
    cells = [f"{batch}, {precision}"]
    for measure, part, figure in MEASURES:
        cells += [figure(p + part + "ours", at("engines", ours, measure, "median"), path),
                  figure(p + part + "ct2", at("engines", theirs, measure, "median"), path),
                  *_ratio_cells(p + part + "vs-ct2", path, vs_ct2, measure)]
    return tuple(cells) + _ratio_cells(p + "vs-hf", path, vs_hf, "generated_tokens_per_s")


def _int8_over_row(batch):
    path = B8 if batch == 8 else B1
    return (str(batch), *_ratio_cells(f"b{batch}-int8-over-f32", path, "ours int8 / ours", "generated_tokens_per_s"),
            load_average(f"b{batch}-load-before", "before", path), load_average(f"b{batch}-load-after", "after", path),
            pct(f"b{batch}-ct2-same", at("same_tokens_as_hf", "CTranslate2 float32"), 0, json=path),
            pct(f"b{batch}-ct2-int8-same", at("same_tokens_as_hf", "CTranslate2 int8"), 0, json=path))


AB = "archive/cpu/ab_"
AB_ROWS = [  # (label, weights, file, the chosen variant, the other)
    ("int8 products in integers, against the converting product", "8, int8", "integer_dots_b8", "integer",
     "dequantizing"),
    ("", "1, int8", "integer_dots_b1", "integer", "dequantizing"),
    ("the decoder one tree per layer, against the scan", "8, float32", "unrolled_decoder_b8", "unrolled", "scanned"),
    ("", "1, float32", "unrolled_decoder_b1", "unrolled", "scanned"),
    ("attention's products over [b, h, l, kv], against [b, l, h, kv]", "8, float32", "heads_major_b8_none",
     "heads_major", "positions_major"),
    ("", "8, int8", "heads_major_b8_int8", "heads_major", "positions_major"),
]


def _speedup(variant, clock, measure):
    """The chosen variant's speedup over the other in a decode_ab.py JSON (its first form held the wall clock's
    alone, under ``speedup_over_dequantizing``)."""
    def get(d):
        if "speedup_over_baseline" in d:
            return d["speedup_over_baseline"][clock][variant][measure]
        return d["speedup_over_dequantizing"][variant][measure] if clock == "wall" else None
    return get


def _ab_row(label, weights, name, variant, other):
    path, key = AB + name + ".json", "ab-" + name.replace("_", "-")
    cells = [label, weights]
    for clock, measure, part in (("wall", "generate_s", ""), ("wall", "first_token_s", "-first"),
                                 ("wall", "per_token_s", "-next"), ("cpu", "per_token_s", "-next-cpu")):
        if _speedup(variant, clock, measure)(load(path)) is None:
            cells += ["", ""]
            continue
        get = _speedup(variant, clock, measure)
        cells += [ratio(key + part, lambda d, get=get: get(d)["median"], json=path),
                  span(key + part + "-range", get, json=path)]
    return tuple(cells) + (sec(key + "-compile", at("compile_s", variant), 1, json=path),
                           sec(key + "-compile-other", at("compile_s", other), 1, json=path))


DECODING_TABLES = [
    Table("cpu-decoding", "Greedy decoding against CTranslate2 and HF `generate`", (B8, B1),
          "pip install -r benchmarks/requirements.txt; python3 benchmarks/compare.py --only decode --int8 "
          "--output_length 16 [--batch 1] --json benchmarks/results/cpu/decode_b8.json (decode_b1.json)",
          "Flan-T5-small's shape, random weights, one device, 16 new tokens (every step timed), the same token ids "
          "to every engine (prompts of 65 to 119 tokens at batch 8, 119 at batch 1): ours, CTranslate2 4.8.5 (the "
          "same HF model converted by its own converter, 2 threads) in float32 and int8, and HF's eager `generate` "
          "(transformers 5.25, torch 2.13 CPU). Each engine a worker of its own, measured 5 batches at a time in "
          "alternation over 5 rounds (`app/alternate.py`): an engine's figure the median round's, a ratio the median "
          "of the rounds' own ratios with their range, over 1 where ours is faster (for a time: theirs over ours). "
          "First token: the prompts read and the first token chosen.",
          ("batch, weights", "tokens/s, ours", "CTranslate2", "ours / CTranslate2", "rounds' range",
           "first token, ours", "CTranslate2", "CTranslate2 / ours", "rounds' range", "each further token, ours",
           "CTranslate2", "CTranslate2 / ours", "rounds' range", "ours / HF eager, tokens/s", "rounds' range"),
          [_ct2_row(8, "float32"), _ct2_row(8, "int8"), _ct2_row(1, "float32"), _ct2_row(1, "int8")]),
    Table("cpu-decoding-int8", "CPU decoding: int8 weights against float32, and the machine", (B8, B1),
          "python3 benchmarks/compare.py --only decode --int8 --output_length 16 [--batch 1] --json "
          "benchmarks/results/cpu/decode_b8.json (decode_b1.json)",
          "The same invocations: ours with int8 weights over ours in float32 (tokens/s, the median of the rounds' "
          "own ratios and their range); the machine's 1-minute load average before and after each (2 cores, shared "
          "with other work); the share of prompts whose tokens from CTranslate2 were HF's, token for token.",
          ("batch", "int8 / float32, tokens/s", "rounds' range", "load average before", "after",
           "CTranslate2 float32, the same tokens as HF", "CTranslate2 int8"),
          [_int8_over_row(8), _int8_over_row(1)]),
    Table("cpu-decoding-choices", "What a CPU decodes differently, each against its alternative",
          tuple(AB + name + ".json" for _, _, name, _, _ in AB_ROWS),
          "benchmarks/probes/decode_ab.py --choice integer_dots|unrolled_decoder|heads_major_attention "
          "[--quantize int8|none] --batch 8|1 [--rounds 10] --json ... (a probe run by hand with python3; each file "
          "holds its own command)",
          "Flan-T5-small's shape, prompts of 128 tokens, 16 new tokens; the two variants' programs compiled in one "
          "process with the choice's function patched, the same weights, alternated (A B, B A), the best of 3 calls "
          "a round: the chosen variant's speedup over the other, the median of the rounds' and their range, in wall "
          "time and, for each further token, in the process's CPU time (the first file measured the wall clock "
          "alone). The machine was shared with other work (each file holds its load average).",
          ("choice", "batch, weights", "whole decoding", "rounds' range", "first token", "rounds' range",
           "each further token", "rounds' range", "each further token, CPU time", "rounds' range",
           "compile time, chosen", "the other"),
          [_ab_row(*row) for row in AB_ROWS]),
]

I8 = "cpu/int8_accuracy.json"


def _int8_row(label, run, metric, key):
    return (label, *(pct(f"int8-{key}-{p.replace(' + ', '-').replace(' ', '-')}",
                         at("runs", run, "scores", p, metric)) for p in
                     ("float32", "float32 + int8", "bfloat16", "bfloat16 + int8")))


DECODING_TABLES.append(
    Table("int8-accuracy", "int8 weights: validation scores", (I8,),
          "python3 benchmarks/int8_accuracy.py --json benchmarks/results/cpu/int8_accuracy.json",
          "The tiny presets trained offline on the CPU, each validated on 500 examples in float32 and bfloat16, each "
          "with and without int8 weights.",
          ("run", "float32", "float32 + int8", "bfloat16", "bfloat16 + int8"), [
              _int8_row("`tiny` (T5), synthetic NLI, accuracy", "tiny (T5)", "accuracy", "tiny"),
              _int8_row("`tiny` + LoRA rank 16 on every layer weight (merged, then int8), accuracy",
                        "tiny + LoRA (T5, merged then quantized)", "accuracy", "lora"),
              _int8_row("`gptj_tiny_headlines` (GPT-J), headlines, exact match", "gptj_tiny_headlines (GPT-J)",
                        "exact_match", "headlines"),
          ]))

ST, SR = "cpu/startup.json", "cpu/serve_readme.json"


def _startup_row(label, model):
    m = ("models", model)
    return (label, sec(f"startup-{model}-cold", at(*m, "cold_s"), 1), sec(f"startup-{model}-warm", at(*m, "warm_s"), 1),
            sec(f"startup-{model}-compile-cold", at(*m, "cold_compile_s"), 1),
            sec(f"startup-{model}-compile-warm", at(*m, "warm_compile_s"), 1))


def _serve_row(label, key, model):
    m = ("models", model)
    return (label, ratio(f"serve-{key}", at(*m, "ratios", "server_8step / static tokens_per_s")),
            ratio(f"serve-{key}-rounds", at(*m, "ratios", "server_8step / static, median of rounds")),
            rate(f"serve-{key}-server", at(*m, "server_8step", "tokens_per_s"), "tokens/s", 0),
            rate(f"serve-{key}-static", at(*m, "static", "tokens_per_s"), "tokens/s", 0),
            sec(f"serve-{key}-ttft", at(*m, "server_8step", "ttft_s", "p50")),
            sec(f"serve-{key}-ttft-static", at(*m, "static", "ttft_s", "p50")))


D256 = "--hidden_size 256 --d_ff 1024 --d_kv 64 --tensor_parallel 1 --data_parallel 1"
CO, SA, SU8 = "cpu/constrained.json", "cpu/serve_adapters.json", "cpu/startup_adapters.json"
CS, CA, S8 = ("serve",), ("serve", "answers"), ("models", "t5_d256_4")
CO_GRAMMARS = [f"json_schema {i}" for i in range(10)] + ["choice 10", "regex 11"]


def _labels_row(title: str, way: str) -> tuple:
    """A row of constrained.json's labels table: the validation ``way``'s accuracy, its ratio to greedy's, its
    seconds (anchors ``co-labels-<way>``...)."""
    return (title, pct(f"co-labels-{way}", at("labels", way, "accuracy")),
            ratio(f"co-labels-{way}-ratio", at("labels", "ratios", f"{way} / greedy accuracy")),
            sec(f"co-labels-{way}-s", at("labels", way, "seconds"), 1))


def _co_id(grammar: str) -> str:
    """'json_schema 3' -> 'json-schema-3' (an anchor)."""
    return grammar.replace("_", "-").replace(" ", "-")


def _adapters_row(label, key, model):
    m, get = ("models", model), lambda d: d["models"][model]["adapters"]["over_merged_per_round"]
    return (label, rate(f"serve-adapters-{key}", at(*m, "adapters", "tokens_per_s"), "tokens/s", 0),
            rate(f"serve-adapters-{key}-merged", at(*m, "merged", "tokens_per_s"), "tokens/s", 0),
            ratio(f"serve-adapters-{key}-over", at(*m, "ratios", "adapters / merged tokens_per_s")),
            ratio(f"serve-adapters-{key}-rounds", at(*m, "ratios", "adapters / merged, median of rounds")),
            span(f"serve-adapters-{key}-range", lambda d: {"min": min(get(d)), "max": max(get(d))}))
ONE = "--tensor_parallel 1 --data_parallel 1"
HC, BF = "cpu/host_cost.json", "cpu/serve_tiny_bf16.json"
SERVING_TABLES = [
    Table("startup", "The server's start-up", (ST,), None,
          "Seconds from `run_server.py` starting to its first `/health` 200 (`--slots 8 --output_length 64`, one "
          "device), medians of 2 starts; cold: an empty compilation cache, warm: the cache the cold start filled. "
          "Each model compiles 4 programs.",
          ("model", "cold", "warm", "programs compiled, cold", "warm"), [
              _startup_row("T5, width 256, 4 layers a stack", "t5_d256_4"),
              _startup_row("T5, width 256, 16 layers a stack", "t5_d256_16"),
              _startup_row("T5 of base's shape (12 + 12 layers, width 768)", "t5_base"),
              ("16 layers a stack against 4, cold", ratio("startup-depth", at("deep_over_shallow_cold")), "", "", ""),
          ]),
    Table("serving", "The server against static batching", (SR,), None,
          "The same 96 requests (Poisson arrivals, prompts of 8 to 48 words, outputs of 16 to 256 tokens, greedy, "
          "streamed) to the server (8 slots, 8 steps a call) and to static batching (`run_inference.py`'s batches of "
          "8 rows), one device, their rounds taking turns; both gave the same tokens for every request. Medians of "
          "5 rounds: the median rounds' tokens/s, and the median of the rounds' own ratios. Two identical servers in "
          "the same rounds differ by up to a fifth on this machine.",
          ("model, one device", "server / static, tokens/s", "median of rounds", "server", "static",
           "time to the first token p50, server", "static"), [
              _serve_row("T5, width 256", "t5-256", f"tiny {D256}"),
              _serve_row("GPT-J, width 256", "gptj-256", f"gptj_tiny {D256}"),
              _serve_row("T5, width 64 (`tiny`)", "t5-64", f"tiny {ONE}"),
              _serve_row("GPT-J, width 64 (`gptj_tiny`)", "gptj-64", f"gptj_tiny {ONE}"),
          ]),
    Table("host-cost", "The server's host ceiling", (HC,), None,
          "The server's engine (scheduler and output threads) over the tests' instant fake device: 32 slots, 512 "
          "requests at once, streamed and whole.",
          ("completions", "tokens/s", "scheduler thread, CPU a token", "output thread, CPU a token"), [
              ("streamed", rate("host-streamed", at("streamed", "tokens_per_s"), "tokens/s", 0),
               Figure("host-scheduler-us", at("streamed", "cpu_us_per_token", "scheduler"), "{:.1f} µs"),
               Figure("host-output-us", at("streamed", "cpu_us_per_token", "output"), "{:.1f} µs")),
              ("whole", rate("host-whole", at("whole", "tokens_per_s"), "tokens/s", 0),
               Figure("host-whole-scheduler-us", at("whole", "cpu_us_per_token", "scheduler"), "{:.1f} µs"),
               Figure("host-whole-output-us", at("whole", "cpu_us_per_token", "output"), "{:.1f} µs")),
          ]),
    Table("bf16-agreement", "bfloat16: the same tokens from the server and static batching", (BF,), None,
          "The tiny T5 in bfloat16, 32 requests: programs of other shapes add in other orders.",
          ("what", "figure"), [
              ("requests with the same tokens from both",
               Figure("bf16-same", at("models", "tiny --precision bfloat16", "static", "same_tokens_as_server"),
                      "{:.0f} of 32", 32.0)),
          ]),
    Table("constrained", "Structured outputs: what a JSON schema costs the server", (CO,), None,
          "`benchmarks/constrained.py`'s serve part: the server's engine in one process (no HTTP) over a random T5 of "
          "width 256 with a vocabulary of 512 learnt here, one device, 16 slots; 64 greedy requests of 16 to 64 new "
          "tokens, all submitted at once, all free, then with every second one held to a JSON schema (each "
          "constrained row asks the host for its allowed tokens at every step), the two taking turns 3 times on "
          "the same compiled programs. A request's tokens/s: its tokens after the first over the time from its "
          "first to its last; each kind's median in a run, then the median over the 3 runs. Compile times: the "
          "tokenizer's pieces read once, then 10 schemas' first compiles (median and most) and the same from the "
          "cache.",
          ("what", "figure", "goal"), [
              ("free requests' tokens/s, all free", rate("co-all-free", at(*CS, "free_tokens_per_s_all_free"),
                                                         "tokens/s"), ""),
              ("free requests' tokens/s, beside half constrained",
               rate("co-free-beside", at(*CS, "free_tokens_per_s_half_constrained"), "tokens/s"), ""),
              ("constrained requests' tokens/s", rate("co-constrained", at(*CS, "constrained_tokens_per_s"),
                                                      "tokens/s"), ""),
              ("free beside constrained / all free",
               ratio("co-free-ratio", at(*CS, "ratios", "free beside constrained / all free")), "0.9x at least"),
              ("constrained / free, beside each other",
               ratio("co-constrained-ratio", at(*CS, "ratios", "constrained / free (same run)")), "0.5x at least"),
              ("the tokenizer's pieces, read once", Figure("co-pieces", at(*CS, "compile", "tokenizer_pieces_ms"),
                                                           "{:.1f} ms"), ""),
              ("a schema's first compile, median", Figure("co-compile", at(*CS, "compile", "first_compile_ms",
                                                                           "median"), "{:.1f} ms"),
               "under 50 ms"),
              ("a schema's first compile, most", Figure("co-compile-most", at(*CS, "compile", "first_compile_ms",
                                                                              "most"), "{:.1f} ms"), ""),
              ("a schema from the cache, median", Figure("co-cached", at(*CS, "compile", "cached_ms", "median"),
                                                         "{:.2f} ms"), ""),
          ]),
    Table("constrained-answers", "Structured outputs: sampled answers checked", (CO,), None,
          "The same invocation, a server of its own over the same model: 20 sampled answers (at most 256 new "
          "tokens) to each of 10 JSON schemas (nested objects, arrays, enums, numbers, required fields), a choice "
          "and a regular expression; each answer its grammar ended checked (`jsonschema`, the set, the expression), "
          "those the token limit cut counted apart (a random model's answers run long). The goal: every answer "
          "valid.",
          ("grammar", "answers", "ended by the grammar", "of these, valid"),
          [(name, Figure(f"co-{_co_id(name)}-answers", at(*CA, "per_grammar", name, "answers"), "{}"),
            Figure(f"co-{_co_id(name)}-ended", at(*CA, "per_grammar", name, "ended"), "{}"),
            Figure(f"co-{_co_id(name)}-valid", at(*CA, "per_grammar", name, "valid_of_ended"), "{}"))
           for name in CO_GRAMMARS] +
          [("all", Figure("co-answers", lambda d: sum(g["answers"] for g in d["serve"]["answers"]["per_grammar"]
                                                      .values()), "{}"),
            Figure("co-ended", at(*CA, "ended"), "{}"), Figure("co-valid", at(*CA, "valid"), "{}")),
           ("valid of those ended", "", "", pct("co-valid-share", at(*CA, "valid_share_of_ended"), 0))]),
    Table("constrained-labels", "A label task held to its labels, and ranked", (CO,), None,
          "The same invocation's labels part: the tiny preset trained 300 steps on the synthetic NLI task (three "
          "labels), then validated on 300 held-out rows three ways: greedy, `--constrain labels` (answers "
          "restricted to the labels), `--score labels` (each example's labels ranked by their log-likelihood). "
          "The goal: each at least greedy's accuracy.",
          ("validation", "accuracy", "over greedy's", "seconds"), [
              ("greedy", pct("co-labels-greedy", at("labels", "greedy", "accuracy")), "",
               sec("co-labels-greedy-s", at("labels", "greedy", "seconds"), 1)),
              _labels_row("`--constrain labels`", "constrained"),
              _labels_row("`--score labels`", "ranked"),
          ]),
    Table("serve-adapters", "LoRA adapters side by side against one merged model", (SA,), None,
          "`benchmarks/serve.py --loras 4`: the same 96 requests (Poisson arrivals, prompts of 8 to 48 words, "
          "outputs of 16 to 256 tokens, greedy, streamed) to a server of 4 LoRA adapters of rank 8 served unmerged "
          "over one base, the requests naming them in turn, and to a server of the first of them merged into the "
          "base; width 256, one device, 8 slots, 8 steps a call, the two taking turns over 3 rounds: the median "
          "rounds' tokens/s, their ratio, and the median and range of the rounds' own ratios. The goal: 0.8x at "
          "least.",
          ("model, one device", "adapters", "merged", "adapters / merged", "median of rounds", "rounds' range"), [
              _adapters_row("T5, width 256", "tiny", f"tiny {D256}"),
              _adapters_row("GPT-J, width 256", "gptj-tiny", f"gptj_tiny {D256}"),
          ]),
    Table("startup-adapters", "The server's start-up with 8 adapters", (SU8,), None,
          "`benchmarks/startup.py --loras 8`: seconds from `run_server.py` starting to its first `/health` 200 "
          "(`--slots 8 --output_length 64`, one device), a T5 of width 256 with 4 layers a stack alone and with 8 "
          "LoRA adapters of rank 8 loaded at start-up, medians of 2 starts each; cold: an empty compilation cache, "
          "warm: the cache the cold start filled. The goal: at most 1.3x the base alone's.",
          ("start", "the base alone", "with 8 adapters", "with / alone"), [
              ("cold", sec("startup-adapters-alone-cold", at(*S8, "cold_s"), 1),
               sec("startup-adapters-cold", at(*S8, "adapters", "cold_s"), 1),
               ratio("startup-adapters-cold-over", at(*S8, "adapters", "cold_over_alone"))),
              ("warm", sec("startup-adapters-alone-warm", at(*S8, "warm_s"), 1),
               sec("startup-adapters-warm", at(*S8, "adapters", "warm_s"), 1),
               ratio("startup-adapters-warm-over", at(*S8, "adapters", "warm_over_alone"))),
          ]),
]

PR, PM, UB, LO = "cpu/precision.json", "cpu/phased_memory.json", "cpu/update_in_backward.json", "cpu/lora.json"
PREC = ("float32", "bfloat16", "bfloat16 + stochastic rounding", "float16 + dynamic loss scaling")
PREC_IDS = ("float32", "bfloat16", "sr", "float16")


def _depth_row(i):
    r = ("rows", i)
    return (Figure(f"depth-{i}-layers", at(*r, "layers"), "{}"),
            Figure(f"depth-{i}-parameters", at(*r, "parameters"), "{:.0f}M", 1e-6),
            Figure(f"depth-{i}-fused", at(*r, "fused_device_bytes"), "{:.0f} MiB", 2 ** -20),
            Figure(f"depth-{i}-phased", at(*r, "phased_device_bytes"), "{:.0f} MiB", 2 ** -20),
            Figure(f"depth-{i}-over", lambda d, i=i: d["rows"][i]["phased_device_bytes"] / d["rows"][i][
                "fused_device_bytes"], "{:.2f}"),
            sec(f"depth-{i}-fused-step", at(*r, "fused_step_s")),
            sec(f"depth-{i}-phased-step", at(*r, "phased_step_s")))


def _checkpoint_row(preset):
    c = ("checkpoints", preset)
    return (f"`{preset}`", Figure(f"lora-{preset}-weights", at(*c, "trained_weights"), "{:.1f}M", 1e-6),
            Figure(f"lora-{preset}-bytes", at(*c, "lora_checkpoint_bytes"), "{:.0f} MB", 1e-6),
            Figure(f"lora-{preset}-full", at(*c, "full_checkpoint_bytes"), "{:.1f} GB", 1e-9))


TRAINING_TABLES = [
    Table("precisions", "The four precisions on the tiny preset", (PR,),
          "python3 benchmarks/precision.py --json benchmarks/results/cpu/precision.json",
          "The tiny preset, 300 steps each, the same seed and data; training time against the float32 run of the "
          "same invocation (a CPU has no half-precision units: the times say the extra work is small, not what a GPU "
          "gains).",
          ("precision", "validation accuracy", "training time / float32's"),
          [(name, pct(f"precision-{key}", at("runs", name, "accuracy")),
            ratio(f"precision-{key}-time", at("runs", name, "time_vs_float32")) if key != "float32" else "")
           for name, key in zip(PREC, PREC_IDS)] +
          [("float16: steps skipped", Figure("precision-float16-skipped",
                                             at("runs", PREC[3], "skipped_steps"), "{} steps"), "")]),
    Table("phased-depth", "Phased execution: device memory against depth", (PM,),
          "python3 benchmarks/phased_memory.py --json benchmarks/results/cpu/phased_memory.json",
          "Flan-T5-small's shape with 8, 16 and 32 layers a stack, rows of 128 tokens packed with MNLI-like examples, "
          "batch 8 in two micro-batches, float32, AdamW, one CPU device. Device bytes: the live device arrays plus "
          "the compiled programs' temporaries and outputs (XLA's memory analysis), at the start of every phase.",
          ("layers a stack", "parameters", "fused", "phased", "phased / fused", "step, fused", "step, phased"),
          [_depth_row(i) for i in range(3)]),
    Table("update-in-backward", "`--update_in_backward` on the CPU", (UB,), None,
          "`small`, phased, bfloat16 weights with stochastic rounding, Adafactor, 6 steps, with the flag against "
          "without it in one invocation (a CPU has no host link: this says the update costs no extra compute, not "
          "what the saved transfers are worth on a GPU).",
          ("what", "with / without"), [
              ("step time", ratio("uib-step", at("in_backward_over_stored_step_s"))),
              ("the plan's host peak", ratio("uib-host", at("in_backward_over_stored_plan_host_bytes"))),
          ]),
    Table("lora-cpu", "LoRA against full fine-tuning", (LO,), None,
          "Flan-T5-small's shape, rank 16, 6 steps, medians of 3, each executor's LoRA run against its full "
          "fine-tuning in the same invocation; and what a checkpoint of each LoRA preset holds (adapters and AdamW "
          "state) against a full one (weights and AdamW state).",
          ("executor", "step time, LoRA / full", "device bytes, LoRA / full"), [
              ("fused", ratio("lora-fused-step", at("lora_over_full", "fused", "median_step_s")),
               ratio("lora-fused-device", at("lora_over_full", "fused", "device_bytes_estimate"))),
              ("phased", ratio("lora-phased-step", at("lora_over_full", "phased", "median_step_s")),
               ratio("lora-phased-device", at("lora_over_full", "phased", "device_bytes_estimate"))),
          ]),
    Table("lora-checkpoints", "What a LoRA preset's checkpoint holds", (LO,), None,
          "The same file's count of each LoRA preset's trained weights and checkpoint bytes (adapters and AdamW "
          "state) against a full fine-tuning's (weights and AdamW state).",
          ("preset", "trained weights", "checkpoint", "a full one"),
          [_checkpoint_row(p) for p in ("gptj_lora_1gpu", "xxl_lora_1gpu", "ul2_lora_1gpu")]),
]

LD, LDL = "cpu/large_data.json", "cpu/large_data_loaded.json"


def _rows_row(i):
    r = ("runs", i)
    return (Figure(f"data-{i}-rows", at(*r, "rows"), "{:,}"),
            gib(f"data-{i}-file", at(*r, "file_bytes"), 2),
            Figure(f"data-{i}-read", at(*r, "read_rows_per_s"), "{:.0f}k rows/s", 1e-3),
            Figure(f"data-{i}-tokenize", at(*r, "tokenize_rows_per_s"), "{:.0f}k rows/s", 1e-3),
            gib(f"data-{i}-rss", at(*r, "first", "peak_rss_bytes"), 2),
            sec(f"data-{i}-second-step", at(*r, "second", "seconds_to_first_step"), 1),
            gib(f"data-{i}-second-rss", at(*r, "second", "peak_rss_bytes"), 2),
            gib(f"data-{i}-reader", at(*r, "first", "helper_peak_rss_bytes"), 1),
            gib(f"data-{i}-reader-anon", at(*r, "first", "helper_peak_anon_rss_bytes"), 2),
            gib(f"data-{i}-cache", at(*r, "cache_bytes"), 1))


DATA_TABLES = [
    Table("large-data", "Data of 1 and 10 million rows", (LD, LDL),
          "python3 benchmarks/large_data.py --rows 1000000 10000000 --json benchmarks/results/cpu/large_data.json",
          "A generated own task of JSONL rows (the synthetic NLI rows under an own template, the word-level "
          "tokenizer), 20 steps of the `tiny` shape, each row count run twice: fresh data and compilation caches, "
          "then the ones the first run built. `large_data.json` on the machine otherwise quiet, "
          "`large_data_loaded.json` on the machine shared with two other test suites (load average 7 to 9).",
          ("rows", "file", "first run: reading", "tokenizing", "training process's peak RSS",
           "second run: first step after", "its peak RSS", "reading process's peak RSS", "its own (not mapped) pages",
           "cache on disk"),
          [_rows_row(0), _rows_row(1)]),
    Table("large-data-figures", "Data of 10 million rows: what grows", (LD, LDL),
          "python3 benchmarks/large_data.py --rows 1000000 10000000 --json benchmarks/results/cpu/large_data.json",
          "From the same runs.",
          ("what", "figure"), [
              ("peak RSS of the first runs, 10 million rows against 1 million",
               pct("data-spread-first", at("peak_rss_spread_first"))),
              ("the same, second runs", pct("data-spread-second", at("peak_rss_spread_second"))),
              ("the whole first run of 10 million rows", sec("data-first-run", at("runs", 1, "first", "seconds"), 0)),
              ("tokenizing on the loaded machine, 10 million rows",
               Figure("data-loaded-tokenize", at("runs", 1, "tokenize_rows_per_s"), "{:.0f}k rows/s", 1e-3, LDL)),
              ("a second run's first step on the loaded machine",
               sec("data-loaded-second-step", at("runs", 1, "second", "seconds_to_first_step"), 1, LDL)),
          ]),
]

# ------------------------------------------------------------------------------------------------- memory plans

PLANS = "cpu/plans.json"


def plan_id(name: str) -> str:
    """'xxl_1gpu --update_in_backward false' -> 'xxl_1gpu-update_in_backward-false' (an anchor)."""
    return name.replace("--", "").replace(" ", "-").replace("_", "-")


def _plan_row(name):
    p, pid = ("plans", name), plan_id(name)

    def link(key):
        return lambda d: d["plans"][name]["link"][key]
    has_link = name.split()[0] not in ("gptj_lora_1gpu",)
    return (f"`{name}`", Figure(f"plan-{pid}-device", at(*p, "device", "peak"), "{}"),
            Figure(f"plan-{pid}-host", at(*p, "host", "peak"), "{}"),
            Figure(f"plan-{pid}-loads", link("loads_gb"), "{} GB") if has_link else "",
            Figure(f"plan-{pid}-stores", link("stores_gb"), "{} GB") if has_link else "",
            Figure(f"plan-{pid}-link", link("seconds"), "{} s") if has_link else "")


def _plan_item(id, name, side, item):
    return Figure(id, at("plans", name, side, "items", item), "{}")


def _decode_plan_row(label, name):
    p, pid = ("plans", name), plan_id(name.replace("run_validation.py", "decode").replace("run_server.py", "serve"))
    return (label, Figure(f"plan-{pid}-device", at(*p, "device", "peak"), "{}"),
            _plan_item(f"plan-{pid}-weights", name, "device", "weights"),
            _plan_item(f"plan-{pid}-cache", name, "device", "KV cache"),
            Figure(f"plan-{pid}-host", at(*p, "host", "peak"), "{}"),
            _plan_item(f"plan-{pid}-base", name, "host", "LoRA base (while merging)"))


DECODE_PLAN_ROWS = [
    ("`xxl_lora_1gpu`, bfloat16", "run_validation.py xxl_lora_1gpu"),
    ("`xxl_lora_1gpu`, `--quantize int8`", "run_validation.py xxl_lora_1gpu --quantize int8"),
    ("`ul2_lora_1gpu`, `--quantize int8`", "run_validation.py ul2_lora_1gpu --quantize int8"),
    ("`ul2_lora_1gpu`, `--quantize int8 --stream_encoder`",
     "run_validation.py ul2_lora_1gpu --quantize int8 --stream_encoder"),
    ("`ul2_lora_1gpu` served, `--quantize int8`, 8 slots", "run_server.py ul2_lora_1gpu --quantize int8"),
]
PLAN_NAMES = ["xxl_1gpu", "xxl_1gpu --update_in_backward false", "xxl_1gpu --compute_copy false",
              "xxl_1gpu --compute_copy false --update_in_backward false", "xxl_1gpu --stochastic_rounding true",
              "xxl_1gpu --stochastic_rounding true --update_in_backward false", "xxl_1gpu --optimizer adamw",
              "ul2_1gpu", "ul2_1gpu --update_in_backward false", "ul2_1gpu --stochastic_rounding false",
              "ul2_1gpu --stochastic_rounding false --update_in_backward false", "gptj_1gpu",
              "gptj_1gpu --compute_copy false", "xxl_lora_1gpu", "ul2_lora_1gpu", "gptj_lora_1gpu"]
ADAPTER_PLANS = "cpu/plans_adapters.json"
ADAPTER_PLAN_ROWS = [
    ("the base alone", "run_server.py xxl_lora_1gpu", "alone"),
    ("8 adapters of rank 16 of q, v, cq, cv (the default)", "run_server.py xxl_lora_1gpu --max_loras 8 "
     "--max_lora_rank 16", "default"),
    ("8 adapters of rank 16 of every weight", "run_server.py xxl_lora_1gpu --max_loras 8 --max_lora_rank 16 "
     "--lora_target_modules q k v o cq ck cv co wi_0 wi_1 wo", "every"),
]


def _adapter_plan_row(label, name, key):
    p = ("plans", name)
    stack = Figure(f"plan-adapters-{key}-stack", at(*p, "device", "items", "LoRA adapter stack"), "{}") \
        if key != "alone" else ""
    over = ratio(f"plan-adapters-{key}-over-alone", at(*p, "device_peak_over_the_base_alone"), 3) \
        if key != "alone" else ""
    return (label, Figure(f"plan-adapters-{key}-device", at(*p, "device", "peak"), "{}"), stack, over)


PLAN_TABLES = [
    Table("plans", "Memory plans of the one-GPU presets", (PLANS,), None,
          "`run_finetuning.py --config PRESET [FLAGS] --plan` on the CPU: shapes alone, the program temporaries "
          "XLA:CPU's count (a GPU's can differ: below, \"On one H100\"), 16 rows a step; the host link at 52 GB/s each "
          "way (what PCIe Gen5 pinned copies measured on the lent H100 box). The layouts beside the presets' own: "
          "gradients stored in host memory instead of each layer updated in its backward (`--update_in_backward "
          "false`), no bfloat16 compute copies (`--compute_copy false`), bfloat16 weights with stochastic rounding, "
          "AdamW. A plan is the code's, not a machine's: the same command writes the same figures anywhere.",
          ("preset and flags", "device peak", "host peak", "loads a step", "stores a step", "on the link"),
          [_plan_row(n) for n in PLAN_NAMES]),
    Table("plan-items", "What the plans hold", (PLANS,), None,
          "Items of the plans above, as `--plan` prints them.",
          ("what", "figure"), [
              ("`xxl_1gpu`, host: master weights", _plan_item("plan-xxl-masters", "xxl_1gpu", "host",
                                                               "master weights")),
              ("`xxl_1gpu`, host: compute copy", _plan_item("plan-xxl-copy", "xxl_1gpu", "host", "compute copy")),
              ("`xxl_1gpu --stochastic_rounding true`, host: master weights (bfloat16)",
               _plan_item("plan-xxl-sr-masters", "xxl_1gpu --stochastic_rounding true", "host", "master weights")),
              ("`xxl_1gpu --optimizer adamw`, host: optimizer state",
               _plan_item("plan-xxl-adamw-state", "xxl_1gpu --optimizer adamw", "host", "optimizer state")),
              ("`xxl_1gpu`, host: optimizer state (Adafactor)",
               _plan_item("plan-xxl-state", "xxl_1gpu", "host", "optimizer state")),
              ("`ul2_1gpu`, host: master weights (bfloat16)",
               _plan_item("plan-ul2-masters", "ul2_1gpu", "host", "master weights")),
              ("`ul2_1gpu --stochastic_rounding false`, host: master weights",
               _plan_item("plan-ul2-f32-masters", "ul2_1gpu --stochastic_rounding false", "host", "master weights")),
              ("`gptj_lora_1gpu`, device: frozen base weights",
               _plan_item("plan-gptj-lora-base", "gptj_lora_1gpu", "device", "frozen base weights")),
              ("`gptj_lora_1gpu`, device: step temporaries (XLA:CPU's: a float32 copy of each frozen weight)",
               _plan_item("plan-gptj-lora-temps", "gptj_lora_1gpu", "device",
                          "step temporaries (gradients, activations)")),
              ("`xxl_lora_1gpu`, host: frozen base",
               _plan_item("plan-xxl-lora-base", "xxl_lora_1gpu", "host", "frozen base weights")),
              ("`ul2_lora_1gpu`, host: frozen base",
               _plan_item("plan-ul2-lora-base", "ul2_lora_1gpu", "host", "frozen base weights")),
          ]),
    Table("decode-plans", "Decoding's memory plans of the 24 GB LoRA presets", (PLANS,), None,
          "`run_validation.py --load CKPT --plan` of a LoRA checkpoint of each preset (the plan reads the checkpoint's "
          "metadata alone: its config and its base's source), bfloat16 on one device, 32 rows of 512-token prompts "
          "and 128 new tokens; and `run_server.py --load CKPT --plan` with 8 slots of 512-token prompts. The "
          "activations are estimated from shapes (`--plan_exact` counts XLA's temporaries on the machine that runs "
          "them).",
          ("decoding", "device peak", "weights", "KV cache", "host peak", "of it, the LoRA base while merging"),
          [_decode_plan_row(label, name) for label, name in DECODE_PLAN_ROWS]),
    Table("adapter-plans", "The server's memory plan with LoRA adapters side by side", (ADAPTER_PLANS,), None,
          "`run_server.py --load CKPT --plan` of a full checkpoint of xxl's shape, bfloat16 on one device, 8 slots of "
          "512-token prompts and 128 new tokens: alone, and with a stack of 8 LoRA adapters of rank 16 on the device "
          "beside the weights (`--max_loras 8 --max_lora_rank 16`; docs/serving.md, \"Many adapters, one base\").",
          ("served", "device peak", "the adapter stack", "over the base alone"),
          [_adapter_plan_row(*row) for row in ADAPTER_PLAN_ROWS]),
]

# ---------------------------------------------------------------------------------------------- one NVIDIA H100

H = "h100/"


def _h100_train_row(label, path, mb16=False):
    p = H + path
    key = path.split("_")[0] + ("-mb16" if mb16 else "")
    if mb16:
        return (label, rate(f"h100-{key}", at("samples_per_s"), "samples/s", json=p), "", "",
                Figure(f"h100-{key}-tflops", at("model_tflops_per_s"), "{:.0f} TFLOP/s", json=p),
                pct(f"h100-{key}-mfu", at("mfu"), json=p), "",
                gib(f"h100-{key}-peak", at("peak_device_bytes"), json=p), "")
    return (label, rate(f"h100-{key}", at("train_samples_per_s", "ours"), "samples/s", json=p),
            rate(f"h100-{key}-hf", at("train_samples_per_s", "hf"), "samples/s", json=p),
            ratio(f"h100-{key}-vs-hf", at("train_samples_per_s", "ratio"), json=p),
            Figure(f"h100-{key}-tflops", at("train_model_tflops_per_s_ours"), "{:.0f} TFLOP/s", json=p),
            pct(f"h100-{key}-mfu", at("train_mfu_ours"), json=p),
            pct(f"h100-{key}-hf-mfu", at("train_mfu_hf"), json=p),
            gib(f"h100-{key}-peak", at("runs", "ours_t", 0, "peak_device_bytes"), json=p),
            gib(f"h100-{key}-hf-peak", at("runs", "theirs_t", 0, "peak_device_bytes"), json=p))


def _h100_decode_row(label, path):
    p, key = H + path, path.split("_")[0]
    return (label, rate(f"h100-{key}-decode", at("decode_tokens_per_s", "ours"), "tokens/s", 0, json=p),
            rate(f"h100-{key}-decode-hf", at("decode_tokens_per_s", "hf"), "tokens/s", 0, json=p),
            ratio(f"h100-{key}-decode-vs-hf", at("decode_tokens_per_s", "ratio"), json=p),
            ms(f"h100-{key}-first", at("first_token_s", "ours"), json=p),
            ms(f"h100-{key}-first-hf", at("first_token_s", "hf"), json=p),
            ms(f"h100-{key}-next", at("decode_token_latency_s", "ours"), 2, json=p),
            ms(f"h100-{key}-next-hf", at("decode_token_latency_s", "hf"), json=p))


F15 = H + "fifteen/"
XXL = F15 + "2_xxl_pool110_workstation/f15_xxl_1gpu.json"
R16 = ("figures", "rows16")
WS = F15 + "4_workstation_serve/f15_workstation.json"
WSX = ("figures", "xxl_lora_1gpu")
P1 = F15 + "1_plan/"
SU = H + "suite/"
SX = ("figures", "rows16")
SL = ("figures", "lora16")
H100_TABLES = [
    Table("h100-training", "Training against HF on one H100", (H + "base_train.json", H + "xl_train.json",
                                                                H + "xl_train_ours_mb16.json"),
          "C=\"--precision bfloat16 --sequence_length 512 --decoder_sequence_length 8 --only train\"; "
          "python3 benchmarks/compare.py --config base $C --batch 128 --micro_batch 32; "
          "python3 benchmarks/compare.py --config xl_pod8 $C --batch 64 --micro_batch 8; "
          "python3 finetuning.py --config xl_pod8 --precision bfloat16 --sequence_length 512 "
          "--decoder_sequence_length 8 --data_parallel 1 --tensor_parallel 1 --recompute false --unroll_layers true "
          "--global_batch_size 64 --micro_batch_size 16 --steps 6 (with XLA_PYTHON_CLIENT_MEM_FRACTION=0.95)",
          "One H100 80GB HBM3 (SXM): jax 0.11.2 (CUDA 13), torch 2.11.0+cu130, transformers 5.17; random weights, "
          "generated data, AdamW, one device, every example padded to 512 tokens (`--lengths uniform`). Ours keeps "
          "float32 master weights and AdamW state and runs bf16 matmuls; HF runs the model, its gradients and AdamW "
          "state in bf16 (`model.to(bfloat16)`, eager), one after the other in the same `compare.py` call. MFU: "
          "model FLOPs over the 989 TFLOP/s dense bf16 datasheet peak.",
          ("training, global batch (micro)", "ours", "HF PyTorch", "ours / HF", "ours, model TFLOP/s", "MFU",
           "HF MFU", "peak memory, ours", "HF"), [
              _h100_train_row("base (248M), 128 (32)", "base_train.json"),
              _h100_train_row("xl (2.85B), 64 (8)", "xl_train.json"),
              _h100_train_row("xl, ours alone, 64 (16)", "xl_train_ours_mb16.json", mb16=True),
          ]),
    Table("h100-decoding", "Greedy decoding against HF on one H100", (H + "base_decode.json", H + "xl_decode.json"),
          "C=\"--precision bfloat16 --sequence_length 512 --only decode --output_length 32\"; "
          "python3 benchmarks/compare.py --config base $C --batch 128; "
          "python3 benchmarks/compare.py --config xl_pod8 --inference_config xl $C --batch 64",
          "The same machine; 32 new tokens, batch 128 (base) and 64 (xl).",
          ("model", "ours", "HF", "ours / HF", "first token, ours", "HF", "each further token, ours", "HF"), [
              _h100_decode_row("base", "base_decode.json"), _h100_decode_row("xl", "xl_decode.json")]),
    Table("h100-xl-phased", "xl phased on one H100", (H + "xl_phased_ours.json",),
          "python3 finetuning.py --config xl_pod8 --phased true --precision bfloat16 --sequence_length 512 "
          "--decoder_sequence_length 8 --data_parallel 1 --tensor_parallel 1 --global_batch_size 16 "
          "--micro_batch_size 8",
          "Every step moves the float32 weights, AdamW state and gradients between host and device.",
          ("what", "figure"), [
              ("the allocator's device peak", gib("h100-xl-phased-peak", at("peak_device_bytes"), 2)),
              ("a step", sec("h100-xl-phased-step", at("median_step_s"))),
              ("samples/s", rate("h100-xl-phased-rate", at("samples_per_s"), "samples/s")),
          ]),
    Table("xxl-1gpu", "Flan-T5-XXL phased on one H100 (`xxl_1gpu`)", (XXL,), None,
          "The fifteen-minute plan's `f15_xxl_1gpu` part (`bash benchmarks/lent_gpu.sh fifteen` with "
          "`XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=110`): 16 packed rows of MNLI-like lengths a step, 3 steps with "
          "`--plan_exact`, one H100 80GB HBM3 (the host's RAM below). Its finetuning.py run is the command.",
          ("what", "figure"), [
              ("a step of 16 rows (median)", sec("xxl-step", at(*R16, "median_step_s"))),
              ("the step over the larger of its compute and its link floor", ratio("xxl-over-floor",
                                                                                  at(*R16, "over_bound"))),
              ("its compute (a serialised step's)", sec("xxl-compute", at(*R16, "phase_timing", "compute_s"))),
              ("its link floor (at the measured bandwidth)", sec("xxl-link-floor", at(*R16, "link_floor_step_s"))),
              ("the host link, measured", rate("xxl-link-gbps", at(*R16, "link", "load_gb_per_s"), "GB/s")),
              ("the allocator's device peak", gib("xxl-device-peak", at(*R16, "peak_device_bytes"))),
              ("the exact plan's device peak (`--plan_exact`, XLA:GPU's temporaries)",
               gib("xxl-plan-exact", at(*R16, "plan_device_bytes_exact"), 2)),
              ("the allocator's peak over the exact plan", ratio("xxl-device-over-plan",
                                                                 at(*R16, "device_over_plan"))),
              ("the process's peak RSS", gib("xxl-rss", at(*R16, "host_peak_rss_bytes"))),
              ("the same in GB", Figure("xxl-rss-gb", at(*R16, "host_peak_rss_bytes"), "{:.1f} GB", 1e-9)),
              ("the host plan", gib("xxl-host-plan", at(*R16, "plan_host_bytes"))),
              ("the process's RSS over the host plan", ratio("xxl-rss-over-plan", at(*R16, "host_rss_over_plan"))),
              ("the machine's RAM", gib("xxl-ram", at("env", "host_ram_bytes"))),
              ("MFU", pct("xxl-mfu", at(*R16, "mfu"))),
          ]),
    Table("workstation", "`xxl_lora_1gpu` on a 24 GB workstation's budget", (WS,), None,
          "The fifteen-minute plan's `f15_workstation` part (`bash benchmarks/lent_gpu.sh f15_workstation 230`): "
          "`benchmarks/workstation.py` on one H100 with the device capped at 22 GiB by JAX's memory fraction (the "
          "host cap of 60 GiB could not be enforced there: no writable cgroup; the peak RSS is reported): 3 steps, "
          "then validation of 64 rows with int8 weights.",
          ("what", "figure"), [
              ("a step after the first", sec("ws-step", at(*WSX, "step_s", 1))),
              ("validation of 64 rows, int8 weights", sec("ws-validation", at("figures", "validation", "seconds"), 1)),
              ("validation's device peak", gib("ws-device-peak", at("figures", "validation", "peak_device_bytes"))),
              ("training's peak RSS", gib("ws-train-rss", at(*WSX, "train_peak_rss_bytes"))),
              ("validation's peak RSS", gib("ws-validate-rss", at(*WSX, "validate_peak_rss_bytes"))),
          ]),
    Table("fifteen", "The fifteen-minute plan's other parts on one H100", (P1 + "f15_xl_mfu.json",
                                                                          P1 + "f15_decode.json",
                                                                          P1 + "f15_int8_fusion.json"), None,
          "`bash benchmarks/lent_gpu.sh fifteen`: xl fused at micro-batch 8; greedy decoding of base (batch 64, "
          "512-token prompts, 8 new tokens) against HF `generate`, and with int8 weights; xl's greedy program with "
          "int8 weights, its optimized HLO read (`benchmarks/int8_hlo.py`; batch 64, 512-token prompts).",
          ("what", "figure"), [
              ("xl fused, micro-batch 8: MFU", pct("f15-xl-mfu", at("figures", "mb8", "mfu"))),
              ("the same: samples/s", rate("f15-xl-rate", at("figures", "mb8", "samples_per_s"), "samples/s")),
              ("greedy decoding, ours / HF", ratio("f15-decode", at("figures", "base", "decode_tokens_per_s", "ratio"),
                                                   json=P1 + "f15_decode.json")),
              ("int8 weights / ours, tokens/s", Figure("f15-int8", at("figures", "int8_over_ours_tokens_per_s"),
                                                       "{:.3f}x", json=P1 + "f15_decode.json")),
              ("xl's greedy program, temporaries with int8 weights",
               gib("f15-int8-temps", at("figures", "temp_bytes_int8"), 2, json=P1 + "f15_int8_fusion.json")),
              ("the same with bfloat16 weights",
               gib("f15-bf16-temps", at("figures", "temp_bytes_bf16_weights"), 2, json=P1 + "f15_int8_fusion.json")),
              ("arrays converted in kernels of their own (one layer's, the encoder's)",
               Figure("f15-int8-arrays", lambda d: len(d["figures"]["materialised"]), "{} arrays",
                      json=P1 + "f15_int8_fusion.json")),
          ]),
    Table("suite", "The GPU suite's run on one H100", (SU + "xxl_1gpu.json", SU + "xl_mfu.json", SU + "decode.json",
                                                      SU + "beams.json", SU + "summaries.json", SU + "gptj_6B.json"),
          "python3 benchmarks/suite.py --out benchmarks/results/h100 (on a lent GPU as bash benchmarks/lent_gpu.sh "
          "PARTS SECONDS)",
          "Its parts' figures that the manual states (every part's table: [gpu_suite.md](gpu_suite.md)). Its "
          "`xxl_1gpu` ran older code than the fifteen-minute plan's (above): its full step is history, its LoRA step "
          "against the full one of the same run is not.",
          ("what", "figure"), [
              ("`xxl_lora_1gpu` step over the full `xxl_1gpu` step of the same run",
               Figure("suite-lora-over-full", at("figures", "lora_over_full_step_s"), "{:.3f}x")),
              ("`xxl_lora_1gpu`: a step", sec("suite-lora-step", at(*SL, "median_step_s"))),
              ("`xxl_lora_1gpu`: the allocator's device peak", gib("suite-lora-peak", at(*SL, "peak_device_bytes"))),
              ("`xxl_lora_1gpu`: the plan's device peak at these lengths",
               gib("suite-lora-plan", at(*SL, "plan_device_bytes"))),
              ("`xxl_lora_1gpu`: the process's peak RSS", gib("suite-lora-rss", at(*SL, "host_peak_rss_bytes"))),
              ("greedy decoding, base: ours / HF (batch 64, 8 tokens)",
               ratio("suite-decode-base", at("figures", "base", "decode_tokens_per_s", "ratio"),
                     json=SU + "decode.json")),
              ("the same, xl", ratio("suite-decode-xl", at("figures", "xl", "decode_tokens_per_s", "ratio"),
                                     json=SU + "decode.json")),
              ("beam search, 4 beams, base: ours / HF",
               ratio("suite-beams", at("figures", "base", "decode_tokens_per_s", "ratio"), 1, json=SU + "beams.json")),
              ("summaries, base: ours packed / HF `torch.compile`",
               ratio("suite-summaries", at("figures", "base", "ratios", "ours packed / HF torch.compile"),
                     json=SU + "summaries.json")),
              ("the same, ours unpacked / HF `torch.compile`",
               ratio("suite-summaries-unpacked", at("figures", "base", "ratios", "ours unpacked / HF torch.compile"),
                     json=SU + "summaries.json")),
              ("the same, packing itself", ratio("suite-summaries-packing",
                                                 at("figures", "base", "ratios", "ours packed / ours unpacked"),
                                                 json=SU + "summaries.json")),
              ("GPT-J 6B phased (`gptj_1gpu`): a step", sec("suite-gptj-step", at("figures", "gptj_1gpu",
                                                                                  "median_step_s"),
                                                            json=SU + "gptj_6B.json")),
              ("the same: the allocator's device peak", gib("suite-gptj-peak", at("figures", "gptj_1gpu",
                                                                                  "peak_device_bytes"),
                                                            json=SU + "gptj_6B.json")),
              ("the same: the plan's device peak", gib("suite-gptj-plan", at("figures", "gptj_1gpu",
                                                                             "plan_device_bytes"),
                                                       json=SU + "gptj_6B.json")),
              ("a small GPT-J, ours / HF `torch.compile`", ratio("suite-gptj-vs-hf", at("figures", "vs_hf", "ratios",
                                                                                       "ours / HF torch.compile"),
                                                                 json=SU + "gptj_6B.json")),
          ]),
]

GROUPS = [
    ("On the 2-core development CPU", "AMD EPYC with AVX-512, shared with other work: only ratios measured in one "
     "invocation compare, the absolute figures move from hour to hour.",
     CPU_TABLES + DECODING_TABLES + SERVING_TABLES + TRAINING_TABLES + DATA_TABLES),
    ("Memory plans (from shapes, on the CPU)", "", PLAN_TABLES),
    ("On one NVIDIA H100", "Lent machines, one command of at most 10 minutes each ([gpu_suite.md](gpu_suite.md)). "
     "Where a plan and a measurement disagree, the measurement is the GPU's: the plan counts XLA:CPU's temporaries "
     "when computed on a CPU, and the allocator's peak holds what the plan does not model.", H100_TABLES),
]

HEAD = """# Measured results

Every measured figure the manual states, read from the JSON that its command wrote under `benchmarks/results/`
(each table names the command and the file). Generated by `python3 benchmarks/results_page.py --output
docs/results.md` (a test checks it is current); the other pages link to a figure's row here (`results.md#ID`), and a
test fails where a page states a figure that is not such a link with the value below. What was run when, and the
runs these superseded: [LOG.md](../benchmarks/results/LOG.md).
"""


def tables() -> list:
    return [t for _, _, group in GROUPS for t in group]


def figures_of(table: Table) -> list:
    return [c for row in table.rows for c in row if isinstance(c, Figure)]


def values(results: str = RESULTS) -> dict:
    """{figure id: its rendered value} of every figure of the page (what a page's link text must equal)."""
    out = {}
    for t in tables():
        for f in figures_of(t):
            if f.id in out:
                raise ValueError(f"figure id {f.id} is used twice")
            out[f.id] = f.render(load(f.json or t.sources[0], results))
    return out


def anchors() -> set:
    """Every anchor of the page: its tables' and its figures'."""
    return {t.anchor for t in tables()} | {f.id for t in tables() for f in figures_of(t)}


def _cell(cell, table: Table, results: str) -> str:
    if isinstance(cell, Figure):
        return f'<a id="{cell.id}"></a>{cell.render(load(cell.json or table.sources[0], results))}'
    return cell


def _table(t: Table, results: str) -> list:
    first = load(t.sources[0], results)
    command = t.command or first.get("command") or "; ".join(first.get("commands", []))
    if not command:
        raise ValueError(f"table {t.anchor}: no command given and none in {t.sources[0]}")
    dates = sorted({d for d in (_date(load(s, results)) for s in t.sources) if d})
    files = ", ".join(f"[{s}](../benchmarks/results/{s})" for s in t.sources)
    lines = [f'### <a id="{t.anchor}"></a>{t.title}', "", t.note, "",
             f"- command: `{command}`", f"- JSON: {files}" + (f" ({', '.join(dates)})" if dates else ""), "",
             "| " + " | ".join(t.header) + " |", "|" + "---|" * len(t.header)]
    for row in t.rows:
        lines.append("| " + " | ".join(_cell(c, t, results) for c in row) + " |")
    return lines + [""]


def markdown(results: str = RESULTS) -> str:
    """The whole page, as docs/results.md holds it, from the JSON under ``results``."""
    lines = [HEAD]
    for title, intro, group in GROUPS:
        lines += [f"## {title}", ""] + ([intro, ""] if intro else [])
        for t in group:
            lines += _table(t, results)
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output", help="write the page here (default: print it)")
    args = p.parse_args(argv)
    text = markdown()
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
