"""The documentation against the code: every command shown in README.md, docs/ and benchmarks/README.md names a
driver that exists, flags its parser knows and presets its preset file holds (the copy-pasteable ones parse whole,
their values checked by the config); every driver flag and every preset is documented in docs/, every driver's own
flags in docs/commands.md's synopses; docs/configuration.md is the config's own reference, regenerated; the README
stays a front page (at most 200 lines, no date, no commit hash: history goes to benchmarks/results/LOG.md); every
result file the docs name exists; the make targets set up what is missing and run."""

from __future__ import annotations

import argparse
import glob
import importlib
import os
import re
import shlex
import shutil
from unittest import mock

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
DOC_FILES = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + \
    [os.path.join(ROOT, "benchmarks", "README.md")]
# every page that names result files: the docs, and the benchmarks' own pages and log
RESULT_PAGES = DOC_FILES + [os.path.join(ROOT, "benchmarks", p) for p in
                            ("probes/README.md", "results/README.md", "results/LOG.md")]

# script (as a command names it) -> (module, {flag naming a preset: the preset file's kind})
DRIVERS = {
    "run_finetuning.py": ("run_finetuning", {"--config": "finetuning"}),
    "run_validation.py": ("run_validation", {"--config": "inference"}),
    "run_inference.py": ("run_inference", {"--config": "inference"}),
    "run_export.py": ("run_export", {"--config": "inference"}),
    "run_server.py": ("run_server", {"--config": "inference"}),
    "finetuning.py": ("finetuning", {"--config": "finetuning"}),
    "inference.py": ("inference", {"--config": "inference"}),
    "benchmarks/compare.py": ("benchmarks.compare", {"--config": "finetuning", "--inference_config": "inference"}),
    "benchmarks/suite.py": ("benchmarks.suite", {}),
    "benchmarks/hf_baseline.py": ("benchmarks.hf_baseline", {"--config": "finetuning"}),
    "benchmarks/ct2_baseline.py": ("benchmarks.ct2_baseline", {"--config": "inference"}),
    "benchmarks/phased_memory.py": ("benchmarks.phased_memory", {"--config": "finetuning"}),
    "benchmarks/workstation.py": ("benchmarks.workstation", {"--preset": "finetuning"}),
    "benchmarks/lora.py": ("benchmarks.lora", {"--config": "finetuning"}),
    "benchmarks/figures.py": ("benchmarks.figures", {}),
    "benchmarks/serve.py": ("benchmarks.serve", {"--configs": "inference"}),
    "benchmarks/constrained.py": ("benchmarks.constrained", {"--config": "inference"}),
    "benchmarks/large_data.py": ("benchmarks.large_data", {}),
    "benchmarks/precision.py": ("benchmarks.precision", {"--config": "finetuning"}),
    "benchmarks/int8_accuracy.py": ("benchmarks.int8_accuracy", {}),
    "benchmarks/int8_hlo.py": ("benchmarks.int8_hlo", {"--config": "inference"}),
    "benchmarks/host_cost.py": ("benchmarks.host_cost", {}),
    "benchmarks/startup.py": ("benchmarks.startup", {}),
    "benchmarks/plans.py": ("benchmarks.plans", {}),
    "benchmarks/results_page.py": ("benchmarks.results_page", {}),
    "-m app.launch": ("app.launch", {}),
    "-m app.reference": ("app.reference", {}),
}
# the drivers whose parsers are app/args.py's: every config field a flag, resolved and validated by the config
CONFIG_DRIVERS = {"run_finetuning.py": "finetuning", "finetuning.py": "finetuning", "run_validation.py": "inference",
                  "run_inference.py": "inference", "run_export.py": "inference", "run_server.py": "inference",
                  "inference.py": "inference"}
OTHER_TOOLS = {"pip", "pytest", "jupyter", "make", "git", "bash", "venv", "nbconvert"}  # not ours to check
INTERNAL = {"-m data.cache"}  # modules the drivers start themselves, named where the docs say so


