"""Forgetting any declaration of a detector fails: `registry.validate()` (run by `serve` at start)
names the omission.

Data: the shipped declarations (gpuvigil/config/*.yaml as `config.defaults()` reads them, the
kinds table, the signal table, docs/runbooks.md), each test removing one declaration in memory
(a copy of the YAML sections, a monkeypatched table or class), for the NVLink CRC detector and,
table-driven, for every registered detector the declaration applies to. No stream data.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gpuvigil import config, kinds, schemas, signals
from gpuvigil.alerts.settings import load_settings
from gpuvigil.detectors import registry

RUNBOOKS = (Path(__file__).resolve().parents[1] / "docs" / "runbooks.md").read_text(encoding="utf-8")
CLASSES = {cls.spec.name: cls for cls in registry.registered()}
# Detectors that declare the gpu_samples telemetry columns they read (the others read any column).
KEYS = {s.name for s in signals.GPU_KEY}
DECLARED_COLUMNS = {
    name: [c for c in cls.spec.reads["gpu_samples"].columns if c not in KEYS]
    for name, cls in CLASSES.items()
    if "gpu_samples" in cls.spec.reads and cls.spec.reads["gpu_samples"].columns
}


def _reported(name: str, *parts: str, defaults=None, runbooks: str | None = RUNBOOKS) -> list[str]:
    """The omissions that name the detector and every part (empty: not reported)."""
    return [m for m in registry.omissions(defaults, runbooks) if m.startswith((f"{name} ", f"{name}:")) and all(p in m for p in parts)]


def test_the_shipped_declarations_are_complete():
    registry.validate(runbooks=RUNBOOKS)
    assert "nvlink_crc" in CLASSES and set(DECLARED_COLUMNS) >= {"nvlink_crc", "pcie", "ecc", "thermal"}
    stale = {c: why for c, why in registry.NOT_EXPORTED.items() if signals.BY_NAME[c].prometheus or not any(c in cols for cols in DECLARED_COLUMNS.values())}
    assert not stale, f"exported now, or no longer read: drop from registry.NOT_EXPORTED: {sorted(stale)}"


def test_validate_raises_naming_every_omission():
    defaults = config.defaults()
    del defaults["detectors"]["nvlink_crc"], defaults["detectors"]["pcie"]
    with pytest.raises(registry.DeclarationError) as info:
        registry.validate(defaults)
    lines = str(info.value).splitlines()
    assert lines[0] == "detector declarations incomplete:"
    assert lines[1:] == [
        "- pcie has no block in gpuvigil/config/detectors.yaml (its values are PcieConfig's defaults)",
        "- nvlink_crc has no block in gpuvigil/config/detectors.yaml (its values are NvlinkCrcConfig's defaults)",
    ]


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_forgotten_spec(name, monkeypatch):
    cls = CLASSES[name]
    monkeypatch.delattr(cls, "spec")
    assert registry.undeclared() == [f"{cls.__module__}.{cls.__qualname__}"]
    assert f"{cls.__module__}.{cls.__qualname__} has detect() but no `spec = DetectorSpec(...)`: it is not registered and never runs" in registry.omissions(runbooks=RUNBOOKS)
    # its YAML block now configures nothing
    assert f"detectors.{name} in gpuvigil/config/detectors.yaml configures no registered detector" in registry.omissions()


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_forgotten_policy_row_and_so_its_route(name, monkeypatch):
    kind = CLASSES[name].spec.emits[0]
    monkeypatch.setattr(kinds, "POLICIES", {k: p for k, p in kinds.POLICIES.items() if k != kind})
    assert _reported(name, kind.value, "no row in POLICIES (gpuvigil/kinds.py)", "owner to route its alerts to")


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_forgotten_runbook_section(name):
    kind = CLASSES[name].spec.emits[-1]
    anchor = kinds.runbook_anchor(kind)
    assert f'<a id="{anchor}"></a>' in RUNBOOKS
    assert _reported(name, kind.value, f"anchor {anchor!r}", "docs/runbooks.md", runbooks=RUNBOOKS.replace(f'<a id="{anchor}"></a>', ""))
    assert not _reported(name, f"anchor {anchor!r}")


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_forgotten_hint_rule(name):
    kind = CLASSES[name].spec.emits[0]
    defaults = config.defaults()
    defaults["hints"]["rules"] = [r for r in defaults["hints"]["rules"] if r["kind"] != kind.value]
    assert _reported(name, kind.value, "no rule in gpuvigil/config/hints.yaml", defaults=defaults)


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_a_forgotten_config_block_or_a_default_that_differs(name):
    spec = CLASSES[name].spec
    defaults = config.defaults()
    block = defaults["detectors"].pop(name)
    assert _reported(name, "has no block in gpuvigil/config/detectors.yaml", defaults=defaults)
    key, value = next((k, v) for k, v in spec.config().model_dump().items() if isinstance(v, int | float) and not isinstance(v, bool) and v > 0)
    other = value + 1 if isinstance(value, int) else value / 2  # within the model's bounds
    defaults["detectors"][name] = {**block, key: other}
    assert _reported(name, f"gives {key} = {other!r}", f"{spec.config.__name__}'s default is {value!r}", defaults=defaults)


def test_a_forgotten_route_team_fails_the_alert_settings():
    """A kind's alerts go to the team of its policy's owner: the hardware team must have receivers."""
    cfg = config.defaults()
    del cfg["alerts"]["teams"][cfg["alerts"]["hardware_team"]]
    assert kinds.policy("nvlink_crc").owner == "hardware"
    with pytest.raises(config.ConfigError, match="team 'gpu-platform' has no receivers under 'teams'"):
        load_settings(cfg)


@pytest.mark.parametrize(("name", "column"), [(n, c) for n, cols in sorted(DECLARED_COLUMNS.items()) for c in cols if c not in registry.NOT_EXPORTED])
def test_a_forgotten_export(name, column, monkeypatch):
    monkeypatch.setitem(signals.BY_NAME, column, dataclasses.replace(signals.BY_NAME[column], prometheus=None))
    assert _reported(name, f"gpu_samples.{column}", "no exported series")


@pytest.mark.parametrize(("name", "column"), [(n, c) for n, cols in sorted(DECLARED_COLUMNS.items()) for c in cols])
def test_a_forgotten_signal_row(name, column, monkeypatch):
    schema = schemas.STREAMS["gpu_samples"]
    monkeypatch.setitem(schemas.STREAMS, "gpu_samples", type(schema)({c: t for c, t in schema.items() if c != column}))
    assert _reported(name, f"gpu_samples.{column}", "a Signal row in gpuvigil/signals.py")


def test_a_forgotten_stream_schema(monkeypatch):
    monkeypatch.delitem(schemas.STREAMS, "allocations")
    assert _reported("nvlink_crc", "stream 'allocations'", "no schema")


def test_the_nvlink_crc_detector_is_held_to_every_declaration(monkeypatch):
    """The worked example of docs/adding-a-detector.md, each declaration forgotten in turn."""
    name, kind = "nvlink_crc", kinds.FindingKind.NVLINK_CRC
    defaults = config.defaults()
    defaults["detectors"].pop(name)
    defaults["hints"]["rules"] = [r for r in defaults["hints"]["rules"] if r["kind"] != name]
    with monkeypatch.context() as m:
        m.setattr(kinds, "POLICIES", {k: p for k, p in kinds.POLICIES.items() if k != kind})
        m.setitem(signals.BY_NAME, "nvlink_crc_errors_total", dataclasses.replace(signals.BY_NAME["nvlink_crc_errors_total"], prometheus=None))
        # (active_findings re-reports every kind a saved gpuvigil page names: each forgotten
        # declaration of a kind is its omission too)
        assert sorted(registry.omissions(defaults, RUNBOOKS)) == [
            "active_findings emits nvlink_crc with no rule in gpuvigil/config/hints.yaml (an empty `actions: []` says none, on purpose)",
            "active_findings emits nvlink_crc, which has no row in POLICIES (gpuvigil/kinds.py): no scope, identity or owner to route its alerts to",
            "nvlink_crc emits nvlink_crc with no rule in gpuvigil/config/hints.yaml (an empty `actions: []` says none, on purpose)",
            "nvlink_crc emits nvlink_crc, which has no row in POLICIES (gpuvigil/kinds.py): no scope, identity or owner to route its alerts to",
            "nvlink_crc has no block in gpuvigil/config/detectors.yaml (its values are NvlinkCrcConfig's defaults)",
            "nvlink_crc reads gpu_samples.nvlink_crc_errors_total, which has no exported series (`prometheus` of its Signal row in gpuvigil/signals.py)",
        ]
    assert registry.omissions(runbooks=RUNBOOKS.replace('<a id="finding-nvlink-crc"></a>', "")) == [
        "nvlink_crc emits nvlink_crc, whose runbook section (anchor 'finding-nvlink-crc') is missing from docs/runbooks.md",
        "active_findings emits nvlink_crc, whose runbook section (anchor 'finding-nvlink-crc') is missing from docs/runbooks.md",
    ]
    monkeypatch.delattr(CLASSES[name], "spec")
    assert registry.omissions(runbooks=RUNBOOKS) == [
        "gpuvigil.detectors.nvlink_crc.NvlinkCrcDetector has detect() but no `spec = DetectorSpec(...)`: it is not registered and never runs",
        "detectors.nvlink_crc in gpuvigil/config/detectors.yaml configures no registered detector",
    ]


def test_serve_refuses_to_start_with_a_missing_declaration(monkeypatch):
    from gpuvigil.app.serve import Server

    monkeypatch.setattr(kinds, "POLICIES", {k: p for k, p in kinds.POLICIES.items() if k != kinds.FindingKind.NVLINK_CRC})
    with pytest.raises(registry.DeclarationError, match="nvlink_crc emits nvlink_crc, which has no row in POLICIES"):
        Server(None)  # type: ignore[arg-type]
