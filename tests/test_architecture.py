"""The structure stays as it is made: one owner for each kind of knowledge, floors that import only downwards, no
import circles, and the engine reading resolved objects rather than the config.

Floors, lowest first (a module may import its own floor and those below it):

    utils       the base helpers: errors, the hub, checkpoint files
    config      the typed config, presets, validation
    modelling   the model families (one module each, plus the registry) and what they share
    data        rows, tasks, tokenisation, batches
    graphs      the engine: mesh, sharding, phase programs, executors, memory plan
    app         what the drivers share: arguments, process set-up, logging, run directories, tracking
    serving     the server: the scheduler over the decoding slots, the engine, the HTTP layer
    (top)       the drivers, the benchmarks, the notebook
"""

from __future__ import annotations

import ast
import os
import pathlib
import sys

import pytest

from modelling import registry

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLOORS = {"utils": 0, "config": 1, "modelling": 2, "data": 3, "graphs": 4, "app": 5, "serving": 6}
TOP = 7  # the drivers (top-level scripts) and benchmarks/
# Function-level imports of project modules are how the drivers defer JAX (and orbax) until the run's devices are
# set up and keep --help fast; below the top floor they would hide circles. The exceptions, each with its reason:
DEFERRED = {("app/args.py", "utils.checkpoint"): "orbax is slow to import: --help and config errors need not pay for it",
            ("app/predict.py", "app.hf_generate"): "torch: imported only when HF generate's outputs are compared"}
# A family's name outside modelling/: the config field's own default (the config cannot ask the registry: it sits
# below modelling).
NAMED = {("config/schema.py", "t5")}


def _sources() -> list:
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if rel.parts[0] in (".git", "tests") or any(part.startswith(".") for part in rel.parts):
            continue
        out.append(rel)
    return out


def _module(rel: pathlib.PurePath) -> str:
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    return FLOORS.get(module.split(".")[0], TOP)


def _imports(rel: pathlib.PurePath, modules: set) -> list:
    """[(imported project module, line, inside a function)] of a file, every import (module-level and deferred)."""
    tree = ast.parse((ROOT / rel).read_text())
    inside = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
              for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
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
                out.append((name, node.lineno, id(node) in inside))
    return out


@pytest.fixture(scope="module")
def graph() -> dict:
    """{module: {(imported module, line, deferred)}} of the project (tests excluded)."""
    files = _sources()
    modules = {_module(f) for f in files}
    return {_module(f): (f, _imports(f, modules)) for f in files}


def test_no_module_imports_a_floor_above_its_own(graph):
    offenders = [f"{f}:{line} ({_module(f)}, floor {_floor(m)}) imports {dep} (floor {_floor(dep)})"
                 for m, (f, deps) in graph.items() for dep, line, _ in deps if _floor(dep) > _floor(m)]
    assert not offenders, "\n".join(offenders)


def test_no_import_circles(graph):
    """Every import counts, deferred ones too: a function-level import does not make a circle go away."""
    edges = {m: {d for d, _, _ in deps if d != m} for m, (_, deps) in graph.items()}
    # packages' __init__ import their own modules; a module importing ``pkg.mod`` does not import pkg's others
    cycles, state, stack = [], {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(edges.get(m, ())):
            if state.get(d) == 1:
                cycles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_deferred_imports_only_in_the_drivers(graph):
    offenders = [f"{f}:{line} defers the import of {dep}" for m, (f, deps) in graph.items() if _floor(m) < TOP
                 for dep, line, deferred in deps if deferred and (str(f), dep) not in DEFERRED]
    assert not offenders, "\n".join(offenders) + "\n(import at the top of the module, or give DEFERRED a reason)"


def test_the_standard_library_is_imported_at_the_top():
    """A function-level import defers a heavy library (JAX, torch, orbax, matplotlib...); the standard library costs
    nothing to import, so it is imported where a reader looks for it: at the top of the module."""
    offenders = []
    for rel in _sources():
        for fn in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(fn):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module] \
                        if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                    offenders += [f"{rel}:{node.lineno} imports {n} in {fn.name}" for n in names
                                  if n.split(".")[0] in sys.stdlib_module_names]
    assert not offenders, "\n".join(offenders)