class _Captured(BaseException):
    """Raised in place of parsing: the parser a driver's main built, caught before any work."""


_PARSERS: dict = {}


def parser_of(script: str) -> argparse.ArgumentParser:
    """The argparse parser ``script``'s main builds, taken at its parse_args (nothing else of main runs)."""
    if script not in _PARSERS:
        module = importlib.import_module(DRIVERS[script][0])
        got = []

        def capture(self, args=None, namespace=None):
            got.append(self)
            raise _Captured

        with mock.patch.object(argparse.ArgumentParser, "parse_args", capture):
            try:
                module.main(["train"] if script.endswith("hf_baseline.py") else [])
            except _Captured:
                pass
        assert got, f"{script}'s main parsed no arguments"
        _PARSERS[script] = got[-1]
    return _PARSERS[script]


def flags_of(parser) -> set:
    return {o for a in parser._actions for o in a.option_strings if o.startswith("--")}


def documented_flags(parser) -> set:
    """The flags a user is told of: --help's (those it hides are internal)."""
    return {o for a in parser._actions if a.help != argparse.SUPPRESS for o in a.option_strings
            if o.startswith("--") and o != "--help"}


def presets(kind: str) -> set:
    from config.presets import preset_path, read_presets

    return set(read_presets(preset_path(kind)))


# ----------------------------------------------------------------------------------------------- reading the docs

def code_blocks(text: str):
    """(first line number, lines) of each fenced code block, continuation lines joined."""
    for m in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M):
        line = text[:m.start()].count("\n") + 2
        yield line, m.group(1).replace("\\\n", " ").splitlines()


