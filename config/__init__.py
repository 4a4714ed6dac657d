from config.config import (  # noqa: F401
    FIELDS,
    ConfigError,
    Config,
    T5Config,
    ModelConfig,
    apply_overrides,
    config_from_mapping,
    dumps_yaml,
    load_config,
    read_presets,
    preset_path,
    to_dict,
)
