"""Presets load and validate; each bad config names the field and the fix."""

import os

import pytest
import yaml

from config import ConfigError, load_config, read_presets, preset_path
from config.presets import config_from_mapping, dumps_yaml
from config.schema import FIELDS
from app.args import parse_config

FINETUNING = ["tiny", "xl_pod8", "xl_pod16", "xxl_1gpu", "xxl_pod16", "xxl_pod64", "small", "base", "large",
              "gptj_6B_1024_pod64", "gptj_6B_1024_pod16", "gptj_1gpu", "gptj_small", "gptj_tiny",
              "mt5_xl_pod8", "mt5_xxl_pod16", "mt5_xl_1gpu", "umt5_xl_pod8", "umt5_xl_1gpu", "ul2_1gpu", "ul2_pod16",
              "tiny_headlines", "tiny_mixture", "gptj_tiny_headlines", "base_samsum", "gptj_lora_1gpu", "xxl_lora_1gpu",
              "ul2_lora_1gpu"]
INFERENCE = ["tiny", "xl", "xl-mnli", "xxl", "xxl-mnli", "small", "base", "large", "gpt-j", "gpt-j-mnli", "gptj_small",
             "gptj_tiny"]


def test_preset_files_hold_exactly_the_documented_presets():
    assert list(read_presets(preset_path("finetuning"))) == [
        "xxl_pod64", "xxl_1gpu", "xxl_pod16", "xl_pod16", "xl_pod8", "large", "base", "small", "tiny",
        "gptj_6B_1024_pod64", "gptj_6B_1024_pod16", "gptj_1gpu", "gptj_lora_1gpu", "xxl_lora_1gpu", "ul2_lora_1gpu",
        "gptj_small",
        "gptj_tiny", "tiny_headlines", "tiny_mixture",
        "gptj_tiny_headlines", "base_samsum", "mt5_xl_pod8",
        "mt5_xxl_pod16", "mt5_xl_1gpu", "umt5_xl_pod8", "umt5_xl_1gpu", "ul2_1gpu", "ul2_pod16"]
    assert set(read_presets(preset_path("inference"))) == set(INFERENCE)


@pytest.mark.parametrize("name", FINETUNING)
def test_finetuning_presets_load_and_validate(name):
    cfg = load_config("finetuning", name)
    assert cfg.gradient_accumulation * cfg.execution.data_parallel * cfg.execution.micro_batch_size == \
        cfg.training.global_batch_size


@pytest.mark.parametrize("name", INFERENCE)
def test_inference_presets_load_and_validate(name):
    assert load_config("inference", name).model.eval


def test_t5_family_presets_have_the_checkpoints_shapes():
    """The shapes of google/mt5-xl, mt5-xxl, umt5-xl and flan-ul2 (their config.json)."""
    shape = lambda c: (c.model.family, c.model.layers, c.model.decoder_depth, c.model.hidden_size,  # noqa: E731
                       c.model.d_ff, c.model.attention.heads, c.model.attention.d_kv, c.model.embedding.vocab_size,
                       c.model.feed_forward_proj, c.model.tie_word_embeddings)
    assert shape(load_config("finetuning", "mt5_xl_pod8")) == ("t5", 24, 24, 2048, 5120, 32, 64, 250112, "gated-gelu",
                                                               False)
    assert shape(load_config("finetuning", "mt5_xxl_pod16")) == ("t5", 24, 24, 4096, 10240, 64, 64, 250112,
                                                                 "gated-gelu", False)
    assert shape(load_config("finetuning", "umt5_xl_1gpu")) == ("umt5", 24, 24, 2048, 5120, 32, 64, 256384,
                                                                "gated-gelu", False)
    assert shape(load_config("finetuning", "ul2_pod16")) == ("t5", 32, 32, 4096, 16384, 16, 256, 32128, "gated-silu",
                                                             False)
    assert load_config("finetuning", "mt5_xl_1gpu").training.optimizer.name == "adafactor"


def test_original_model_bases_and_parallelism():
    xl, xxl = load_config("finetuning", "xl_pod16"), load_config("finetuning", "xxl_pod64")
    assert (xl.model.layers, xl.model.hidden_size, xl.model.d_ff, xl.model.attention.heads, xl.model.attention.d_kv) \
        == (24, 2048, 5120, 32, 64)
    assert (xxl.model.layers, xxl.model.hidden_size, xxl.model.d_ff, xxl.model.attention.heads) == (24, 4096, 10240, 64)
    for c in (xl, xxl):
        assert (c.model.embedding.vocab_size, c.model.sequence_length) == (32128, 512)
        assert (c.model.attention.relative_attention_num_buckets, c.model.attention.relative_attention_max_distance) \
            == (32, 128)
    assert (xl.execution.data_parallel, xl.execution.tensor_parallel, xl.devices) == (2, 8, 16)
    assert (xxl.execution.data_parallel, xxl.execution.tensor_parallel, xxl.gradient_accumulation) == (4, 16, 32)


