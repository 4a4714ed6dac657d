"""The structure stays as it is made: one owner for each kind of knowledge, floors that import only downwards, no
import circles, thin drivers over a library, and the engine reading resolved objects rather than the config.

Floors, lowest first (a module may import its own floor and those below it):

    utils       the base helpers: errors, the hub, checkpoint files, host calls from a program
    config      the typed config, presets, validation
    modelling   the model families (one module each, plus the registry) and what they share
    data        rows, tasks, tokenisation, batches
    partitioning  what training and decoding both build on: placement (mesh, sharding, the tree), LoRA's base,
                the memory plan's shared part, device memory
    graphs      the training graphs: phase programs, executors, the optimizer, training's memory plan
    decoder     decoding as an engine of its own (nothing of graphs/): its weights' layout, search and slot
                programs, its plan
    app         the library under the drivers: training, prediction, evaluation, export, process set-up, flags
    serving     the server: a scheduler of decode slots and its HTTP layer
    (top)       the drivers, the benchmarks, the notebook

Tests are found by module: tests/ mirrors the packages (tests/app/test_trainer.py states app/trainer.py's contract),
the drivers' end-to-end tests are in tests/drivers/, and docs/testing.md's table maps every module to the test files
that state its contract, which import it (or the table says why not).

Every rule is a function of a tree of sources ({path: text}); each test runs it on the project and on a small
synthetic tree that breaks it, so that a rule that could never fail would fail its own test.
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

from modelling import registry

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTING = ROOT / "docs" / "testing.md"
TABLE = "## Where each module is tested"  # docs/testing.md's section holding the table from module to test files
FLOORS = {"utils": 0, "config": 1, "modelling": 2, "data": 3, "partitioning": 4, "graphs": 5, "decoder": 5, "app": 6,
          "serving": 7}
# Training's modules (the optimizer, the executors, the training data path): nothing decoding imports reaches them
TRAINING = ("graphs.graphs", "graphs.optim", "graphs.executor", "graphs.fused", "graphs.phased", "graphs.phases",
            "data.loader", "data.cache", "data.mixture", "app.train_data", "app.trainer", "app.resume")
DECODING = ("decoder", "serving")  # the packages of the decoding path
TRAINING_LIBRARIES = ("optax",)
DATA_LIBRARIES = ("datasets",)  # the data sets' library: nothing on the decoding path imports it
TOP = 8  # the drivers (top-level scripts) and benchmarks/
DRIVERS = ("run_finetuning", "run_validation", "run_inference", "run_export", "run_server", "finetuning",
           "inference")
# Function-level imports of project modules are how the drivers defer JAX (and orbax) until the run's devices are
# set up and keep --help fast; below the top floor they would hide circles. The exceptions, each with its reason:
DEFERRED = {("app/args.py", "utils.checkpoint"): "orbax is slow to import: --help and config errors need not pay for it",
            ("app/predict.py", "app.hf_generate"): "torch: imported only when HF generate's outputs are compared",
            ("app/predict.py", "data.sources"): "datasets: run_server.py reads its decoding config and plan here, no data",
            ("app/predict.py", "data.mixture"): "datasets: run_server.py reads its decoding config and plan here, no data"}
# A family's name outside modelling/: the config field's own default (the config cannot ask the registry: it sits
# below modelling).
NAMED = {("config/schema.py", "t5")}
LONGEST = 60  # lines of a function


def project() -> dict:
    """{path relative to the root: source} of the project's Python files (tests excluded)."""
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in (".git", "tests") or any(part.startswith(".") for part in rel.parts):
            continue
        out[str(rel)] = p.read_text()
    return out


def sources_of_tests() -> dict:
    """{path relative to the root: source} of tests/'s Python files, its folders' included."""
    return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tests").rglob("*.py"))}


@pytest.fixture(scope="module")
def tree() -> dict:
    return project()