def inline_spans(text: str):
    """(line number, text) of each inline code span outside fenced blocks."""
    outside = re.sub(r"^```[^\n]*\n.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S | re.M)
    for m in re.finditer(r"`([^`\n]+)`", outside):
        yield outside[:m.start()].count("\n") + 1, m.group(1)


def split_command(line: str, variables: dict):
    """A shell line -> [(script, [args])] for each python3 command of ours in it (joined by && or ;); env
    assignments, prompts and `/usr/bin/time -v` in front are skipped, $VARS of the block expanded."""
    for name, value in variables.items():
        line = line.replace(f"${name}", value)
    try:
        tokens = shlex.split(line.lstrip("$ "), comments=True)
    except ValueError:
        return []
    out, cmd = [], []
    for t in tokens + ["&&"]:
        if t in ("&&", ";", "||"):  # not |: a synopsis's alternatives (--load CKPT | --hf_model DIR)
            out.append(cmd)
            cmd = []
        else:
            cmd.append(t)
    found = []
    for cmd in out:
        while cmd and (re.match(r"^[A-Z_][A-Z0-9_]*=", cmd[0]) or cmd[0] in ("/usr/bin/time", "-v", "time")):
            cmd = cmd[1:]
        if len(cmd) < 2 or cmd[0] not in ("python3", "python", "$(PY)", ".venv/bin/python"):
            continue
        if cmd[1] == "-m":
            found.append((f"-m {cmd[2]}", cmd[3:]))
        elif cmd[1] != "-c":
            found.append((cmd[1], cmd[2:]))
    return found


def commands_in(text: str, name: str):
    """(name:line, script, args, whole) of every python3 command in a page's text; whole: a copy-pasteable line of a
    code block (else an inline synopsis such as `run_validation.py --load CKPT [--limit N]`)."""
    for start, lines in code_blocks(text):
        variables = {}
        for i, line in enumerate(lines):
            m = re.match(r'^([A-Z_][A-Z0-9_]*)="([^"]*)"\s*$', line)
            if m:
                variables[m.group(1)] = m.group(2)
            for script, args in split_command(line, variables):
                yield f"{name}:{start + i}", script, args, True
    for line, span in inline_spans(text):
        for script, args in split_command(span.replace("\\|", "|"), {}):
            yield f"{name}:{line}", script, args, False


def doc_commands():
    """commands_in every page of the docs."""
    for path in DOC_FILES:
        yield from commands_in(open(path).read(), os.path.relpath(path, ROOT))


def flag_tokens(args: list):
    """The --flags among a command's tokens (synopsis brackets stripped), stopping at `--` (what follows is passed
    on to another script) and at a driver named inside it (the launcher's command)."""
    for t in args:
        t = t.strip("[]()")
        if t == "--" or t.endswith(".py"):
            return
        if " " in t:  # a quoted value ("--num_beams 4" given to --decode_flags): another script's flags
            continue
        m = re.match(r"^(--[a-z][\w-]*)", t)
        if m:
            yield m.group(1)


def preset_values(args: list, preset_flags: dict):
    """(flag, value, kind) of each concrete preset named after a preset flag (placeholders like PRESET skipped)."""
    for i, t in enumerate(args):
        flag = t.strip("[]()").split("=")[0]
        if flag in preset_flags:
            values = [t.split("=", 1)[1]] if "=" in t else []
            for v in args[i + 1:] if not values else []:
                if v.startswith("-") or not re.match(r"^[a-z][\w.-]*$", v.strip("[]()")):
                    break
                values.append(v.strip("[]()"))
                if flag != "--configs":
                    break
            for v in values:
                yield flag, v, preset_flags[flag]


# ---------------------------------------------------------------------------------------------------- the tests

COMMANDS = list(doc_commands())


def test_the_docs_show_commands_of_every_kind():
    """The extraction reads what it should: commands in code blocks and inline, of many drivers (a reader that
    found nothing would pass every check below)."""
    scripts = {s for _, s, _, _ in COMMANDS}
    assert {"run_finetuning.py", "run_validation.py", "run_inference.py", "run_server.py", "run_export.py",
            "benchmarks/suite.py", "-m app.launch"} <= scripts
    assert sum(whole for *_, whole in COMMANDS) > 40 and sum(not whole for *_, whole in COMMANDS) > 40


def test_every_command_names_a_driver_flags_and_presets_that_exist():
    problems = []
    for where, script, args, _ in COMMANDS:
        if script.startswith("-m ") and script.split()[1].split(".")[0] in OTHER_TOOLS:
            continue
        if script in INTERNAL:
            assert importlib.util.find_spec(script.split()[1]), f"{where}: no module {script}"
            continue
        if script not in DRIVERS:
            problems.append(f"{where}: {script} is no driver of this project")
            continue
        known = flags_of(parser_of(script))
        problems += [f"{where}: {script} has no flag {f}" for f in flag_tokens(args) if f not in known]
        problems += [f"{where}: {script} {flag} {v}: no such preset in config/{kind}.yml"
                     for flag, v, kind in preset_values(args, DRIVERS[script][1]) if v not in presets(kind)]
        if script == "-m app.launch" and any(a.endswith(".py") for a in args):  # the command it launches
            i = next(i for i, a in enumerate(args) if a.endswith(".py"))
            inner = flags_of(parser_of(args[i]))
            problems += [f"{where}: {args[i]} has no flag {f}" for f in flag_tokens(args[i + 1:]) if f not in inner]
    assert not problems, "\n".join(problems)


def make_commands():
    """(file:line, [tokens]) of every `make ...` command in the docs."""
    for path in DOC_FILES:
        text, name = open(path).read(), os.path.relpath(path, ROOT)
        spans = [(start + i, line) for start, lines in code_blocks(text) for i, line in enumerate(lines)]
        for where, line in spans + list(inline_spans(text)):
            if line.startswith("make "):
                yield f"{name}:{where}", shlex.split(line, comments=True)[1:]


def test_every_make_command_names_targets_and_variables_the_makefile_has():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    variables = set(re.findall(r"^(\w+) \?=", makefile, re.M))
    found = list(make_commands())
    assert {"quickstart", "test"} <= {t for _, args in found for t in args}
    problems = [f"{where}: make {a}" for where, args in found for a in args if a != "..."
                if (a.split("=")[0] not in variables if "=" in a else a not in targets)]
    assert not problems, problems


def test_every_copy_pasteable_command_parses_and_its_config_validates():
    """A code block's command parses whole with its driver's parser (values of the right type, nothing missing)
    and, for a driver of app/args.py, its preset with its flags is a valid config."""
    from app.args import join_negative_values, make_config

    problems = []
    for where, script, args, whole in COMMANDS:
        if not whole or script not in DRIVERS or script == "-m app.launch":
            continue
        argv = args[1:] if script.endswith("hf_baseline.py") else args
        argv = argv[:argv.index("--")] if "--" in argv else argv
        try:
            ns = parser_of(script).parse_args(join_negative_values(argv))
        except SystemExit:
            problems.append(f"{where}: {script} {shlex.join(args)} does not parse")
            continue
        if script in CONFIG_DRIVERS:
            overrides = {k[len("cfg__"):]: v for k, v in vars(ns).items() if k.startswith("cfg__")}
            try:
                make_config(CONFIG_DRIVERS[script], ns.config, overrides)
            except Exception as e:  # noqa: BLE001 -- any config error is the finding
                problems.append(f"{where}: {script} {shlex.join(args)}: {e}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("script", sorted(CONFIG_DRIVERS))
def test_each_driver_describes_itself_by_its_docstring_and_starts_from_the_tiny_preset(script):
    """The prologue the seven drivers share (app.args.command_line): --help opens with the first line of the driver's
    docstring, and --config, not given, names the tiny preset."""
    parser = parser_of(script)
    assert parser.description == importlib.import_module(DRIVERS[script][0]).__doc__.splitlines()[0]
    assert parser.get_default("config") == "tiny"


def test_every_driver_flag_and_every_preset_is_documented_in_docs():
    """The reverse: every flag of every driver and every preset of either file is in docs/: a config field in
    docs/configuration.md (generated from the config's docs), a driver's own flag in a command of that driver
    shown in docs/ (docs/commands.md's synopses), a preset by name in the written pages."""
    import modelling.registry  # noqa: F401 (the families' own fields are flags too, whatever ran before)
    from config.schema import FIELDS

    docs = {p: open(p).read() for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))}
    written = "\n".join(t for p, t in docs.items() if not p.endswith("configuration.md"))
    reference = docs[os.path.join(ROOT, "docs", "configuration.md")]
    config_flags = {f"--{f}" for f in FIELDS}
    shown = {}
    for where, script, args, _ in COMMANDS:
        if where.startswith("docs"):
            shown.setdefault(script, set()).update(flag_tokens(args))
    missing = []
    for script in DRIVERS:
        for flag in sorted(documented_flags(parser_of(script))):
            if flag in config_flags and (script in CONFIG_DRIVERS or script.endswith(("hf_baseline.py",
                                                                                     "ct2_baseline.py"))):
                if not re.search(re.escape(f"`{flag}`"), reference):
                    missing.append(f"{script} {flag} (docs/configuration.md)")
            elif flag not in shown.get(script, ()):
                missing.append(f"{script} {flag}")
    for kind in ("finetuning", "inference"):
        missing += [f"preset {p} of config/{kind}.yml" for p in sorted(presets(kind)) if f"`{p}`" not in written]
    assert not missing, "not in docs/: " + ", ".join(missing)


