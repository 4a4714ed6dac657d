"""Measured figures have one source: docs/results.md is what benchmarks/results_page.py generates from the JSON under
benchmarks/results/ (byte for byte), and every other page of the manual (README.md, docs/, benchmarks/README.md)
states a figure only as a link to its row there whose text is the row's value (``[2.68 s](results.md#xxl-step)``):
a number with a unit of measure anywhere else on a page fails, unless the page's list below declares it no
measurement (a limit, a default, a size, a goal, a requirement). benchmarks/results/cpu/plans.json, the source of the
plans' figures, is what `--plan` prints now (a long test: it runs the drivers 21 times)."""

from __future__ import annotations

import glob
import json
import os
import re
import shutil

import pytest

from benchmarks import results_page
from tests.env import ROOT

# the manual: the pages tests/test_docs.py reads
DOC_FILES = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + \
    [os.path.join(ROOT, "benchmarks", "README.md")]

RESULTS_MD = os.path.join(ROOT, "docs", "results.md")
# the pages whose figures are generated (each checked against its source by its own test)
GENERATED = {os.path.join(ROOT, "docs", "results.md"), os.path.join(ROOT, "docs", "configuration.md")}
PAGES = [p for p in DOC_FILES if p not in GENERATED]

# A figure: a number (with thousands' commas, a decimal part, a "k") and a unit of measure, "x" and "%" written
# against the number, the others after a space (so "dp 2 x tp 2", "2048x2048" and "429s" are none).
UNIT = (r"(?:x|%|(?:\s|&nbsp;)(?:ms|µs|s|minutes?|hours?|GiB|GB|MiB|MB|KiB|TB|GB/s|TFLOP/s|GFLOP/s|MFLOP|"
        r"(?:tokens|samples|examples|rows)/s))")
FIGURE = re.compile(rf"(?<![\w.^/#-])(\d[\d,]*(?:\.\d+)?k?{UNIT})(?![\w/])")
LINK = re.compile(r"\[([^\]\n]+)\]\((?:\.\./docs/|docs/)?results\.md#([\w-]+)\)")