def _module(rel: str) -> str:
    parts = list(pathlib.PurePath(rel).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    return FLOORS.get(module.split(".")[0], TOP)


def _is_driver(module: str) -> bool:
    return module in DRIVERS


def imports(tree: dict) -> dict:
    """{module: (path, [(imported project module, line, inside a function)])} of a tree, every import."""
    modules = {_module(f) for f in tree}
    out = {}
    for rel, text in tree.items():
        parsed = ast.parse(text)
        inside = {id(n) for f in ast.walk(parsed) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        found = []
        for node in ast.walk(parsed):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # ``from pkg import mod`` imports pkg.mod when that is a module, else a name of pkg
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                         for a in node.names]
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name:
                    found.append((name, node.lineno, id(node) in inside))
        out[_module(rel)] = (rel, found)
    return out


# --------------------------------------------------------------------------- the rules


def upward_imports(tree: dict) -> list:
    return [f"{f}:{line} ({m}, floor {_floor(m)}) imports {dep} (floor {_floor(dep)})"
            for m, (f, deps) in imports(tree).items() for dep, line, _ in deps if _floor(dep) > _floor(m)]


def driver_imports(tree: dict) -> list:
    """A driver (run_*.py, finetuning.py, inference.py) imported by anything: what is shared lives in the library."""
    return [f"{f}:{line} ({m}) imports the driver {dep}: move what it needs into the library (app/)"
            for m, (f, deps) in imports(tree).items() for dep, line, _ in deps if _is_driver(dep) and dep != m]


def import_circles(tree: dict) -> list:
    """Every import counts, deferred ones too: a function-level import does not make a circle go away."""
    edges = {m: {d for d, _, _ in deps if d != m} for m, (_, deps) in imports(tree).items()}
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    return cycles


def deferred_imports(tree: dict) -> list:
    return [f"{f}:{line} defers the import of {dep} (import at the top of the module, or give DEFERRED a reason)"
            for m, (f, deps) in imports(tree).items() if _floor(m) < TOP
            for dep, line, deferred in deps if deferred and (f, dep) not in DEFERRED]


def late_standard_library(tree: dict) -> list:
    """A function-level import defers a heavy library (JAX, torch, orbax, matplotlib...); the standard library costs
    nothing to import, so it is imported where a reader looks for it: at the top of the module."""
    offenders = []
    for rel, text in tree.items():
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module] \
                        if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                    offenders += [f"{rel}:{node.lineno} imports {n} in {fn.name}" for n in names
                                  if n.split(".")[0] in sys.stdlib_module_names]
    return offenders


def family_questions(tree: dict, names: set, specific_keys: set) -> list:
    """Outside modelling/ nothing asks which family a run has, what kind it is, or what its batches hold: no family
    name ('t5', 'gptj'), no comparison of a ``family`` value, no ``.causal`` read, and no batch key only some
    families have (``decoder_input_ids`` ...): the family answers (its row format, prompt layout, decoding)."""
    out = []
    for rel, text in tree.items():
        if rel.split("/")[0] == "modelling":
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if node.value in names and (rel, node.value) not in NAMED:
                    out.append(f"{rel}:{node.lineno} names the family {node.value!r}")
                if node.value in specific_keys:
                    out.append(f"{rel}:{node.lineno} builds the batch key {node.value!r}: the family's row format "
                               "does (modelling/)")
            if isinstance(node, ast.Attribute) and node.attr == "causal":
                out.append(f"{rel}:{node.lineno} branches on .causal: ask the family for what differs")
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    key = side.attr if isinstance(side, ast.Attribute) else getattr(side.slice, "value", None) \
                        if isinstance(side, ast.Subscript) else None
                    if key == "family":
                        out.append(f"{rel}:{node.lineno} compares a family name: ask the family (modelling/family.py)")
    return out


def _libraries(tree: dict, wanted: tuple) -> dict:
    """{module: the libraries of ``wanted`` it imports (top-level names, function-level imports included)}."""
    out = {}
    for rel, text in tree.items():
        names = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[_module(rel)] = names & set(wanted)
    return out


