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

import copy
import difflib
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from gpuvigil.errors import UserError

SECTION = "sources"
Act = Literal["off", "dry-run", "on"]
SchedulerKind = Literal["slurm", "kubernetes", "none"]
_PLACEHOLDER = re.compile(r"\{(job|rank|node)\}")


@dataclass(frozen=True)
class SourceSpec:
    """One source of the `sources:` section, registered with `register_source`.

    `key`: its key under `sources:` (and the `Sources` field), of pydantic type `annotation`
    with `default`; `is_set(value)`: whether the value configures it (a real source: the
    simulator is then left out); `flag`: the `serve` argparse destination that overrides the key
    (`flag_list`: a repeatable flag, whose values replace the list); `build`: "module:function"
    of its builder, `builder(sources, ctx) -> list[deploysources.Source]`, called in `order` at
    start (with `always` even when the key is unset: the job map builds from whatever the node
    has); `check`: a validator of the value (raise ValueError)."""

    key: str
    annotation: Any
    default: Any
    description: str
    order: int
    build: str | None = None
    flag: str | None = None
    flag_list: bool = False
    is_set: Callable[[Any], bool] = bool
    always: bool = False
    check: Callable[[Any], Any] | None = None
    # The flag's help and further argparse keywords (metavar, choices): `add_source_flags`.
    flag_help: str = ""
    flag_kwargs: tuple[tuple[str, Any], ...] = ()

    @property
    def option(self) -> str | None:
        return None if self.flag is None else "--" + self.flag.replace("_", "-")


def add_source_flags(group: Any) -> None:
    """One `serve` flag per registered source that has one, in start-up order."""
    for spec in sorted(SOURCE_SPECS, key=lambda s: s.order):
        if spec.flag is None:
            continue
        kwargs = dict(spec.flag_kwargs)
        if spec.flag_list:
            kwargs.update(action="append", default=[])
        group.add_argument(spec.option, dest=spec.flag, help=spec.flag_help or f"{spec.description} (sources.{spec.key})", **kwargs)


def _check_urls(urls: list[str]) -> list[str]:
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{url!r} is not an http(s):// URL of a dcgm-exporter /metrics endpoint")
    return urls


def _check_address(value: str | None) -> str | None:
    if value is not None:
        split_address(value)
    return value


def _check_patterns(patterns: list[str]) -> list[str]:
    for p in patterns:
        if not p.startswith("/"):
            raise ValueError(f"{p!r}: log patterns must be absolute paths")
        for name in ("job", "rank", "node"):
            if p.count("{" + name + "}") > 1:
                raise ValueError(f"{p!r}: {{{name}}} may appear once")
    return patterns


