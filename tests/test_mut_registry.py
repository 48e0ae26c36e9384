"""Mutation testing: the default detector set (`gpuvigil/detectors/registry.py`).

Data: the shipped default configuration (`gpuvigil/config/*.yaml`, read by `config.load`) with one
setting of every detector changed; no stream data (this is about how the set is built).
"""

from __future__ import annotations

from gpuvigil import config
from gpuvigil.detectors.registry import default_detectors


def _one_numeric_field(model) -> tuple[str, object]:
    for name, value in model.model_dump().items():
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            continue
        return name, (value + 1 if isinstance(value, int) else value * 1.5)
    raise AssertionError(f"{type(model).__name__} has no positive numeric setting")


def test_every_default_detector_reads_its_block_of_the_configuration():
    """Each detector of the set is built from the configuration it was given, not the defaults."""
    base = default_detectors(config.load())
    changes = {d.name: _one_numeric_field(d.config) for d in base}
    assert len(changes) == len(base) == 23
    cfg = config.load(overrides={"detectors": {name: {field: value} for name, (field, value) in changes.items()}})
    for d in default_detectors(cfg):
        field, value = changes[d.name]
        assert getattr(d.config, field) == value, (d.name, field)


def test_the_set_declares_levels_and_fresh_only_look_backs():
    by = {d.name: d for d in default_detectors(config.load())}
    assert (by["hang"].level, by["hang"].capability, by["hang"].streams) == ("L2", "hang", ("rank_progress",))
    assert (by["hang_fr"].level, by["hang_device"].level, by["watchdog"].level) == ("L1", "L0", "L0")
    assert by["xid"].lookback_seconds() == {"gpu_samples": 0.0} and by["hang"].lookback_seconds() == {"rank_progress": 0.0}
    assert by["oom"].lookback_seconds() != {"allocator_stats": 0.0}  # its own declaration is kept


def test_a_declared_detector_without_its_own_look_back_gets_its_specs():
    from gpuvigil.detectors.base import FRESH, HISTORY, Declared, DetectorSpec
    from gpuvigil.detectors.xid import XidConfig
    from gpuvigil.model import FindingKind

    class Plugin(Declared):
        spec = DetectorSpec(name="plugin", config=XidConfig, emits=(FindingKind.XID,), reads={"gpu_samples": FRESH, "events": HISTORY}, order=1)

    class OwnLookback(Plugin):
        spec = DetectorSpec(name="own", config=XidConfig, emits=(FindingKind.XID,), reads={"gpu_samples": FRESH}, order=2)

        def lookback_seconds(self) -> dict[str, float]:
            return {"gpu_samples": 30.0}

    d = Plugin()
    assert (d.name, d.level, d.capability, d.streams) == ("plugin", "L0", None, ("gpu_samples", "events"))
    assert d.lookback_seconds() == {"gpu_samples": 0.0}
    assert not hasattr(d, "window_columns")
    assert OwnLookback().lookback_seconds() == {"gpu_samples": 30.0}
