"""The dashboards, as grafanalib objects. `DASHBOARDS` maps a file stem to its builder.

Every panel query goes through `q()`, which adds the `$cluster` matcher, so one Grafana serves
several clusters (Prometheus adds `cluster` as a target label; without it `.*` matches all).
Template variables: `datasource`, `cluster`, and per dashboard `node` or `job`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from grafanalib.core import (
    Dashboard,
    GridPos,
    Heatmap,
    HeatmapColor,
    RowPanel,
    Stat,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

DATASOURCE = "${datasource}"
CLUSTER = 'cluster=~"$cluster"'
NODE = 'node=~"$node"'
JOB = 'job=~"$job"'
RATE = "$__rate_interval"


def q(metric: str, *matchers: str) -> str:
    """`metric{cluster=~"$cluster", ...}`."""
    return f"{metric}{{{', '.join((CLUSTER, *matchers))}}}"


# -- template variables ----------------------------------------------------------------------
def datasource_var() -> Template:
    return Template(name="datasource", label="Data source", query="prometheus", type="datasource", default="Prometheus")


def query_var(name: str, label: str, query: str, *, multi: bool = True, include_all: bool = True) -> Template:
    return Template(
        name=name, label=label, query=query, dataSource=DATASOURCE, includeAll=include_all, multi=multi,
        allValue=".*", refresh=2, sort=1, default="All" if include_all else "",
    )


def cluster_var(metric: str = "gpuvigil_build_info") -> Template:
    return query_var("cluster", "Cluster", f"label_values({metric}, cluster)")


def node_var(metric: str = "gpuvigil_node_gpus", label: str = "node") -> Template:
    return query_var("node", "Node", f"label_values({metric}{{{CLUSTER}}}, {label})")


def job_var() -> Template:
    return query_var("job", "Job", f'label_values(gpuvigil_job_info{{{CLUSTER}, state="running"}}, job)', multi=False, include_all=False)


# -- panels --------------------------------------------------------------------------------
def targets(*exprs: tuple[str, str]) -> list[Target]:
    return [Target(expr=expr, legendFormat=legend, refId=chr(ord("A") + i), datasource=DATASOURCE) for i, (expr, legend) in enumerate(exprs)]


def ts(title: str, *exprs: tuple[str, str], unit: str = "short", description: str = "", stacking: bool = False, **kw) -> TimeSeries:
    return TimeSeries(
        title=title, description=description, dataSource=DATASOURCE, targets=targets(*exprs), unit=unit,
        stacking={"mode": "normal", "group": "A"} if stacking else {}, legendDisplayMode="table", legendPlacement="right",
        legendCalcs=["lastNotNull", "max"], **kw,
    )


def stat(title: str, *exprs: tuple[str, str], unit: str = "none", description: str = "", reduce: str = "lastNotNull") -> Stat:
    return Stat(title=title, description=description, dataSource=DATASOURCE, targets=targets(*exprs), format=unit, reduceCalc=reduce, graphMode="area")


def heatmap(title: str, expr: str, legend: str, *, unit: str, description: str = "") -> Heatmap:
    """Rank × time: each series (one per rank) is a row, colored by its value."""
    target = Target(expr=expr, legendFormat=legend, refId="A", datasource=DATASOURCE, format="heatmap")
    return Heatmap(
        title=title, description=description, dataSource=DATASOURCE, targets=[target], dataFormat="tsbuckets",
        yBucketBound="middle", hideZeroBuckets=False, color=HeatmapColor(mode="spectrum", colorScheme="interpolateTurbo"),
        extraJson={"options": {"calculate": False, "yAxis": {"unit": "none", "reverse": False}, "cellValues": {"unit": unit},
                               "color": {"mode": "scheme", "scheme": "Turbo"}}, "fieldConfig": {"defaults": {"unit": unit}}},
    )


def layout(rows: Iterable[tuple[str, list]]) -> list:
    """Rows of panels on a 24-column grid: panels of a row share its width equally."""
    panels: list = []
    y = 0
    for title, row_panels in rows:
        panels.append(RowPanel(title=title, gridPos=GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        per_line = 3 if len(row_panels) > 2 else len(row_panels)
        width = 24 // per_line
        for i, panel in enumerate(row_panels):
            panel.gridPos = GridPos(h=8, w=width, x=(i % per_line) * width, y=y + (i // per_line) * 8)
        y += 8 * ((len(row_panels) + per_line - 1) // per_line)
        panels.extend(row_panels)
    return panels


def dashboard(uid: str, title: str, description: str, variables: list[Template], rows: Iterable[tuple[str, list]], tags: list[str]) -> Dashboard:
    return Dashboard(
        uid=uid, title=title, description=description, tags=["gpuvigil", *tags], timezone="utc",
        templating=Templating(list=[datasource_var(), *variables]), panels=layout(rows), refresh="30s",
        time=Time("now-3h", "now"), graphTooltip=1,
    ).auto_panel_ids()


# -- dashboards ------------------------------------------------------------------------------
def cluster_overview() -> Dashboard:
    return dashboard(
        "gpuvigil-cluster", "gpuvigil / Cluster overview",
        "GPUs by scheduler state, utilisation, memory, power and the findings gpuvigil holds now.",
        [cluster_var()],
        [
            ("GPUs", [
                stat("GPUs by state", (f"sum by (state) ({q('gpuvigil_scheduler_gpus')})", "{{state}}")),
                stat("Active findings (page)", ("sum(" + q("gpuvigil_findings_active", 'severity="page"') + ")", "page")),
                stat("Nodes by state", (f"sum by (state) ({q('gpuvigil_node_state')})", "{{state}}")),
                ts("GPUs by state", (f"sum by (state) ({q('gpuvigil_scheduler_gpus')})", "{{state}}"), stacking=True),
                ts("Jobs by state", (f"sum by (state) ({q('gpuvigil_scheduler_jobs')})", "{{state}}"), stacking=True),
            ]),
            ("Utilisation", [
                ts("SM utilisation by node", (f"avg by (node) ({q('gpuvigil_gpu_utilization_ratio')})", "{{node}}"), unit="percentunit"),
                ts("Memory used", (f"sum by (node) ({q('gpuvigil_gpu_memory_used_bytes')}) / sum by (node) ({q('gpuvigil_gpu_memory_total_bytes')})", "{{node}}"), unit="percentunit"),
                ts("Power by node", (f"sum by (node) ({q('gpuvigil_gpu_power_watts')})", "{{node}}"), unit="watt"),
                ts("Cluster power", (f"sum({q('gpuvigil_gpu_power_watts')})", "total"), unit="watt"),
                ts("Hottest GPU per node", (f"max by (node) ({q('gpuvigil_gpu_temperature_celsius')})", "{{node}}"), unit="celsius"),
                ts("Memory used (bytes)", (f"sum({q('gpuvigil_gpu_memory_used_bytes')})", "used"), (f"sum({q('gpuvigil_gpu_memory_total_bytes')})", "total"), unit="bytes"),
            ]),
            ("Findings", [
                ts("Active findings by kind", (f"sum by (kind, severity) ({q('gpuvigil_findings_active')})", "{{kind}} ({{severity}})"), stacking=True),
                ts("Active findings by node", (f"sum by (node, severity) ({q('gpuvigil_node_findings_active')})", "{{node}} ({{severity}})")),
            ]),
        ],
        ["cluster"],
    )


def node() -> Dashboard:
    gpu = "GPU {{gpu}}"
    port = "{{device}}/{{port}}"
    return dashboard(
        "gpuvigil-node", "gpuvigil / Node",
        "Per-GPU health of one node: utilisation, memory, power, temperature, clocks, throttling, XID and ECC timelines, InfiniBand ports and NVLink.",
        [cluster_var(), node_var()],
        [
            ("Health", [
                stat("Scheduler state", (f"max by (state) ({q('gpuvigil_node_state', NODE)}) == 1", "{{state}}")),
                stat("Fatal XID GPUs", (f"sum({q('gpuvigil_gpu_last_xid_fatal', NODE)})", "GPUs")),
                ts("Active findings on the node", (f"sum by (kind, severity) ({q('gpuvigil_node_findings_active', NODE)})", "{{kind}} ({{severity}})")),
            ]),
            ("GPUs", [
                ts("SM utilisation", (q("gpuvigil_gpu_utilization_ratio", NODE), gpu), unit="percentunit"),
                ts("Memory used", (q("gpuvigil_gpu_memory_used_bytes", NODE), gpu), unit="bytes"),
                ts("Power", (q("gpuvigil_gpu_power_watts", NODE), gpu), unit="watt"),
                ts("Temperature", (q("gpuvigil_gpu_temperature_celsius", NODE), gpu), unit="celsius"),
                ts("SM clock", (q("gpuvigil_gpu_sm_clock_hertz", NODE), gpu), unit="hertz"),
                ts("Clock throttled (by reason)", (f"max by (gpu, reason) ({q('gpuvigil_gpu_clock_throttled', NODE)})", "GPU {{gpu}} {{reason}}")),
            ]),
            ("XID and ECC", [
                ts("XIDs", (f"increase({q('gpuvigil_gpu_xid_errors_total', NODE)}[{RATE}])", gpu), description="XIDs reported in each interval."),
                ts("Last XID code", (q("gpuvigil_gpu_last_xid", NODE), gpu), description="0 until the GPU reports an XID."),
                ts("Uncorrected ECC (DBE)", (f"increase({q('gpuvigil_gpu_ecc_dbe_errors_total', NODE)}[{RATE}])", gpu)),
                ts("Corrected ECC (SBE)", (f"increase({q('gpuvigil_gpu_ecc_sbe_errors_total', NODE)}[{RATE}])", gpu)),
                ts("Remapped rows / retired pages", (q("gpuvigil_gpu_retired_pages_total", NODE), gpu)),
                ts("Row remap failure", (q("gpuvigil_gpu_row_remap_failure", NODE), gpu),
                   description="1 once a row remap failed: the GPU can no longer repair its memory, NVIDIA's RMA criterion (a row_remap_failure page)."),
                ts("Memory repairs waiting", (q("gpuvigil_gpu_row_remap_pending", NODE), "row remap, " + gpu),
                   (q("gpuvigil_gpu_retired_pages_pending", NODE), "page retirement, " + gpu),
                   description="1 while a row remap waits for a GPU reset, or pages wait for a reboot to be retired."),
            ]),
            ("Fabric: InfiniBand and NVLink", [
                ts("InfiniBand ports up", (q("gpuvigil_ib_port_up", NODE), port), description="1 while the port is ACTIVE."),
                ts("InfiniBand port rate", (q("gpuvigil_ib_port_rate_bytes_per_second", NODE), port), unit="Bps",
                   description="Active width x speed; a port below its peers trained at a lower width or speed."),
                ts("InfiniBand link drops", (f"increase({q('gpuvigil_ib_port_link_downed_total', NODE)}[{RATE}])", port)),
                ts("InfiniBand link errors", (f"increase({q('gpuvigil_ib_port_symbol_errors_total', NODE)}[{RATE}])", "symbol " + port),
                   (f"increase({q('gpuvigil_ib_port_receive_errors_total', NODE)}[{RATE}])", "receive " + port),
                   (f"increase({q('gpuvigil_ib_port_link_integrity_errors_total', NODE)}[{RATE}])", "link integrity " + port)),
                ts("NVLinks up", (q("gpuvigil_gpu_nvlink_links_up", NODE), "up, " + gpu), (q("gpuvigil_gpu_nvlink_links", NODE), "total, " + gpu),
                   description="A PCIe GPU has no NVLink (0)."),
                ts("NVLink fabric status", (q("gpuvigil_gpu_fabric_manager_status", NODE), gpu),
                   description="DCGM's dcgmFabricManagerStatus_t: 0 not supported, 1 not started, 2 in progress, 3 success, 4 failure."),
            ]),
        ],
        ["node"],
    )


def job() -> Dashboard:
    rank = "{{rank}}"
    behind = (
        f"max by (cluster, instance, job) ({q('gpuvigil_rank_collective_completed_seq', JOB)}) "
        f"- on(cluster, instance, job) group_right {q('gpuvigil_rank_collective_completed_seq', JOB)}"
    )
    return dashboard(
        "gpuvigil-job", "gpuvigil / Job",
        "One training job at a glance: per-rank step time and collective progress (rank × time), memory headroom and predicted time to OOM.",
        [cluster_var(), job_var()],
        [
            ("Progress", [
                heatmap("Step time (rank × time)", q("gpuvigil_rank_step_time_seconds", JOB), rank, unit="s",
                        description="One row per rank; a straggler is a bright row, a hang a row that stops changing."),
                heatmap("Collectives behind the fastest rank (rank × time)", behind, rank, unit="none",
                        description="0 for ranks in step with the leader; a rank that stopped enqueuing falls behind."),
                ts("Step time", (q("gpuvigil_rank_step_time_seconds", JOB), "rank {{rank}}"), unit="s"),
                ts("Collectives in flight", (q("gpuvigil_rank_collective_pending", JOB), "rank {{rank}}")),
                ts("Training step", (q("gpuvigil_rank_step", JOB), "rank {{rank}}")),
                ts("Restarts", (q("gpuvigil_job_restarts_total", JOB), "{{job}}")),
            ]),
            ("Memory", [
                ts("Memory headroom (tightest rank)", (q("gpuvigil_job_memory_headroom_ratio", JOB), "{{job}}"), unit="percentunit"),
                ts("Predicted time to OOM", (q("gpuvigil_job_predicted_oom_seconds", JOB), "{{job}}"), unit="s",
                   description="Only while gpuvigil predicts an OOM for the job."),
                ts("Headroom per rank", (q("gpuvigil_rank_memory_headroom_bytes", JOB), "rank {{rank}}"), unit="bytes"),
                ts("Allocated / reserved per rank", (q("gpuvigil_rank_memory_allocated_bytes", JOB), "allocated {{rank}}"),
                   (q("gpuvigil_rank_memory_reserved_bytes", JOB), "reserved {{rank}}"), unit="bytes"),
            ]),
            ("Findings", [
                ts("Active findings for the job", (f"sum by (kind, severity) ({q('gpuvigil_job_findings_active', JOB)})", "{{kind}} ({{severity}})")),
            ]),
        ],
        ["job"],
    )


def detectors() -> Dashboard:
    return dashboard(
        "gpuvigil-detectors", "gpuvigil / Detectors",
        "What gpuvigil finds and how fast: findings over time, detector and tick latency, ingest, collector errors, alert delivery.",
        [cluster_var()],
        [
            ("Findings", [
                ts("Findings raised", (f"sum by (kind, severity) (increase({q('gpuvigil_findings_total')}[{RATE}]))", "{{kind}} ({{severity}})")),
                ts("Active findings", (f"sum by (kind) ({q('gpuvigil_findings_active')})", "{{kind}}"), stacking=True),
            ]),
            ("Latency", [
                ts("Detector latency p95", (f"histogram_quantile(0.95, sum by (le, detector) (rate({q('gpuvigil_detector_duration_seconds_bucket')}[{RATE}])))", "{{detector}}"), unit="s"),
                ts("Tick duration", *[(f"histogram_quantile({p}, sum by (le) (rate({q('gpuvigil_pipeline_tick_duration_seconds_bucket')}[{RATE}])))", f"p{int(p * 100)}") for p in (0.5, 0.95, 0.99)], unit="s"),
                ts("Last tick", (q("gpuvigil_pipeline_last_tick_duration_seconds"), "{{instance}}"), unit="s"),
            ]),
            ("Ingest and delivery", [
                ts("Samples ingested", (f"sum by (instance) (rate({q('gpuvigil_pipeline_samples_ingested_total')}[{RATE}]))", "{{instance}}"), unit="rowsps"),
                ts("Collector errors", (f"sum by (collector) (increase({q('gpuvigil_collector_errors_total')}[{RATE}]))", "{{collector}}")),
                ts("Alert outbox", (q("gpuvigil_alert_outbox_pending"), "pending"), (f"increase({q('gpuvigil_alert_delivery_failures_total')}[{RATE}])", "failed deliveries")),
            ]),
        ],
        ["detectors"],
    )


def scheduler() -> Dashboard:
    wait_p95 = "histogram_quantile(0.95, sum by (le, {by}) ({m}))"
    bucket = q("gpuvigil_scheduler_queue_wait_seconds_bucket")
    return dashboard(
        "gpuvigil-scheduler", "gpuvigil / Scheduler",
        "The scheduler gpuvigil feeds: queue, wait time by priority and tenant, fragmentation, preemptions, GPU-hours lost.",
        [cluster_var()],
        [
            ("Queue", [
                ts("Queued jobs by priority", (f"sum by (priority) ({q('gpuvigil_scheduler_queue_jobs')})", "{{priority}}"), stacking=True),
                ts("Queued jobs by tenant", (f"sum by (tenant) ({q('gpuvigil_scheduler_queue_jobs')})", "{{tenant}}"), stacking=True),
                ts("Oldest wait by priority", (f"max by (priority) ({q('gpuvigil_scheduler_queue_oldest_wait_seconds')})", "{{priority}}"), unit="s"),
                ts("Wait p95 by priority (since start)", (wait_p95.format(by="priority", m=bucket), "{{priority}}"), unit="s"),
                ts("Wait p95 by tenant (since start)", (wait_p95.format(by="tenant", m=bucket), "{{tenant}}"), unit="s"),
            ]),
            ("Capacity", [
                ts("GPUs by state", (f"sum by (state) ({q('gpuvigil_scheduler_gpus')})", "{{state}}"), stacking=True),
                ts("Fragmentation", (q("gpuvigil_scheduler_fragmentation_ratio"), "free GPUs on partly used nodes"), unit="percentunit"),
                ts("Largest free block", (q("gpuvigil_scheduler_largest_free_block_gpus"), "GPUs"), unit="short"),
            ]),
            ("Disruption", [
                ts("Preemptions", (f"sum by (priority, tenant) (increase({q('gpuvigil_scheduler_preemptions_total')}[{RATE}]))", "{{priority}} {{tenant}}")),
                ts("Requeues", (f"sum by (priority, tenant) (increase({q('gpuvigil_scheduler_requeues_total')}[{RATE}]))", "{{priority}} {{tenant}}"),
                   description="Restarts from checkpoint: hints (cordon, resize, allocator setting), crashes, compaction."),
                ts("GPU-hours lost to restarts", (f"sum by (priority, tenant) ({q('gpuvigil_scheduler_lost_gpu_seconds_total')}) / 3600", "{{priority}} {{tenant}}"), unit="h"),
                ts("Scheduler actions", (f"sum by (action) (increase({q('gpuvigil_scheduler_actions_total')}[{RATE}]))", "{{action}}")),
            ]),
        ],
        ["scheduler"],
    )


def dcgm_node() -> Dashboard:
    """The node dashboard on a plain dcgm-exporter (no gpuvigil): DCGM_FI_* metrics, `Hostname` label."""
    host = 'Hostname=~"$node"'
    gpu = "GPU {{gpu}}"

    def d(metric: str) -> str:
        return q(metric, host)

    return dashboard(
        "gpuvigil-dcgm-node", "gpuvigil / Node (dcgm-exporter)",
        "Per-GPU health of one node from a plain dcgm-exporter: the same views as the gpuvigil node dashboard, without gpuvigil.",
        [cluster_var("DCGM_FI_DEV_GPU_TEMP"), node_var("DCGM_FI_DEV_GPU_TEMP", "Hostname")],
        [
            ("GPUs", [
                ts("SM utilisation", (f"{d('DCGM_FI_DEV_GPU_UTIL')} / 100", gpu), unit="percentunit"),
                ts("Memory used", (f"{d('DCGM_FI_DEV_FB_USED')} * 1048576", gpu), unit="bytes", description="dcgm-exporter reports MiB."),
                ts("Memory used share", (f"{d('DCGM_FI_DEV_FB_USED')} / ({d('DCGM_FI_DEV_FB_USED')} + {d('DCGM_FI_DEV_FB_FREE')})", gpu), unit="percentunit"),
                ts("Power", (d("DCGM_FI_DEV_POWER_USAGE"), gpu), unit="watt"),
                ts("Temperature", (d("DCGM_FI_DEV_GPU_TEMP"), gpu), unit="celsius"),
                ts("SM clock", (f"{d('DCGM_FI_DEV_SM_CLOCK')} * 1e6", gpu), unit="hertz"),
                ts("Clock event reasons (bitmask)", (d("DCGM_FI_DEV_CLOCKS_EVENT_REASONS"), gpu),
                   description="0x20/0x40 = thermal slowdown, 0x8 = HW slowdown, 0x4 = power cap."),
            ]),
            ("XID and ECC", [
                ts("Last XID code", (d("DCGM_FI_DEV_XID_ERRORS"), gpu), description="dcgm-exporter reports the most recent XID code."),
                ts("Uncorrected ECC (DBE, volatile)", (d("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"), gpu)),
                ts("Corrected ECC (SBE, volatile)", (d("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"), gpu)),
                ts("Remapped rows", (d("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS"), "correctable {{gpu}}"), (d("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS"), "uncorrectable {{gpu}}")),
                ts("Row remap failure", (d("DCGM_FI_DEV_ROW_REMAP_FAILURE"), gpu)),
                ts("PCIe replays", (f"increase({d('DCGM_FI_DEV_PCIE_REPLAY_COUNTER')}[{RATE}])", gpu)),
            ]),
        ],
        ["node", "dcgm"],
    )


def fleet() -> Dashboard:
    by_replica = "{{replica}}"
    nats_up = q("up", 'job="gpuvigil-nats"')  # the control plane's scrape of prometheus-nats-exporter
    return dashboard(
        "gpuvigil-fleet", "gpuvigil / Fleet health",
        "The fleet's control plane on NATS JetStream: detect partitions judged, the act leader, consumer and clock lag, "
        "partition takeovers (each replays the partition), alert delivery, and the NATS servers.",
        [cluster_var("gpuvigil_detect_partitions")],
        [
            ("Fleet health", [
                stat("Partitions judged", (f"sum({q('gpuvigil_detect_partitions_caught_up')}) / max({q('gpuvigil_detect_partitions')})", "judged"),
                     unit="percentunit", description="Share of job partitions a detect replica holds and has caught up on (GpuvigilFleetPartitionsUnjudged)."),
                stat("Act leaders", (f"sum({q('gpuvigil_act_leader')})", "leaders"), description="1 in a healthy fleet (GpuvigilFleetNoActLeader)."),
                stat("NATS servers up", (f"sum({nats_up})", "up"), description="Of 3: one may be lost (GpuvigilNatsServerDown)."),
                ts("Partitions held by replica", (f"sum by (replica) ({q('gpuvigil_detect_partitions_held')})", by_replica), stacking=True),
                ts("Consumer lag (messages)", (f"max by (replica) ({q('gpuvigil_detect_consumer_pending_messages')})", "detect " + by_replica),
                   (f"max by (replica) ({q('gpuvigil_act_consumer_pending_messages')})", "act " + by_replica),
                   description="Messages of the streams not read yet (GpuvigilFleetConsumerLag)."),
                ts("Data clock lag", (f"max by (replica) ({q('gpuvigil_detect_clock_lag_seconds')})", "detect " + by_replica),
                   (f"max by (replica) ({q('gpuvigil_act_clock_lag_seconds')})", "act " + by_replica), unit="s",
                   description="The fleet's data clock behind the replica's own (GpuvigilFleetClockLag)."),
                ts("Partition takeovers (replays)", (f"sum by (replica) (increase({q('gpuvigil_detect_partitions_taken_total')}[{RATE}]))", "taken " + by_replica),
                   (f"sum by (replica) (increase({q('gpuvigil_detect_partitions_lost_total')}[{RATE}]))", "lost " + by_replica),
                   description="Each takeover replays the partition from the stream (GpuvigilFleetReplays)."),
                ts("Alerts pending delivery", (f"max by (replica) ({q('gpuvigil_act_alerts_pending')})", by_replica),
                   description="The act leader's outbox to Alertmanager."),
                ts("Pages sent by act", (f"sum by (replica) (increase({q('gpuvigil_act_pages_total')}[{RATE}]))", by_replica)),
                ts("Acting circuit breaker", (f"max by (replica) ({q('gpuvigil_breaker_open')})", "open " + by_replica),
                   (f"max by (replica) ({q('gpuvigil_breaker_taken_nodes')})", "nodes taken " + by_replica),
                   description="The act leader's breaker (act: on): open, nothing more is drained until a person closes it (GpuvigilBreakerOpen)."),
            ]),
        ],
        ["fleet"],
    )


DASHBOARDS: dict[str, Callable[[], Dashboard]] = {
    "gpuvigil-cluster": cluster_overview,
    "gpuvigil-node": node,
    "gpuvigil-job": job,
    "gpuvigil-detectors": detectors,
    "gpuvigil-scheduler": scheduler,
    "gpuvigil-dcgm-node": dcgm_node,
    "gpuvigil-fleet": fleet,
}