def presets_listed_in_commands_md(text: str) -> dict:
    """{kind: the preset names docs/commands.md's Presets section lists}: the rows of its table of
    config/finetuning.yml, the paragraph of config/inference.yml's."""
    section = text.split("\n## Presets", 1)[1]
    table, _, rest = section.partition("`config/inference.yml`")
    return {"finetuning": set(re.findall(r"^\| `([^`]+)` \|", table, re.M)),
            "inference": set(re.findall(r"`([^`]+)`", rest.split("\n\n", 1)[0]))}


def test_the_presets_section_of_docs_commands_lists_every_preset():
    """Guards the table against a preset added without its row (`tiny_mixture` had none): every preset of
    config/finetuning.yml is a row of the table, and the table has no row of a preset that is gone; every one of
    config/inference.yml is named in the paragraph after it."""
    listed = presets_listed_in_commands_md(open(os.path.join(ROOT, "docs", "commands.md")).read())
    assert listed["finetuning"] == presets("finetuning")
    assert presets("inference") <= listed["inference"]
    # the check reads what it must: a row taken out of the table, or a preset of neither file, fails it
    table = open(os.path.join(ROOT, "docs", "commands.md")).read()
    assert presets_listed_in_commands_md(table.replace("| `tiny_mixture` |", "| tiny_mixture |"))["finetuning"] != \
        presets("finetuning")


