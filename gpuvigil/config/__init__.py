"""Rules and thresholds as data.

Defaults live beside this module, one YAML file per section (`detectors.yaml`,
`scheduler.yaml`, `alerts.yaml`, ...): the file's stem is the section name. A user config file
(YAML or JSON) may override any key of any section; it is deep-merged over the defaults. Each
owner validates its section with a pydantic model through `section()`, so a bad value is
rejected at load with the reason, not at 3 a.m. in a detector.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gpuvigil.errors import UserError

M = TypeVar("M", bound=BaseModel)


class ConfigError(UserError, ValueError):
    """The configuration is invalid; the message says where and why."""


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def defaults() -> dict[str, Any]:
    """All default sections, keyed by section name."""
    out: dict[str, Any] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            data = yaml.safe_load(entry.read_text()) or {}
            out[entry.name[: -len(".yaml")]] = data
    return out


def read_user_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {str(exc).splitlines()[0]}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Defaults, deep-merged with a user file and then with explicit overrides."""
    cfg = defaults()
    if path is not None:
        user = read_user_file(path)
        unknown = sorted(set(user) - set(cfg))
        if unknown:
            raise ConfigError(f"{path}: unknown config section(s): {', '.join(unknown)} (known: {', '.join(sorted(cfg))})")
        cfg = _deep_merge(cfg, user)
    if overrides:
        cfg = _deep_merge(cfg, overrides)
    return cfg


def section(name: str, model: type[M], cfg: dict[str, Any] | None = None) -> M:
    """Validate one section of a loaded config (defaults when `cfg` is None)."""
    cfg = defaults() if cfg is None else cfg
    try:
        return model.model_validate(cfg.get(name, {}))
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        raise ConfigError(f"config section '{name}': {where}: {err['msg']}") from exc