_BUILD = "gpuvigil.app.sources:"
SOURCE_SPECS: list[SourceSpec] = [
    SourceSpec("nvml", bool, False, "sample this node's GPUs through NVML", 10, _BUILD + "build_nvml"),
    SourceSpec("dcgm", list[str], [], "dcgm-exporter /metrics URLs", 20, _BUILD + "build_dcgm", flag="dcgm_url", flag_list=True, check=_check_urls,
               flag_help="dcgm-exporter /metrics URL (repeat for several nodes)"),
    SourceSpec("kernel_log", str | None, None, "kmsg | journald | PATH of a kernel log file", 30, _BUILD + "build_kernel_log", flag="kernel_log",
               flag_help="kernel log: kmsg, journald, or a file path (sources.kernel_log)"),
    SourceSpec("logs", list[str], [], "torch/NCCL log path patterns ({job}, {rank}, {node}, shell globs)", 40, _BUILD + "build_logs", flag="log", flag_list=True,
               check=_check_patterns, flag_help="torch/NCCL log path pattern, e.g. '/logs/{job}/rank{rank}.log' (repeatable; sources.logs)",
               flag_kwargs=(("metavar", "PATTERN"),)),
    SourceSpec("flight_recorder", str | None, None, "folder where ranks write Flight Recorder dumps", 50, _BUILD + "build_flight_recorder", flag="fr_dump_dir",
               flag_help="folder of Flight Recorder dumps to analyse as they appear (sources.flight_recorder)"),
    SourceSpec("nccl_inspector", str | None, None, "folder of NCCL Inspector output, one <job>/ folder per job (L1, docs/levels.md)", 60, _BUILD + "build_nccl_inspector",
               flag="nccl_inspector_dir", flag_help="folder of NCCL Inspector output, <job>/ per job (sources.nccl_inspector)"),
    SourceSpec("hook", str | None, None, "HOST:PORT where the in-process hook's HttpSink posts", 70, _BUILD + "build_hook", flag="hook_listen", check=_check_address,
               flag_help="receive the in-process hook's records here (sources.hook)", flag_kwargs=(("metavar", "HOST:PORT"),)),
    # After nvml, whose PCI bus ids place each port beside its GPUs.
    SourceSpec("infiniband", bool | str | None, None, "this node's InfiniBand/RoCE ports from <sysfs root>/class/infiniband: true for /sys, or the root "
               "(a container's /host/sys, a copy of a machine's tree)", 75, _BUILD + "build_infiniband", flag="sysfs_root",
               flag_help="read InfiniBand/RoCE ports from DIR/class/infiniband (DIR default /sys; sources.infiniband)",
               flag_kwargs=(("metavar", "DIR"), ("nargs", "?"), ("const", "/sys"))),
    SourceSpec("job_map_dir", str | None, None, "GPU → job files (dcgm-exporter's --hpc-job-mapping-dir; deploy/slurm/prolog.sh writes them)", 80, _BUILD + "build_job_map",
               flag="job_map_dir", always=True, flag_help="GPU → job mapping files, as dcgm-exporter's --hpc-job-mapping-dir (sources.job_map_dir)"),
    SourceSpec("scheduler", Literal["slurm", "kubernetes", "none"], "none", "slurm | kubernetes | none", 90, _BUILD + "build_scheduler", flag="scheduler",
               is_set=lambda v: v != "none", flag_help="job map and acting (sources.scheduler)", flag_kwargs=(("choices", ["slurm", "kubernetes", "none"]),)),
]


class _SourcesBase(BaseModel):
    """The `sources:` section: the settings below, and one field per registered source
    (`SOURCE_SPECS`). Every field is optional; see the module docstring."""

    model_config = ConfigDict(extra="forbid")

    node: str | None = Field(None, description="this node's name as the scheduler knows it (default: the hostname)")
    sim: bool = Field(False, description="the simulated cluster (demo); cannot be combined with real sources")

    @property
    def real(self) -> bool:
        """Whether any registered source is configured (then the simulator is not started)."""
        return bool(self.configured())

    def configured(self) -> list[str]:
        """The registered sources this section configures, in start-up order."""
        return [spec.key for spec in sorted(SOURCE_SPECS, key=lambda s: s.order) if spec.is_set(getattr(self, spec.key))]

    def node_name(self) -> str:
        return self.node or socket.gethostname()


def _sources_model() -> type[_SourcesBase]:
    fields: dict[str, Any] = {}
    validators: dict[str, Any] = {}
    for spec in SOURCE_SPECS:
        default = Field(default_factory=lambda d=spec.default: copy.deepcopy(d), description=spec.description) if isinstance(spec.default, list | dict) else Field(
            spec.default, description=spec.description)
        fields[spec.key] = (spec.annotation, default)
        if spec.check is not None:
            validators[f"_check_{spec.key}"] = field_validator(spec.key)(classmethod(lambda cls, v, _c=spec.check: _c(v)))
    # Every node's agent reads the scheduler's state; 1000 agents polling squeue each second
    # would be slurmctld's busiest client. Snapshots stay in the window between polls.
    fields["scheduler_poll_seconds"] = (float, Field(10.0, gt=0, description="seconds between reads of the scheduler's job map"))
    fields["act"] = (Act, Field("dry-run", description="off | dry-run | on: what to do with hints on the scheduler"))
    return create_model("Sources", __base__=_SourcesBase, __validators__=validators, **fields)  # type: ignore[call-overload, no-any-return]


