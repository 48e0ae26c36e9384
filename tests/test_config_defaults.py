"""Defaults come from one place: where a default YAML file (gpuvigil/config/*.yaml) gives a key,
its value is the section model's own default, so code that builds a model without the YAML (a
test, a library caller) runs with what `serve` runs. Every section, every key, nested models too."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel

from gpuvigil import config


# Keys whose YAML value is an example for a site to replace, not a product default.
SITE_SPECIFIC = {"alerts.tenants": "which team owns which tenant's jobs"}


def _dump(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_dump(v) for v in value]
    return value


def disagreements(model: type[BaseModel], data: dict[str, Any], where: str, default_of: BaseModel | None = None) -> list[str]:
    """Keys of `data` (a YAML block) whose validated value differs from the model's default; in a
    nested block, from the default the enclosing field gives (`default_of`), if it gives one."""
    validated = model.model_validate(data)
    out = []
    for key in data:
        field = model.model_fields[key]
        if f"{where}.{key}" in config.SECTIONS or f"{where}.{key}" in SITE_SPECIFIC:
            continue
        if default_of is not None:
            default = getattr(default_of, key)
        elif field.is_required():
            continue
        else:
            default = field.get_default(call_default_factory=True)
        value = getattr(validated, key)
        if isinstance(value, BaseModel) and isinstance(data[key], dict):
            out += disagreements(type(value), data[key], f"{where}.{key}", default if isinstance(default, BaseModel) else None)
        elif _dump(value) != _dump(default):
            out.append(f"{where}.{key}: YAML {_dump(value)!r}, model default {_dump(default)!r}")
    return out


def _sections() -> list[tuple[str, type[BaseModel], dict[str, Any]]]:
    defaults = config.defaults()
    out = []
    for name in (s for s in config.SECTIONS if "." not in s):
        data = defaults.get(name, {})
        models = config.blocks(name)
        if models is None:
            out.append((name, config.model_of(name), data))
        else:
            out += [(f"{name}.{block}", models[block], data.get(block) or {}) for block in models]
    for sub in (s for s in config.SECTIONS if "." in s):
        top, _, key = sub.partition(".")
        out.append((sub, config.model_of(sub), (defaults.get(top) or {}).get(key) or {}))
    return out


@pytest.mark.parametrize(("where", "model", "data"), _sections(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_yaml_defaults_are_the_models_defaults(where, model, data):
    assert disagreements(model, data, where) == []


def test_the_check_catches_a_disagreement():
    from gpuvigil.detectors.thermal import ThermalConfig

    assert disagreements(ThermalConfig, {"window_seconds": 99.0}, "detectors.thermal") == ["detectors.thermal.window_seconds: YAML 99.0, model default 15.0"]


@pytest.mark.parametrize("block", ["oom", "oom_device"])
def test_a_page_sooner_than_the_horizon_is_required(block):
    with pytest.raises(config.ConfigError, match="page_within_seconds must not exceed predict_horizon_seconds"):
        config.load(overrides={"detectors": {block: {"predict_horizon_seconds": 600, "page_within_seconds": 900}}})


def test_the_check_reads_a_nested_default_from_its_enclosing_field():
    from gpuvigil.scheduler.remediation import RemediationConfig

    assert disagreements(RemediationConfig, {"verify": {"timeout_seconds": 900.0}}, "remediation") == []
    assert disagreements(RemediationConfig, {"verify": {"timeout_seconds": 5.0}}, "remediation") == ["remediation.verify.timeout_seconds: YAML 5.0, model default 900.0"]
