"""The families' one list (modelling/registry.py) and the interface it holds them to (modelling/family.py): a family
that leaves a question of the interface unanswered cannot be made, the registry lists each family once (the
config's choices and the HF model types come from it), each family's options are the config's fields and its own,
and each names the shape fields it reads."""

from __future__ import annotations

import pathlib

import pytest

from modelling import registry

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_family_interface_is_enforced_and_the_registry_is_its_one_list():
    """A family that leaves a question of the interface unanswered cannot be made; the registry lists each family
    once, and the config's choices and the HF model types come from it."""
    from modelling.causal import CausalLM

    class Incomplete(CausalLM):  # no parameters, no block
        name = "incomplete"

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()
    types = registry.hf_model_types()
    assert {types[t] for t in types} == set(registry.names()) == set(registry.FAMILIES)
    text = (ROOT / "modelling" / "registry.py").read_text()
    assert text.count("Family()") == len(registry.FAMILIES)  # one entry a family, in one place


def test_each_family_s_options_are_the_config_s_fields_and_its_own():
    """A family's options (``Family.options``) hold every field of the config's model and lora sections that no
    family declares as its own, with the config's default, plus the execution fields and exactly the fields the
    family declares (``config_options``): a field added to the config and not to ModelOptions, a default that
    drifts, or a family reading another's options fails here."""
    import dataclasses

    from config.presets import load_config
    from config.schema import FIELDS
    from modelling.family import EXECUTION_FIELDS, ModelOptions

    common = {f for f, r in FIELDS.items() if r.path[0] in ("model", "lora")} - set(registry.owners())
    assert {f.name: f.default for f in dataclasses.fields(ModelOptions)} == \
        {**{f: FIELDS[f].default for f in common}, **{f: FIELDS[f].default for f in EXECUTION_FIELDS}}
    for family in registry.FAMILIES.values():
        own = registry.own_fields(family)
        assert own and {f.name for f in dataclasses.fields(family.options)} == common | set(EXECUTION_FIELDS) | own
        assert issubclass(family.options, ModelOptions)
    assert {f.name for f in dataclasses.fields(registry.get("t5").options)} & {"rotary_dim", "kv_heads"} == set()
    cfg = load_config("finetuning", "tiny", {"layers": 3, "dropout_prob": 0.1, "relative_attention_num_buckets": 16})
    opts = registry.of_config(cfg).options_of(cfg)
    assert (opts.layers, opts.dropout_prob, opts.relative_attention_num_buckets) == (3, 0.1, 16)
    cfg.model.eval = True
    assert registry.of_config(cfg).options_of(cfg).dropout_prob == 0.0  # no dropout when built for evaluation
    hash(opts)  # static under jit
    gptj = load_config("finetuning", "gptj_tiny", {"rotary_positional_embeddings_base": 500.0})
    assert registry.of_config(gptj).options_of(gptj).rotary_positional_embeddings_base == 500.0


def test_each_family_names_the_shape_fields_it_reads():
    from config.schema import MODEL_SHAPE

    for family in registry.FAMILIES.values():
        assert set(family.shape_fields) <= set(MODEL_SHAPE) and "family" in family.shape_fields
    assert "relative_attention_num_buckets" not in registry.get("gptj").shape_fields
    assert "rotary_dim" not in registry.get("t5").shape_fields