def register_source(spec: SourceSpec) -> None:
    """Add a source: its key joins the `sources:` model, its flag the merge, its builder the
    start-up chain. A key registered twice is an error."""
    global Sources
    if any(s.key == spec.key for s in SOURCE_SPECS) or spec.key in (*_SourcesBase.model_fields, "scheduler_poll_seconds", "act"):
        raise ValueError(f"source {spec.key!r} is registered already")
    SOURCE_SPECS.append(spec)
    Sources = _sources_model()


def unregister_source(key: str) -> None:
    global Sources
    SOURCE_SPECS[:] = [s for s in SOURCE_SPECS if s.key != key]
    Sources = _sources_model()


def sources_model() -> type[_SourcesBase]:
    """The `sources:` model as registered now (config validation asks for it by this name)."""
    return Sources


Sources = _sources_model()


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


def parse(raw: Any, where: str = "config") -> _SourcesBase:
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


def merge_flags(sources: _SourcesBase, args: Any) -> _SourcesBase:
    """Flags override the file: each given flag replaces its key (the registered sources' flags,
    `--source` for the boolean ones and the simulator, `--act`, `--node`)."""
    data = sources.model_dump()
    chosen = list(getattr(args, "source", None) or [])
    if "sim" in chosen:
        if len(set(chosen)) > 1:
            raise UserError("--source sim cannot be combined with a real source")
        data["sim"] = True
    for spec in SOURCE_SPECS:
        if spec.key in chosen and spec.annotation is bool:
            data[spec.key] = True
        value = getattr(args, spec.flag, None) if spec.flag else None
        if spec.flag_list and value:
            data[spec.key] = list(value)
        elif not spec.flag_list and value is not None:
            data[spec.key] = str(value)
    if "dcgm" in chosen and not data["dcgm"]:
        raise UserError("--source dcgm needs --dcgm-url URL (a dcgm-exporter /metrics endpoint)")
    for flag in ("act", "node"):
        value = getattr(args, flag, None)
        if value is not None:
            data[flag] = str(value)
    merged = parse(data, "flags")
    if merged.sim and merged.real:
        what = [k if k != "scheduler" else f"scheduler {merged.scheduler}" for k in merged.configured()]  # type: ignore[attr-defined]
        raise UserError(f"the simulated cluster (--source sim / sources.sim) cannot be combined with real sources ({', '.join(what)})")
    return merged


def from_config(cfg: dict[str, Any], args: Any, where: str = "config") -> _SourcesBase:
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
Role = Literal["agent", "detect", "act"]


class NatsTLS(BaseModel):
    """TLS to NATS: the CA that signed the servers' certificates and, where the servers ask for one
    (`verify: true`), this process's client certificate and key."""

    model_config = ConfigDict(extra="forbid")

    ca: str | None = Field(None, description="PEM file of the CA that signed the NATS servers' certificates (default: the system's)")
    cert: str | None = Field(None, description="PEM client certificate (mutual TLS)")
    key: str | None = Field(None, description="PEM private key of `cert`")

    @model_validator(mode="after")
    def _pair(self) -> NatsTLS:
        if (self.key is None) != (self.cert is None):
            raise ValueError("cert and key go together")
        return self


