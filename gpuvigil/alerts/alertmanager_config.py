"""Alertmanager config (alerts/alertmanager.yml) and a Prometheus config that scrapes gpuvigil
and evaluates its rules (alerts/prometheus.yml), both generated from the `alerts` section.

Routing: severity first (`page` → the team's pager receiver, `ticket` → its ticket receiver,
`info` → nowhere), then the `team` label picks the team (gpuvigil sets `team` from the job's
tenant via `tenants:`; hardware alerts go to `hardware_team`; every alert of one incident goes to
the team of the finding that opened it). gpuvigil's findings are grouped by incident
(`finding_group_by`), so an incident's update lands in the notification group of its first
message; the rules' alerts are grouped per alert name, job and node (`group_by`). A fatal hardware alert on a node inhibits job-scoped alerts on the same node: the job
failing there is a consequence, and the pager should ring once, for the cause.
"""

from __future__ import annotations

import copy
from typing import Any

from gpuvigil.alerts.settings import AlertSettings

NULL_RECEIVER = "blackhole"


def receiver_name(team: str, severity: str) -> str:
    return f"{team}-{severity}"


def alertmanager_document(s: AlertSettings) -> dict[str, Any]:
    routes = []
    for severity in ("page", "ticket"):
        team_routes = [
            {"matchers": [f'team="{team}"'], "receiver": receiver_name(team, severity)}
            for team in sorted(s.teams)
            if team != s.default_team
        ]
        route: dict[str, Any] = {
            "matchers": [f'severity="{severity}"'],
            "receiver": receiver_name(s.default_team, severity),
            "repeat_interval": s.repeat_interval.get(severity, "24h"),
        }
        if team_routes:
            route["routes"] = team_routes
        routes.append(route)
    routes.append({"matchers": ['severity="info"'], "receiver": NULL_RECEIVER})
    findings_route = {
        "matchers": ['origin="finding"'],
        "receiver": receiver_name(s.default_team, "ticket"),
        "group_by": list(s.finding_group_by),
        "routes": copy.deepcopy(routes),  # deep: no YAML anchors in the file
    }
    receivers = [{"name": NULL_RECEIVER}]
    for team in sorted(s.teams):
        for severity in ("page", "ticket"):
            receivers.append({"name": receiver_name(team, severity), **s.teams[team][severity]})
    return {
        "route": {
            # Anything without a severity is still seen: it becomes a ticket for the default team.
            "receiver": receiver_name(s.default_team, "ticket"),
            "group_by": list(s.group_by),
            "group_wait": s.group_wait,
            "group_interval": s.group_interval,
            "repeat_interval": s.repeat_interval.get("ticket", "24h"),
            "routes": [findings_route, *routes],
        },
        "inhibit_rules": [
            {
                # A dead GPU/node explains the hangs, timeouts and OOMs of the jobs on it.
                "source_matchers": ['hardware="fatal"'],
                "target_matchers": ['scope="job"'],
                "equal": ["node"],
            },
            {
                # gpuvigil's own finding about a node fault supersedes the rule alert on it.
                "source_matchers": ['origin="finding"'],
                "target_matchers": ['origin="rule"', 'scope="node"'],
                "equal": ["kind", "node"],
            },
            {
                # Same for a job: the finding names the culprit rank, the rule only the symptom.
                "source_matchers": ['origin="finding"'],
                "target_matchers": ['origin="rule"', 'scope="job"'],
                "equal": ["kind", "job"],
            },
            {
                # And for a collector target that is down (finding: with its reason).
                "source_matchers": ['origin="finding"', 'kind="collector_down"'],
                "target_matchers": ['origin="rule"', 'kind="collector_down"'],
                "equal": ["collector", "target"],
            },
            {
                # A page already covers the ticket about the same thing.
                "source_matchers": ['severity="page"'],
                "target_matchers": ['severity="ticket"'],
                "equal": ["alertname", "job", "node", "gpu"],
            },
        ],
        "receivers": receivers,
    }


def prometheus_document(
    *,
    targets: list[str],
    alertmanagers: list[str],
    rule_files: list[str],
    scrape_interval: str = "15s",
    evaluation_interval: str = "15s",
    cluster: str | None = None,
) -> dict[str, Any]:
    """A Prometheus config that scrapes gpuvigil and sends its rules' alerts to Alertmanager.

    `honor_labels: true` keeps gpuvigil's `job` label (the training job) instead of renaming it.
    """
    static: dict[str, Any] = {"targets": targets}
    if cluster:
        static["labels"] = {"cluster": cluster}
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval},
        "rule_files": rule_files,
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": alertmanagers}]}]},
        "scrape_configs": [{"job_name": "gpuvigil", "honor_labels": True, "static_configs": [static]}],
    }
