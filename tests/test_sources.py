"""Sources are registered (deployconfig.SOURCE_SPECS, deployconfig.register_source): the
`sources:` model, whether the simulator is left out, the flag merge and the start-up chain all
follow the registrations, so a new source configured alone starts it and no simulator."""

from __future__ import annotations

import argparse

import polars as pl
import pytest

from gpuvigil import config
from gpuvigil.config import deploy as deployconfig
from gpuvigil.app import sources as deploysources
from gpuvigil.errors import UserError

class _Probe:
    name = "probe"
    errors = 0
    streams: dict = {}

    def __init__(self, where: str):
        self.where = where

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        return {}


def build_probe(sources, ctx) -> list[deploysources.Source]:
    return [deploysources.Source("probe", sources.probe, _Probe(sources.probe), "a registered test source")]


@pytest.fixture
def probe():
    deployconfig.register_source(deployconfig.SourceSpec(
        "probe", str | None, None, "a source a plugin registers", 85, "tests.test_sources:build_probe", flag="probe_at",
        check=lambda v: v if v is None or v.startswith("/") else (_ for _ in ()).throw(ValueError(f"{v!r} is not a path"))))
    yield
    deployconfig.unregister_source("probe")


def _flags(**kw) -> argparse.Namespace:
    return argparse.Namespace(**kw)


def test_a_new_source_configured_alone_starts_and_no_simulator(probe):
    cfg = config.load(overrides={"sources": {"probe": "/dev/probe"}})
    sources = deployconfig.from_config(cfg, _flags())
    assert sources.real and sources.configured() == ["probe"]
    started = deploysources.build(sources, cfg)
    assert [(s.kind, s.where) for s in started] == [("probe", "/dev/probe")]


def test_its_flag_overrides_the_file_and_its_check_runs(probe):
    sources = deployconfig.from_config({"sources": {"probe": "/a"}}, _flags(probe_at="/b"))
    assert sources.probe == "/b"
    with pytest.raises(UserError, match="sources.probe: 'b' is not a path"):
        deployconfig.parse({"probe": "b"})
    with pytest.raises(UserError, match=r"cannot be combined with real sources \(probe\)"):
        deployconfig.from_config({"sources": {"probe": "/a"}}, _flags(source=["sim"]))


def test_an_unregistered_key_is_an_error_naming_the_nearest():
    with pytest.raises(config.ConfigError, match="sources.probe"):
        config.load(overrides={"sources": {"probe": "/dev/probe"}})
    assert not deployconfig.parse({}).real


def test_every_source_field_is_a_registration_or_a_setting():
    fields = set(deployconfig.Sources.model_fields)
    assert fields == {s.key for s in deployconfig.SOURCE_SPECS} | {"node", "sim", "scheduler_poll_seconds", "act"}
    for spec in deployconfig.SOURCE_SPECS:
        module, _, attr = spec.build.partition(":")
        assert callable(getattr(__import__(module, fromlist=[attr]), attr)), spec.key


def test_serve_has_the_flag_of_every_registered_source(probe):
    from gpuvigil.app import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(["serve", "--probe-at", "/x", "--dcgm-url", "http://a/metrics", "--dcgm-url", "http://b/metrics"])
    sources = deployconfig.from_config({}, args)
    assert (sources.probe, sources.dcgm, sources.configured()) == ("/x", ["http://a/metrics", "http://b/metrics"], ["dcgm", "probe"])