def test_docs_configuration_is_the_config_s_own_reference():
    """docs/configuration.md is what `python3 -m app.reference` writes from config/schema.py and the families' own
    fields now: a field added, renamed or redocumented without regenerating it fails here."""
    from app.reference import markdown

    assert open(os.path.join(ROOT, "docs", "configuration.md")).read() == markdown(), \
        "docs/configuration.md is stale: python3 -m app.reference --output docs/configuration.md"


def set_up_block(text: str) -> list:
    """The lines of a page's first code block holding `make quickstart` (its set-up), comments dropped."""
    block = next(lines for _, lines in code_blocks(text) if any(x.startswith("make quickstart") for x in lines))
    return [x.split("#", 1)[0].strip() for x in block if x.split("#", 1)[0].strip()]


def test_the_set_up_the_docs_print_activates_the_environment_make_builds():
    """Every command the docs print runs as printed after the set-up: the README's and docs/install.md's set-up
    blocks end by activating the virtual environment the Makefile builds (a `python3` of the system may lack JAX);
    tests/test_install.py runs a driver so on a fresh clone."""
    venv = re.search(r"^VENV \?= (\S+)$", open(os.path.join(ROOT, "Makefile")).read(), re.M).group(1)
    for page in (README, os.path.join(ROOT, "docs", "install.md")):
        assert set_up_block(open(page).read()) == ["make quickstart", "make test", f"source {venv}/bin/activate"], page
    # the check reads what it must: a set-up without the activation fails it
    assert set_up_block("```bash\nmake quickstart   # x\nmake test\n```\n") == ["make quickstart", "make test"]


README_LINES = 200  # a front page, as vLLM's, PEFT's and t5x's: what it is, the set-up, the main commands, links
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
COMMIT = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")  # a hash holds digits and letters


def front_page_problems(text: str, pages: list) -> list:
    """What keeps a README from being a front page: more than README_LINES lines, a page of docs/ it does not link,
    a date or a commit hash (what happened when belongs in benchmarks/results/LOG.md)."""
    lines = text.splitlines()
    problems = [f"{len(lines)} lines (at most {README_LINES})"] if len(lines) > README_LINES else []
    problems += [f"no link to docs/{page}" for page in pages if f"](docs/{page})" not in text]
    for n, line in enumerate(lines, 1):
        problems += [f"line {n}: a date, {m.group(0)}" for m in DATE.finditer(line)]
        problems += [f"line {n}: a commit hash, {m.group(0)}" for m in COMMIT.finditer(line)]
    return problems


