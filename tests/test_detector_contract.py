"""Every registered detector against its declaration, the way scikit-learn's `check_estimator` runs
over every estimator (detectors/base.py: DetectorSpec; detectors/registry.py).

Data: the simulated cluster (gpuvigil/sim, 1 Hz samples) running `node_xid79` (an XID 79, the
hang it causes, three background jobs) for 130 s, every stream of every tick recorded once and
replayed into each detector's own window; plus empty, late and null frames built from the
schemas. For each detector:

- it reads only the streams it declares (the window records every `get` and `fresh`), and of a
  stream whose columns it declares, only those (its findings are the same when the window holds
  nothing else);
- it returns `Finding`s of the kinds it declares, sourced to its name;
- it survives an empty window, rows far older than the window (late), and rows whose every
  non-key column is null;
- its defaults come from one place: its config model's defaults are its YAML block's values;
- its name, config model and placement are consistent with the rest of the product, and every
  declaration it needs is made (`registry.validate()`).
"""

from __future__ import annotations

import polars as pl
import pytest

from gpuvigil import config, kinds, schemas
from gpuvigil.app import compose
from gpuvigil.detectors import registry
from gpuvigil.model import Finding
from gpuvigil.window import Window

SPECS = registry.specs()


def _built(name: str, cfg):
    """The detector as the mode that runs it builds it: `analyze` runs every registered one,
    the live ones and those placed `offline`."""
    return compose.detectors(cfg, "analyze", only=[name])[0]


class RecordingWindow(Window):
    """A window that notes every stream a detector asks for."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read: set[str] = set()

    def get(self, stream: str) -> pl.DataFrame:
        self.read.add(stream)
        return super().get(stream)

    def fresh(self, stream: str) -> pl.DataFrame:
        self.read.add(stream)
        return super().fresh(stream)


class _Tape:
    """A sink that records each tick's fresh rows of every stream."""

    def __init__(self):
        self.ticks: list[tuple[float, dict[str, pl.DataFrame]]] = []

    def on_tick(self, result, window) -> None:
        self.ticks.append((result.now, {s: window.fresh(s) for s in schemas.STREAMS if window.fresh(s).height}))


@pytest.fixture(scope="module")
def tape() -> list[tuple[float, dict[str, pl.DataFrame]]]:
    from gpuvigil.app.runtime import build_simulated
    from gpuvigil.sim import scenario as scenario_mod

    sc = scenario_mod.load("node_xid79").model_copy(update={"duration_seconds": 130.0})
    cfg = config.load(overrides={"hints": {"rules": []}})
    t = _Tape()
    rt = build_simulated(sc, seed=1, cfg=cfg, sinks=[t])
    rt.run(sc.duration_seconds)
    return t.ticks


def _play(name: str, ticks, keep: dict[str, tuple[str, ...]] | None = None) -> tuple[RecordingWindow, list[list[Finding]]]:
    det = _built(name, config.defaults())
    w = RecordingWindow(600.0)
    out = []
    for now, frames in ticks:
        for stream, df in frames.items():
            if keep and stream in keep:
                df = df.select([c for c in df.columns if c in keep[stream]])
            w.add(stream, df)
        w.seal(now)
        out.append(det.detect(w))
    return w, out


def _comparable(findings: list[list[Finding]]) -> list[list[dict]]:
    return [[f.to_json_dict() for f in tick] for tick in findings]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_reads_only_what_it_declares_and_emits_its_kinds(name, tape):
    spec = SPECS[name]
    w, out = _play(name, tape)
    undeclared = w.read - set(spec.reads)
    assert not undeclared, f"{name} reads {sorted(undeclared)} but declares only {sorted(spec.reads)}"
    for f in (f for tick in out for f in tick):
        assert isinstance(f, Finding)
        assert f.kind in spec.emits, f"{name} raised {f.kind.value}, not among its declared kinds {[k.value for k in spec.emits]}"
        assert f.source in (name, None) or f.source.startswith(name), f.source
    columns = {s: r.columns for s, r in spec.reads.items() if r.columns is not None}
    if columns:
        _, projected = _play(name, tape, keep=columns)
        assert _comparable(projected) == _comparable(out), f"{name} reads columns beyond those it declares for {sorted(columns)}"


def _null_rows(stream: str, now: float) -> pl.DataFrame:
    row = {"ts": now, "node": "n0", "gpu": 0, "job": "j", "rank": 0}
    return schemas.frame([{k: v for k, v in row.items() if k in schemas.STREAMS[stream]}], stream)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_survives_empty_late_and_null_input(name):
    det = _built(name, config.defaults())
    w = Window(600.0)
    for now in (1000.0, 1001.0):
        w.seal(now)
        assert det.detect(w) == []  # nothing seen, nothing said
    streams = [s for s in SPECS[name].reads if s in schemas.STREAMS]
    for now in (1002.0, 1003.0, 1004.0):
        for stream in streams:
            w.add(stream, _null_rows(stream, now))
            w.add(stream, _null_rows(stream, now - 10_000.0))  # a row from long before the window
        w.seal(now)
        for f in det.detect(w):
            assert isinstance(f, Finding) and f.kind in SPECS[name].emits


@pytest.mark.parametrize("name", sorted(SPECS))
def test_its_defaults_come_from_one_place(name):
    spec = SPECS[name]
    block = config.defaults()["detectors"].get(name)
    assert block is not None, f"{name} has no block in gpuvigil/config/detectors.yaml"
    assert spec.config.model_validate(block).model_dump() == spec.config().model_dump(), (
        f"{name}: gpuvigil/config/detectors.yaml and {spec.config.__name__}'s defaults disagree"
    )
    det = _built(name, None)
    assert det.name == spec.name and isinstance(det.config, spec.config)


def test_the_registry_is_the_set_serve_runs_and_the_config_knows():
    from gpuvigil.app import compose

    names = [d.name for d in registry.default_detectors(config.defaults())]
    assert names == [n for n, spec in SPECS.items() if spec.placement != "offline"] and len(set(names)) == len(names)
    assert compose.detector_names("analyze") == list(SPECS)  # analyze runs the live set and the offline ones
    assert set(config.blocks("detectors") or {}) == set(SPECS)
    assert set(config.defaults()["detectors"]) == set(SPECS)
    for spec in SPECS.values():
        assert set(spec.emits) <= set(kinds.POLICIES)
        assert set(spec.reads) <= set(schemas.STREAMS), f"{spec.name} reads a stream with no schema"


def test_every_declaration_is_made():
    """A class with `detect` and no spec, a kind without a policy row or hint rule, a missing
    YAML block: the product's own check (registry.validate, run by serve) names each;
    tests/test_declarations.py forgets each in turn."""
    registry.validate()


def test_fleet_placement_follows_the_kinds_scope():
    placed = registry.placement()
    assert sorted(n for n, p in placed.items() if p == "agent") == ["anomaly", "ecc", "infiniband", "memory_repair", "nvlink_crc", "nvlink_fabric", "pcie", "thermal", "xid"]
    assert [n for n, p in placed.items() if p == "act"] == ["fragmentation_cluster"]
