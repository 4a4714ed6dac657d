"""Presets (config/presets.py): the preset files hold exactly the documented presets, each loads and validates, the
T5 family's presets have their checkpoints' shapes and the original apps' bases their parallelism; overrides apply
with their types, an unknown preset or YAML key is an error, a config dumps and reloads the same; docs/tasks.md's
own-task command is the tiny_headlines preset field for field."""

import os

import pytest
import yaml

import modelling.registry  # noqa: F401 (the families' own fields are config fields and preset keys)
from config import ConfigError, load_config, preset_path, read_presets
from config.presets import config_from_mapping, dumps_yaml
from tests.helpers import ROOT

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


def test_unknown_preset_lists_the_choices_and_names_a_close_one():
    with pytest.raises(ConfigError, match="unknown preset 'xxl_pod4'.*choose one of .*xxl_pod16"):
        load_config("finetuning", "xxl_pod4")
    for kind, typo, meant in (("finetuning", "tinyy", "tiny"), ("inference", "gptj_tnyi", "gptj_tiny")):
        with pytest.raises(ConfigError, match=rf"unknown preset '{typo}' in .* \(did you mean {meant}\?\): choose"):
            load_config(kind, typo)
    with pytest.raises(ConfigError) as e:
        load_config("finetuning", "zzzzzz")
    assert "did you mean" not in str(e.value)


def test_unknown_yaml_key_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'model.attention.head'"):
        config_from_mapping({"model": {"attention": {"head": 4}}})
    with pytest.raises(ConfigError, match="is not a valid int"):
        config_from_mapping({"model": {"layers": [1, 2]}})


def test_dump_and_reload_round_trip():
    cfg = load_config("finetuning", "xl_pod16")
    again = config_from_mapping(yaml.safe_load(dumps_yaml(cfg)))
    assert again == cfg


def test_the_readme_s_own_task_command_is_the_tiny_headlines_preset():
    """docs/tasks.md says the tiny_headlines preset is `--config tiny` with its flags: they give the same
    config, field for field (the flags it named once left out the lengths, the learning rate and the steps)."""
    import re
    import shlex

    from app.args import parse_config
    from config.fields import get_path
    from config.schema import FIELDS

    text = open(os.path.join(ROOT, "docs", "tasks.md")).read()
    block = re.search(r"```bash\n(python3 run_finetuning\.py --config tiny --task_name headlines .*?)```", text, re.S)
    argv = shlex.split(block.group(1).replace("\\\n", " "))[2:]
    del argv[argv.index("--save"): argv.index("--save") + 2]
    flags, _ = parse_config("finetuning", "", "tiny", argv)
    preset = load_config("finetuning", "tiny_headlines")
    differ = {f: (get_path(flags, r.path), get_path(preset, r.path)) for f, r in FIELDS.items()
              if get_path(flags, r.path) != get_path(preset, r.path)}
    assert not differ, differ