def test_the_readme_is_a_front_page_that_links_every_doc():
    pages = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    assert front_page_problems(open(README).read(), pages) == []
    # the rule bites on a diary line, a page left unlinked, a page too long
    diary = "[install](docs/install.md)\nCI: 8.1 minutes (797 tests, 2026-11-28 02:51, code 3813f1b)\n"
    assert front_page_problems(diary, ["install.md", "serving.md"]) == \
        ["no link to docs/serving.md", "line 2: a date, 2026-11-28", "line 2: a commit hash, 3813f1b"]
    assert front_page_problems("a line\n" * (README_LINES + 1), []) == [f"{README_LINES + 1} lines (at most 200)"]
    # and not on what is no history: a shape, a count, a port, a word of hex letters, a preset's name
    assert front_page_problems("a 2048x2048 GEMM, 1000000 rows, --port 8000, defaced, f15_xxl_1gpu\n", []) == []


def test_every_link_of_the_readme_and_docs_leads_to_a_file():
    """Pages and figures: README.md's links into docs/, benchmarks/ and imgs/, and every relative link of docs/ (a
    page or an image, which docs/ reads from ../imgs/)."""
    links = re.findall(r"\]\(((?:docs|benchmarks|imgs)/[^)#]+)", open(README).read())
    for path in glob.glob(os.path.join(ROOT, "docs", "*.md")):
        links += [os.path.join("docs", link) for link in
                  re.findall(r"\]\(([^)#:]+\.(?:md|png|json))", open(path).read())]
    assert len(links) > 40
    assert [link for link in links if not os.path.exists(os.path.join(ROOT, os.path.normpath(link)))] == []


RESULT = re.compile(r"(?<![\w/.-])((?:benchmarks/)?results/[\w./-]*\w)")


def missing_results(text: str, here: str) -> list:
    """Each result file or folder a page names that does not exist: `benchmarks/results/...` from the root, and
    `results/...` from the page's own folder (benchmarks/): a figure whose JSON is gone, or was archived without its
    page being told."""
    found = [m.group(1) for m in RESULT.finditer(text)]
    return [p for p in found if not os.path.exists(os.path.join(ROOT if p.startswith("benchmarks/") else here, p))]


def test_every_result_file_the_docs_name_exists():
    named = 0
    for path in RESULT_PAGES:
        text = open(path).read()
        named += len(RESULT.findall(text))
        assert missing_results(text, os.path.dirname(path)) == [], os.path.relpath(path, ROOT)
    assert named > 40
    # the rule bites: a run moved to archive/ that a page still names where it was, a file never written
    page = "`benchmarks/results/cpu/startup.json`, `benchmarks/results/cpu/serve_1434.json`, `results/cpu/none.json`"
    assert missing_results(page, os.path.join(ROOT, "benchmarks")) == \
        ["benchmarks/results/cpu/serve_1434.json", "results/cpu/none.json"]


def own_flags() -> dict:
    """{script: the flags its --help lists that are its own (config fields are docs/configuration.md's)}."""
    import modelling.registry  # noqa: F401 (the families' own fields are flags too, whatever ran before)
    from config.schema import FIELDS

    config = {f"--{f}" for f in FIELDS}
    return {s: {f for f in documented_flags(parser_of(s))
                if not (f in config and (s in CONFIG_DRIVERS or s.endswith(("hf_baseline.py", "ct2_baseline.py"))))}
            for s in DRIVERS}


def flags_missing_from(text: str, name: str, own: dict) -> list:
    """"SCRIPT --FLAG" for each of a driver's own flags that no command of that driver in a page's text names."""
    shown = {}
    for _, script, args, _ in commands_in(text, name):
        shown.setdefault(script, set()).update(flag_tokens(args))
    return [f"{s} {f}" for s, flags in sorted(own.items()) for f in sorted(flags) if f not in shown.get(s, ())]


