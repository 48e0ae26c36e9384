"""Grafana dashboards: golden copies in dashboards/, structure, and every queried metric exists
(in a real scrape of gpuvigil, or in a dcgm-exporter page for the DCGM variant). That every
query returns data from a real Prometheus is checked in the integration test."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil.cli.main import main
from gpuvigil.dashboards.build import artefacts, dashboard_json, panel_queries
from gpuvigil.dashboards.definitions import DASHBOARDS
from gpuvigil.exporter.metrics import Snapshot, TickStats
from gpuvigil.exporter.prometheus import exposition
from obs_helpers import tiny_runtime

REPO = Path(__file__).resolve().parents[1]
DCGM_PAGE = Path(__file__).parent / "data" / "obs" / "dcgm_node07.prom"
SELECTOR = re.compile(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{")


def test_checked_in_dashboards_are_current(capsys):
    assert main(["dashboards", "build", "--check", "--out", str(REPO / "dashboards")]) == 0, capsys.readouterr()


def test_check_detects_a_stale_dashboard(tmp_path):
    assert main(["dashboards", "build", "--out", str(tmp_path)]) == 0
    path = tmp_path / "gpuvigil-job.json"
    path.write_text(path.read_text().replace("Step time", "Step tiem"))
    assert main(["dashboards", "build", "--check", "--out", str(tmp_path)]) == 1


def test_the_issue_s_dashboards_exist():
    assert set(artefacts()) == {f"{n}.json" for n in ("gpuvigil-cluster", "gpuvigil-node", "gpuvigil-job", "gpuvigil-detectors", "gpuvigil-scheduler", "gpuvigil-dcgm-node",
                                                      "gpuvigil-fleet")}


@pytest.mark.parametrize("name", sorted(DASHBOARDS))
def test_structure(name):
    d = dashboard_json(name)
    assert d["uid"] == name and d["title"].startswith("gpuvigil / ")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["cluster"]["includeAll"] and variables["cluster"]["allValue"] == ".*"
    panels = [p for p in d["panels"] if p["type"] != "row"]
    assert panels
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    cells = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
    for p in panels:
        assert p["datasource"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert 'cluster=~"$cluster"' in t["expr"], (p["title"], t["expr"])
            for var in re.findall(r"\$(\w+)", t["expr"]):
                assert var in variables or var.startswith("__"), (p["title"], var)


@pytest.mark.parametrize(
    "name, variable",
    [("gpuvigil-node", "node"), ("gpuvigil-job", "job"), ("gpuvigil-dcgm-node", "node")],
)
def test_template_variables(name, variable):
    variables = {v["name"]: v for v in dashboard_json(name)["templating"]["list"]}
    assert variable in variables and variables[variable]["query"].startswith("label_values(")


def test_job_dashboard_has_rank_by_time_heatmaps():
    d = dashboard_json("gpuvigil-job")
    heatmaps = [p for p in d["panels"] if p["type"] == "heatmap"]
    exprs = " ".join(t["expr"] for p in heatmaps for t in p["targets"])
    assert len(heatmaps) == 2
    assert "gpuvigil_rank_step_time_seconds" in exprs and "gpuvigil_rank_collective_completed_seq" in exprs
    assert all(p["targets"][0]["legendFormat"] == "{{rank}}" for p in heatmaps)


@pytest.fixture(scope="module")
def exported_names() -> set[str]:
    stats = TickStats()
    rt = tiny_runtime(sinks=[stats])
    for _ in range(3):
        rt.step()
    names = set()
    for fam in text_string_to_metric_families(exposition(Snapshot(rt, stats)).decode()):
        names |= {s.name for s in fam.samples}
    # Alert-delivery self-metrics exist when serve pushes to Alertmanager.
    return names | {"gpuvigil_alert_outbox_pending", "gpuvigil_alert_delivery_failures_total"}


@pytest.mark.parametrize("name", sorted(n for n in DASHBOARDS if n not in ("gpuvigil-dcgm-node", "gpuvigil-fleet")))
def test_queries_use_only_exported_metrics(name, exported_names):
    for title, expr in panel_queries(dashboard_json(name)):
        for metric in SELECTOR.findall(expr):
            assert metric in exported_names, f"{name} / {title}: {metric} is not exported"


def test_dcgm_dashboard_uses_only_dcgm_exporter_metrics():
    # The names as Prometheus stores them (the text parser would append _total to counters).
    names = {re.split(r"[{ ]", line, maxsplit=1)[0] for line in DCGM_PAGE.read_text().splitlines() if line and not line.startswith("#")}
    for title, expr in panel_queries(dashboard_json("gpuvigil-dcgm-node")):
        for metric in SELECTOR.findall(expr):
            assert metric.startswith("DCGM_FI_") and metric in names, f"{title}: {metric}"


def test_fleet_dashboard_uses_only_what_detect_act_and_the_nats_scrape_export(tmp_path):
    """Every metric of the fleet dashboard is served by `gpuvigil detect` or `act` (their /metrics
    families, built from real replicas), or is the NATS exporter's scrape `up`."""
    import argparse

    from gpuvigil.fleet import act as act_mod
    from gpuvigil.fleet import detect as detect_mod
    from gpuvigil.fleet.metrics import act_families, detect_families

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    detect_mod.add_parser(sub)
    act_mod.add_parser(sub)
    d = detect_mod.Detect(parser.parse_args(["detect", "--id", "d1"]))
    a = act_mod.Act(parser.parse_args(["act", "--id", "a1", "--outbox", str(tmp_path / "outbox.sqlite")]))
    # A leader acting on Slurm (act: on) exports its acting and breaker families too.
    from gpuvigil.app.acting import make_acting

    a.acting = make_acting("slurm", "on", store=None, cfg=a.cfg)
    names = {"up"}
    for fam in [*detect_families(d), *act_families(a)]:
        names |= {s.name for s in fam.samples} | {fam.name}
    exprs = panel_queries(dashboard_json("gpuvigil-fleet"))
    assert len(exprs) >= 11
    for title, expr in exprs:
        for metric in SELECTOR.findall(expr):
            assert metric in names, f"gpuvigil-fleet / {title}: {metric} is not exported by detect or act"
