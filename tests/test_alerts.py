"""Generated alerting artefacts: golden copies in alerts/, rules linted and unit-tested by the real
promtool, the Alertmanager config checked and its routing resolved by the real amtool."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from gpuvigil import config
from gpuvigil.alerts import alertmanager_config, build, rules
from gpuvigil.alerts.pusher import alert_name
from gpuvigil.alerts.settings import load_settings
from gpuvigil.cli.main import main
from gpuvigil.model import FindingKind
from services import AMTOOL, PROMTOOL, binary

REPO = Path(__file__).resolve().parents[1]
ALERTS = REPO / "alerts"


def test_checked_in_alerts_are_current(capsys):
    assert main(["alerts", "build", "--check", "--out", str(ALERTS)]) == 0, capsys.readouterr()


def test_check_detects_a_stale_copy(tmp_path, capsys):
    assert main(["alerts", "build", "--out", str(tmp_path)]) == 0
    (tmp_path / build.ALERTMANAGER_FILE).write_text((tmp_path / build.ALERTMANAGER_FILE).read_text().replace("4h", "5m"))
    assert main(["alerts", "build", "--check", "--out", str(tmp_path)]) == 1
    assert "alertmanager.yml" in capsys.readouterr().err
    (tmp_path / build.RULES_FILE).unlink()
    assert main(["alerts", "build", "--check", "--out", str(tmp_path)]) == 1


def test_build_writes_what_check_accepts(tmp_path):
    assert main(["alerts", "build", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(build.artefacts(load_settings()))
    assert main(["alerts", "build", "--check", "--out", str(tmp_path)]) == 0


def test_promtool_check_rules():
    proc = subprocess.run([binary(PROMTOOL), "check", "rules", build.RULES_FILE], cwd=ALERTS, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules.rules(load_settings()))} rules found" in proc.stdout


def test_promtool_test_rules():
    """Each rule is quiet on its example before the condition holds and fires after, with the
    exact labels (incl. the team joined from gpuvigil_job_info) and rendered annotations."""
    proc = subprocess.run([binary(PROMTOOL), "test", "rules", build.RULES_TEST_FILE], cwd=ALERTS, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_every_rule_has_a_unit_test():
    doc = yaml.safe_load((ALERTS / build.RULES_TEST_FILE).read_text())
    tested = {case["alertname"] for t in doc["tests"] for case in t["alert_rule_test"] if case["exp_alerts"]}
    assert tested == {r.name for r in rules.rules(load_settings())}


def test_promtool_test_rules_fails_on_a_wrong_expectation(tmp_path):
    """The rule tests are not vacuous: a wrong expected label makes promtool fail."""
    (tmp_path / build.RULES_FILE).write_text((ALERTS / build.RULES_FILE).read_text())
    doc = yaml.safe_load((ALERTS / build.RULES_TEST_FILE).read_text())
    doc["tests"][0]["alert_rule_test"][-1]["exp_alerts"][0]["exp_labels"]["severity"] = "ticket"
    (tmp_path / "t.yml").write_text(yaml.safe_dump(doc))
    proc = subprocess.run([binary(PROMTOOL), "test", "rules", "t.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0


def test_promtool_check_config():
    proc = subprocess.run([binary(PROMTOOL), "check", "config", build.PROMETHEUS_FILE], cwd=ALERTS, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_amtool_check_config():
    proc = subprocess.run([binary(AMTOOL), "check-config", build.ALERTMANAGER_FILE], cwd=ALERTS, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "labels, receiver",
    [
        ({"severity": "page", "team": "ml-research"}, "ml-research-page"),
        ({"severity": "page", "team": "ml-vision"}, "ml-vision-page"),
        ({"severity": "page", "team": "gpu-platform", "hardware": "fatal"}, "gpu-platform-page"),
        ({"severity": "page", "team": "somebody-else"}, "gpu-platform-page"),
        ({"severity": "ticket", "team": "ml-research"}, "ml-research-ticket"),
        ({"severity": "ticket", "team": "gpu-platform"}, "gpu-platform-ticket"),
        ({"severity": "info", "team": "ml-research"}, "blackhole"),
        ({"alertname": "SomethingWithoutSeverity"}, "gpu-platform-ticket"),
        # gpuvigil's own findings (grouped by incident) route by the same severity and team.
        ({"origin": "finding", "incident": "abc", "severity": "page", "team": "ml-vision"}, "ml-vision-page"),
        ({"origin": "finding", "incident": "abc", "severity": "ticket", "team": "ml-research", "update": "true"}, "ml-research-ticket"),
        ({"origin": "finding", "incident": "abc", "severity": "info", "team": "ml-research"}, "blackhole"),
        ({"origin": "finding", "kind": "collector_down"}, "gpu-platform-ticket"),
    ],
)
def test_amtool_routes(labels, receiver):
    args = [f"{k}={v}" for k, v in labels.items()]
    proc = subprocess.run(
        [binary(AMTOOL), "config", "routes", "test", f"--config.file={build.ALERTMANAGER_FILE}", *args],
        cwd=ALERTS, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == receiver


def test_alertmanager_document_shape():
    doc = alertmanager_config.alertmanager_document(load_settings())
    route = doc["route"]
    assert route["group_by"] == ["alertname", "job", "node"]
    # gpuvigil's findings first, grouped by incident, under the same severity/team tree as rules'.
    findings, *rules_routes = route["routes"]
    assert findings["matchers"] == ['origin="finding"'] and findings["group_by"] == ["incident"]
    assert findings["routes"] == rules_routes
    repeats = {r["matchers"][0]: r.get("repeat_interval") for r in rules_routes}
    assert repeats['severity="page"'] == "4h" and repeats['severity="ticket"'] == "24h"
    hw = doc["inhibit_rules"][0]
    assert hw == {"source_matchers": ['hardware="fatal"'], "target_matchers": ['scope="job"'], "equal": ["node"]}


def test_settings_overrides_flow_into_the_config():
    cfg = config.load(overrides={"alerts": {"group_wait": "1s", "repeat_interval": {"page": "1h", "ticket": "2h"}}})
    doc = alertmanager_config.alertmanager_document(load_settings(cfg))
    assert doc["route"]["group_wait"] == "1s"
    findings, page = doc["route"]["routes"][:2]
    assert page["repeat_interval"] == "1h" and findings["routes"][0]["repeat_interval"] == "1h"


@pytest.mark.parametrize(
    "override, message",
    [
        ({"group_wait": "soon"}, "not a Prometheus duration"),
        ({"tenants": {"research": "nobody"}}, "team 'nobody' has no receivers"),
        ({"teams": {"storage": {"page": {"webhook_configs": [{"url": "http://127.0.0.1:1/"}]}}}}, "team 'storage': no receiver for severity ticket"),
        ({"resend_seconds": 600, "end_after_seconds": 300}, "end_after_seconds must exceed resend_seconds"),
        ({"rules": {"memory_headroom_ratio": 3}}, "less than or equal to 1"),
        ({"rules": {"collective_stall_for": "5 minutes"}}, "not a Prometheus duration"),
    ],
)
def test_bad_settings_are_rejected_with_the_reason(override, message):
    # Rejected at load (the whole config is validated there) and by the section's own loader.
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.load(overrides={"alerts": override})
    cfg = config.load(overrides={"alerts": override}, validate=False)
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        load_settings(cfg)


def test_bad_user_config_is_a_one_line_error(tmp_path, capsys):
    bad = tmp_path / "c.yaml"
    bad.write_text("alerts:\n  group_wait: later\n")
    assert main(["alerts", "build", "--config", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "group_wait" in err[0]


def _anchors() -> set[str]:
    text = (REPO / "docs" / "runbooks.md").read_text()
    return set(re.findall(r'<a id="([^"]+)"></a>', text))


def test_every_rule_runbook_anchor_exists():
    s = load_settings()
    anchors = _anchors()
    for rule in rules.rules(s):
        url = rules.annotations(rule, s)["runbook"]
        assert url.split("#", 1)[1] in anchors, rule.name


def test_every_finding_kind_has_a_runbook_anchor():
    anchors = _anchors()
    for kind in FindingKind:
        assert f"finding-{kind.value.replace('_', '-')}" in anchors, kind
        assert re.fullmatch(r"Gpuvigil[A-Z][A-Za-z]+", alert_name(kind.value))
