"""Configs: typed dataclasses filled from YAML and ``key=value`` overrides.

By job: ``loading.py`` (a file or mapping plus overrides -> an instance; the shipped configs by name;
paths beside the config file), ``typed.py`` (each value checked against its annotation, failing with
the dotted path), ``schema.py`` (the sections both environments share: algo, optim, rewards,
trainer), ``recipes.py`` (named variants: a few keys set together) and ``docs.py`` (docs/configs.md
from the dataclasses). Importing this package reads no config and imports no torch.
"""

from unirl.config.loading import (CONFIGS_ROOT, FILE_SPEC, PATH, absolute_paths, available_configs, config_to_dict,
                                  dump_config, load_config, parse_yaml, resolve_config_path)
from unirl.config.typed import SHORTHAND, ConfigError

__all__ = ["CONFIGS_ROOT", "FILE_SPEC", "PATH", "SHORTHAND", "ConfigError", "absolute_paths", "available_configs",
           "config_to_dict", "dump_config", "load_config", "parse_yaml", "resolve_config_path"]