def test_docs_commands_names_every_driver_s_own_flags():
    """docs/commands.md is where a user looks a flag up: every driver's own flags in its synopsis (a flag shown only
    somewhere else in docs/ is not enough); the presets' side is test_the_presets_section_of_docs_commands_lists_every_preset."""
    path = os.path.join(ROOT, "docs", "commands.md")
    text, own = open(path).read(), own_flags()
    assert flags_missing_from(text, "docs/commands.md", own) == []
    # the rule bites: a flag taken out of run_server.py's synopsis (its row comes before benchmarks/serve.py's)
    assert text.index("python3 run_server.py (--load") < text.index("[--insert_rows N ...] ")
    assert flags_missing_from(text.replace("[--insert_rows N ...] ", "", 1), "docs/commands.md", own) == \
        ["run_server.py --insert_rows"]


def test_the_gpu_suite_table_lives_between_its_markers_in_docs_and_is_current(tmp_path):
    """The suite's --readme rewrites docs/gpu_suite.md's table between its markers; regenerated from the committed
    results, it equals the committed page (no other file holds the markers)."""
    from benchmarks import suite

    page = os.path.join(ROOT, "docs", "gpu_suite.md")
    holders = [p for p in DOC_FILES if suite.BEGIN in open(p).read()]
    assert holders == [page]
    results = tmp_path / "suite"
    shutil.copytree(os.path.join(ROOT, "benchmarks", "results", "h100", "suite"), results)
    copy = tmp_path / "gpu_suite.md"
    shutil.copy(page, copy)
    suite.update_readme(str(copy), str(results))
    fresh = copy.read_text().replace(os.path.relpath(str(results), suite.ROOT), "benchmarks/results/h100/suite")
    fresh = fresh.replace(os.path.relpath(str(copy), suite.ROOT), "docs/gpu_suite.md")
    assert fresh == open(page).read()


# a parse that reads a flag that is not the driver's own, or a preset that is gone, must fail the checks above
def test_the_checks_catch_a_wrong_flag_and_a_wrong_preset():
    (where, script, args, _), = [c for c in COMMANDS if c[1] == "run_validation.py" and c[3]][:1]
    known = flags_of(parser_of(script))
    assert "--nmu_beams" not in known and "--num_beams" in known
    assert list(flag_tokens(["--load", "x", "[--nmu_beams", "4]"])) == ["--load", "--nmu_beams"]
    assert list(preset_values(["--config", "tinyy", "--steps", "3"], {"--config": "finetuning"})) == \
        [("--config", "tinyy", "finetuning")] and "tinyy" not in presets("finetuning")
    assert list(preset_values(["--config", "PRESET"], {"--config": "finetuning"})) == []  # a placeholder
    with pytest.raises(SystemExit):
        parser_of("run_validation.py").parse_args(["--load", "x", "--nmu_beams", "4"])


def test_every_long_test_named_exists_and_ci_leaves_out_the_long_ones():
    """tests/long.txt names tests that exist (a renamed test would silently rejoin CI), with their parameters where
    the test is parametrized; CI's .ci/run runs the README's command, which leaves out the `long` marker as the
    Makefile's `make test` does, and `make test-all` does not."""
    import ast

    from tests.conftest import long_tests

    listed = long_tests()
    assert len(listed) > 20
    for test_id in listed:
        path, _, name = test_id.partition("::")
        base, _, params = name.partition("[")
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        funcs = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
        assert base in funcs, f"tests/long.txt names {test_id}, which does not exist"
        parametrized = any(isinstance(d, ast.Call) and getattr(d.func, "attr", "") == "parametrize"
                           for d in funcs[base].decorator_list)
        assert bool(params) == parametrized, f"{test_id}: name its parameters exactly when it has some"
    make = open(os.path.join(ROOT, "Makefile")).read()
    assert re.search(r'^TESTS \?= -m "not long" ', make, re.M)
    assert re.search(r"^test-all:.*\n\t.*pytest(?!.*not long).*tests$", make, re.M)
    readme = open(os.path.join(ROOT, "README.md")).read()
    command = 'pytest -q -ra --durations=15 -m "not long" -n 2 --dist loadfile tests'
    assert command in readme
    assert f"python3 -m {command}" in open(os.path.join(ROOT, ".ci", "run")).read()  # CI runs the README's command
