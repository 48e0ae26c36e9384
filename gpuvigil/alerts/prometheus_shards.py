"""Prometheus configs for a fleet of gpuvigil agents split over N Prometheus servers (shards).

Every shard discovers the same agent targets (a static list and/or file_sd files) and keeps the
ones whose address hashes to it: `hashmod` relabelling with modulus N, then `keep` where the hash is
its index. Prometheus computes the hash from the target address (md5, the low 64 bits, mod N;
`shard_of` is the same computation), so each agent is scraped by exactly one shard and all series
of one agent (one `instance`) live on the same shard.

The shards evaluate the rules that are *shard-safe*: rules whose every aggregation keeps
`instance` (`by (..., instance, ...)`) and whose every vector match keeps it (`on(..., instance,
...)`, or no `on()` at all), so series of two targets never meet in one result. Such a rule gives
the same alerts on a shard as on one Prometheus with every target. The other rules need series of
several targets (e.g. a cluster-wide `sum()` joined `on()`), which no shard has: they go to a
separate rule file for the global view's ruler (Thanos Ruler, Mimir's ruler, vmalert) or for the
Prometheus that scrapes the control plane. `shard_safety` decides it from the expression.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any
from urllib.parse import urlsplit

from gpuvigil.alerts import rules
from gpuvigil.alerts.settings import AlertSettings

SHARD_RULES_FILE = "gpuvigil-rules-shard.yml"
SHARD_RULES_TEST_FILE = "gpuvigil-rules-shard.test.yml"
GLOBAL_RULES_FILE = "gpuvigil-rules-global.yml"
SCRAPE_JOB = "gpuvigil-agents"
CONTROL_FILE = "prometheus-control.yml"
# The fleet's control plane: `gpuvigil detect` and `act` (--metrics-port) and the NATS servers
# (prometheus-nats-exporter in front of each one's monitoring port). The fleet-health rules use
# these job names.
FLEET_JOBS = {"detect": "gpuvigil-detect", "act": "gpuvigil-act", "nats": "gpuvigil-nats"}
HASH_LABEL = "__tmp_gpuvigil_shard"


def config_file(shard: int) -> str:
    return f"prometheus-shard-{shard}.yml"


def shard_of(address: str, shards: int) -> int:
    """The shard that keeps `address` (host:port), as Prometheus's `hashmod` computes it: the md5
    of the source label value, its last 8 bytes as a big-endian integer, modulo `shards`."""
    return int.from_bytes(hashlib.md5(address.encode()).digest()[8:], "big") % shards


# -- shard safety of a PromQL expression ------------------------------------------------------

AGGREGATIONS = frozenset(
    {"sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
     "limitk", "limit_ratio"}
)
# Functions whose answer depends on series that may live on another shard.
CROSS_TARGET_FUNCTIONS = frozenset({"absent", "absent_over_time", "scalar"})
# Functions that can rewrite labels, `instance` included: a later match can then join targets.
LABEL_REWRITERS = frozenset({"label_replace", "label_join"})
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_TOKEN = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*|\(|\)|,|[^\sA-Za-z_:(),]+")


def _labels_at(tokens: list[str], i: int) -> tuple[set[str], int]:
    """The label list `( a, b )` starting at tokens[i] == '(' → (labels, index after ')')."""
    assert tokens[i] == "("
    labels: set[str] = set()
    j = i + 1
    while j < len(tokens) and tokens[j] != ")":
        if tokens[j] != ",":
            labels.add(tokens[j])
        j += 1
    return labels, j + 1


def _skip_group(tokens: list[str], i: int) -> int:
    """Index after the parenthesised group starting at tokens[i] == '('."""
    depth = 0
    for j in range(i, len(tokens)):
        depth += {"(": 1, ")": -1}.get(tokens[j], 0)
        if depth == 0:
            return j + 1
    return len(tokens)


def shard_safety(expr: str) -> list[str]:
    """Why `expr` needs series from more than one target ([] when it is shard-safe).

    A reading of the expression's structure (strings and label matchers removed, then aggregation
    clauses and vector-matching modifiers), conservative where unsure: an expression it cannot
    place is called unsafe, never the reverse."""
    text = _MATCHERS.sub(" ", _STRING.sub('""', expr))
    tokens = _TOKEN.findall(text)
    reasons: list[str] = []
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if tok in AGGREGATIONS and (nxt == "(" or nxt in ("by", "without")):
            j = i + 1
            grouping: tuple[str, set[str]] | None = None
            if tokens[j] in ("by", "without") and j + 1 < len(tokens) and tokens[j + 1] == "(":
                labels, j = _labels_at(tokens, j + 1)
                grouping = (tokens[i + 1], labels)
            if j < len(tokens) and tokens[j] == "(":
                after = _skip_group(tokens, j)
                if grouping is None and after + 1 < len(tokens) and tokens[after] in ("by", "without") and tokens[after + 1] == "(":
                    labels, _ = _labels_at(tokens, after + 1)
                    grouping = (tokens[after], labels)
            if grouping is None:
                reasons.append(f"{tok}(...) aggregates over every target")
            elif grouping[0] == "by" and "instance" not in grouping[1]:
                reasons.append(f"{tok} by ({', '.join(sorted(grouping[1]))}) merges targets (no instance)")
            elif grouping[0] == "without" and "instance" in grouping[1]:
                reasons.append(f"{tok} without (instance) merges targets")
        elif tok in ("on", "ignoring") and nxt == "(":
            labels, _ = _labels_at(tokens, i + 1)
            if tok == "on" and "instance" not in labels:
                reasons.append(f"on({', '.join(sorted(labels))}) matches series of different targets")
            if tok == "ignoring" and "instance" in labels:
                reasons.append("ignoring(instance) matches series of different targets")
        elif tok in CROSS_TARGET_FUNCTIONS and nxt == "(":
            reasons.append(f"{tok}() depends on series of every target")
        elif tok in LABEL_REWRITERS and nxt == "(":
            # Its target label sits in a string (removed above): it may rewrite `instance`.
            reasons.append(f"{tok}() may rewrite instance")
        i += 1
    return reasons


def split_rules(s: AlertSettings) -> tuple[list[rules.Rule], dict[str, list[str]]]:
    """(shard-safe rules, {rule name: why not} for the others)."""
    safe, unsafe = [], {}
    for rule in rules.rules(s):
        why = shard_safety(rule.expr)
        if why:
            unsafe[rule.name] = why
        else:
            safe.append(rule)
    return safe, unsafe


def _rule_docs(s: AlertSettings, names: set[str]) -> dict[str, Any]:
    doc = rules.rules_document(s)
    groups = [{"name": g["name"], "rules": [r for r in g["rules"] if r["alert"] in names]} for g in doc["groups"]]
    return {"groups": [g for g in groups if g["rules"]]}


def shard_rules_document(s: AlertSettings) -> dict[str, Any]:
    safe, _ = split_rules(s)
    return _rule_docs(s, {r.name for r in safe})


def global_rules_document(s: AlertSettings) -> dict[str, Any]:
    _, unsafe = split_rules(s)
    return _rule_docs(s, set(unsafe))


def shard_rules_tests_document(s: AlertSettings) -> dict[str, Any]:
    """The `promtool test rules` cases of the shard-safe rules, against the shard rule file."""
    safe = {r.name for r in split_rules(s)[0]}
    doc = rules.tests_document(s, SHARD_RULES_FILE)
    doc["tests"] = [t for t in doc["tests"] if t["name"] in safe]
    return doc


def alerting_section(alertmanagers: list[str]) -> list[dict[str, Any]]:
    """Prometheus `alertmanagers` entries for base URLs: one entry per (scheme, path prefix), each
    listing its peers; Prometheus sends every alert to every one, as gpuvigil's pusher does."""
    entries: dict[tuple[str, str], list[str]] = {}
    for url in alertmanagers:
        parts = urlsplit(url)
        entries.setdefault((parts.scheme, parts.path.rstrip("/")), []).append(parts.netloc)
    out = []
    for (scheme, prefix), hosts in entries.items():
        entry: dict[str, Any] = {"scheme": scheme}
        if prefix:
            entry["path_prefix"] = prefix
        entry["static_configs"] = [{"targets": hosts}]
        out.append(entry)
    return out


