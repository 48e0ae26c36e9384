"""`gpuvigil bench scale`'s table and model, from a result of the shape `run` returns (the run
itself needs a 3-node NATS cluster and minutes: `gpuvigil bench scale --quick`, not in CI).

The model's figures follow from its inputs: the clock fan-out is one message per node per second
to every detect and act replica, the rows on disk are rate x retention per server, act's input is
the node findings, partition findings and node summaries at their shipped refresh intervals, and
detect and act cores are GPUs x CPU per GPU-sample."""

from __future__ import annotations

import re

from benchmarks import scale
from gpuvigil.config.deploy import Fleet


def result() -> dict:
    faults = [{"phase": p, "kind": k, "job": "job-0001", "node": "node-001", "at_data_s": 60.0, "latency_s": lat, "notifications": 1}
              for p, k, lat in (("steady", "xid", 1.5), ("steady", "collective_hang", 20.0), ("detect failover", "collective_hang", None),
                                ("act failover", "xid", 12.0), ("NATS server loss", "xid", 2.5))]
    return {"agent": {"cpu_ms_per_node_tick": 4.0, "msgs_per_node_tick": 1.25, "bytes_per_node_tick": 15000.0},
            "nats": {"publish_msgs_per_s": 500.0, "mb_per_s_published": 7.0},
            "e2e": {"nodes": 6, "gpus": 48, "speed": 4.0, "lease_ttl_s": 10.0, "nats_nodes": 3, "replicas": 3, "partitions": 8, "data_reached_s": 470.0,
                    "faults": faults, "detect_failover_s": 14.0, "detect_failover_empty_messages": 0, "act_failover_s": 11.0,
                    "cpu_window_data_s": 140.0, "cpu_us_per_gpu_sample": {"agent": 900.0, "detect": 120.0, "act": 30.0}}}


def row(md: str, first: str) -> list[str]:
    line = next(ln for ln in md.splitlines() if ln.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_model_follows_from_its_inputs():
    md = scale.markdown(result(), cmd="gpuvigil bench scale --quick")
    f = Fleet()
    cells = row(md, "100,000")
    nodes = 100_000 / 8
    assert cells[1] == "12,500"
    assert cells[4] == f"{nodes * 4:,.0f}"  # clock fan-out: 2 detect + 2 act replicas
    assert cells[5] == f"{nodes / f.findings_refresh_seconds + 64 / f.findings_refresh_seconds + nodes / f.cluster_refresh_seconds:,.0f}"
    mb = nodes * 15000 / 1e6
    assert cells[6] == f"{mb:,.0f} MB/s" and cells[7] == f"{mb * 900 / 1e3:,.0f} GB"
    assert cells[9] == f"{100_000 * 120 / 1e6:,.1f}" and cells[10] == f"{100_000 * 30 / 1e6:,.1f}"
    assert row(md, "1,000,000")[8] == "8"  # 1,875 MB/s over streams of at most 250 MB/s


def test_table_states_the_data_source_and_each_phase():
    md = scale.markdown(result(), cmd="gpuvigil bench scale --quick")
    assert md.startswith("Written by `gpuvigil bench scale --quick`.")
    assert "**simulated**" in md and "x4 speed" in md and "shared 2-core machine" in md and "short run" in md
    summary = [ln for ln in md.splitlines() if re.match(r"\| (steady|detect failover|act failover|NATS server loss) \| \d+ of \d+ \|", ln)]
    assert summary == ["| steady | 2 of 2 | 1.50 s | 20.00 s |", "| detect failover | 0 of 1 | n/a | n/a |",
                       "| act failover | 1 of 1 | 12.00 s | 12.00 s |", "| NATS server loss | 1 of 1 | 2.50 s | 2.50 s |"]