def _decoding_path(tree: dict) -> dict:
    """{every module of decoder/ and serving/: {each module it imports in turn (itself included): the import path
    from it}}, every import counted (deferred ones too)."""
    found = imports(tree)
    edges = {m: {d for d, _, _ in deps} for m, (_, deps) in found.items()}
    out = {}
    for start in sorted(m for m in found if m.split(".")[0] in DECODING):
        path, todo = {start: [start]}, [start]
        while todo:
            m = todo.pop()
            for d in sorted(edges.get(m, ())):
                if d not in path:
                    path[d] = path[m] + [d]
                    todo.append(d)
        out[start] = path
    return out


def _reaching(tree: dict, modules, libraries: tuple) -> list:
    """The decoding path's modules reaching a module that ``modules(name)`` says yes to, or one of ``libraries``."""
    libs = _libraries(tree, libraries)
    out = []
    for start, path in _decoding_path(tree).items():
        out += [f"{start} reaches {m} ({' -> '.join(path[m])})" for m in sorted(path) if modules(m)]
        out += [f"{start} reaches {lib} ({' -> '.join(path[m])})" for m in sorted(path) for lib in sorted(libs.get(m, ()))]
    return out


def training_on_the_decoding_path(tree: dict) -> list:
    """Decoding is an engine of its own: every module of decoder/ and serving/, and everything they import in turn,
    stays clear of training's modules (the optimizer, the executors, the training data path: ``TRAINING``) and of
    the optimizer's library, so that a server or a validation run never builds, imports or waits for them."""
    return _reaching(tree, lambda m: m.startswith(TRAINING), TRAINING_LIBRARIES)


def graphs_on_the_decoding_path(tree: dict) -> list:
    """decoder/ and serving/ build on partitioning/ (placement, sharding, LoRA's base, the memory plan's shared part),
    never on graphs/, the training graphs: nothing they import, in turn, is a module of graphs/."""
    return _reaching(tree, lambda m: m.split(".")[0] == "graphs", ())


def data_library_on_the_decoding_path(tree: dict) -> list:
    """Nothing decoder/ and serving/ import, in turn, imports Hugging Face ``datasets`` (``DATA_LIBRARIES``): a server
    reads its tokenizer and its padding id from data/tokenizer.py, never from the data sets' modules (data/tasks.py
    -> data/sources.py), and never waits for the data library's import."""
    return _reaching(tree, lambda m: False, DATA_LIBRARIES)


def engine_reading_config(tree: dict) -> list:
    """graphs/ and partitioning/: the config is resolved once (partitioning/placement.py: the family, its options,
    the mesh and the weights' layouts; graphs/graphs.py: the updater and the step options); the executors, programs
    and plans read those, never ``cfg`` parked on an object."""
    return [f"{rel}:{node.lineno} reads .cfg" for rel, text in tree.items()
            if rel.startswith(("graphs/", "partitioning/")) and rel not in ("graphs/graphs.py",
                                                                            "partitioning/placement.py")
            for node in ast.walk(ast.parse(text)) if isinstance(node, ast.Attribute) and node.attr == "cfg"]


def long_functions(tree: dict) -> list:
    """In the engine, the families, the drivers and the benchmarks: a longer function is split by what it does."""
    return [f"{rel}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines" for rel, text in tree.items()
            for node in ast.walk(ast.parse(text))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= LONGEST]


def imports_of_test_modules(tree: dict) -> list:
    """A test module imported by another (or by a helper): what both need is a helper of its own (tests/helpers.py,
    tests/hf_utils.py, a fixture), so that each test module can be read, run and changed alone."""
    return [f"{f}:{line} ({m}) imports the test module {dep}: move what it needs into tests/helpers.py"
            for m, (f, deps) in imports(tree).items() for dep, line, _ in deps
            if dep.rpartition(".")[2].startswith("test_") and dep != m]


