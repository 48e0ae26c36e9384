"""End to end against the real servers: `gpuvigil serve` (subprocess) on a fault scenario, a real
Prometheus 2.42 scraping it every second and evaluating the generated rules, and a real
Alertmanager 0.25 (the generated config, with test-only timings and local webhook receivers).

Asserts that
- alerts queued while Alertmanager is down are delivered once it is back (durable outbox),
- the pushed page alert reaches the owning team's pager webhook, and no group is paged twice,
- a ticket-severity alert reaches the ticket webhook of its tenant's team,
- a job alert on a node with a fatal hardware alert is inhibited (reaches Alertmanager, never a
  webhook),
- the generated rules load and evaluate without error,
- every query of every generated dashboard panel returns data from Prometheus.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpuvigil import schemas
from gpuvigil.alerts import build as alerts_build
from gpuvigil.alerts.alertmanager_config import alertmanager_document, prometheus_document
from gpuvigil.alerts.pusher import AlertPusher
from gpuvigil.dashboards.build import dashboard_json, panel_queries
from gpuvigil.dashboards.definitions import DASHBOARDS
from gpuvigil.model import Finding, FindingKind, Severity
from gpuvigil.pipeline.core import TickResult
from gpuvigil.window import Window
from obs_helpers import alert_settings_for_tests
from services import StaticPage, WebhookSink, binary, free_port, start_alertmanager, start_prometheus, wait_for

pytestmark = [pytest.mark.services, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[1]
DCGM_PAGE = Path(__file__).parent / "data" / "obs" / "dcgm_node07.prom"
SCENARIO, JOB, TEAM = "leak_to_oom", "llm-pretrain", "ml-research"  # llm-pretrain's tenant is research
CLUSTER = "it"
# The fleet dashboard reads the detect/act processes and NATS (not this single serve); these
# series come from the InfiniBand source and NVML/DCGM fabric fields the simulated cluster does
# not send (tests/test_infiniband_serve.py and tests/test_nvlink_fabric.py read them for real).
CHECKED_DASHBOARDS = [n for n in DASHBOARDS if n != "gpuvigil-fleet"]
NOT_FROM_THE_SIMULATOR = ("gpuvigil_ib_port_", "gpuvigil_gpu_nvlink_links", "gpuvigil_gpu_fabric_", "gpuvigil_gpu_row_remap_pending", "gpuvigil_gpu_retired_pages_pending")


def metric(text: str, name: str) -> list[tuple[dict, float]]:
    return [(s.labels, s.value) for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def firing_alerts(notifications) -> list[tuple[str, dict]]:
    return [(path, a) for path, n in notifications for a in n.get("alerts", []) if a.get("status") == "firing"]


def tick(findings: list[Finding], window: Window, cleared: list[Finding] = ()) -> TickResult:
    return TickResult(now=0.0, new_findings=list(findings), active_findings=list(findings), cleared_findings=list(cleared),
                      new_hints=[], expired_hints=[], duration_seconds=0.0, samples_ingested=0)


@pytest.fixture
def stack(tmp_path):
    binary("prometheus")
    binary("prometheus-alertmanager", "alertmanager")
    cleanup = []
    try:
        webhook = WebhookSink().__enter__()
        cleanup.append(lambda: webhook.__exit__(None, None, None))
        settings = alert_settings_for_tests(webhook.url)
        am_config = alertmanager_document(settings)
        am_port = free_port()
        am_dir = tmp_path / "alertmanager"
        am = start_alertmanager(am_config, am_dir, port=am_port)
        state = {"am": am}
        cleanup.append(lambda: state["am"].stop())

        serve = subprocess.Popen(
            [sys.executable, "-m", "gpuvigil", "serve", "--scenario", SCENARIO, "--speed", "4", "--port", "0",
             "--alertmanager", am.url, "--outbox", str(tmp_path / "outbox.sqlite"), "--log-level", "warning"],
            cwd=tmp_path, stdout=subprocess.PIPE, stderr=(tmp_path / "serve.log").open("w"), text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        cleanup.append(lambda: (serve.poll() is None and serve.terminate(), serve.wait(timeout=30)))
        first = serve.stdout.readline()
        assert first.startswith("gpuvigil serve:"), first + (tmp_path / "serve.log").read_text()[-2000:]
        metrics_url = first.split("metrics ", 1)[1].split(";")[0].strip()
        serve_target = metrics_url.split("//", 1)[1].split("/", 1)[0]

        dcgm = StaticPage(DCGM_PAGE.read_bytes())
        cleanup.append(dcgm.close)
        rules_text = (REPO / "alerts" / alerts_build.RULES_FILE).read_text()
        prom_config = prometheus_document(targets=[serve_target], alertmanagers=[f"127.0.0.1:{am_port}"],
                                          rule_files=[alerts_build.RULES_FILE], scrape_interval="1s", evaluation_interval="1s", cluster=CLUSTER)
        prom_config["scrape_configs"].append({"job_name": "dcgm", "static_configs": [{"targets": [dcgm.target], "labels": {"cluster": CLUSTER}}]})
        prom = start_prometheus(prom_config, tmp_path / "prometheus", extra_files={alerts_build.RULES_FILE: rules_text})
        cleanup.append(prom.stop)

        def restart_alertmanager():
            state["am"] = start_alertmanager(am_config, am_dir, port=am_port)
            return state["am"]

        yield {"webhook": webhook, "settings": settings, "am": state, "restart_am": restart_alertmanager,
               "metrics_url": metrics_url, "prom": prom, "serve": serve, "tmp": tmp_path}
    finally:
        for fn in reversed(cleanup):
            try:
                fn()
            except Exception:  # noqa: BLE001 - keep stopping the rest
                pass


def test_end_to_end(stack):
    webhook, settings, prom = stack["webhook"], stack["settings"], stack["prom"]
    started = time.time()

    # -- 1. Alertmanager outage: the page is queued in the outbox, then delivered after restart --
    stack["am"]["am"].stop()

    def page_queued():
        text = httpx.get(stack["metrics_url"], timeout=10).text
        pending = metric(text, "gpuvigil_alert_outbox_pending")
        failures = metric(text, "gpuvigil_alert_delivery_failures_total")
        pages = sum(v for labels, v in metric(text, "gpuvigil_findings_total") if labels["severity"] == "page" and labels["kind"] == "oom_predicted")
        return pages >= 1 and pending and pending[0][1] >= 1 and failures and failures[0][1] >= 1

    wait_for(page_queued, timeout=90, what="the OOM page to be queued while Alertmanager is down")
    assert webhook.notifications() == []
    stack["restart_am"]()

    def oom_paged():
        return [(p, a) for p, a in firing_alerts(webhook.notifications("/page/"))
                if a["labels"].get("kind") == "oom_predicted" and a["labels"].get("job") == JOB and a["labels"].get("origin") == "finding"]

    paged = wait_for(oom_paged, timeout=60, what="the queued OOM page to reach the pager webhook")
    assert {p for p, _ in paged} == {f"/page/{TEAM}"}
    alert = paged[0][1]
    assert alert["labels"]["severity"] == "page" and alert["labels"]["team"] == TEAM
    assert alert["annotations"]["runbook"].endswith("#finding-oom-predicted")
    assert json.loads(alert["annotations"]["evidence"])["time_to_oom_seconds"] > 0

    # -- 2. Routing and inhibition with findings we control, through the same outbox code -------
    pusher = AlertPusher(stack["am"]["am"].url, stack["tmp"] / "test-outbox.sqlite", settings)
    window = Window()
    window.add("jobs", schemas.frame([{"job": "victim", "tenant": "research"}, {"job": "slowjob", "tenant": "vision"}], schemas.JOBS))
    xid = Finding(kind=FindingKind.XID, severity=Severity.PAGE, ts=0, node="node-x9", gpu=3, xid=79, job="victim",
                  evidence={"fatal": True}, summary="XID 79 on node-x9 GPU 3")
    hang = Finding(kind=FindingKind.COLLECTIVE_HANG, severity=Severity.PAGE, ts=0, job="victim", node="node-x9", culprit_ranks=[5],
                   evidence={"culprit_nodes": ["node-x9"]}, summary="victim hangs: rank 5 stopped enqueuing")
    straggler = Finding(kind=FindingKind.STRAGGLER, severity=Severity.TICKET, ts=0, job="slowjob", node="node-s1", gpu=0,
                        evidence={"slowdown": 1.8}, summary="slowjob rank 2 is 1.8x slower")
    pusher.on_tick(tick([xid], window), window)
    assert pusher.flush() == 1
    wait_for(lambda: [a for _, a in firing_alerts(webhook.notifications("/page/gpu-platform")) if a["labels"].get("node") == "node-x9"],
             timeout=30, what="the XID page at the hardware team's pager")
    pusher.on_tick(tick([xid, hang, straggler], window), window)
    assert pusher.flush() == 2  # the XID is not due for a resend yet
    tickets = wait_for(lambda: [(p, a) for p, a in firing_alerts(webhook.notifications("/ticket/")) if a["labels"].get("job") == "slowjob"],
                       timeout=30, what="the straggler ticket")
    assert {p for p, _ in tickets} == {"/ticket/ml-vision"}

    def hang_inhibited():
        resp = httpx.get(f"{stack['am']['am'].url}/api/v2/alerts", params={"inhibited": "true"}, timeout=10).json()
        return [a for a in resp if a["labels"].get("kind") == "collective_hang" and a["status"]["inhibitedBy"]]

    wait_for(hang_inhibited, timeout=30, what="Alertmanager to hold the hang alert as inhibited")
    time.sleep(3 * 2)  # three group_intervals: time enough for a wrongly routed notification
    assert not [a for _, a in firing_alerts(webhook.notifications()) if a["labels"].get("kind") == "collective_hang"]
    pusher.close()

    # -- 3. No group paged twice (outage, restart and resends included) ------------------------
    seen: dict[tuple[str, frozenset], int] = {}
    for path, n in webhook.notifications("/page/"):
        key = (n["groupKey"], frozenset(a["fingerprint"] for a in n["alerts"] if a["status"] == "firing"))
        if n["status"] == "firing":
            seen[key] = seen.get(key, 0) + 1
    assert seen and all(count == 1 for count in seen.values()), seen

    # -- 4. The generated rules load and evaluate cleanly in Prometheus ------------------------
    groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    evaluated = [r for g in groups for r in g["rules"]]
    assert len(evaluated) == sum(len(g["rules"]) for g in alerts_build.rules.rules_document(settings)["groups"])
    wait_for(lambda: all(r.get("lastEvaluation", "").startswith("20") for g in httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"] for r in g["rules"]),
             timeout=30, what="every rule to be evaluated")
    groups = httpx.get(f"{prom.url}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert all(r["health"] == "ok" for g in groups for r in g["rules"]), [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]]

    # -- 5. Every panel query of every dashboard returns data ----------------------------------
    node = _node_with_findings(prom.url, started)
    variables = {"$cluster": CLUSTER, "$job": JOB, "$__rate_interval": "5s"}
    failures = []
    checked = 0
    for name in CHECKED_DASHBOARDS:
        subs = dict(variables, **{"$node": "gpu-node-07" if name == "gpuvigil-dcgm-node" else node})
        for title, expr in panel_queries(dashboard_json(name)):
            if any(m in expr for m in NOT_FROM_THE_SIMULATOR):
                continue
            query = expr
            for var, val in sorted(subs.items(), key=lambda kv: -len(kv[0])):
                query = query.replace(var, val)
            checked += 1
            resp = httpx.get(f"{prom.url}/api/v1/query_range", params={"query": query, "start": started, "end": time.time(), "step": "1"}, timeout=30)
            body = resp.json()
            if body.get("status") != "success":
                failures.append((name, title, query, body.get("error")))
                continue
            values = [float(v) for series in body["data"]["result"] for _, v in series["values"]]
            if not any(not math.isnan(v) for v in values):
                failures.append((name, title, query, "no data"))
    assert not failures, "\n".join(map(str, failures))
    assert checked == sum(1 for n in CHECKED_DASHBOARDS for _, e in panel_queries(dashboard_json(n)) if not any(m in e for m in NOT_FROM_THE_SIMULATOR)) > 60
    print(f"checked {checked} panel queries; pager notifications: {len(webhook.notifications('/page/'))}, groups: {len(seen)}")


def _node_with_findings(prom_url: str, since: float) -> str:
    resp = httpx.get(f"{prom_url}/api/v1/series", params={"match[]": f'gpuvigil_node_findings_active{{cluster="{CLUSTER}"}}', "start": since}, timeout=10)
    nodes = sorted({s["node"] for s in resp.json()["data"]})
    assert nodes, "no node ever had an active finding"
    return nodes[0]
