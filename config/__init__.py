"""The typed configuration, in parts: config/schema.py (the sections and their fields, validation), config/fields.py
(reading the declarations: flat flags, coercion), config/presets.py (the YAML presets, overrides) and config/carry.py
(what a checkpoint carries). The names most callers need are here."""

from config.presets import (  # noqa: F401
    apply_overrides,
    config_from_mapping,
    dumps_yaml,
    load_config,
    preset_path,
    read_presets,
    to_dict,
)
from config.schema import FIELDS, Config, ModelConfig, T5Config  # noqa: F401
from utils.errors import ConfigError  # noqa: F401