def test_overrides_apply_with_types():
    cfg = load_config("finetuning", "tiny", {"micro_batch_size": "4", "layers": 3, "learning_rate": "1e-3",
                                              "eval": "false", "checkpoint_steps": 5, "save": "x"})
    assert cfg.execution.micro_batch_size == 4 and cfg.model.layers == 3
    assert cfg.training.optimizer.learning_rate.maximum == 1e-3
    assert cfg.checkpoint.steps == 5 and cfg.training.steps == 1000
    assert cfg.gradient_accumulation == 32 // (2 * 4)


@pytest.mark.parametrize("overrides,message", [
    ({"tensor_parallel": 3}, "heads=4 is not divisible by tensor_parallel=3"),
    ({"global_batch_size": 30}, "global_batch_size=30 is not divisible by data_parallel \\* micro_batch_size"),
    ({"micro_batch_size": 0}, "micro_batch_size=0 must be at least 1"),
    ({"precision": "float64"}, "precision='float64' is not one of"),
    ({"micro_batch_size": "two"}, "micro_batch_size='two' is not a valid int"),
    ({"learning_rate": "fast"}, "learning_rate='fast' is not a valid float"),
    ({"no_such_field": 1}, "unknown config field 'no_such_field'"),
    ({"packed_decoder_length": 2}, "packed_decoder_length=2 is shorter than decoder_sequence_length=4"),
    ({"attention_serialisation": 3}, "sequence_length=64 is not divisible by attention_serialisation=3"),
])
def test_bad_values_name_the_field_and_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("finetuning", "tiny", overrides)


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ConfigError, match="unknown preset 'xxl_pod4'.*choose one of .*xxl_pod16"):
        load_config("finetuning", "xxl_pod4")


def test_unknown_yaml_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'model.attention.head'"):
        config_from_mapping({"model": {"attention": {"head": 4}}})
    with pytest.raises(ConfigError, match="is not a valid int"):
        config_from_mapping({"model": {"layers": [1, 2]}})


def test_dump_and_reload_round_trip():
    cfg = load_config("finetuning", "xl_pod16")
    again = config_from_mapping(yaml.safe_load(dumps_yaml(cfg)))
    assert again == cfg


def test_cli_flat_flags(capsys):
    cfg, args = parse_config("finetuning", "t", "tiny", ["--config", "tiny", "--micro_batch_size", "2", "--layers", "3",
                                                          "--eval", "--available_memory_proportion", "0.2", "0.3"])
    assert cfg.execution.micro_batch_size == 2 and cfg.model.layers == 3 and cfg.model.eval
    assert cfg.execution.available_memory_proportion == (0.2, 0.3)
    assert args.config == "tiny"


@pytest.mark.parametrize("argv,message", [
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--config", "nope"], "unknown preset 'nope'"),
    (["--tensor_parallel", "3"], "heads=4 is not divisible by tensor_parallel=3"),
])
def test_cli_errors_exit_nonzero_with_one_line(capsys, argv, message):
    from app.entry import entry

    with pytest.raises(SystemExit) as e:
        entry(lambda a: parse_config("finetuning", "t", "tiny", a))(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1]


def test_every_field_has_a_docstring():
    missing = [f for f, r in FIELDS.items() if not r.doc]
    assert not missing