def module_table(text: str) -> dict:
    """{path: ([test files], why)} of docs/testing.md's table (its section ``TABLE``): a row a module (or another file
    whose contract tests state: the README, the Makefile, the notebook), the test files that state its contract, and
    why none of them imports it, where none does (else empty)."""
    rows = {}
    for line in text.split(TABLE, 1)[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            rows[cells[0].strip("`")] = ([f.strip() for f in cells[1].split(",") if f.strip() not in ("", "—")],
                                         cells[2])
    return rows


def _is_test(module: str) -> bool:
    return module.split(".")[0] == "tests" and module.rpartition(".")[2].startswith("test_")


def importers(tree: dict) -> dict:
    """{project module: {test files importing it}} of a tree of the project's and the tests' sources: imported by the
    test file itself or by a helper module of tests/ that it imports (tests/toy_family.py, tests/hf_utils.py ...)."""
    found = imports(tree)
    out = {}
    for m, (path, _) in found.items():
        if not _is_test(m):
            continue
        seen, todo = set(), [m]
        while todo:
            for d, _, _ in found[todo.pop()][1]:
                if d not in seen:
                    seen.add(d)
                    if d.split(".")[0] == "tests" and not _is_test(d):
                        todo.append(d)
        for d in seen:
            if d.split(".")[0] != "tests":
                out.setdefault(d, set()).add(path)
    return out


def table_problems(tree: dict, rows: dict, others: set) -> list:
    """docs/testing.md's table against a tree of sources: every module of the project (``__init__.py`` aside) has a
    row, every row names a module of the tree or one of ``others`` (files that exist), every test file a row names
    exists, every module is imported by a test file of its row or the row says why not in one line (and only then),
    and every test file of tests/ is named in a row."""
    modules = {p for p in tree if p.endswith(".py") and not p.startswith("tests/") and not p.endswith("__init__.py")}
    test_files = {p for p in tree if _is_test(_module(p))}
    by = importers(tree)
    out = [f"{m} has no row in docs/testing.md's table" for m in sorted(modules - set(rows))]
    for path, (files, why) in sorted(rows.items()):
        if path not in modules and path not in others:
            out.append(f"{path}'s row names no file of the project")
        out += [f"{path}'s row names {f}, which does not exist" for f in files if f not in test_files]
        if path in modules:
            importing = sorted(set(files) & by.get(_module(path), set()))
            if not importing and not why:
                out.append(f"{path} is imported by none of {', '.join(files) or 'no test file'}: name one that "
                           "imports it, or say why not in its row")
            if importing and why:
                out.append(f"{path}'s row says why not imported, but {importing[0]} imports it")
    named = {f for files, _ in rows.values() for f in files}
    out += [f"{f} is named in no row of docs/testing.md's table" for f in sorted(test_files - named)]
    return out


def _family_facts() -> tuple:
    names = set(registry.names()) | set(registry.hf_model_types())
    keys = [set(f.batch_keys) for f in registry.FAMILIES.values()]
    return names, set().union(*keys) - set.intersection(*keys)


# --------------------------------------------------------------------------- each rule on the project, and biting


def _bites(rule, tree: dict, *args, expect: str) -> None:
    found = rule(tree, *args)
    assert found and any(expect in x for x in found), (rule.__name__, found)


def test_no_module_imports_a_floor_above_its_own(tree):
    assert not upward_imports(tree), "\n".join(upward_imports(tree))
    _bites(upward_imports, {"utils/a.py": "import graphs.b\n", "graphs/b.py": ""}, expect="utils/a.py:1")
    _bites(upward_imports, {"app/a.py": "from serving import b\n", "serving/b.py": ""}, expect="imports serving.b")


def test_no_driver_is_imported_by_anything(tree):
    """Drivers parse, build and call; another driver, a benchmark or the library importing one means the code it
    wants lives in the wrong place."""
    assert not driver_imports(tree), "\n".join(driver_imports(tree))
    _bites(driver_imports, {"run_inference.py": "from run_validation import Validator\n", "run_validation.py": ""},
           expect="imports the driver run_validation")
    _bites(driver_imports, {"benchmarks/x.py": "import finetuning\n", "finetuning.py": ""},
           expect="benchmarks/x.py:1")


def test_no_test_module_imports_another():
    found = imports_of_test_modules(sources_of_tests())
    assert not found, "\n".join(found)
    _bites(imports_of_test_modules, {"tests/test_a.py": "from tests.test_b import params_at\n", "tests/test_b.py": ""},
           expect="tests/test_a.py:1")
    _bites(imports_of_test_modules, {"tests/test_a.py": "def f():\n    from tests import test_b as B\n",
                                 "tests/test_b.py": ""}, expect="imports the test module tests.test_b")


def test_no_import_circles(tree):
    assert not import_circles(tree), "\n".join(import_circles(tree))
    _bites(import_circles, {"data/a.py": "import data.b\n", "data/b.py": "def f():\n    import data.a\n"},
           expect="data.a -> data.b -> data.a")


def test_deferred_imports_only_in_the_drivers(tree):
    assert not deferred_imports(tree), "\n".join(deferred_imports(tree))
    _bites(deferred_imports, {"graphs/a.py": "def f():\n    import data.b\n", "data/b.py": ""},
           expect="graphs/a.py:2 defers")
    assert not deferred_imports({"run_x.py": "def main():\n    import data.b\n", "data/b.py": ""})  # drivers may


def test_the_standard_library_is_imported_at_the_top(tree):
    assert not late_standard_library(tree), "\n".join(late_standard_library(tree))
    _bites(late_standard_library, {"app/a.py": "def f():\n    import json\n"}, expect="imports json in f")


def test_only_modelling_asks_what_a_family_is(tree):
    names, keys = _family_facts()
    assert {"decoder_input_ids", "decoder_attention_mask"} <= keys and "input_ids" not in keys
    offenders = family_questions(tree, names, keys)
    assert not offenders, "\n".join(offenders)
    _bites(family_questions, {"data/a.py": "x = 'gptj'\n"}, names, keys, expect="names the family 'gptj'")
    _bites(family_questions, {"app/a.py": "if family.causal:\n    pass\n"}, names, keys, expect="branches on .causal")
    _bites(family_questions, {"data/a.py": "row = {'decoder_input_ids': 1}\n"}, names, keys,
           expect="builds the batch key 'decoder_input_ids'")
    _bites(family_questions, {"app/a.py": "ok = cfg.model.family == name\n"}, names, keys, expect="compares")
    assert not family_questions({"modelling/x.py": "if self.causal:\n    k = 'decoder_input_ids'\n"}, names, keys)


def test_nothing_on_the_decoding_path_imports_training(tree):
    assert not training_on_the_decoding_path(tree), "\n".join(training_on_the_decoding_path(tree))
    _bites(training_on_the_decoding_path, {"decoder/a.py": "import graphs.b\n", "graphs/b.py": "import graphs.optim\n",
                                           "graphs/optim.py": ""}, expect="decoder.a -> graphs.b -> graphs.optim")
    _bites(training_on_the_decoding_path, {"serving/a.py": "from data import mixture\n", "data/mixture.py": ""},
           expect="serving.a reaches data.mixture")
    _bites(training_on_the_decoding_path, {"serving/a.py": "import graphs.b\n", "graphs/b.py": "import optax\n"},
           expect="serving.a reaches optax")
    assert not training_on_the_decoding_path({"app/a.py": "import graphs.optim\n", "graphs/optim.py": ""})


def test_the_decoding_path_imports_nothing_of_graphs(tree):
    assert not graphs_on_the_decoding_path(tree), "\n".join(graphs_on_the_decoding_path(tree))
    _bites(graphs_on_the_decoding_path, {"decoder/a.py": "from graphs.state import fingerprint\n",
                                         "graphs/state.py": ""}, expect="decoder.a reaches graphs.state")
    _bites(graphs_on_the_decoding_path, {"serving/a.py": "import decoder.b\n", "graphs/host_state.py": "",
                                         "decoder/b.py": "def f():\n    from graphs import host_state\n"},
           expect="serving.a -> decoder.b -> graphs.host_state")
    assert not graphs_on_the_decoding_path({"decoder/a.py": "from partitioning import sharding\n",
                                            "partitioning/sharding.py": "", "app/b.py": "import graphs.plan\n",
                                            "graphs/plan.py": ""})  # (partitioning/, and graphs/ off the path)


def test_nothing_on_the_decoding_path_imports_the_data_library(tree):
    assert not data_library_on_the_decoding_path(tree), "\n".join(data_library_on_the_decoding_path(tree))
    _bites(data_library_on_the_decoding_path, {"serving/a.py": "from data.tasks import pad_id\n",
                                               "data/tasks.py": "from data.sources import Rows\n",
                                               "data/sources.py": "import datasets\n"},
           expect="serving.a reaches datasets (serving.a -> data.tasks -> data.sources)")
    _bites(data_library_on_the_decoding_path, {"decoder/a.py": "def f():\n    from datasets import load_dataset\n"},
           expect="decoder.a reaches datasets (decoder.a)")
    assert not data_library_on_the_decoding_path({"decoder/a.py": "from data import tokenizer\n",
                                                  "data/tokenizer.py": "import numpy\n",
                                                  "app/b.py": "import datasets\n"})


def test_the_engine_reads_resolved_objects_not_the_config(tree):
    assert not engine_reading_config(tree), "\n".join(engine_reading_config(tree))
    _bites(engine_reading_config, {"graphs/phased.py": "x = self.g.cfg.model\n"}, expect="graphs/phased.py:1")
    _bites(engine_reading_config, {"partitioning/plan.py": "x = g.cfg\n"}, expect="partitioning/plan.py:1")
    assert not engine_reading_config({"graphs/graphs.py": "x = self.cfg\n"})  # where the config is resolved


def test_no_function_over_60_lines(tree):
    assert not long_functions(tree), "\n".join(long_functions(tree))
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST))
    _bites(long_functions, {"app/a.py": f"def f():\n{body}"}, expect="f: 61 lines")


