"""The deployment config of `gpuvigil serve`: what this node or cluster has (`sources:`), and what
gpuvigil may do about it (`scheduler`, `act`).

    sources:
      node: gpu-node-07                 # this node's name as the scheduler knows it
      nvml: true                        # or dcgm: [http://10.0.0.7:9400/metrics, ...]
      kernel_log: kmsg                  # kmsg | journald | /var/log/kern.log
      logs: ["/shared/logs/{job}/rank{rank}.log"]
      flight_recorder: /var/tmp/gpuvigil-fr
      nccl_inspector: /var/tmp/gpuvigil-nccl-inspector
      hook: 0.0.0.0:9401
      job_map_dir: /run/gpuvigil/job-map  # GPU → job files (deploy/slurm/prolog.sh)
      scheduler: slurm                  # slurm | kubernetes | none
      act: dry-run                      # off | dry-run | on

It lives in the same file as every other config section (`serve --config deploy.yaml`), and each
key has a `serve` flag that overrides it (`merge_flags`). Validation is strict: a misspelt key is
an error naming the nearest valid key, because a silently ignored `kernal_log:` is a node that
never reports an XID.

Nothing configured means the simulated cluster (the demo). A real source that cannot start is an
error naming it; serve never swaps the simulator in for it.
"""

from __future__ import annotations

import difflib
import re
import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from gpuvigil.errors import UserError

SECTION = "sources"
Act = Literal["off", "dry-run", "on"]
SchedulerKind = Literal["slurm", "kubernetes", "none"]
_PLACEHOLDER = re.compile(r"\{(job|rank|node)\}")


class Sources(BaseModel):
    """The `sources:` section. Every field is optional; see the module docstring."""

    model_config = ConfigDict(extra="forbid")

    node: str | None = Field(None, description="this node's name as the scheduler knows it (default: the hostname)")
    sim: bool = Field(False, description="the simulated cluster (demo); cannot be combined with real sources")
    nvml: bool = Field(False, description="sample this node's GPUs through NVML")
    dcgm: list[str] = Field(default_factory=list, description="dcgm-exporter /metrics URLs")
    kernel_log: str | None = Field(None, description="kmsg | journald | PATH of a kernel log file")
    logs: list[str] = Field(default_factory=list, description="torch/NCCL log path patterns ({job}, {rank}, {node}, shell globs)")
    flight_recorder: str | None = Field(None, description="folder where ranks write Flight Recorder dumps")
    nccl_inspector: str | None = Field(None, description="folder of NCCL Inspector output, one <job>/ folder per job (L1, docs/levels.md)")
    hook: str | None = Field(None, description="HOST:PORT where the in-process hook's HttpSink posts")
    job_map_dir: str | None = Field(None, description="GPU → job files (dcgm-exporter's --hpc-job-mapping-dir; deploy/slurm/prolog.sh writes them)")
    infiniband: bool = Field(False, description="read this node's InfiniBand/RoCE ports from <sysfs_root>/class/infiniband")
    sysfs_root: str = Field("/sys", description="the sysfs tree the infiniband source reads (a copy of a machine's /sys in tests)")
    scheduler: SchedulerKind = "none"
    # Every node's agent reads the scheduler's state; 1000 agents polling squeue each second
    # would be slurmctld's busiest client. Snapshots stay in the window between polls.
    scheduler_poll_seconds: float = Field(10.0, gt=0, description="seconds between reads of the scheduler's job map")
    act: Act = "dry-run"

    @field_validator("dcgm")
    @classmethod
    def _urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s):// URL of a dcgm-exporter /metrics endpoint")
        return urls

    @field_validator("hook")
    @classmethod
    def _address(cls, value: str | None) -> str | None:
        if value is not None:
            split_address(value)
        return value

    @field_validator("logs")
    @classmethod
    def _patterns(cls, patterns: list[str]) -> list[str]:
        for p in patterns:
            if not p.startswith("/"):
                raise ValueError(f"{p!r}: log patterns must be absolute paths")
            for name in ("job", "rank", "node"):
                if p.count("{" + name + "}") > 1:
                    raise ValueError(f"{p!r}: {{{name}}} may appear once")
        return patterns

    @property
    def real(self) -> bool:
        """Whether anything but the simulator is configured."""
        return bool(self.nvml or self.dcgm or self.kernel_log or self.logs or self.flight_recorder or self.nccl_inspector or self.hook or self.job_map_dir
                    or self.infiniband or self.scheduler != "none")

    def node_name(self) -> str:
        return self.node or socket.gethostname()