@pytest.mark.parametrize("kind", ["finetuning", "inference"])
def test_cli_help_lists_every_field(capsys, kind):
    # Field docs are free text (a "%" in one once broke argparse's help formatting).
    with pytest.raises(SystemExit) as e:
        parse_config(kind, "t", "tiny", ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    from app.args import TRAINING_ONLY

    # the decoding drivers list every field but the training-only ones (which they still accept)
    hidden = {f for f, ref in FIELDS.items() if ref.path[0] == "training" or f in TRAINING_ONLY}
    listed = set(FIELDS) - (hidden if kind == "inference" else set())
    missing = [f for f in listed if f"--{f}" not in out]
    assert not missing
    assert not [f for f in FIELDS if f not in listed and f"--{f} " in out]
    assert ("10% faster" in out) == (kind == "finetuning")  # a "%" in a doc (unroll_layers) once broke --help


@pytest.mark.slow
def test_the_pinned_host_pool_is_sized_from_the_plan_unless_set(monkeypatch):
    """A phased run's pinned host pool is its memory plan's host bytes +80% +2 GiB (computed before JAX starts, in
    a child process on JAX's CPU backend; measured: xxl_1gpu's process peaks at 1.78x its host plan, and +10% ran
    out), at most 90% of the machine's RAM but never under the plan +10% +2 GiB; a fused run, or a pool the user
    set, is left alone; without a GPU plugin nothing is computed."""
    from app.runtime import POOL_VAR, ensure_pinned_host_memory, gpu_plugin_installed, pool_gib
    from graphs.executor import make_executor
    from graphs.graphs import Graphs
    from graphs.plan import plan

    monkeypatch.delenv(POOL_VAR, raising=False)
    assert ensure_pinned_host_memory(load_config("finetuning", "tiny"), force=True) is None and POOL_VAR not in os.environ
    cfg = load_config("finetuning", "tiny", {"phased": True, "layers": 2})
    if not gpu_plugin_installed():
        assert ensure_pinned_host_memory(cfg) is None and POOL_VAR not in os.environ
    gib = ensure_pinned_host_memory(cfg, force=True)
    host = plan(make_executor(Graphs(cfg))).host_peak
    assert gib == pool_gib(host) == int(os.environ[POOL_VAR]) == 3  # a few MiB of plan: +2 GiB, rounded up
    tib = 2 ** 40
    assert pool_gib(62 * 2 ** 30, tib) == 114  # Flan-T5-XXL's ~62 GiB on a large machine: +80%, +2 GiB
    assert pool_gib(62 * 2 ** 30, 100 * 2 ** 30) == 90  # on a 100 GiB one: 90% of its RAM
    assert pool_gib(62 * 2 ** 30, 64 * 2 ** 30) == 71  # never under the plan +10% +2 GiB (the plan refuses the run)
    monkeypatch.setenv(POOL_VAR, "7")
    assert ensure_pinned_host_memory(cfg, force=True) is None and os.environ[POOL_VAR] == "7"


@pytest.mark.parametrize("flag", ["warmup_steps", "steps", "eval_every", "checkpoint_steps", "to_keep", "holdout",
                                  "packed_decoder_length", "num_proc", "mixture_cap", "decoder_layers", "kv_heads"])
def test_a_count_that_may_be_zero_may_not_be_negative(flag):
    """Every field declared ``minimum=0`` refuses -1 with a one-line error naming it. ``spec`` once kept only the
    truthy parts of a declaration, so a minimum of 0 was dropped and every one of these took -1 silently."""
    from config.fields import spec

    assert spec(0, minimum=0).metadata == {"minimum": 0} and spec(1, minimum=1).metadata == {"minimum": 1}
    with pytest.raises(ConfigError, match=f"{flag}=-1 must not be negative: pass --{flag} 0 or more"):
        load_config("finetuning", "tiny", {flag: -1})
def test_a_family_s_own_fields_join_a_section_with_what_each_declares():
    """config.fields.extend_section, which adds a model family's own fields (``Family.config_options``) to a config
    section: the new field is a leaf with its path, docstring (its --help text) and ``spec``; the section's own fields
    keep theirs; instances, equality, repr and asdict see the new field; a second identical declaration adds nothing,
    a different one is refused before anything changes."""
    import dataclasses
    from dataclasses import dataclass, field
    from typing import ClassVar

    from config.fields import extend_section, leaf_fields, spec

    @dataclass
    class Sec:
        a: int = spec(1, minimum=1, shape=True)
        """A's own doc."""

    @dataclass
    class Root:
        sec: Sec = field(default_factory=Sec)

    @dataclass(frozen=True)
    class Mine:
        section: ClassVar[str] = "sec"
        window: int = spec(0, minimum=0, shape=True)
        """How far a token looks back."""

    assert extend_section(Sec, Mine) == ["window"]
    refs = {r.flag: r for r in leaf_fields(Root)}
    assert list(refs) == ["a", "window"]
    assert (refs["window"].path, refs["window"].doc, refs["window"].meta, refs["window"].default) == \
        (("sec", "window"), "How far a token looks back.", {"minimum": 0, "shape": True}, 0)
    assert (refs["a"].doc, refs["a"].meta, refs["a"].default) == ("A's own doc.", {"minimum": 1, "shape": True}, 1)
    assert Root().sec.window == 0 and Sec(a=2, window=3) == Sec(2, 3) != Sec(2, 4)
    assert repr(Sec(window=5)) == "test_a_family_s_own_fields_join_a_section_with_what_each_declares.<locals>." \
        "Sec(a=1, window=5)" and dataclasses.asdict(Root()) == {"sec": {"a": 1, "window": 0}}
    assert extend_section(Sec, Mine) == []

    @dataclass(frozen=True)
    class Clash:
        section: ClassVar[str] = "sec"
        window: int = spec(8)
        """Another window."""

    @dataclass(frozen=True)
    class Stricter:
        section: ClassVar[str] = "sec"
        window: int = spec(0, minimum=1, shape=True)
        """How far a token looks back."""

    for other in (Clash, Stricter):
        with pytest.raises(ConfigError, match="'window' is declared twice"):
            extend_section(Sec, other)
    assert [f.name for f in dataclasses.fields(Sec)] == ["a", "window"] and Sec().window == 0

    @dataclass
    class Outer:  # a section with a subsection: an added value goes before the subsection, as --help lists them
        b: int = 1
        """B."""
        sec: Sec = field(default_factory=Sec)

    @dataclass(frozen=True)
    class More:
        section: ClassVar[str] = "outer"
        c: str = spec("x", choices=("x", "y"))
        """C."""

    extend_section(Outer, More)
    assert [r.flag for r in leaf_fields(Outer)] == ["b", "c", "a", "window"] and Outer().c == "x"


def test_a_config_read_before_any_family_added_its_fields_says_what_to_import():
    """config alone (no modelling imported) knows only the shared fields: a family's own key is refused with the
    import that adds it, not a bare "unknown key"."""
    import subprocess
    import sys

    code = "from config.presets import load_config\nload_config('finetuning', 'gptj_tiny')"
    out = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(__file__)),
                         capture_output=True, text=True)
    assert out.returncode != 0 and "unknown config key 'model.attention.rotary_dim'" in out.stderr
    assert "import modelling.registry first" in out.stderr
    assert "import modelling.registry" not in str(pytest.raises(ConfigError, load_config, "finetuning", "tiny",
                                                                {"frobnicate": 1}).value)