def test_docs_testing_md_maps_every_module_to_the_tests_that_state_its_contract(tree):
    """A reader who opens a module finds its tests: docs/testing.md's table names, for every module, the test files
    that state its contract, and one of them imports it (or the row says why not)."""
    rows = module_table(TESTING.read_text())
    others = {p for p in rows if not p.endswith(".py") and (ROOT / p).exists()}
    found = table_problems({**tree, **sources_of_tests()}, rows, others)
    assert not found, "\n".join(found)
    small = {"data/a.py": "", "data/b.py": "", "tests/data/test_a.py": "from data import a\n",
             "tests/helpers.py": "import data.b\n", "tests/data/test_b.py": "from tests.helpers import x\n"}
    ok = {"data/a.py": (["tests/data/test_a.py"], ""), "data/b.py": (["tests/data/test_b.py"], ""),
          "Makefile": (["tests/data/test_b.py"], "")}
    assert not table_problems(small, ok, {"Makefile"})  # (data/b.py imported through the helper)
    _bites(table_problems, small, {k: v for k, v in ok.items() if k != "data/b.py"}, {"Makefile"},
           expect="data/b.py has no row")
    _bites(table_problems, small, ok, set(), expect="Makefile's row names no file")
    _bites(table_problems, small, {**ok, "data/b.py": (["tests/data/test_c.py"], "")}, {"Makefile"},
           expect="names tests/data/test_c.py, which does not exist")
    _bites(table_problems, small, {**ok, "data/a.py": (["tests/data/test_b.py"], "")}, {"Makefile"},
           expect="data/a.py is imported by none of tests/data/test_b.py")
    _bites(table_problems, small, {**ok, "data/a.py": (["tests/data/test_a.py"], "run by a driver")}, {"Makefile"},
           expect="says why not imported, but tests/data/test_a.py imports it")
    _bites(table_problems, {**small, "tests/data/test_c.py": ""}, ok, {"Makefile"},
           expect="tests/data/test_c.py is named in no row")
    assert module_table(f"# T\n\n{TABLE}\n\n| module | tests | why |\n|---|---|---|\n"
                        "| `data/a.py` | tests/data/test_a.py, tests/data/test_b.py | |\n| `x.py` | — | run by hand |\n"
                        "\n## Next\n\n| `y.py` | tests/test_y.py | |\n") == {
        "data/a.py": (["tests/data/test_a.py", "tests/data/test_b.py"], ""), "x.py": ([], "run by hand")}
