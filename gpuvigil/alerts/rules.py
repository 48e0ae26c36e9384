"""Prometheus alerting rules over gpuvigil's metrics, and their `promtool test rules` cases.

Each rule says who owns it: `hardware` rules go to the hardware team, `job` rules to the team
of the job's tenant (joined from `gpuvigil_job_info`, which carries `team`), `platform` rules to
the default team. Labels the Alertmanager config routes and inhibits on:

- `severity`: page | ticket
- `team`: receiver owner
- `scope`: node | job | cluster; job-scoped alerts are inhibited while their node has an alert
  labelled `hardware="fatal"`.

Thresholds come from the `alerts.rules` config section, so the shipped rules and the unit tests
are regenerated together by `gpuvigil alerts build`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from gpuvigil.alerts.settings import AlertSettings, RuleThresholds

# Job alerts take their owner from the job's info series. `instance` keeps two gpuvigil
# instances (two clusters) with a job of the same name apart.
JOB_TEAM = "* on(instance, job) group_left(team, tenant) gpuvigil_job_info"


@dataclass
class Example:
    """A promtool unit-test case: input series, and the labels the alert must fire with."""

    series: dict[str, str]  # series selector → promtool values notation
    eval_time: str
    fires_with: list[dict[str, str]]  # extra labels per expected alert (beyond the rule's own)
    quiet_at: str | None = None  # an eval time at which the alert must not fire


@dataclass
class Rule:
    name: str
    group: str
    expr: str
    severity: str
    owner: str  # hardware | job | platform
    scope: str  # node | job | cluster
    summary: str
    description: str
    for_: str = "0m"
    fatal_hardware: bool = False
    example: Example | None = None
    kind: str | None = None  # the finding kind about the same cause (see rule_labels)
    labels: dict[str, str] = field(default_factory=dict)


def _dur_seconds(d: str) -> int:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    return int(sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", d)))


def _minutes(d: str) -> int:
    return max(1, _dur_seconds(d) // 60)


def _num(x: float) -> str:
    return repr(int(x)) if float(x).is_integer() else repr(float(x))


def rules(s: AlertSettings) -> list[Rule]:
    """Every alerting rule, group by group, in the order of the generated rules file."""
    t = s.rules
    return [
        *_gpu_rules(t),
        *_fabric_rules(t),
        *_memory_repair_rules(),
        *_job_rules(t, s),
        *_scheduler_rules(t),
        *_self_rules(t),
        *_fleet_clock_rules(t),
        *_fleet_rules(t),
    ]


# Each rule's promtool example runs on one GPU, one InfiniBand port or one job of the research tenant.
_GPU_SELECTOR = '{node="n1",gpu="0"}'


def _gpu() -> dict[str, str]:
    return {"node": "n1", "gpu": "0"}


def _ib() -> dict[str, str]:
    return {"node": "n1", "device": "mlx5_0", "port": "1", "link_layer": "InfiniBand"}


def _ib_port(name: str, device: str = "mlx5_0") -> str:
    return f'{name}{{node="n1",device="{device}",port="1",link_layer="InfiniBand"}}'


def _gpu_rules(t: RuleThresholds) -> list[Rule]:
    gpu = _gpu()
    sel = _GPU_SELECTOR
    temp_min = _minutes(t.gpu_temperature_for)
    return [
        # -- hardware ----------------------------------------------------------------------
        Rule(
            "GpuvigilGpuFatalXid", "gpuvigil-hardware", "gpuvigil_gpu_last_xid_fatal == 1", "page", "hardware", "node",
            "GPU {{ $labels.gpu }} on {{ $labels.node }} reported a fatal XID",
            "The GPU's last XID needs an operator (reset, reboot or drain). Jobs on the node stop; gpuvigil cordons it.",
            fatal_hardware=True,
            kind="xid",
            example=Example({f"gpuvigil_gpu_last_xid_fatal{sel}": "0 0 1 1 1"}, "3m", [gpu], quiet_at="1m"),
        ),
        Rule(
            "GpuvigilGpuEccUncorrectable", "gpuvigil-hardware", "increase(gpuvigil_gpu_ecc_dbe_errors_total[15m]) > 0", "page", "hardware", "node",
            "Uncorrectable ECC error on GPU {{ $labels.gpu }} of {{ $labels.node }}",
            "A double-bit ECC error corrupted device memory: the process on that GPU died. Drain the node and reset the GPU.",
            fatal_hardware=True,
            kind="ecc",
            example=Example({f"gpuvigil_gpu_ecc_dbe_errors_total{sel}": "0 0 0 1 1"}, "4m", [gpu], quiet_at="2m"),
        ),
        Rule(
            "GpuvigilGpuRowRemapFailure", "gpuvigil-hardware", "gpuvigil_gpu_row_remap_failure == 1", "page", "hardware", "node",
            "Row remapping failed on GPU {{ $labels.gpu }} of {{ $labels.node }}",
            "A row remap failed: the GPU can no longer repair its failing memory (NVIDIA's RMA criterion). Drain the node and replace the GPU.",
            fatal_hardware=True,
            kind="row_remap_failure",
            example=Example({f"gpuvigil_gpu_row_remap_failure{sel}": "0 1 1"}, "2m", [gpu], quiet_at="0m"),
        ),
        Rule(
            "GpuvigilGpuHighSbeRate", "gpuvigil-hardware", f"increase(gpuvigil_gpu_ecc_sbe_errors_total[1h]) > {_num(t.sbe_per_hour)}", "ticket", "hardware", "node",
            "High corrected-ECC rate on GPU {{ $labels.gpu }} of {{ $labels.node }}",
            "Corrected errors are rising fast: a sign of failing memory. Schedule a reset and check remapped rows.",
            kind="ecc",
            example=Example({f"gpuvigil_gpu_ecc_sbe_errors_total{sel}": f"0+{int(t.sbe_per_hour) // 10 + 1}x70"}, "65m", [gpu], quiet_at="5m"),
        ),
        Rule(
            "GpuvigilGpuThermalThrottle", "gpuvigil-hardware",
            'max by (cluster, instance, node, gpu) (gpuvigil_gpu_clock_throttled{reason=~"hw_thermal_slowdown|sw_thermal_slowdown"}) == 1',
            "ticket", "hardware", "node",
            "GPU {{ $labels.gpu }} on {{ $labels.node }} is throttling for heat",
            "Thermal slowdown lowers the SM clock; a synchronous job runs at the speed of this GPU. Check cooling.",
            for_=t.gpu_temperature_for,
            kind="thermal_throttle",
            example=Example({'gpuvigil_gpu_clock_throttled{node="n1",gpu="0",reason="hw_thermal_slowdown"}': f"1x{temp_min + 5}"}, f"{temp_min + 1}m", [gpu], quiet_at="0m"),
        ),
        Rule(
            "GpuvigilGpuOverheating", "gpuvigil-hardware", f"gpuvigil_gpu_temperature_celsius > {_num(t.gpu_temperature_celsius)}", "ticket", "hardware", "node",
            "GPU {{ $labels.gpu }} on {{ $labels.node }} runs hot",
            "The GPU has been above the temperature threshold long enough to throttle soon. Check the node's airflow.",
            for_=t.gpu_temperature_for,
            kind="thermal_throttle",
            example=Example({f"gpuvigil_gpu_temperature_celsius{sel}": f"{_num(t.gpu_temperature_celsius + 3)}x{temp_min + 5}"}, f"{temp_min + 1}m", [gpu], quiet_at="0m"),
        ),
    ]


def _fabric_rules(t: RuleThresholds) -> list[Rule]:
    """InfiniBand/RoCE ports, NVLink and Fabric Manager."""
    gpu = _gpu()
    sel = _GPU_SELECTOR
    ib = _ib()
    deg_min = _minutes(t.ib_degraded_for)
    fab_min = _minutes(t.fabric_not_ready_for)
    return [
        # -- fabric: InfiniBand/RoCE ports, NVLink ------------------------------------------
        Rule(
            "GpuvigilIbPortDown", "gpuvigil-hardware", "(gpuvigil_ib_port_up == 0) and (max_over_time(gpuvigil_ib_port_up[1h]) == 1)", "page", "hardware", "node",
            "InfiniBand port {{ $labels.device }}/{{ $labels.port }} on {{ $labels.node }} is down",
            "A port that was ACTIVE within the hour is not: jobs spanning the node stall or fail. Check the cable, transceiver and switch port; gpuvigil cordons the node.",
            for_="2m",
            kind="ib_link_down",
            example=Example({_ib_port("gpuvigil_ib_port_up"): "1x3 0x10"}, "8m", [ib], quiet_at="3m"),
        ),
        Rule(
            "GpuvigilIbLinkFlapping", "gpuvigil-hardware", f"increase(gpuvigil_ib_port_link_downed_total[10m]) >= {_num(t.ib_link_flaps)}", "ticket", "hardware", "node",
            "InfiniBand link {{ $labels.device }}/{{ $labels.port }} on {{ $labels.node }} is flapping",
            "The link went down and came back several times in ten minutes: reseat or replace the cable or transceiver.",
            kind="ib_link_down",
            example=Example({_ib_port("gpuvigil_ib_port_link_downed_total"): f"1x3 {1 + int(t.ib_link_flaps)}x10"}, "6m", [ib], quiet_at="2m"),
        ),
        Rule(
            "GpuvigilIbLinkDegraded", "gpuvigil-hardware",
            "(gpuvigil_ib_port_rate_bytes_per_second < on(cluster, instance, node, link_layer) group_left() "
            "max by (cluster, instance, node, link_layer) (gpuvigil_ib_port_rate_bytes_per_second)) and (gpuvigil_ib_port_up == 1)",
            "ticket", "hardware", "node",
            "InfiniBand port {{ $labels.device }}/{{ $labels.port }} on {{ $labels.node }} runs below its peers' rate",
            "The port trained at a lower rate or width than the fastest port of its link layer on the node: collectives across the node slow down. Check the cable and retrain the link.",
            for_=t.ib_degraded_for,
            kind="ib_link_degraded",
            example=Example(
                {_ib_port("gpuvigil_ib_port_rate_bytes_per_second"): f"5e10x3 2.5e10x{deg_min + 10}", _ib_port("gpuvigil_ib_port_up"): f"1x{deg_min + 13}",
                 _ib_port("gpuvigil_ib_port_rate_bytes_per_second", "mlx5_1"): f"5e10x{deg_min + 13}", _ib_port("gpuvigil_ib_port_up", "mlx5_1"): f"1x{deg_min + 13}"},
                f"{deg_min + 5}m", [ib], quiet_at="2m",
            ),
        ),
        Rule(
            "GpuvigilIbSymbolErrors", "gpuvigil-hardware", f"rate(gpuvigil_ib_port_symbol_errors_total[5m]) * 60 > {_num(t.ib_symbol_errors_per_minute)}", "ticket", "hardware", "node",
            "InfiniBand port {{ $labels.device }}/{{ $labels.port }} on {{ $labels.node }} has a high symbol error rate",
            "Symbol errors climb fast: the cable or transceiver is degrading and the link often goes down next.",
            kind="ib_link_errors",
            example=Example({_ib_port("gpuvigil_ib_port_symbol_errors_total"): f"0x3 0+{int(t.ib_symbol_errors_per_minute) * 2}x10"}, "9m", [ib], quiet_at="2m"),
        ),
        Rule(
            "GpuvigilIbPortMissing", "gpuvigil-hardware", "gpuvigil_ib_ports < max_over_time(gpuvigil_ib_ports[1d])", "page", "hardware", "node",
            "{{ $labels.node }} lost an InfiniBand port",
            "The node has fewer RDMA ports than it had within a day: an HCA fell off the bus or its driver failed. Drain the node and check the adapter.",
            for_="2m",
            kind="ib_port_missing",
            example=Example({'gpuvigil_ib_ports{node="n1"}': "3x3 2x10"}, "8m", [{"node": "n1"}], quiet_at="3m"),
        ),
        Rule(
            "GpuvigilGpuNvlinkDown", "gpuvigil-hardware",
            "(gpuvigil_gpu_nvlink_links_up < max_over_time(gpuvigil_gpu_nvlink_links_up[1d])) and (gpuvigil_gpu_nvlink_links > 0)", "page", "hardware", "node",
            "NVLink down on GPU {{ $labels.gpu }} of {{ $labels.node }}",
            "The GPU has fewer NVLinks up than it had within a day: collectives between the node's GPUs slow down or fail. Drain the node and reset the GPU.",
            for_="2m",
            kind="nvlink_down",
            example=Example({f"gpuvigil_gpu_nvlink_links_up{sel}": "18x3 17x10", f"gpuvigil_gpu_nvlink_links{sel}": "18x13"}, "8m", [gpu], quiet_at="3m"),
        ),
        Rule(
            "GpuvigilGpuFabricNotReady", "gpuvigil-hardware", "(gpuvigil_gpu_fabric_manager_status == 4) or (gpuvigil_gpu_fabric_manager_status == 2)", "page", "hardware", "node",
            "The NVLink fabric of GPU {{ $labels.gpu }} on {{ $labels.node }} is not ready",
            "Fabric Manager (or IMEX) failed to set up the GPU's NVLink fabric, or has not finished: CUDA cannot use the GPU. Check nvidia-fabricmanager / nvidia-imex; reboot the node if it does not recover.",
            for_=t.fabric_not_ready_for,
            kind="fabric_manager",
            example=Example({f"gpuvigil_gpu_fabric_manager_status{sel}": f"3x3 4x{fab_min + 10}"}, f"{fab_min + 5}m", [gpu], quiet_at="3m"),
        ),
    ]


def _memory_repair_rules() -> list[Rule]:
    """Repairs of device memory that wait for a GPU reset or a reboot."""
    gpu = _gpu()
    sel = _GPU_SELECTOR
    return [
        Rule(
            "GpuvigilGpuRowRemapPending", "gpuvigil-hardware", "gpuvigil_gpu_row_remap_pending == 1", "ticket", "hardware", "node",
            "A row remap waits for a reset on GPU {{ $labels.gpu }} of {{ $labels.node }}",
            "The GPU repaired a failing memory row; the repair takes effect after a GPU reset. Drain the node and reset the GPU when it is idle.",
            for_="5m",
            kind="row_remap_pending",
            example=Example({f"gpuvigil_gpu_row_remap_pending{sel}": "0x3 1x10"}, "10m", [gpu], quiet_at="4m"),
        ),
        Rule(
            "GpuvigilGpuRetiredPagesPending", "gpuvigil-hardware", "gpuvigil_gpu_retired_pages_pending == 1", "ticket", "hardware", "node",
            "Pages wait for retirement on GPU {{ $labels.gpu }} of {{ $labels.node }}",
            "Memory pages are marked for retirement, which takes effect at the next reboot. Reboot the node at the next maintenance slot.",
            for_="5m",
            kind="retired_pages",
            example=Example({f"gpuvigil_gpu_retired_pages_pending{sel}": "0x3 1x10"}, "10m", [gpu], quiet_at="4m"),
        ),
    ]


def _job_rules(t: RuleThresholds, s: AlertSettings) -> list[Rule]:
    job_info = 'gpuvigil_job_info{job="j1",tenant="research",team="%s",priority="P0",state="running"}' % s.team_of_tenant("research")
    job_labels = {"job": "j1", "tenant": "research", "team": s.team_of_tenant("research")}
    head_min = _minutes(t.memory_headroom_for)
    stall_min = _minutes(t.collective_stall_for)
    return [
        # -- jobs ----------------------------------------------------------------------------
        Rule(
            "GpuvigilJobPredictedOom", "gpuvigil-jobs", f"(gpuvigil_job_predicted_oom_seconds < {_num(t.predicted_oom_seconds)}) {JOB_TEAM}", "page", "job", "job",
            "Job {{ $labels.job }} will run out of GPU memory soon",
            "Memory grows step after step: at this rate the job hits a CUDA OOM within the threshold. gpuvigil hints a resize or an allocator setting.",
            kind="oom_predicted",
            example=Example({'gpuvigil_job_predicted_oom_seconds{job="j1"}': f"{_num(t.predicted_oom_seconds * 2)} {_num(t.predicted_oom_seconds / 2)}x3", job_info: "1x5"}, "2m", [job_labels], quiet_at="0m"),
        ),
        Rule(
            "GpuvigilJobMemoryHeadroomLow", "gpuvigil-jobs", f"(gpuvigil_job_memory_headroom_ratio < {_num(t.memory_headroom_ratio)}) {JOB_TEAM}", "ticket", "job", "job",
            "Job {{ $labels.job }} has almost no GPU memory headroom",
            "The job's tightest rank peaks within a few percent of device capacity: a longer sequence or a fragmented allocator will OOM it.",
            for_=t.memory_headroom_for,
            example=Example({'gpuvigil_job_memory_headroom_ratio{job="j1"}': f"{_num(t.memory_headroom_ratio / 2)}x{head_min + 5}", job_info: f"1x{head_min + 5}"}, f"{head_min + 1}m", [job_labels], quiet_at="0m"),
        ),
        Rule(
            "GpuvigilJobCollectiveStalled", "gpuvigil-jobs",
            f"((max by (cluster, instance, job) (gpuvigil_rank_collective_pending) > 0) and on(instance, job) "
            f"(max by (cluster, instance, job) (changes(gpuvigil_rank_collective_completed_seq[{t.collective_stall_for}])) == 0)) {JOB_TEAM}",
            "page", "job", "job",
            "Job {{ $labels.job }} made no collective progress",
            "Ranks have collectives in flight but none completed: an NCCL hang. Find the rank that stopped enqueuing (gpuvigil names it) before the watchdog kills the job.",
            kind="collective_hang",
            example=Example(
                {
                    'gpuvigil_rank_collective_pending{job="j1",rank="0"}': f"1x{stall_min + 10}",
                    'gpuvigil_rank_collective_completed_seq{job="j1",rank="0"}': f"10+4x3 22x{stall_min + 7}",
                    job_info: f"1x{stall_min + 10}",
                },
                f"{stall_min + 5}m", [job_labels], quiet_at="2m",
            ),
        ),
    ]


def _scheduler_rules(t: RuleThresholds) -> list[Rule]:
    frag_min = _minutes(t.fragmentation_for)
    queue_or = " or ".join(
        f'gpuvigil_scheduler_queue_oldest_wait_seconds{{priority="{p}"}} > {_num(v)}' for p, v in sorted(t.queue_wait_seconds.items())
    )
    p0_wait = t.queue_wait_seconds.get("P0", next(iter(t.queue_wait_seconds.values()), 900))
    return [
        # -- scheduler -----------------------------------------------------------------------
        Rule(
            "GpuvigilQueueWaitHigh", "gpuvigil-scheduler", queue_or, "ticket", "platform", "cluster",
            "{{ $labels.priority }} jobs of {{ $labels.tenant }} wait too long for GPUs",
            "The oldest waiting job of this priority exceeds its wait target: the cluster is full, fragmented or has cordoned nodes.",
            example=Example({'gpuvigil_scheduler_queue_oldest_wait_seconds{priority="P0",tenant="research"}': f"0 {_num(p0_wait * 2)}"}, "1m", [{"priority": "P0", "tenant": "research"}], quiet_at="0m"),
        ),
        Rule(
            "GpuvigilClusterFragmented", "gpuvigil-scheduler",
            f"(gpuvigil_scheduler_fragmentation_ratio > {_num(t.fragmentation_ratio)}) and on() (sum(gpuvigil_scheduler_queue_jobs) > 0)",
            "ticket", "platform", "cluster",
            "Free GPUs are scattered while jobs wait",
            "Most free GPUs sit on partly used nodes, so gang jobs cannot start. gpuvigil hints compaction moves.",
            for_=t.fragmentation_for,
            example=Example({"gpuvigil_scheduler_fragmentation_ratio": f"0.9x{frag_min + 5}", 'gpuvigil_scheduler_queue_jobs{priority="P1",tenant="vision"}': f"2x{frag_min + 5}"}, f"{frag_min + 1}m", [{}], quiet_at="0m"),
        ),
    ]


def _self_rules(t: RuleThresholds) -> list[Rule]:
    stall_pipe_min = _minutes(t.pipeline_stall_for)
    down_min = _minutes(t.collector_down_for)
    return [
        # -- gpuvigil itself -----------------------------------------------------------------
        Rule(
            "GpuvigilPipelineStalled", "gpuvigil-self", "rate(gpuvigil_pipeline_ticks_total[1m]) == 0", "page", "platform", "cluster",
            "gpuvigil on {{ $labels.instance }} stopped ticking",
            "The pipeline loop is stuck: no detector runs, so no fault is seen. Restart gpuvigil and look at its log.",
            for_=t.pipeline_stall_for,
            example=Example({'gpuvigil_pipeline_ticks_total{instance="gv:9400"}': f"0+60x3 180x{stall_pipe_min + 10}"}, f"{stall_pipe_min + 6}m", [{"instance": "gv:9400"}], quiet_at="2m"),
        ),
        Rule(
            "GpuvigilCollectorErrors", "gpuvigil-self", "increase(gpuvigil_collector_errors_total[10m]) > 0", "ticket", "platform", "cluster",
            "Collector {{ $labels.collector }} drops samples",
            "A collector could not parse or read some of its input (malformed lines, unreachable endpoint): detectors see less than they should.",
            example=Example({'gpuvigil_collector_errors_total{collector="dcgm"}': "0 0 3 3"}, "3m", [{"collector": "dcgm"}], quiet_at="1m"),
        ),
        Rule(
            "GpuvigilCollectorDown", "gpuvigil-self", "gpuvigil_collector_up == 0", "ticket", "platform", "cluster",
            "Collector {{ $labels.collector }} cannot read {{ $labels.target }}",
            "The collector failed several collects in a row (the reason is in gpuvigil's log and in the collector_down finding): "
            "what it watches (GPUs, kernel log, training logs) is not seen. Check the endpoint, device or file it names.",
            for_=t.collector_down_for,
            kind="collector_down",
            example=Example(
                {'gpuvigil_collector_up{collector="dcgm",target="http://n1:9400/metrics"}': f"1 0x{down_min + 5}"},
                f"{down_min + 2}m", [{"collector": "dcgm", "target": "http://n1:9400/metrics"}], quiet_at="0m",
            ),
        ),
        Rule(
            "GpuvigilAlertOutboxBacklog", "gpuvigil-self", "gpuvigil_alert_outbox_pending > 0", "ticket", "platform", "cluster",
            "gpuvigil cannot deliver its alerts to Alertmanager",
            "Alerts wait in gpuvigil's outbox (nothing is lost; they are retried with backoff). Check that Alertmanager is up and reachable.",
            for_="10m",
            example=Example({"gpuvigil_alert_outbox_pending": "3x20"}, "11m", [{}], quiet_at="5m"),
        ),
    ]


def _fleet_clock_rules(t: RuleThresholds) -> list[Rule]:
    lag_min = _minutes(t.fleet_clock_lag_for)
    return [
        Rule(
            "GpuvigilFleetClockLag", "gpuvigil-self",
            f"max by (instance, replica) ({{__name__=~\"gpuvigil_(detect|act)_clock_lag_seconds\"}}) > {_num(t.fleet_clock_lag_seconds)}",
            "page", "platform", "cluster",
            "The fleet's data clock trails {{ $labels.replica }}'s own clock",
            "The data time detect or act ticks on is far behind the replica's own clock: no agent's announcement or rows reach it, or their "
            "stamps are refused as too far ahead of it, so nothing new is judged. Check the agents, NATS, and the replica's clock skew.",
            for_=t.fleet_clock_lag_for,
            example=Example({'gpuvigil_detect_clock_lag_seconds{instance="d1:9500",replica="d1"}': f"1x2 {_num(t.fleet_clock_lag_seconds * 3)}x{lag_min + 5}"},
                            f"{lag_min + 4}m", [{"instance": "d1:9500", "replica": "d1"}], quiet_at="1m"),
        ),
        Rule(
            "GpuvigilFleetClockSkew", "gpuvigil-self",
            f"(max by (instance, replica) (abs({{__name__=~\"gpuvigil_(detect|act)_clock_skew_seconds\"}})) > {_num(t.fleet_clock_skew_seconds)}) or "
            "(sum by (instance, replica) (increase({__name__=~\"gpuvigil_(detect|act)_clock_future_messages_total\"}[10m])) > 0)",
            "ticket", "platform", "cluster",
            "Times far from {{ $labels.replica }}'s clock on the fleet bus",
            "A host stamps its clock announcements, rows or findings far from this replica's clock: ahead of the bound, they are ignored "
            "(gpuvigil_*_clock_future_messages_total, the log names the subject). Fix the host's NTP, or find the client that forges stamps.",
            example=Example({'gpuvigil_act_clock_future_messages_total{instance="a1:9501",replica="a1",message="clock"}': "0 0 0 1 1"},
                            "3m", [{"instance": "a1:9501", "replica": "a1"}], quiet_at="1m"),
        ),
    ]


def _fleet_rules(t: RuleThresholds) -> list[Rule]:
    return [
        # Fleet health (gpuvigil detect / act / NATS): the control plane's Prometheus scrapes them
        # (`gpuvigil deploy prometheus --detect-target/--act-target/--nats-target`).
        Rule(
            "GpuvigilFleetPartitionsUnjudged", "gpuvigil-self",
            "max by (cluster) (gpuvigil_detect_partitions) - (sum by (cluster) (gpuvigil_detect_partitions_caught_up) or max by (cluster) (gpuvigil_detect_partitions) * 0) > 0",
            "page", "platform", "cluster",
            "Job partitions of cluster {{ $labels.cluster }} are judged by no detect replica",
            "Some job partitions have no detect replica that holds their lease and has caught up on their rows: hangs, stragglers and "
            "cross-rank OOMs of those jobs are not detected. Check that detect replicas run, reach NATS, and hold their leases "
            "(gpuvigil_detect_partitions_held, gpuvigil_detect_member_lease_held).",
            for_=t.fleet_partitions_unjudged_for,
            example=Example({'gpuvigil_detect_partitions{cluster="c1",replica="d1"}': f"4x{_minutes(t.fleet_partitions_unjudged_for) + 6}",
                             'gpuvigil_detect_partitions_caught_up{cluster="c1",replica="d1"}': f"4x2 2x{_minutes(t.fleet_partitions_unjudged_for) + 4}"},
                            f"{_minutes(t.fleet_partitions_unjudged_for) + 4}m", [{"cluster": "c1"}], quiet_at="1m"),
        ),
        Rule(
            "GpuvigilFleetNoActLeader", "gpuvigil-self",
            "(sum by (cluster) (gpuvigil_act_leader) or max by (cluster) (gpuvigil_detect_partitions) * 0) < 1",
            "page", "platform", "cluster",
            "No gpuvigil act leader: findings are neither paged nor acted on",
            "No act replica holds the leader lease, so findings reach no Alertmanager and no hint is issued. Check the act replicas "
            "(running, reaching NATS) and gpuvigil_act_lease_held.",
            for_="1m",
            example=Example({'gpuvigil_act_leader{cluster="c1",replica="a1"}': "1x2 0x6", 'gpuvigil_detect_partitions{cluster="c1",replica="d1"}': "4x8"},
                            "5m", [{"cluster": "c1"}], quiet_at="1m"),
        ),
        Rule(
            "GpuvigilFleetConsumerLag", "gpuvigil-self",
            f"max by (instance, replica) ({{__name__=~\"gpuvigil_(detect|act)_consumer_pending_messages\"}}) > {_num(t.fleet_consumer_pending_messages)}",
            "ticket", "platform", "cluster",
            "{{ $labels.replica }} is far behind on its NATS stream",
            "A detect or act replica reads its stream slower than it fills: its findings come later and later. Give detect more "
            "replicas (partitions spread over them) or CPU, or spread the rows over more streams (fleet.rows_streams).",
            for_=t.fleet_consumer_pending_for,
            example=Example({'gpuvigil_detect_consumer_pending_messages{instance="d1:9500",replica="d1",partition="3",stream="GV_ROWS"}':
                             f"0x2 {_num(t.fleet_consumer_pending_messages * 2)}x{_minutes(t.fleet_consumer_pending_for) + 6}"},
                            f"{_minutes(t.fleet_consumer_pending_for) + 4}m", [{"instance": "d1:9500", "replica": "d1"}], quiet_at="1m"),
        ),
        Rule(
            "GpuvigilFleetReplays", "gpuvigil-self",
            f"sum by (instance, replica) (increase({{__name__=~\"gpuvigil_detect_partitions_(taken|lost)_total\"}}[10m])) > {_num(t.fleet_replays_per_10m)}",
            "ticket", "platform", "cluster",
            "{{ $labels.replica }} keeps taking and losing partitions",
            "Partition leases move again and again: each takeover replays the partition from the stream and its findings may flap. "
            "Usually the replica misses lease renewals (NATS slow or failing over, the replica starved of CPU, fleet.lease_ttl_seconds "
            "too short for them).",
            example=Example({'gpuvigil_detect_partitions_taken_total{instance="d1:9500",replica="d1"}': f"0x2 0+{_num(t.fleet_replays_per_10m)}x4"},
                            "6m", [{"instance": "d1:9500", "replica": "d1"}], quiet_at="1m"),
        ),
        Rule(
            "GpuvigilNatsServerDown", "gpuvigil-self",
            # Aggregated so the alert carries no `job` label (alerts route a `job` as a training job's).
            'max by (instance) (up{job="gpuvigil-nats"}) == 0',
            "ticket", "platform", "cluster",
            "NATS server {{ $labels.instance }} of the fleet is down",
            "One NATS server of the fleet's JetStream cluster does not answer its monitoring scrape. Three servers survive the loss "
            "of one; a second loss stops the fleet's streams (no quorum). Restart it or replace its node.",
            for_="2m",
            example=Example({'up{job="gpuvigil-nats",instance="nats-1:7777"}': "1x2 0x6"}, "5m", [{"instance": "nats-1:7777"}], quiet_at="1m"),
        ),
    ]


def rule_labels(rule: Rule, s: AlertSettings) -> dict[str, str]:
    labels = {"severity": rule.severity, "scope": rule.scope, "origin": "rule"}
    if rule.kind:
        # gpuvigil pushes a finding alert (origin="finding") with the same kind for the same
        # cause; Alertmanager then holds this rule alert back so the pager rings once.
        labels["kind"] = rule.kind
    if rule.owner == "hardware":
        labels["team"] = s.hardware_team
    elif rule.owner == "platform":
        labels["team"] = s.default_team
    if rule.fatal_hardware:
        labels["hardware"] = "fatal"
    labels.update(rule.labels)
    return labels


def annotations(rule: Rule, s: AlertSettings) -> dict[str, str]:
    return {"summary": rule.summary, "description": rule.description, "runbook": s.runbook(rule.name)}


def rules_document(s: AlertSettings) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for rule in rules(s):
        body: dict[str, Any] = {"alert": rule.name, "expr": rule.expr}
        if rule.for_ != "0m":
            body["for"] = rule.for_
        body["labels"] = rule_labels(rule, s)
        body["annotations"] = annotations(rule, s)
        groups.setdefault(rule.group, []).append(body)
    return {"groups": [{"name": name, "rules": body} for name, body in groups.items()]}


_LABEL_REF = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}")


def _render(template: str, labels: dict[str, str]) -> str:
    return _LABEL_REF.sub(lambda m: labels.get(m.group(1), ""), template)


def tests_document(s: AlertSettings, rule_file: str) -> dict[str, Any]:
    """A `promtool test rules` file: for every rule, it fires on its example and is quiet before."""
    tests = []
    for rule in rules(s):
        ex = rule.example
        if ex is None:
            continue
        expected = []
        for extra in ex.fires_with:
            labels = {**rule_labels(rule, s), **extra}
            # Series labels the expression keeps (it never keeps __name__ for these rules).
            expected.append(
                {
                    "exp_labels": dict(sorted(labels.items())),
                    "exp_annotations": {k: _render(v, labels) for k, v in annotations(rule, s).items()},
                }
            )
        cases = [{"eval_time": ex.eval_time, "alertname": rule.name, "exp_alerts": expected}]
        if ex.quiet_at is not None:
            cases.insert(0, {"eval_time": ex.quiet_at, "alertname": rule.name, "exp_alerts": []})
        tests.append(
            {
                "name": rule.name,
                "interval": "1m",
                "input_series": [{"series": k, "values": v} for k, v in ex.series.items()],
                "alert_rule_test": cases,
            }
        )
    return {"rule_files": [rule_file], "evaluation_interval": "1m", "tests": tests}