def split_address(value: str) -> tuple[str, int]:
    """'HOST:PORT' or ':PORT' or 'PORT' → (host, port); host defaults to 127.0.0.1."""
    host, sep, port = value.rpartition(":")
    if not sep:
        host, port = "", value
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not an address HOST:PORT (port 0-65535)")
    return host, int(port)


def _nearest(key: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(valid)}"


def parse(raw: Any, where: str = "config") -> Sources:
    """Validate a `sources:` mapping; errors are one line naming the key (and the nearest valid
    key for an unknown one)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"{where}: '{SECTION}' must be a mapping, got {type(raw).__name__}")
    try:
        return Sources.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            key = str(err["loc"][-1])
            raise UserError(f"{where}: {SECTION}.{key}: unknown key; {_nearest(key, list(Sources.model_fields))}") from None
        msg = err["msg"].removeprefix("Value error, ")
        raise UserError(f"{where}: {SECTION}.{loc}: {msg}") from None


def merge_flags(sources: Sources, args: Any) -> Sources:
    """Flags override the file: each given flag replaces its key."""
    data = sources.model_dump()
    chosen = list(getattr(args, "source", None) or [])
    if "sim" in chosen:
        if len(set(chosen)) > 1:
            raise UserError("--source sim cannot be combined with a real source")
        data["sim"] = True
    if "nvml" in chosen:
        data["nvml"] = True
    if "infiniband" in chosen:
        data["infiniband"] = True
    if getattr(args, "sysfs_root", None):
        data["sysfs_root"], data["infiniband"] = str(args.sysfs_root), True
    if getattr(args, "dcgm_url", None):
        data["dcgm"] = list(args.dcgm_url)
    if "dcgm" in chosen and not data["dcgm"]:
        raise UserError("--source dcgm needs --dcgm-url URL (a dcgm-exporter /metrics endpoint)")
    for flag, key in (("kernel_log", "kernel_log"), ("fr_dump_dir", "flight_recorder"), ("nccl_inspector_dir", "nccl_inspector"), ("hook_listen", "hook"), ("job_map_dir", "job_map_dir"),
                      ("scheduler", "scheduler"), ("act", "act"), ("node", "node")):
        value = getattr(args, flag, None)
        if value is not None:
            data[key] = str(value)
    if getattr(args, "log", None):
        data["logs"] = list(args.log)
    merged = parse(data, "flags")
    if merged.sim and merged.real:
        what = [k for k in ("nvml", "dcgm", "kernel_log", "logs", "flight_recorder", "nccl_inspector", "hook", "job_map_dir", "infiniband") if getattr(merged, k)]
        if merged.scheduler != "none":
            what.append(f"scheduler {merged.scheduler}")
        raise UserError(f"the simulated cluster (--source sim / sources.sim) cannot be combined with real sources ({', '.join(what)})")
    return merged


def from_config(cfg: dict[str, Any], args: Any, where: str = "config") -> Sources:
    return merge_flags(parse(cfg.get(SECTION), where), args)


# -- log path patterns --------------------------------------------------------------------------
def pattern_glob(pattern: str) -> str:
    """'/logs/{job}/rank{rank}.log' → '/logs/*/rank*.log'."""
    return _PLACEHOLDER.sub("*", pattern)


def pattern_regex(pattern: str) -> re.Pattern[str]:
    """The pattern as a regex with named groups job/rank/node; shell globs match within a folder."""
    out = []
    for piece in re.split(r"(\{job\}|\{rank\}|\{node\}|\*\*|\*|\?|\[[^\]]*\])", pattern):
        if piece == "{job}":
            out.append(r"(?P<job>[^/]+?)")
        elif piece == "{node}":
            out.append(r"(?P<node>[^/]+?)")
        elif piece == "{rank}":
            out.append(r"(?P<rank>\d+)")
        elif piece == "**":
            out.append(r".*")
        elif piece == "*":
            out.append(r"[^/]*")
        elif piece == "?":
            out.append(r"[^/]")
        elif piece.startswith("[") and piece.endswith("]") and len(piece) > 2:
            out.append("[" + ("^" + piece[2:-1] if piece[1] == "!" else piece[1:-1]) + "]")
        else:
            out.append(re.escape(piece))
    return re.compile("".join(out) + r"\Z")


def pattern_root(pattern: str) -> Path:
    """The folder above the first placeholder or glob character (must exist at start)."""
    parts = []
    for part in Path(pattern).parts[:-1]:
        if _PLACEHOLDER.search(part) or any(c in part for c in "*?["):
            break
        parts.append(part)
    return Path(*parts) if parts else Path("/")


# -- fleet: the scale-out deployment on NATS JetStream (gpuvigil.fleet) ------------------------
class Fleet(BaseModel):
    """The `fleet:` section: how `gpuvigil agent`, `detect` and `act` meet on NATS JetStream
    (docs/scale.md, deploy/fleet.yaml). `serve` ignores it: one process, no NATS."""

    model_config = ConfigDict(extra="forbid")

    servers: list[str] = Field(default_factory=lambda: ["nats://127.0.0.1:4222"], min_length=1, description="NATS URLs (any node of the cluster)")
    prefix: str = Field("gv", pattern=r"^[A-Za-z][A-Za-z0-9_-]{0,31}$", description="first token of every subject; names streams and buckets")
    # Must equal N in the server's subject mapping {{partition(N,1)}} (`fleet.nats_mapping`).
    partitions: int = Field(16, ge=1, le=4096, description="job partitions: the unit a detect replica leases")
    # One stream is one RAFT group whose leader takes every write: the bandwidth limit near 1M GPUs
    # (docs/scale.md). Partition p's rows go to stream p % rows_streams; changing it needs the rows
    # streams recreated (their subject sets would overlap).
    rows_streams: int = Field(1, ge=1, le=64, description="rows streams the partitions are spread over (partition p -> stream p % N)")
    replicas: int = Field(1, ge=1, le=5, description="JetStream replicas of every stream and bucket (3 in production)")
    rows_max_age_seconds: float = Field(900.0, gt=0, description="how long the rows stream keeps job rows (>= replay_seconds)")
    replay_seconds: float = Field(600.0, gt=0, description="a replica that takes a partition replays this much of it (the detectors' window)")
    lease_ttl_seconds: float = Field(10.0, ge=1, le=3600, description="a lease not renewed for this long expires and another replica takes it")
    findings_refresh_seconds: float = Field(5.0, gt=0, description="agents and detect replicas republish unchanged active findings this often")
    findings_stale_seconds: float = Field(60.0, gt=0, description="act forgets a source that has said nothing for this long")
    # A node summary is sent when it changes and at least this often (act's liveness of the node):
    # at 125k nodes, 20 s is ~6k small messages/s into the act leader besides the changes.
    cluster_refresh_seconds: float = Field(20.0, gt=0, description="agents resend an unchanged node summary (fragmentation_cluster at act) this often; < findings_stale_seconds")
    # None: the registered detectors whose findings are all about one GPU or node (their specs'
    # placement, detectors/registry.py); a list overrides it.
    agent_detectors: list[str] | None = Field(None, description="detectors run in the agent, every other one in detect (default: those whose findings are about one node or GPU)")

    @field_validator("servers")
    @classmethod
    def _servers(cls, urls: list[str]) -> list[str]:
        for url in urls:
            if not url.startswith(("nats://", "tls://", "ws://", "wss://")):
                raise ValueError(f"{url!r} is not a nats:// (or tls://) URL")
        return urls

    @field_validator("rows_streams")
    @classmethod
    def _rows_streams(cls, value: int, info: Any) -> int:
        parts = info.data.get("partitions")
        if parts is not None and value > parts:
            raise ValueError(f"rows_streams {value} exceeds partitions {parts}: a stream would hold no partition")
        return value

    @field_validator("cluster_refresh_seconds")
    @classmethod
    def _cluster_refresh(cls, value: float, info: Any) -> float:
        stale = info.data.get("findings_stale_seconds")
        if stale is not None and value >= stale:
            raise ValueError(f"cluster_refresh_seconds {value:g} must be below findings_stale_seconds {stale:g}: act would drop live nodes")
        return value

    @field_validator("replay_seconds")
    @classmethod
    def _replay(cls, value: float, info: Any) -> float:
        keep = info.data.get("rows_max_age_seconds")
        if keep is not None and value > keep:
            raise ValueError(f"replay_seconds {value:g} exceeds rows_max_age_seconds {keep:g}: the stream would not hold what a takeover replays")
        return value


def fleet_from_config(cfg: dict[str, Any], where: str = "config") -> Fleet:
    raw = cfg.get("fleet") or {}
    if not isinstance(raw, dict):
        raise UserError(f"{where}: 'fleet' must be a mapping, got {type(raw).__name__}")
    try:
        return Fleet.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err["type"] == "extra_forbidden":
            key = str(err["loc"][-1])
            raise UserError(f"{where}: fleet.{key}: unknown key; {_nearest(key, list(Fleet.model_fields))}") from None
        loc = ".".join(str(p) for p in err["loc"])
        raise UserError(f"{where}: fleet.{loc}: {err['msg'].removeprefix('Value error, ')}") from None
