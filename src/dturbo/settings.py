"""The whole configuration of a run, read: the class the registry composes (:func:`config_class`) from a TOML file, a
mapping shaped like the TOML, a Config or a preset shipped with dturbo, with overrides applied."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from . import config as _config
from .algorithms.registry import config_class
from .config import Config, ConfigError

__all__ = ["ConfigError", "apply_overrides", "config_class", "load_config", "parse_config"]


def parse_config(data: dict[str, Any]) -> Config:
    """``data`` (shaped like the TOML) validated into the whole configuration; ConfigError naming the key."""
    schema = config_class()
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_config.format_error(schema, err)) from None


def apply_overrides(data: dict[str, Any], overrides: Sequence[str] | Mapping[str, Any]) -> dict[str, Any]:
    """``overrides`` set in ``data`` (:func:`dturbo.config.apply_overrides`)."""
    return _config.apply_overrides(config_class(), data, overrides)


def load_config(source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None,
                overrides: Sequence[str] | Mapping[str, Any] | None = None, *, preset: str | None = None) -> Config:
    """A validated :class:`Config` from a TOML file (a path), a mapping shaped like the TOML, a Config, or a preset
    shipped with dturbo (``preset="recommended"``, :mod:`dturbo.presets`), with ``overrides`` applied
    (:func:`apply_overrides`: ``["experiment.rounds=3"]`` as ``--set`` takes them, or ``{"experiment.rounds": 3}``).
    The source is not modified. Raises :class:`ConfigError` naming the key."""
    if (source is None) == (preset is None):
        raise ConfigError("give a config (a TOML file, a dict or a dturbo.Config) or a preset name, one of the two")
    if preset is not None:
        from . import presets

        try:
            return parse_config(apply_overrides(presets.read(preset), overrides or []))
        except presets.PresetError as err:
            raise ConfigError(str(err)) from None
    if isinstance(source, Config):
        data = source.to_dict()
    elif isinstance(source, Mapping):
        data = copy.deepcopy(dict(source))
    elif isinstance(source, str | os.PathLike):
        data = _config.read_toml(Path(source))
    else:
        raise ConfigError(f"a config is a TOML file path, a dict or a dturbo.Config, not {type(source).__name__}")
    return parse_config(apply_overrides(data, overrides or []))


def merged(base: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra``'s keys set, sub-tables merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = dict(value) if isinstance(value, Mapping) else value
    return out
