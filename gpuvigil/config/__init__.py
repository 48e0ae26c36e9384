"""Rules and thresholds as data.

Defaults live beside this module, one YAML file per section (`detectors.yaml`,
`scheduler.yaml`, `alerts.yaml`, ...): the file's stem is the section name. A user config file
(YAML or JSON) may override any key of any section; it is deep-merged over the defaults.

`load()` validates the whole result, every section, whatever the command will use: a key no
model knows is an error naming it (with the nearest valid key), and a bad value is rejected with
the reason, at load, not at 3 a.m. in a detector. Each section's pydantic model stays with its
owner; `SECTIONS` says where it is. Owners read their validated section through `section()`.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import json
import types
import typing
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from gpuvigil.errors import UserError

M = TypeVar("M", bound=BaseModel)

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when the wheel has it: ~10x faster

# Section → the model that validates it, as "module:Class" (imported only when validating).
# A dict instead of a string, or a "module:function()" that returns one: the section is a mapping
# of named blocks, one model each.
# Sub-keys validated by their own model are given as "section.key". A new default YAML file
# needs its entry here (a test checks that every default section has one).
SECTIONS: dict[str, str | dict[str, str]] = {
    "acting": "gpuvigil.scheduler.quarantine:ActingConfig",
    "alerts": "gpuvigil.alerts.settings:AlertSettings",
    "api": "gpuvigil.api.config:ApiConfig",
    "api.slurm": "gpuvigil.scheduler.slurm:SlurmConfig",
    "api.kubernetes": "gpuvigil.scheduler.kubernetes:KubernetesConfig",
    # One block per registered detector, each validated by the config model its spec declares.
    "detectors": "gpuvigil.detectors.registry:config_models()",
    "fleet": "gpuvigil.config.deploy:Fleet",
    "hints": "gpuvigil.pipeline.hints:HintConfig",
    "kernel_log": "gpuvigil.collectors.kernel_log:KernelLogConfig",
    "levels": "gpuvigil.pipeline.levels:LevelsConfig",
    "oom_classify": "gpuvigil.parsers.oom:OomClassifyConfig",
    "pipeline": "gpuvigil.pipeline.core:PipelineConfig",
    "preflight": "gpuvigil.preflight.config:PreflightConfig",
    "remediation": "gpuvigil.scheduler.remediation:RemediationConfig",
    "report": "gpuvigil.offline.report:ReportConfig",
    "scheduler": "gpuvigil.scheduler.config:SchedulerConfig",
    # One key per registered source (deployconfig.SOURCE_SPECS), besides its settings.
    "sources": "gpuvigil.config.deploy:sources_model()",
}

# Sections that became a block of another: old name -> (section, block). A user file that still
# has the old section is read into the new place (an explicit value there wins).
MOVED: dict[str, tuple[str, str]] = {
    "allocator": ("detectors", "allocator_state"),
}


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


@functools.lru_cache(maxsize=1)
def _defaults() -> dict[str, Any]:
    # Parsed once per process; callers get deep copies (`defaults()`, `section()`), never this.
    out: dict[str, Any] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".yaml"):
            out[entry.name[: -len(".yaml")]] = yaml.load(entry.read_text(encoding="utf-8"), Loader=_Loader) or {}
    return out


def defaults() -> dict[str, Any]:
    """All default sections, keyed by section name (a fresh deep copy: callers may change it)."""
    return copy.deepcopy(_defaults())


def read_user_file(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config: {exc.strerror or exc}") from exc
    if b"\x00" in raw[:8192]:
        raise ConfigError(f"{p}: not a config file (binary data); expected YAML or JSON text")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start}); expected YAML or JSON") from None
    kind = "JSON" if p.suffix == ".json" else "YAML"
    try:
        data = json.loads(text) if kind == "JSON" else yaml.load(text, Loader=_Loader)
    except (json.JSONDecodeError, yaml.YAMLError, ValueError, RecursionError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{p}: not valid {kind}: {first}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load(path: str | Path | None = None, overrides: dict[str, Any] | None = None, *, validate: bool = True) -> dict[str, Any]:
    """Defaults, deep-merged with a user file and then with explicit overrides, validated whole."""
    cfg = defaults()
    where = str(path) if path is not None else "config overrides"
    if path is not None:
        cfg = _deep_merge(cfg, _moved(read_user_file(path), where))
    if overrides:
        cfg = _deep_merge(cfg, _moved(overrides, where))
    if validate and (path is not None or overrides):
        validate_all(cfg, where)
    return cfg


def _moved(data: dict[str, Any], where: str) -> dict[str, Any]:
    """`data` with each moved section read into its new place (MOVED)."""
    if not any(old in data for old in MOVED):
        return data
    out = dict(data)
    for old, (top, block) in MOVED.items():
        if old not in out:
            continue
        value = out.pop(old)
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: config section '{old}' (now {top}.{block}) must be a mapping, got {type(value).__name__}")
        section_ = out.get(top, {})
        if not isinstance(section_, dict):
            raise ConfigError(f"{where}: config section '{top}' must be a mapping, got {type(section_).__name__}")
        given = section_.get(block) if isinstance(section_.get(block), dict) else {}
        out[top] = {**section_, block: _deep_merge(value, given)}
    return out


def section(name: str, model: type[M], cfg: dict[str, Any] | None = None) -> M:
    """Validate one section of a loaded config (defaults when `cfg` is None)."""
    # From the cache, the section is copied: a model field typed Any would otherwise share it.
    data = copy.deepcopy(_defaults().get(name, {})) if cfg is None else cfg.get(name, {})
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"config section '{name}': {_first_error(exc)}") from None


# -- whole-config validation ---------------------------------------------------------------------
@functools.cache
def _model(ref: str) -> type[BaseModel]:
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


def _resolve(ref: str) -> Any:
    """A "module:Class" model, or what a "module:function()" returns now (a registry's model or
    blocks: its registrations may change at run time)."""
    if ref.endswith("()"):
        module, _, attr = ref[:-2].partition(":")
        return getattr(importlib.import_module(module), attr)()
    return _model(ref)


def blocks(name: str) -> dict[str, type[BaseModel]] | None:
    """A section of named blocks: block -> its model (None for a section with one model)."""
    spec = SECTIONS[name]
    if isinstance(spec, dict):
        return {block: _model(ref) for block, ref in spec.items()}
    got = _resolve(spec)
    return dict(got) if isinstance(got, dict) else None


def model_of(name: str) -> type[BaseModel]:
    """The model of a section (or "section.key") validated by one model."""
    spec = SECTIONS[name]
    assert isinstance(spec, str), name
    return _resolve(spec)  # type: ignore[no-any-return]


def _first_error(exc: ValidationError) -> str:
    err = exc.errors(include_input=False, include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"]


def _unknown_key(key: Any, valid: typing.Iterable[str], path: str, where: str) -> ConfigError:
    valid = sorted(str(v) for v in valid)
    close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
    hint = f"; did you mean '{close[0]}'?" if close else f" (valid: {', '.join(valid)})" if len(valid) <= 16 else ""
    what = f"key '{path}.{key}'" if path else f"section '{key}'"
    return ConfigError(f"{where}: unknown config {what}{hint}")


def _model_types(annotation: Any) -> list[Any]:
    """The annotation itself, or the members of a Union/Optional."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [a for a in typing.get_args(annotation) if a is not type(None)]
    return [annotation]