class NatsCredential(BaseModel):
    """How one fleet role proves who it is to NATS: a .creds file (JWT + nkey seed, operator mode),
    an nkey seed file, or a user with a password read from a file."""

    model_config = ConfigDict(extra="forbid")

    creds: str | None = Field(None, description=".creds file (decentralised auth: JWT and nkey seed, made with nsc)")
    nkey_seed: str | None = Field(None, description="file holding an nkey user seed (SU...)")
    user: str | None = Field(None, description="user name (with password_file)")
    password_file: str | None = Field(None, description="file whose first line is the user's password")

    @model_validator(mode="after")
    def _one(self) -> NatsCredential:
        ways = [k for k in ("creds", "nkey_seed") if getattr(self, k)] + (["user"] if self.user or self.password_file else [])
        if len(ways) != 1:
            raise ValueError("give exactly one of creds, nkey_seed, or user with password_file")
        if (self.user is None) != (self.password_file is None):
            raise ValueError("user and password_file go together")
        return self

    def describe(self) -> str:
        return f"creds {self.creds}" if self.creds else f"nkey seed {self.nkey_seed}" if self.nkey_seed else f"user {self.user}"


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
    # A disk bound besides the age: at 186 MB/s of rows, 900 s is ~167 GB per replica. Size it
    # rows rate x rows_max_age_seconds / rows_streams; past it the oldest rows go first.
    # None: no bound but the age (a small or test server); JetStream reserves the bound on its
    # store at once, so it must fit the servers' max_file_store.
    rows_max_bytes: int | None = Field(None, ge=2**20, description="bytes each rows stream keeps (per replica); the oldest rows are dropped past it")
    spool_max_bytes: int = Field(1 << 30, ge=1 << 20, description="an agent's `--spool` keeps at most this much of what NATS could not take (oldest dropped)")
    replay_seconds: float = Field(600.0, gt=0, description="a replica that takes a partition replays this much of it (the detectors' window)")
    # What a replay of replay_seconds cannot rebuild (a hang's start, a finding's first report),
    # snapshotted per partition into the KV bucket <prefix>_<state_bucket> (gpuvigil.fleet.detect).
    state_bucket: str = Field("detect_state", pattern=r"^[A-Za-z0-9_-]{1,64}$", description="KV bucket (after '<prefix>_') holding each partition's carried-over detector state")
    state_snapshot_seconds: float = Field(5.0, gt=0, description="a detect replica snapshots each held partition's carried-over state this often (data time) and on a clean handover")
    state_max_bytes: int = Field(512 * 1024, ge=1024, le=8 * 2**20, description="a larger snapshot carries the findings only, without the detectors' state (NATS max_payload bounds it)")
    lease_ttl_seconds: float = Field(10.0, ge=1, le=3600, description="a lease not renewed for this long expires and another replica takes it")
    findings_refresh_seconds: float = Field(5.0, gt=0, description="agents and detect replicas republish unchanged active findings this often")
    findings_stale_seconds: float = Field(60.0, gt=0, description="act forgets a source that has said nothing for this long")
    # A node summary is sent when it changes and at least this often (act's liveness of the node):
    # at 125k nodes, 20 s is ~6k small messages/s into the act leader besides the changes.
    cluster_refresh_seconds: float = Field(20.0, gt=0, description="agents resend an unchanged node summary (fragmentation_cluster at act) this often; < findings_stale_seconds")
    # None: the registered detectors whose findings are all about one GPU or node (their specs'
    # placement, detectors/registry.py); a list overrides it.
    agent_detectors: list[str] | None = Field(None, description="detectors run in the agent, every other one in detect (default: those whose findings are about one node or GPU)")
    # The data clock takes a time only within this much of the receiver's own clock (gpuvigil.fleet.clock):
    # a message stamped further ahead is counted, logged and ignored, never a jump.
    clock_max_skew_seconds: float = Field(15.0, gt=0, description="a data time further than this ahead of the receiver's own clock is ignored with its message")
    clock_origin: Literal["wall", "data"] = Field("wall", description="the receiver's own clock: its wall clock (real fleets), or a simulation's data time anchored at the first time heard")
    clock_rate: float = Field(1.0, gt=0, description="with clock_origin data: data seconds per wall second (the simulator's --speed)")
    # Security (docs/security.md): one credential per role, so NATS can give each role only its
    # subjects (`gpuvigil agent --print-nats-config` writes the server side).
    tls: NatsTLS | None = Field(None, description="TLS to NATS (CA, optional client certificate)")
    credentials: dict[Role, NatsCredential] = Field(default_factory=dict, description="role (agent, detect, act) → its NATS credential")

    def credential(self, role: str) -> NatsCredential | None:
        return self.credentials.get(role)  # type: ignore[call-overload]

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
