"""The model families this project runs: one line each. A new family is one module (a ``Family`` subclass,
modelling/family.py) and one line here; the config's choices, the family's own config fields and the Hugging Face
model types follow. A family added at run time (a test's, a plugin's) calls ``add``."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from config.fields import get_path
from config.schema import FIELDS, add_options
from modelling import gptj, t5
from modelling.family import Family
from utils.errors import CheckpointError, ConfigError

FAMILIES: dict = {f.name: f for f in (t5.T5Family(), t5.UMT5Family(), gptj.GPTJFamily())}


def add(family: Family) -> Family:
    """A family into the registry, its own config fields into the config (``Family.config_options``: flags, preset
    keys and --help text like every other field's)."""
    for declared in family.config_options:
        add_options(declared)
    FAMILIES[family.name] = family
    return family


for _family in tuple(FAMILIES.values()):
    add(_family)


def names() -> tuple:
    """The ``model.family`` values, as --help lists them."""
    return tuple(FAMILIES)


def get(name: str) -> Family:
    """The family of a ``model.family`` value; ConfigError naming the choices."""
    if name not in FAMILIES:
        raise ConfigError(f"unknown model family {name!r}: choose one of {', '.join(FAMILIES)} (--family)")
    return FAMILIES[name]


def of_config(cfg) -> Family:
    """The family of a config."""
    return get(cfg.model.family)


def checked(cfg) -> Family:
    """The family of a config, after it checked what only it knows (``Family.validate_config``) and that no other
    family's own field is set (it would be ignored: ``foreign_fields``)."""
    family = of_config(cfg)
    foreign = foreign_fields(cfg, family)
    if foreign:
        flag, value, owners = foreign[0]
        raise ConfigError(f"{flag}={value} is a field of the {', '.join(owners)} model family, not of {family.name}: "
                          f"a {family.name} model would ignore it: drop --{flag} (or pass its default, "
                          f"{FIELDS[flag].default})")
    family.validate_config(cfg)
    return family


def own_fields(family: Family) -> set:
    """The flags of the fields a family declares as its own (``Family.config_options``)."""
    return {f.name for declared in family.config_options for f in dataclasses.fields(declared)}


def owners() -> dict:
    """{flag: [the families that declare it as their own]} of every family's own fields (the shared ones absent)."""
    out: dict = {}
    for family in FAMILIES.values():
        for flag in sorted(own_fields(family)):
            out.setdefault(flag, []).append(family.name)
    return out


def foreign_fields(cfg, family: Family) -> list:
    """[(flag, value, the families that declare it)] of the fields other families declare as their own, set in cfg
    to other than their default: a family reads only the shared fields and its own."""
    mine, out = own_fields(family), []
    for flag, names in sorted(owners().items()):
        value = get_path(cfg, FIELDS[flag].path)
        if flag not in mine and value != FIELDS[flag].default:
            out.append((flag, value, names))
    return out


def hf_model_types() -> dict:
    """{HF config.json ``model_type``: our family name}, from every family's HF mapping (``Family.hf``)."""
    return {t: f.name for f in FAMILIES.values() for t in f.hf.model_types}


def of_hf_config(hf: Mapping) -> Family:
    """The family that loads an HF config (dict form); CheckpointError naming the supported types."""
    types = hf_model_types()
    kind = hf.get("model_type")
    if kind not in types:
        raise CheckpointError(f"model_type {kind!r} is not supported: this project runs "
                              f"{', '.join(sorted(types))} checkpoints (config.json's model_type)")
    return FAMILIES[types[kind]]
