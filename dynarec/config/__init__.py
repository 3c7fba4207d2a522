"""The YAML config: pydantic schema and loader."""

from dynarec.config.load import ConfigError, config_fingerprint, config_from_dict, load_config
from dynarec.config.schema import Config

__all__ = ["Config", "ConfigError", "config_fingerprint", "config_from_dict", "load_config"]