def _normal(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def figure_problems(text: str, values: dict, anchors: set, declared=()) -> list:
    """What a page states against docs/results.md: a link to an anchor the page has not, a link to a figure whose
    text is not the figure's value, and a figure outside such a link that ``declared`` (phrases of the page, each
    holding a quantity that is no measurement) does not hold. Whitespace is read as one space."""
    problems = []
    for m in LINK.finditer(text):
        shown, anchor = m.group(1).strip("* "), m.group(2)
        if anchor not in anchors:
            problems.append(f"a link to results.md#{anchor}, which docs/results.md has not")
        elif anchor in values and shown != values[anchor]:
            problems.append(f"[{shown}](results.md#{anchor}) where the JSON holds {values[anchor]}")
    rest = _normal(LINK.sub(lambda m: "" if m.group(2) in values else m.group(0), text))
    for phrase in declared:
        if _normal(phrase) not in rest:
            problems.append(f"declared {phrase!r}, which the page does not say")
        rest = rest.replace(_normal(phrase), " ")
    problems += [f"{m.group(1)!r} is no link to its row of docs/results.md: "
                 f"...{rest[max(0, m.start() - 60):m.end() + 10]}..." for m in FIGURE.finditer(rest)]
    return problems


def _short(problems: list) -> list:
    return [p.split(": ...", 1)[0] for p in problems]


def page_text(path: str) -> str:
    """A page as the rule reads it: the GPU suite's table, generated from its JSON (and checked by
    tests/test_docs.py), left out."""
    from benchmarks import suite

    text = open(path).read()
    if suite.BEGIN in text:
        text = text[:text.index(suite.BEGIN)] + text[text.index(suite.END) + len(suite.END):]
    return text


# ------------------------------------------------------------------------- the quantities pages state that are
# no measurement: each a phrase of its page (a machine's size, a requirement, a limit or default of the code or of a
# lent machine, a goal a benchmark decides, a test's bound). A phrase declared holds wherever the page says it.
DECLARED: dict = {
    "README.md": ("one 24 GB GPU", "one 80 GB GPU", "64 GB of host memory", "a 24 GB card", "128 GB of RAM",
                  "CI's limit 20 minutes", "past 20 minutes", "24 GB validation"),
    "docs/benchmarks.md": ("accuracy at 80% or more", "JAX takes 75% of the GPU"),
    "docs/commands.md": ("one 24 GB GPU", "one 80 GB GPU", "64 GB of host memory", "128 GB of RAM",
                         "A 24 GB / 64 GB workstation", "one command of at most 10 minutes", "within 480 s"),
    "docs/decoding.md": ("What a 24 GB card", "under 3% of their spread", "under 10% at the worst logit",
                         "products by under 4% and under 15%", "(512 x 32128) is a fixed 66 MB read",
                         "two 24 GB LoRA presets within a 22 GiB device and 59 GiB of host memory", "22 GiB"),
    "docs/gpu_suite.md": ("at most 480 s", "at most 10 minutes", "15 minutes of device time", "within 90 s",
                          "(goal 2x)", "(goal: 2x", "(goal 1.2x)", "(goal 15%)", "(the goal, 1.2x, not reached)",
                          "(the goal, within 15%, not reached", "capped at 22 GiB (and the host at 60 GiB",
                          "the 24 GB workstation", "the 22 GiB cap", "a 22 GiB / 60 GiB workstation",
                          "default 25 minutes"),
    "docs/install.md": ("bounded at 8 GiB",),
    "docs/lora.md": ("one 24 GB GPU", "64 GB of host memory", "checks 22 GiB and 59 GiB", "Under a 22 GiB device cap",
                     "a 24 GB workstation's", "no 24 GB GPU", "an 80 GB GPU"),
    "docs/numerics.md": ("within 1% of float32",),
    "docs/phased.md": ("the plan's 52 GB/s", "caps at 64 GB", "+80% +2 GiB, at most 90%", "the plan +10% +2 GiB",
                       "within 10%", "one 80 GB GPU", "128 GB of RAM"),
    "docs/serving.md": ("(10 s:", "(30 s)", "closed after 30 s", "40 MFLOP or more", "(1 MiB;", "goal 0.9x",
                        "(goal 0.5x)", "goal under 50 ms", "(goal 0.8x)", "goal 1.3x"),
    "docs/status.md": ("a 22 GiB device cap", "a 24 GB / 64 GB", "at most 480 s"),
    "docs/tasks.md": ("well below 1%", "more than 32 MiB"),
    "docs/testing.md": ("under 20 minutes", "at 15 s of CPU", "with 32 MiB", "one 24 GB GPU and 64 GB of host memory",
                        "allocate (10%)", "or 0.1% of"),
    "docs/training.md": ("above 1%",),
    "benchmarks/README.md": ("a 22 GiB device cap and a 60 GiB host cap", "a 24 GB card, 64 GB of RAM"),
}


# ---------------------------------------------------------------------------------------------------- the tests

def test_docs_results_is_what_the_json_generates():
    assert open(RESULTS_MD).read() == results_page.markdown(), \
        "docs/results.md is stale: python3 benchmarks/results_page.py --output docs/results.md"


def test_a_changed_json_changes_its_figure_and_nothing_else(tmp_path):
    """The page is read from the files, figure by figure: a step time changed in its JSON changes that row alone."""
    results = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, "benchmarks", "results"), results)
    path = results / "h100/fifteen/2_xxl_pool110_workstation/f15_xxl_1gpu.json"
    doc = json.loads(path.read_text())
    doc["figures"]["rows16"]["median_step_s"] = 4.11
    path.write_text(json.dumps(doc))
    before, after = results_page.values(), results_page.values(str(results))
    assert {k for k in before if before[k] != after[k]} == {"xxl-step"} and after["xxl-step"] == "4.11 s"
    old, new = results_page.markdown().splitlines(), results_page.markdown(str(results)).splitlines()
    assert [(a, b) for a, b in zip(old, new) if a != b] == \
        [('| a step of 16 rows (median) | <a id="xxl-step"></a>2.68 s |',
          '| a step of 16 rows (median) | <a id="xxl-step"></a>4.11 s |')]


def test_a_ratio_s_range_is_its_own_rounds_smallest_and_largest(tmp_path):
    """A ratio of alternated rounds is stated with its rounds' range: the smallest and the largest round of that pair
    of engines and that measure, read from compare.py's spread (a first token's, not the tokens/s' beside it)."""
    results = tmp_path / "results"
    shutil.copytree(os.path.join(ROOT, "benchmarks", "results"), results)
    path = results / "cpu/decode_b8.json"
    doc = json.loads(path.read_text())
    doc["decode_ratios"]["ours / CTranslate2 float32"]["first_token_s"].update(min=0.5, max=2.25)
    path.write_text(json.dumps(doc))
    before, after = results_page.values(), results_page.values(str(results))
    assert {k for k in before if before[k] != after[k]} == {"b8-first-vs-ct2-range"}
    assert after["b8-first-vs-ct2-range"] == "0.50x-2.25x"


def test_every_figure_id_is_one_anchor_and_every_table_names_its_command_and_files():
    anchors = [t.anchor for t in results_page.tables()] + \
        [f.id for t in results_page.tables() for f in results_page.figures_of(t)]
    assert len(anchors) == len(set(anchors)) > 200
    assert all(re.fullmatch(r"[a-z0-9_-]+", a) for a in anchors)
    text = open(RESULTS_MD).read()
    for t in results_page.tables():
        section = text.split(f'<a id="{t.anchor}"></a>', 1)[1].split("\n### ", 1)[0]
        assert "- command: `" in section and all(f"(../benchmarks/results/{s})" in section for s in t.sources)


