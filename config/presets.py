"""Presets: a preset file holds model bases (YAML anchors) and a ``release:`` mapping of named presets.
``load_config(kind_or_path, name, overrides)`` resolves one preset, applies ``{flat_flag: value}`` overrides and
validates the result; ``to_dict`` / ``dumps_yaml`` write a config back out."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from dataclasses import fields
from typing import Optional

import yaml

from config.fields import coerce, set_path
from config.schema import FIELDS, Config, Task, families_added
from utils.errors import ConfigError

CONFIG_DIR = os.path.dirname(os.path.abspath(__file__))


def preset_path(kind: str) -> str:
    """Path of a preset file: kind is 'finetuning' or 'inference'."""
    return os.path.join(CONFIG_DIR, f"{kind}.yml")


def read_presets(path: str) -> dict:
    """Named presets of a preset file (its ``release:`` mapping)."""
    with open(path) as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict) or not isinstance(doc.get("release"), dict):
        raise ConfigError(f"{path} has no 'release:' mapping of presets: see config/finetuning.yml for the format")
    return doc["release"]


def _unregistered_hint() -> str:
    """What an unknown key's error adds while no model family has added its own fields (``import modelling.registry``
    adds them: every driver does; a script that reads the config alone must too)."""
    return "" if families_added() else " (no model family's own fields are known yet: import modelling.registry first)"


def _apply_mapping(cfg, mapping: dict, cls, where: str) -> None:
    """Sets the values of a nested YAML mapping on cfg; unknown keys are errors."""
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in fields(cls)}
    for key, value in mapping.items():
        if key not in names:
            raise ConfigError(f"unknown config key '{where}{key}': known keys here are {', '.join(sorted(names))}"
                              + _unregistered_hint())
        typ = hints[key]
        if dataclasses.is_dataclass(typ):
            if not isinstance(value, dict):
                raise ConfigError(f"config key '{where}{key}' must be a mapping of {', '.join(f.name for f in fields(typ))}")
            _apply_mapping(getattr(cfg, key), value, typ, f"{where}{key}.")
        else:
            flag = names[key].metadata.get("flag", key)
            setattr(cfg, key, coerce(FIELDS[flag], value))


def config_from_mapping(mapping: dict) -> Config:
    """A Config from a nested mapping (a resolved preset, or a saved config)."""
    cfg = Config()
    _apply_mapping(cfg, mapping, Config, "")
    return cfg


def load_config(kind_or_path: str, name: str, overrides: Optional[dict] = None) -> Config:
    """Resolves preset ``name`` of a preset file, applies flat overrides and validates.

    Args:
      kind_or_path: 'finetuning', 'inference' or a path to a preset YAML file.
      name: the preset name (a key of the file's ``release:`` mapping).
      overrides: {flat_flag: value}, e.g. {'micro_batch_size': 2}.
    """
    path = kind_or_path if kind_or_path.endswith((".yml", ".yaml")) else preset_path(kind_or_path)
    presets = read_presets(path)
    if name not in presets:
        close = difflib.get_close_matches(name, list(presets), n=1)
        raise ConfigError(
            f"unknown preset '{name}' in {os.path.relpath(path)}" + (f" (did you mean {close[0]}?)" if close else "")
            + f": choose one of {', '.join(presets)}"
        )
    cfg = config_from_mapping(presets[name] or {})
    mnli_preset = not own_task(resolve_mixture(config_from_mapping(presets[name] or {})))
    apply_overrides(cfg, overrides or {})
    resolve_mixture(cfg)
    name_own_task(cfg)
    if mnli_preset and own_task(cfg) and "loss_tokens" not in (overrides or {}):
        # an MNLI preset's loss on every token (the original's, gptj_tiny's) is MNLI's: a task of one's own given to
        # it by flags is trained on its target, as on every other preset, unless --loss_tokens says otherwise
        cfg.data.loss_tokens = "target"
    return cfg.validate()


def _own(t) -> bool:
    """Whether a task (a config's task section, or a mixture's task mapping) is other than MNLI's."""
    get = (lambda k: t.get(k)) if isinstance(t, dict) else (lambda k: getattr(t, k))
    mnli, labels = Task(), get("labels")
    return (get("input_template"), get("input_column"), get("target_column"),
            tuple(labels) if labels is not None else None) != \
        (mnli.input_template, mnli.input_column, mnli.target_column, tuple(mnli.labels))


def own_task(cfg: Config) -> bool:
    """Whether a config trains a task of one's own: its task section, or one of its mixture's tasks, other than
    MNLI's (the data may be any file: MNLI's task on it is still MNLI's)."""
    return _own(cfg.task) or any(_own(t) for t in cfg.mixture.tasks if isinstance(t, dict))


def name_own_task(cfg: Config) -> Config:
    """A task of one's own left with MNLI's name (no --task_name) is named after its data (qa.csv: qa), so that its
    logs, metrics and reports never call it mnli; a task defined as MNLI's keeps the name, whatever file holds it."""
    t, mnli = cfg.task, Task()
    own = _own(t)
    if t.name == mnli.name and own and cfg.data.dataset:
        stem = os.path.splitext(os.path.basename(str(cfg.data.dataset).rstrip("/")))[0]
        t.name = re.sub(r"[^\w-]+", "_", stem).strip("_") or "task"
    return cfg


def mixture_entry(cfg: Config) -> dict:
    """A config's one task as a mixture task: its task section and where its rows come from."""
    t, d = cfg.task, cfg.data
    return {"name": t.name, "dataset": d.dataset, "hub_config": d.hub_config, "train_split": d.train_split,
            "split": d.split, "holdout": d.holdout, "input_template": t.input_template, "input_column": t.input_column,
            "target_column": t.target_column, "labels": list(t.labels) if t.labels is not None else None,
            "metrics": list(t.metrics)}


def resolve_mixture(cfg: Config) -> Config:
    """The mixture's tasks as whole mappings: a preset's name becomes that preset's task (config/finetuning.yml),
    a mapping gets the defaults of the keys it leaves out (MNLI's task, the data section's splits)."""
    if not cfg.mixture.tasks:
        return cfg
    presets, out = None, []
    for entry in cfg.mixture.tasks:
        if isinstance(entry, str):
            presets = presets or read_presets(preset_path("finetuning"))
            if entry not in presets:
                raise ConfigError(f"mixture task {entry!r} is not a preset of config/finetuning.yml: name one of "
                                  f"{', '.join(presets)}, or give a mapping {{name: ..., dataset: ..., ...}}")
            entry = mixture_entry(config_from_mapping(presets[entry] or {}))
        else:
            defaults = mixture_entry(Config())  # MNLI's task; the run's splits (--train_split, --split)
            defaults.update(dataset=None, name=None, train_split=cfg.data.train_split, split=cfg.data.split)
            entry = {**defaults, **entry}
            for key in ("labels", "metrics", "holdout"):
                ref = FIELDS[key]
                value = coerce(ref, entry[key]) if entry[key] is not None else None
                entry[key] = list(value) if isinstance(value, tuple) else value
        out.append(entry)
    cfg.mixture.tasks = tuple(out)
    return cfg


def apply_overrides(cfg: Config, overrides: dict) -> Config:
    """Applies {flat_flag: value} overrides; unknown flags are errors."""
    for flag, value in overrides.items():
        if flag not in FIELDS:
            raise ConfigError(f"unknown config field '{flag}': see --help for the list of fields" + _unregistered_hint())
        ref = FIELDS[flag]
        set_path(cfg, ref.path, coerce(ref, value))
    return cfg


def to_dict(cfg: Config) -> dict:
    """Nested plain-dict form of a config (for YAML/JSON dumps and checkpoints); tuples as lists."""
    def plain(x):
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return list(x) if isinstance(x, tuple) else x

    return plain(dataclasses.asdict(cfg))


def dumps_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
