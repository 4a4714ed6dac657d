"""The config's schema and validation (config/schema.py): each bad value names the field and the fix (before any
work, through a driver too), every field has a docstring, a family's own fields are flags, preset keys and checked
(another family's refused, not ignored), IPU-only fields are said once and never silently ignored, and an own task
without a name is named after its data."""

from __future__ import annotations

import os

import pytest

import run_finetuning
from config import ConfigError, load_config
from config.presets import config_from_mapping
from config.schema import FIELDS
from tests.helpers import ROOT, SMALL, fails
from utils import checkpoint as ckpt


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


def test_every_field_has_a_docstring():
    missing = [f for f, r in FIELDS.items() if not r.doc]
    assert not missing


def test_a_config_read_before_any_family_added_its_fields_says_what_to_import():
    """config alone (no modelling imported) knows only the shared fields: a family's own key is refused with the
    import that adds it, not a bare "unknown key"."""
    import subprocess
    import sys

    code = "from config.presets import load_config\nload_config('finetuning', 'gptj_tiny')"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
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


@pytest.mark.parametrize("value,message", [
    ("nan", "learning_rate=nan is not a finite number"),
    ("1e9", "learning_rate=1e+09 is outside (0, 1]"),
    ("-1e-3", "learning_rate=-0.001 is outside (0, 1]"),  # with a space: a value, not an argparse usage dump
])
def test_bad_learning_rates_are_refused_before_any_work(tmp_path, capsys, value, message):
    save = str(tmp_path / "ck")
    fails(capsys, run_finetuning.main, SMALL + ["--save", save, "--learning_rate", value], message)
    assert not ckpt.saved_steps(save)
    fails(capsys, run_finetuning.main, SMALL + ["--gradient_clipping", "inf"], "gradient_clipping=inf is not a finite")


def test_device_iterations_other_than_one_is_refused(capsys):
    fails(capsys, run_finetuning.main, SMALL + ["--device_iterations", "4"], "--device_iterations 1")


def test_ipu_only_fields_are_said_once_never_silently_ignored(caplog):
    from app.args import make_config

    with caplog.at_level("WARNING", logger="flan_t5"):
        make_config("finetuning", "tiny", {})
    assert not [r for r in caplog.records if "IPUs" in r.getMessage()]
    with caplog.at_level("WARNING", logger="flan_t5"):
        make_config("finetuning", "tiny", {"io_tiles": 128, "available_memory_proportion": [0.2]})
    said = [r.getMessage() for r in caplog.records if "IPUs" in r.getMessage()]
    assert len(said) == 2 and "io_tiles=128" in said[0] and "no effect" in said[0]


# -------------------------------------------------------------------------- 11. an own task's name
def test_an_own_task_without_task_name_is_named_after_its_data_not_mnli():
    from config import load_config

    own = {"dataset": "/data/sort.csv", "input_template": "sort: {numbers}", "target_column": "sorted",
           "labels": "none"}
    assert load_config("finetuning", "tiny", own).task.name == "sort"
    assert load_config("finetuning", "tiny", {**own, "task_name": "mine"}).task.name == "mine"
    assert load_config("finetuning", "tiny", {"dataset": "/data/nli.jsonl"}).task.name == "mnli"  # MNLI's format
    assert load_config("finetuning", "tiny", {**own, "dataset": "knkarthick/samsum"}).task.name == "samsum"
    row = next(line for line in open(os.path.join(ROOT, "docs", "tasks.md")) if line.startswith("| `--task_name` |"))
    assert "named after its data" in row and "`mnli`" in row  # (the flags' reference says the rule)