def test_every_family_s_own_fields_are_flags_preset_keys_and_checked():
    """Each field a registered family declares (T5's feed-forward kind, tied head and relative position buckets, a
    causal family's rotary embedding and key/value heads) is a config field in the section it names: a flag, a preset
    key, in MODEL_SHAPE where declared ``shape``, validated by its declaration and its family; registering a
    declaration again changes nothing."""
    import dataclasses

    from config.schema import MODEL_SHAPE, add_options
    from modelling import registry

    seen = set()
    for family in registry.FAMILIES.values():
        for declared in family.config_options:
            for f in dataclasses.fields(declared):
                ref = FIELDS[f.name]
                assert ref.path == (*declared.section.split("."), f.name) and ref.default == f.default and ref.doc
                assert (f.name in MODEL_SHAPE) == bool(f.metadata.get("shape"))
                seen.add(f.name)
            before = dict(FIELDS)
            assert add_options(declared) == [] and FIELDS == before
    assert seen == {"relative_attention_num_buckets", "relative_attention_max_distance", "kv_heads", "rotary_dim",
                    "rotary_positional_embeddings_base", "feed_forward_proj", "tie_word_embeddings"}
    assert FIELDS["feed_forward_proj"].path == ("model", "feed_forward_proj")
    cfg = config_from_mapping({"model": {"family": "gptj", "attention": {"rotary_dim": 8, "kv_heads": 2}}})
    assert (cfg.model.attention.rotary_dim, cfg.model.attention.kv_heads) == (8, 2)
    assert load_config("finetuning", "gptj_tiny", {"rotary_dim": "4"}).model.attention.rotary_dim == 4
    with pytest.raises(ConfigError, match="kv_heads"):
        load_config("finetuning", "gptj_tiny", {"kv_heads": -1})
    from modelling.registry import checked

    with pytest.raises(ConfigError, match="tie_word_embeddings=True is a field of the t5, umt5 model family, not of "
                                          "gptj: a gptj model would ignore it: drop --tie_word_embeddings"):
        checked(load_config("finetuning", "gptj_tiny", {"tie_word_embeddings": True}))


@pytest.mark.parametrize("preset,flag,value", [
    ("gptj_tiny", "feed_forward_proj", "relu"), ("gptj_tiny", "relative_attention_num_buckets", 16),
    ("tiny", "rotary_dim", 8), ("tiny", "kv_heads", 2), ("tiny", "rotary_positional_embeddings_base", 500.0)])
def test_another_family_s_own_field_set_is_refused_not_ignored(preset, flag, value):
    """A family reads the shared fields and its own: another family's field set to other than its default would be
    ignored, so it is refused naming the field, the families that have it and the fix; at its default it passes
    (every saved config holds every field), and the family's own fields pass whatever their value."""
    from modelling.registry import checked

    with pytest.raises(ConfigError, match=rf"{flag}={value} is a field of the .* model family, not of .*drop --{flag}"):
        checked(load_config("finetuning", preset, {flag: value}))
    checked(load_config("finetuning", preset, {}))
    own = {"tiny": {"relative_attention_max_distance": 64, "feed_forward_proj": "relu", "tie_word_embeddings": True},
           "gptj_tiny": {"rotary_dim": 8, "rotary_positional_embeddings_base": 500.0}}[preset]
    checked(load_config("finetuning", preset, own))
