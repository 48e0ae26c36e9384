"""`gpuvigil deploy prometheus --shards N`: sharded Prometheus configs and per-shard rules.

- the generated files pass `promtool check config`, `promtool check rules` and the shard rules'
  own `promtool test rules` cases; the first shard's config matches its golden file;
- the shard/global split of the shipped rules: which rules are shard-safe and why the others are
  not, with the checker proven on planted expressions (safe and unsafe) so it cannot pass vacuously;
- against three real Prometheus servers running the generated configs, and a fourth with every
  target (`--shards 1`) for reference: every agent target (static and file_sd) is scraped by exactly
  one shard, the one `shard_of` names (Prometheus's own hashmod); the shards together fire exactly
  the alerts the single Prometheus fires (a per-GPU rule and a job rule joined on instance), each
  on the shard that owns its agent and nowhere else.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

import golden
from gpuvigil.alerts import prometheus_shards as ps
from gpuvigil.alerts import rules
from gpuvigil.alerts.settings import load_settings
from gpuvigil.cli.main import main
from services import StaticPage, binary, free_port, wait_for, wait_ready

GOLDEN = Path(__file__).parent / "data" / "golden" / "deploy_prometheus"


def generate(out: Path, *extra: str, shards: int = 3) -> int:
    return main(["deploy", "prometheus", "--shards", str(shards), "--out", str(out), *extra])


def test_generated_configs_and_rules_pass_promtool_and_match_the_golden(tmp_path, capsys):
    promtool = binary("promtool")
    out = tmp_path / "out"
    (out / "sd").mkdir(parents=True)
    (out / "sd" / "agents.json").write_text(json.dumps([{"targets": ["node-101:9400", "node-102:9400"], "labels": {"rack": "r1"}}]))
    cfg = tmp_path / "gpuvigil.yaml"
    cfg.write_text(yaml.safe_dump({"alerts": {"alertmanagers": ["http://am-0:9093", "http://am-1:9093", "https://am-ext.example/am/"]}}))
    assert generate(out, "--target", "node-001:9400", "--target", "node-002:9400", "--targets-file", "sd/*.json",
                    "--cluster", "prod", "--config", str(cfg)) == 0
    names = sorted(p.name for p in out.glob("*.yml"))
    assert names == sorted([*(ps.config_file(i) for i in range(3)), ps.SHARD_RULES_FILE, ps.SHARD_RULES_TEST_FILE, ps.GLOBAL_RULES_FILE])
    for i in range(3):
        res = subprocess.run([promtool, "check", "config", ps.config_file(i)], cwd=out, capture_output=True, text=True)
        assert res.returncode == 0 and "WARNING" not in res.stdout + res.stderr, res.stdout + res.stderr
    res = subprocess.run([promtool, "check", "rules", ps.SHARD_RULES_FILE, ps.GLOBAL_RULES_FILE], cwd=out, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
    res = subprocess.run([promtool, "test", "rules", ps.SHARD_RULES_TEST_FILE], cwd=out, capture_output=True, text=True)
    assert res.returncode == 0 and "SUCCESS" in res.stdout, res.stdout + res.stderr

    shard1 = yaml.safe_load((out / ps.config_file(1)).read_text())
    relabel = shard1["scrape_configs"][0]["relabel_configs"]
    assert relabel[0] == {"source_labels": ["__address__"], "modulus": 3, "target_label": ps.HASH_LABEL, "action": "hashmod"}
    assert relabel[1] == {"source_labels": [ps.HASH_LABEL], "regex": "1", "action": "keep"}
    assert shard1["global"]["external_labels"] == {"cluster": "prod", "shard": "1"}
    # Every shard alerts to every Alertmanager peer (grouped by scheme and path prefix).
    assert shard1["alerting"]["alertmanagers"] == [
        {"scheme": "http", "static_configs": [{"targets": ["am-0:9093", "am-1:9093"]}]},
        {"scheme": "https", "path_prefix": "/am", "static_configs": [{"targets": ["am-ext.example"]}]},
    ]
    golden.check_text(GOLDEN / ps.config_file(0), (out / ps.config_file(0)).read_text())

    # The fleet's control plane: detect, act and the NATS exporters, with both rule files.
    assert generate(out, "--target", "node-001:9400", "--target", "node-002:9400", "--targets-file", "sd/*.json", "--cluster", "prod", "--config", str(cfg),
                    "--detect-target", "detect-0:9403", "--detect-target", "detect-1:9403", "--act-target", "act-0:9404",
                    "--nats-target", "nats-0:7777", "--nats-target", "nats-1:7777", "--nats-target", "nats-2:7777") == 0
    res = subprocess.run([promtool, "check", "config", ps.CONTROL_FILE], cwd=out, capture_output=True, text=True)
    assert res.returncode == 0 and "WARNING" not in res.stdout + res.stderr, res.stdout + res.stderr
    control = yaml.safe_load((out / ps.CONTROL_FILE).read_text())
    assert [j["job_name"] for j in control["scrape_configs"]] == ["gpuvigil-detect", "gpuvigil-act", "gpuvigil-nats"]
    assert control["rule_files"] == [ps.SHARD_RULES_FILE, ps.GLOBAL_RULES_FILE]
    # The fleet-health rules reach it: the per-replica ones in the shard file, the ones over
    # every replica together in the global file.
    shard_rules = (out / ps.SHARD_RULES_FILE).read_text()
    global_rules = (out / ps.GLOBAL_RULES_FILE).read_text()
    for name in ("GpuvigilFleetConsumerLag", "GpuvigilFleetReplays", "GpuvigilNatsServerDown"):
        assert f"alert: {name}" in shard_rules, name
    for name in ("GpuvigilFleetPartitionsUnjudged", "GpuvigilFleetNoActLeader"):
        assert f"alert: {name}" in global_rules, name
    golden.check_text(GOLDEN / ps.CONTROL_FILE, (out / ps.CONTROL_FILE).read_text())
    (out / ps.CONTROL_FILE).unlink()

    # --check: current files pass; a hand edit is reported.
    capsys.readouterr()
    assert generate(out, "--target", "node-001:9400", "--target", "node-002:9400", "--targets-file", "sd/*.json",
                    "--cluster", "prod", "--config", str(cfg), "--check") == 0
    (out / ps.config_file(2)).write_text("edited\n")
    assert generate(out, "--target", "node-001:9400", "--target", "node-002:9400", "--targets-file", "sd/*.json",
                    "--cluster", "prod", "--config", str(cfg), "--check") == 1


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--shards", "0", "--target", "a:1"], "--shards 0"),
        (["--shards", "2"], "no agent targets"),
        (["--shards", "2", "--target", "http://a:9400"], "expected HOST:PORT"),
        (["--shards", "2", "--target", "a:1", "--scrape-interval", "15 s"], "not a Prometheus duration"),
        (["--shards", "2", "--target", "a:1", "--cluster", "a b"], "--cluster"),
    ],
)
def test_bad_arguments_are_one_line_errors(argv, message, tmp_path, capsys):
    assert main(["deploy", "prometheus", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_shipped_rules_split_into_shard_safe_and_global():
    s = load_settings()
    safe, unsafe = ps.split_rules(s)
    # The one rule that joins a cluster-wide sum() with on(): scheduler series, not an agent's; and
    # the fleet-health rules over every detect or act replica together (the control plane's).
    assert set(unsafe) == {"GpuvigilClusterFragmented", "GpuvigilFleetPartitionsUnjudged", "GpuvigilFleetNoActLeader"}
    assert any("on()" in why for why in unsafe["GpuvigilClusterFragmented"])
    # Per-node and per-GPU (hardware), per-job joined on(instance, job), per-process (self) rules are shard-safe.
    assert {"GpuvigilGpuFatalXid", "GpuvigilGpuThermalThrottle", "GpuvigilJobPredictedOom", "GpuvigilJobCollectiveStalled",
            "GpuvigilPipelineStalled", "GpuvigilCollectorDown"} <= {r.name for r in safe}
    every = {r.name for r in rules.rules(s)}
    in_shard = {r["alert"] for g in ps.shard_rules_document(s)["groups"] for r in g["rules"]}
    in_global = {r["alert"] for g in ps.global_rules_document(s)["groups"] for r in g["rules"]}
    assert in_shard | in_global == every and not in_shard & in_global
    assert {t["name"] for t in ps.shard_rules_tests_document(s)["tests"]} <= in_shard


@pytest.mark.parametrize(
    "expr, safe",
    [
        ("gpuvigil_gpu_temperature_celsius > 87", True),
        ('max by (cluster, instance, node) (x{reason=~"a|b"}) == 1', True),
        ("max(x) by (instance, node) == 1", True),
        ("sum without (gpu) (x)", True),
        ("(a < 1) * on(instance, job) group_left(team) b", True),
        ("a and b", True),
        ('x{label="sum(by on() ignoring(instance))"} > 0', True),  # inside strings and matchers: not PromQL structure
        ("sum(x) > 0", False),
        ("max by (cluster, node) (x)", False),
        ("max(x) by (node)", False),
        ("sum without (instance) (x)", False),
        ("topk(3, x)", False),
        ("a and on() b", False),
        ("a / on(job) b", False),
        ("a / ignoring(instance) b", False),
        ("absent(up{job=\"gpuvigil\"})", False),
        ("x > scalar(y)", False),
        ('label_replace(x, "instance", "all", "", "") / on(instance) y', False),
    ],
)
def test_shard_safety_checker(expr, safe):
    reasons = ps.shard_safety(expr)
    assert (reasons == []) is safe, reasons


def test_shard_of_is_a_partition():
    targets = [f"node-{i:04d}:9400" for i in range(2000)]
    counts = [0] * 8
    for t in targets:
        counts[ps.shard_of(t, 8)] += 1
    assert sum(counts) == 2000 and min(counts) > 0
    assert all(ps.shard_of(t, 1) == 0 for t in targets[:10])


def _get(url: str, path: str) -> dict:
    resp = httpx.get(f"{url}{path}", timeout=5)
    resp.raise_for_status()
    return resp.json()["data"]


def _start_prometheus(exe: str, folder: Path, config: str, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = folder / f"{name}.log"
    proc = subprocess.Popen(
        [exe, f"--config.file={config}", f"--storage.tsdb.path={folder / f'data-{name}'}", f"--web.listen-address=127.0.0.1:{port}",
         "--log.level=warn"],
        stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=folder,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(f"{url}/-/ready", proc, log=log)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def _firing(url: str) -> set[tuple[tuple[str, str], ...]]:
    return {tuple(sorted(a["labels"].items())) for a in _get(url, "/api/v1/alerts")["alerts"] if a["state"] == "firing"}


@pytest.mark.services
@pytest.mark.timeout(240)
def test_three_real_prometheus_shards_split_the_agents_and_alert_as_one_prometheus_would(tmp_path):
    """Three shards and, for reference, one Prometheus with every target (`--shards 1`), on the
    same agents: each target lands on the shard `shard_of` names, and the alerts the shards fire
    together are exactly those the single Prometheus fires."""
    exe = binary("prometheus")
    shards = 3
    # Agent stand-ins serving gpuvigil metrics: one reports a fatal XID (a per-GPU rule), one a job
    # about to run out of memory with its info series (a job rule joined on(instance, job)).
    healthy = b'gpuvigil_gpu_last_xid_fatal{node="n-ok",gpu="0"} 0\n'
    broken = b'gpuvigil_gpu_last_xid_fatal{node="n-bad",gpu="3"} 1\n'
    job = (b'gpuvigil_job_predicted_oom_seconds{job="j1"} 100\n'
           b'gpuvigil_job_info{job="j1",tenant="research",team="ml-research",priority="P0",state="running"} 1\n')
    pages = [StaticPage(healthy) for _ in range(5)] + [StaticPage(job), StaticPage(broken)]
    static, from_file = [p.target for p in pages[:3]], [p.target for p in pages[3:]]
    # Addresses nobody listens on: still targets (down), still assigned to exactly one shard.
    static += [f"127.0.0.1:{free_port()}" for _ in range(6)]
    every = static + from_file
    folders = {"shards": tmp_path / "shards", "single": tmp_path / "single"}
    for name, folder in folders.items():
        (folder / "sd").mkdir(parents=True)
        (folder / "sd" / "agents.yml").write_text(yaml.safe_dump([{"targets": from_file}]))
        assert generate(folder, *[a for t in static for a in ("--target", t)], "--targets-file", "sd/*.yml", "--scrape-interval", "1s",
                        "--evaluation-interval", "1s", "--cluster", "it", shards=shards if name == "shards" else 1) == 0
    servers: list[tuple[subprocess.Popen, str]] = []
    try:
        for i in range(shards):
            servers.append(_start_prometheus(exe, folders["shards"], ps.config_file(i), f"shard-{i}"))
        single = _start_prometheus(exe, folders["single"], ps.config_file(0), "single")
        servers.append(single)
        shard_urls = [url for _, url in servers[:shards]]

        def active(url: str) -> set[str]:
            return {t["discoveredLabels"]["__address__"] for t in _get(url, "/api/v1/targets")["activeTargets"]}

        wait_for(lambda: sum(len(active(u)) for u in shard_urls) == len(every) and len(active(single[1])) == len(every), 60,
                 what="every Prometheus to discover its targets")
        owned = [active(u) for u in shard_urls]
        for i, mine in enumerate(owned):
            assert mine == {t for t in every if ps.shard_of(t, shards) == i}, f"shard {i}"
        assert set().union(*owned) == set(every)

        def names(alerts) -> set[str]:
            return {dict(a)["alertname"] for a in alerts}

        expected = {"GpuvigilGpuFatalXid", "GpuvigilJobPredictedOom"}
        wait_for(lambda: names(_firing(single[1])) >= expected and names(set().union(*(_firing(u) for u in shard_urls))) >= expected,
                 60, what="the XID and OOM rules to fire")
        reference = _firing(single[1])
        per_shard = [_firing(u) for u in shard_urls]
        assert set().union(*per_shard) == reference
        xid = [dict(a) for a in reference if dict(a)["alertname"] == "GpuvigilGpuFatalXid"]
        oom = [dict(a) for a in reference if dict(a)["alertname"] == "GpuvigilJobPredictedOom"]
        assert [(a["node"], a["gpu"], a["cluster"]) for a in xid] == [("n-bad", "3", "it")]
        assert [(a["job"], a["team"]) for a in oom] == [("j1", "ml-research")]
        # Each alert fires on the shard that owns its agent, and nowhere else.
        for alert in reference:
            owner = ps.shard_of(dict(alert)["instance"], shards)
            assert [alert in fired for fired in per_shard] == [i == owner for i in range(shards)]
        for _, url in servers:
            groups = _get(url, "/api/v1/rules")["groups"]
            assert all(r["health"] != "err" for g in groups for r in g["rules"]), url
    finally:
        for proc, _ in servers:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        for page in pages:
            page.close()