def shard_config(
    shard: int,
    shards: int,
    *,
    targets: list[str],
    target_files: list[str],
    alertmanagers: list[str],
    cluster: str,
    scrape_interval: str = "15s",
    evaluation_interval: str = "15s",
) -> dict[str, Any]:
    """The Prometheus config of shard `shard` of `shards`."""
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} not in 0..{shards - 1}")
    job: dict[str, Any] = {
        "job_name": SCRAPE_JOB,
        # gpuvigil's series carry `job` = the training job; keep it instead of the scrape job's name.
        "honor_labels": True,
    }
    if targets:
        job["static_configs"] = [{"targets": list(targets)}]
    if target_files:
        job["file_sd_configs"] = [{"files": list(target_files), "refresh_interval": "1m"}]
    job["relabel_configs"] = [
        {"source_labels": ["__address__"], "modulus": shards, "target_label": HASH_LABEL, "action": "hashmod"},
        {"source_labels": [HASH_LABEL], "regex": str(shard), "action": "keep"},
        # The rules group by `cluster`; set it here so static and file_sd targets both carry it.
        {"target_label": "cluster", "replacement": cluster},
    ]
    doc: dict[str, Any] = {
        "global": {
            "scrape_interval": scrape_interval,
            "evaluation_interval": evaluation_interval,
            # Unique per shard: Thanos/Mimir/federation tell the shards' series apart by them.
            "external_labels": {"cluster": cluster, "shard": str(shard)},
        },
        "rule_files": [SHARD_RULES_FILE],
    }
    if alertmanagers:
        doc["alerting"] = {"alertmanagers": alerting_section(alertmanagers)}
    doc["scrape_configs"] = [job]
    return doc


def control_config(
    *,
    detect: list[str],
    act: list[str],
    nats: list[str],
    alertmanagers: list[str],
    cluster: str,
    scrape_interval: str = "15s",
    evaluation_interval: str = "15s",
) -> dict[str, Any]:
    """The Prometheus of the fleet's control plane: scrapes detect, act and NATS (few targets, so
    one server, not sharded) and evaluates both rule files: the shard-safe ones fire on its own
    targets (clock lag, consumer lag, replays, a NATS server down), and the global ones need
    every detect and act replica together (partitions judged by nobody, no act leader)."""
    jobs = []
    for role, targets in (("detect", detect), ("act", act), ("nats", nats)):
        if targets:
            jobs.append({"job_name": FLEET_JOBS[role], "static_configs": [{"targets": list(targets)}],
                         "relabel_configs": [{"target_label": "cluster", "replacement": cluster}]})
    doc: dict[str, Any] = {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": evaluation_interval,
                   "external_labels": {"cluster": cluster, "shard": "control"}},
        "rule_files": [SHARD_RULES_FILE, GLOBAL_RULES_FILE],
    }
    if alertmanagers:
        doc["alerting"] = {"alertmanagers": alerting_section(alertmanagers)}
    doc["scrape_configs"] = jobs
    return doc