def _family_questions(rel: pathlib.PurePath, names: set) -> list:
    tree = ast.parse((ROOT / rel).read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names \
                and (str(rel), node.value) not in NAMED:
            out.append(f"{rel}:{node.lineno} names the family {node.value!r}")
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                key = side.attr if isinstance(side, ast.Attribute) else getattr(side.slice, "value", None) \
                    if isinstance(side, ast.Subscript) else None
                if key == "family":
                    out.append(f"{rel}:{node.lineno} compares a family name: ask the family (modelling/family.py)")
    return out


def test_only_modelling_names_a_family():
    """Outside modelling/ nothing asks which family a run has: it asks the family (causal, left_pad_prompts,
    encode_inputs, decode_start ...). The names are the registry's and the HF model types it loads."""
    names = set(registry.names()) | set(registry.hf_model_types())
    offenders = [x for f in _sources() if f.parts[0] != "modelling" for x in _family_questions(f, names)]
    assert not offenders, "\n".join(offenders)


def test_the_engine_reads_resolved_objects_not_the_config():
    """graphs/: the config is resolved once into Graphs (graphs/graphs.py: the family, options, updater, step
    options); the executors, programs and plans read those, never ``cfg`` parked on an object."""
    offenders = []
    for p in sorted((ROOT / "graphs").glob("*.py")):
        if p.name == "graphs.py":
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "cfg":
                offenders.append(f"graphs/{p.name}:{node.lineno} reads .cfg")
    assert not offenders, "\n".join(offenders)


def test_no_function_over_60_lines():
    """In the engine, the families, the drivers and the benchmarks: a longer function is split by what it does."""
    long = []
    for rel in _sources():
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{rel}:{node.lineno} {node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)


def test_a_new_family_is_one_module_and_one_registry_line():
    """Every registered family implements the whole interface (an abstract method left out cannot be
    instantiated), and the registry is the one list of families: the HF model types come from it."""
    for name, family in registry.FAMILIES.items():
        assert family.name == name and family.hf_model_types
        assert not getattr(type(family), "__abstractmethods__", None)
    types = registry.hf_model_types()
    assert {types[t] for t in types} == set(registry.names())
    text = (ROOT / "modelling" / "registry.py").read_text()
    assert text.count("Family()") == len(registry.FAMILIES)  # one entry a family, in one place
    assert os.path.isfile(ROOT / "modelling" / "family.py")


def test_model_options_are_derived_from_the_config():
    """ModelOptions is no hand copy: every field of the config's model section is an option of the same name."""
    import dataclasses

    from config.presets import load_config
    from config.schema import FIELDS
    from modelling.family import EXECUTION_FIELDS, ModelOptions

    names = {f.name for f in dataclasses.fields(ModelOptions)}
    assert names == {f for f, r in FIELDS.items() if r.path[0] in ("model", "lora")} | set(EXECUTION_FIELDS)
    cfg = load_config("finetuning", "tiny", {"layers": 3, "dropout_prob": 0.1})
    opts = ModelOptions.from_config(cfg)
    assert (opts.layers, opts.dropout_prob, opts.relative_attention_num_buckets) == (3, 0.1, 32)
    cfg.model.eval = True
    assert ModelOptions.from_config(cfg).dropout_prob == 0.0  # no dropout when built for evaluation
    hash(opts)  # static under jit


def test_ipu_only_fields_are_said_once_never_silently_ignored(caplog):
    from app.args import make_config

    with caplog.at_level("WARNING", logger="flan_t5"):
        make_config("finetuning", "tiny", {})
    assert not [r for r in caplog.records if "IPUs" in r.getMessage()]
    with caplog.at_level("WARNING", logger="flan_t5"):
        make_config("finetuning", "tiny", {"io_tiles": 128, "available_memory_proportion": [0.2]})
    said = [r.getMessage() for r in caplog.records if "IPUs" in r.getMessage()]
    assert len(said) == 2 and "io_tiles=128" in said[0] and "no effect" in said[0]


def test_each_family_names_the_shape_fields_it_reads():
    from config.schema import MODEL_SHAPE

    for family in registry.FAMILIES.values():
        assert set(family.shape_fields) <= set(MODEL_SHAPE) and "family" in family.shape_fields
    assert "relative_attention_num_buckets" not in registry.get("gptj").shape_fields
    assert "rotary_dim" not in registry.get("t5").shape_fields