def _check_keys(annotation: Any, data: Any, path: str, where: str, skip: frozenset[str] = frozenset()) -> None:
    """Raise on the first mapping key that the model behind `annotation` does not declare.

    Walks nested models, and the values of dict/list/tuple fields; free-form mappings (dict[str,
    float], receiver bodies...) are left to the model's own validation."""
    for ann in _model_types(annotation):
        origin = typing.get_origin(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            if not isinstance(data, dict):
                return
            if ann.model_config.get("extra") == "allow":
                return
            fields = ann.model_fields
            names = {**{n: f for n, f in fields.items()}, **{f.alias: f for f in fields.values() if f.alias}}
            for key, value in data.items():
                sub = f"{path}.{key}" if path else str(key)
                if key not in names:
                    raise _unknown_key(key, fields, path, where)
                if sub not in skip:
                    _check_keys(names[key].annotation, value, sub, where, skip)
            return
        if origin in (dict, typing.Mapping) or (isinstance(origin, type) and issubclass(origin, typing.Mapping)):
            args = typing.get_args(ann)
            if isinstance(data, dict) and len(args) == 2:
                for key, value in data.items():
                    _check_keys(args[1], value, f"{path}.{key}", where, skip)
            return
        if origin in (list, tuple, set, frozenset) or (isinstance(origin, type) and issubclass(origin, typing.Sequence)):
            args = [a for a in typing.get_args(ann) if a is not Ellipsis]
            if isinstance(data, (list, tuple)) and args:
                for i, value in enumerate(data):
                    _check_keys(args[min(i, len(args) - 1)], value, f"{path}[{i}]", where, skip)
            return


def validate_all(cfg: dict[str, Any], where: str = "config") -> None:
    """Validate every section of `cfg` (unknown sections and keys included); ConfigError if not."""
    known = [s for s in SECTIONS if "." not in s]
    for name in cfg:
        if name not in SECTIONS:
            raise _unknown_key(name, known, "", where)
    for name, spec in SECTIONS.items():
        if "." in name:
            top, _, key = name.partition(".")
            data = (cfg.get(top) or {}).get(key, {}) if isinstance(cfg.get(top), dict) else {}
        else:
            data = cfg.get(name, {})
        models = blocks(name)
        if models is not None:
            if not isinstance(data, dict):
                raise ConfigError(f"{where}: config section '{name}' must be a mapping, got {type(data).__name__}")
            for block in data:
                if block not in models:
                    raise _unknown_key(block, models, name, where)
            for block, model in models.items():
                _validate(f"{name}.{block}", model, data.get(block) or {}, where, frozenset())
        else:
            nested = frozenset(s for s in SECTIONS if s.startswith(f"{name}."))
            _validate(name, model_of(name), data, where, nested)


def _validate(name: str, model: type[BaseModel], data: Any, where: str, skip: frozenset[str]) -> None:
    _check_keys(model, data, name, where, skip)
    try:
        model.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}: config section '{name}': {_first_error(exc)}") from None