@pytest.mark.parametrize("page", [os.path.relpath(p, ROOT) for p in PAGES])
def test_a_page_states_a_figure_only_as_a_link_to_its_row(page):
    values, anchors = results_page.values(), results_page.anchors()
    assert figure_problems(page_text(os.path.join(ROOT, page)), values, anchors, DECLARED.get(page, ())) == []


def test_the_rule_bites():
    values, anchors = {"xxl-step": "2.68 s", "packing-x": "8.94x"}, {"xxl-step", "packing-x", "xxl-1gpu"}
    # a figure written out, a stale figure in a link, a link to a row that is gone, a number in a table's link
    page = ("A step took 4.11 s. One took [4.11 s](results.md#xxl-step), [8.94x](docs/results.md#packing-y) "
            "and [9.1x](results.md#xxl-1gpu).")
    assert _short(figure_problems(page, values, anchors)) == [
        "[4.11 s](results.md#xxl-step) where the JSON holds 2.68 s",
        "a link to results.md#packing-y, which docs/results.md has not",
        "'4.11 s' is no link to its row of docs/results.md",
        "'8.94x' is no link to its row of docs/results.md",
        "'9.1x' is no link to its row of docs/results.md"]
    # what passes: the figure linked with its value (bold or not, from the README's docs/), a table linked without
    # a figure, a declared quantity (across a line break), and what is no figure
    good = ("It took [**2.68 s**](docs/results.md#xxl-step), [8.94x](results.md#packing-x) ([the table](results.md#"
            "xxl-1gpu)) on one 80 GB\nGPU; dp 2 x tp 2, a 2048x2048 GEMM, 16 rows, 429s, v1.5x, 2^15, `--steps 300`.")
    assert figure_problems(good, values, anchors, ["one 80 GB GPU"]) == []
    # a declaration the page does not hold is a problem too (a stale list), and leaves the figure unmarked
    assert _short(figure_problems(good, values, anchors, ["one 24 GB GPU"])) == [
        "declared 'one 24 GB GPU', which the page does not say", "'80 GB' is no link to its row of docs/results.md"]
    # every unit of measure the manual uses is read as one
    units = "3 s, 20 ms, 2.1 µs, 6.5 minutes, 1.5 GiB, 2 GB, 377 MiB, 176 MB, 0.5 KiB, 51.4 GB/s, 244 TFLOP/s, " \
            "190 GFLOP/s, 40 MFLOP, 1,377 tokens/s, 7.1 samples/s, 14.66 examples/s, 153k rows/s, 99.9%, 1.05x"
    assert [m.group(1) for m in FIGURE.finditer(units)] == units.split(", ")
    # and the rule reads the pages as they are: a figure written into the README in place of its link fails it
    readme = page_text(os.path.join(ROOT, "README.md"))
    assert "[**2.68 s**](docs/results.md#xxl-step)" in readme
    assert _short(figure_problems(readme.replace("[**2.68 s**](docs/results.md#xxl-step)", "**4.11 s**"),
                                  results_page.values(), results_page.anchors(), DECLARED["README.md"])) == \
        ["'4.11 s' is no link to its row of docs/results.md"]


def test_the_plans_are_read_as_plan_prints_them():
    from benchmarks import plans

    out = ("memory plan (fused executor, XLA's count of program temporaries):\n"
           "  device: 35.4 GiB per device at its peak (training step): step temporaries (gradients, activations) "
           "24.0 GiB, frozen base weights 11.3 GiB, step outputs 256 B\n"
           "  host:   65.7 GiB per process at its peak (decoder_layer_fwd): master weights 41.5 GiB\n"
           "host link per step (per device): loads 70.591 GB, stores 70.589 GB; floor of this layout: loads ...\n"
           "  at 52 GB/s each way: 1.358 s a step on the link (floor 1.358 s)\n")
    assert plans.parse(out) == {
        "device": {"peak": "35.4 GiB", "peak_bytes": round(35.4 * 2 ** 30), "phase": "training step",
                   "items": {"step temporaries (gradients, activations)": "24.0 GiB",
                             "frozen base weights": "11.3 GiB", "step outputs": "256 B"}},
        "host": {"peak": "65.7 GiB", "peak_bytes": round(65.7 * 2 ** 30), "phase": "decoder_layer_fwd",
                 "items": {"master weights": "41.5 GiB"}},
        "link": {"loads_gb": "70.591", "stores_gb": "70.589", "gb_per_s": "52", "seconds": "1.358"}}


def test_the_plans_json_is_what_plan_prints_now():
    """Every plan of benchmarks/results/cpu/plans.json, run again (21 drivers' `--plan`: a long test)."""
    from benchmarks import plans

    saved = json.load(open(os.path.join(ROOT, "benchmarks", "results", "cpu", "plans.json")))["plans"]
    assert list(saved) == [plans.plan_name(p, f, d) for d, p, f in plans.every_plan()]
    for driver, preset, flags in plans.every_plan():
        fresh = plans.run_plan(preset, flags, driver)
        assert fresh == saved[plans.plan_name(preset, flags, driver)], plans.command(preset, flags, driver)
