"""Which job, rank and pod use each GPU of this node: the `gpu_jobs` stream.

Sources, most authoritative first (each is optional; the collector uses what is configured):

1. dcgm-exporter's HPC job-mapping directory (`--hpc-job-mapping-dir`): one file per GPU, named
   by its index (or UUID), holding the ids of the jobs on it, one per line — written by a Slurm
   prolog and removed by the epilog (see deploy/).
2. `scontrol pidinfo PID` for each process NVML lists on a GPU (Slurm asks the node's slurmd).
3. The process's own environment and cgroup (`/proc/PID/environ`, `/proc/PID/cgroup`):
   SLURM_JOB_ID (or LSB_JOBID / PBS_JOBID, or `job_N` in the cgroup path); the rank from RANK,
   SLURM_PROCID, OMPI_COMM_WORLD_RANK or PMI_RANK; LOCAL_RANK / SLURM_LOCALID for the local rank.
   Reading another user's environ needs root (or CAP_SYS_PTRACE); without it the cgroup is used.
4. The kubelet PodResources API (as dcgm-exporter uses it): the pod, namespace and container
   holding each `nvidia.com/gpu`. A GPU whose job is not known otherwise is attributed to the
   job `<namespace>/<pod>`.

Failures of a source are reported per source by `health()` (see pipeline/health.py), never raised.
"""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from gpuvigil import schemas

MAX_ENVIRON_BYTES = 1 << 20
MAX_MAPPING_FILE_BYTES = 64 << 10

_SLURM_JOB_IN_CGROUP = re.compile(r"/job_(\d+)(?:/|$)")
# cgroupfs: /kubepods/burstable/pod<uid>/<container>; systemd: kubepods-burstable-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope
_POD_IN_CGROUP = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")
_CONTAINER_IN_CGROUP = re.compile(r"(?:cri-containerd-|docker-|crio-|/)([0-9a-f]{64})(?:\.scope)?(?:/|$)")
# `scontrol pidinfo`: "Slurm JobId=1234 ends at ..." (older releases: "Slurm job id 1234 ends at ...")
_PIDINFO = re.compile(r"\bjob\s*id[= ](\d+)", re.IGNORECASE)

JOB_ENV = ("SLURM_JOB_ID", "SLURM_JOBID", "LSB_JOBID", "PBS_JOBID")
RANK_ENV = ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
LOCAL_RANK_ENV = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")

# Which source wins when several name a job for the same GPU (lower first).
SOURCE_PRIORITY = {
    "hpc_job_mapping": 0, "dcgm_hpc_job": 0,  # dcgm-exporter's hpc_job label is read from the same files
    "slurm_pidinfo": 1, "proc_environ": 2, "proc_cgroup": 3, "podresources": 4, "dcgm_pod": 4,
}


@dataclass(frozen=True)
class ProcessOwner:
    """What a process's /proc says about its owner (best effort; None where it says nothing)."""

    slurm_job: str | None = None
    pod_uid: str | None = None
    container_id: str | None = None
    rank: int | None = None
    local_rank: int | None = None
    # Derived from the above and the environment (not part of equality):
    job: str | None = field(default=None, compare=False)  # SLURM_JOB_ID, else LSB/PBS id, else the cgroup's job_N
    job_from: str | None = field(default=None, compare=False)  # proc_environ | proc_cgroup


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    value = value.strip()
    return int(value) if value.isascii() and value.isdigit() and len(value) < 10 else None


def read_environ(pid: int, proc_root: str | Path = "/proc") -> dict[str, str]:
    try:
        with open(Path(proc_root) / str(pid) / "environ", "rb") as fh:
            raw = fh.read(MAX_ENVIRON_BYTES)
    except OSError:
        return {}  # another user's process without privilege, or gone
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def attribute_pid(pid: int, proc_root: str | Path = "/proc") -> ProcessOwner:
    """Which Slurm job or Kubernetes pod a PID belongs to, and its rank, from /proc (never raises)."""
    env = read_environ(pid, proc_root)
    slurm_job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or None
    job = next((env[k] for k in JOB_ENV if env.get(k)), None)
    job_from = "proc_environ" if job else None
    rank = next((r for r in (_int(env.get(k)) for k in RANK_ENV) if r is not None), None)
    local_rank = next((r for r in (_int(env.get(k)) for k in LOCAL_RANK_ENV) if r is not None), None)
    pod_uid = container_id = None
    try:
        cgroup = (Path(proc_root) / str(pid) / "cgroup").read_text(errors="replace")[:MAX_ENVIRON_BYTES]
    except OSError:
        cgroup = ""
    if slurm_job is None and (m := _SLURM_JOB_IN_CGROUP.search(cgroup)):
        slurm_job = m.group(1)
        if job is None:
            job, job_from = slurm_job, "proc_cgroup"
    if m := _POD_IN_CGROUP.search(cgroup):
        pod_uid = m.group(1).replace("_", "-")
        if c := _CONTAINER_IN_CGROUP.search(cgroup[m.end():]):
            container_id = c.group(1)
    return ProcessOwner(slurm_job, pod_uid, container_id, rank, local_rank, job, job_from)


def parse_pidinfo(text: str) -> str | None:
    """The job id in `scontrol pidinfo` output, or None."""
    m = _PIDINFO.search(text)
    return m.group(1) if m else None


def read_job_mapping_dir(directory: str | Path, uuid_to_gpu: Mapping[str, int] | None = None) -> dict[int, list[str]]:
    """dcgm-exporter's HPC job-mapping files: GPU → job ids. Raises OSError if unreadable."""
    d = Path(directory)
    out: dict[int, list[str]] = {}
    if not d.exists():
        return out  # no job has run since boot: the prolog creates it
    for f in sorted(d.iterdir()):
        if f.name.startswith(".") or not f.is_file():
            continue
        gpu = _int(f.name)
        if gpu is None and uuid_to_gpu:
            gpu = uuid_to_gpu.get(f.name)
        if gpu is None:
            continue
        try:
            with f.open("rb") as fh:
                text = fh.read(MAX_MAPPING_FILE_BYTES).decode(errors="replace")
        except FileNotFoundError:
            continue  # the epilog removed it meanwhile
        jobs = [line.strip() for line in text.splitlines() if line.strip() and len(line.strip()) < 128]
        if jobs:
            out[gpu] = jobs
    return out


@dataclass(frozen=True)
class GpuProcess:
    gpu: int
    gpu_uuid: str | None
    pid: int


class JobMapCollector:
    """Emits `gpu_jobs` (a snapshot of the node's GPU → job, rank, pod) on every collect."""

    streams: Mapping[str, pl.Schema] = {"gpu_jobs": schemas.GPU_JOBS}

    def __init__(
        self,
        *,
        node: str | None = None,
        processes: Callable[[], Iterable[Any]] | None = None,
        hpc_job_mapping_dir: str | Path | None = None,
        podresources_socket: str | Path | None = None,
        scontrol: str | None = None,
        proc_root: str | Path = "/proc",
        uuid_to_gpu: Mapping[str, int] | Callable[[], Mapping[str, int]] | None = None,
        timeout_seconds: float = 5.0,
    ):
        self.name = "jobmap"
        self.node = node or socket.gethostname()
        self.processes = processes
        self.hpc_job_mapping_dir = Path(hpc_job_mapping_dir) if hpc_job_mapping_dir else None
        self.podresources_socket = str(podresources_socket) if podresources_socket else None
        self.scontrol = shutil.which(scontrol) if scontrol else None
        self._scontrol_wanted = scontrol
        self.proc_root = proc_root
        self._uuid_to_gpu = uuid_to_gpu
        self.timeout_seconds = timeout_seconds
        self.errors = 0
        self._health: dict[str, str | None] = {}
        self._pidinfo: dict[tuple[int, str], str | None] = {}  # (pid, start time) → job

    def describe(self) -> str:
        parts = []
        if self.hpc_job_mapping_dir:
            parts.append(f"job-mapping dir {self.hpc_job_mapping_dir}")
        if self._scontrol_wanted:
            parts.append(f"scontrol pidinfo ({self.scontrol or 'not found'})")
        if self.processes is not None:
            parts.append(f"process environ/cgroup in {self.proc_root}")
        if self.podresources_socket:
            parts.append(f"kubelet PodResources {self.podresources_socket}")
        return "job map: " + (", ".join(parts) or "no source configured")

    def health(self) -> dict[str, str | None]:
        return dict(self._health) or {self.name: None}

    def uuid_to_gpu(self) -> dict[str, int]:
        m = self._uuid_to_gpu() if callable(self._uuid_to_gpu) else self._uuid_to_gpu
        return dict(m or {})

    # -- sources --------------------------------------------------------------------------

    def _start_time(self, pid: int) -> str:
        try:
            stat = (Path(self.proc_root) / str(pid) / "stat").read_text()
            return stat.rsplit(")", 1)[1].split()[19]  # field 22, after the command name
        except (OSError, IndexError):
            return ""

    def _pidinfo_job(self, pid: int) -> str | None:
        key = (pid, self._start_time(pid))
        if key in self._pidinfo:
            return self._pidinfo[key]
        assert self.scontrol is not None
        try:
            proc = subprocess.run([self.scontrol, "pidinfo", str(pid)], capture_output=True, text=True, timeout=self.timeout_seconds)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise OSError(f"scontrol pidinfo {pid}: {exc}") from None
        # A process that is not a job's exits non-zero ("Failed to locate job"): not an error.
        job = parse_pidinfo(proc.stdout) if proc.returncode == 0 else None
        if proc.returncode != 0 and "locate job" not in (proc.stderr or "") and proc.stderr.strip():
            raise OSError(f"scontrol pidinfo {pid}: {proc.stderr.strip().splitlines()[-1][:200]}")
        if len(self._pidinfo) > 4096:
            self._pidinfo.clear()
        self._pidinfo[key] = job
        return job

    def _rows(self, now: float) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        uuids = self.uuid_to_gpu()
        uuid_of = {i: u for u, i in uuids.items()}
        base = {"ts": now, "node": self.node}

        if self.hpc_job_mapping_dir is not None:
            target = f"hpc_job_mapping:{self.hpc_job_mapping_dir}"
            try:
                for gpu, jobs in read_job_mapping_dir(self.hpc_job_mapping_dir, uuids).items():
                    rows.extend({**base, "gpu": gpu, "gpu_uuid": uuid_of.get(gpu), "job": j, "source": "hpc_job_mapping"} for j in jobs)
                self._health[target] = None
            except OSError as exc:
                self._health[target] = f"cannot read {self.hpc_job_mapping_dir}: {exc.strerror or exc}"

        if self.processes is not None:
            try:
                procs = [p if isinstance(p, GpuProcess) else GpuProcess(*p) for p in self.processes()]
                self._health["processes"] = None
            except Exception as exc:  # noqa: BLE001 - the provider is another collector's reading
                procs = []
                self._health["processes"] = f"listing GPU processes failed: {type(exc).__name__}: {exc}"
            pidinfo_error = None
            for p in procs:
                owner = attribute_pid(p.pid, self.proc_root)
                job, source = owner.job, owner.job_from
                if self.scontrol is not None:
                    try:
                        if (sj := self._pidinfo_job(p.pid)) is not None:
                            job, source = sj, "slurm_pidinfo"
                    except OSError as exc:
                        pidinfo_error = str(exc)
                if job is None and owner.rank is None:
                    continue  # not a job's process as far as this node can tell
                rows.append(
                    {**base, "gpu": p.gpu, "gpu_uuid": p.gpu_uuid or uuid_of.get(p.gpu), "job": job, "rank": owner.rank,
                     "local_rank": owner.local_rank, "pid": p.pid, "source": source or "proc_environ"}
                )
            if self._scontrol_wanted:
                self._health["scontrol"] = pidinfo_error if self.scontrol else f"{self._scontrol_wanted!r} not found on PATH"

        if self.podresources_socket is not None:
            from gpuvigil.collectors.podresources import list_gpu_assignments

            target = f"podresources:{self.podresources_socket}"
            try:
                for a in list_gpu_assignments(self.podresources_socket, timeout_seconds=self.timeout_seconds):
                    gpu = _int(a.device_id)
                    if gpu is None:
                        gpu = uuids.get(a.device_id)
                    rows.append(
                        {**base, "gpu": gpu, "gpu_uuid": a.device_id if gpu is None or not a.device_id.isdigit() else uuid_of.get(gpu),
                         "pod": a.pod, "namespace": a.namespace, "source": "podresources"}
                    )
                self._health[target] = None
            except (OSError, ImportError) as exc:
                self._health[target] = str(exc)
        return rows

    def collect(self, now: float) -> dict[str, pl.DataFrame]:
        rows = self._rows(now)
        self.errors += sum(1 for v in self._health.values() if v)
        return {"gpu_jobs": merge(rows, now, self.node)}


def merge(rows: list[dict[str, Any]], now: float, node: str) -> pl.DataFrame:
    """One row per (GPU, job): the best source's job, the rank from the process, the pod from
    PodResources; a GPU with only a pod gets the job `<namespace>/<pod>`."""
    df = schemas.frame(rows, schemas.GPU_JOBS)
    if df.is_empty():
        return df
    prio = pl.col("source").replace_strict(SOURCE_PRIORITY, default=9, return_dtype=pl.Int32)
    pods = (
        df.filter(pl.col("pod").is_not_null())
        .group_by("node", "gpu", maintain_order=True)
        .agg(pl.col("pod").first().alias("_pod"), pl.col("namespace").first().alias("_ns"), pl.col("gpu_uuid").first().alias("_uuid"))
    )
    jobs = df.filter(pl.col("job").is_not_null())
    # A process with a rank but no job id (e.g. torchrun outside any scheduler) keeps its rank
    # for the GPU's job named by another source.
    ranks = (
        df.filter(pl.col("rank").is_not_null())
        .sort("rank")
        .group_by("node", "gpu", maintain_order=True)
        .agg(pl.col("rank").first().alias("_rank"), pl.col("local_rank").first().alias("_local"), pl.col("pid").first().alias("_pid"))
    )
    best = (
        jobs.with_columns(prio.alias("_prio"))
        .sort(["_prio", "rank"], nulls_last=True)
        .group_by("node", "gpu", "job", maintain_order=True)
        .agg(
            pl.col("ts").first(),
            pl.col("gpu_uuid").drop_nulls().first(),
            pl.col("rank").drop_nulls().first(),
            pl.col("local_rank").drop_nulls().first(),
            pl.col("pid").drop_nulls().first(),
            pl.col("source").first(),
        )
    )
    best = (
        best.join(ranks, on=["node", "gpu"], how="left", nulls_equal=True)
        .with_columns(
            pl.coalesce("rank", "_rank").alias("rank"),
            pl.coalesce("local_rank", "_local").alias("local_rank"),
            pl.coalesce("pid", "_pid").alias("pid"),
        )
        .drop("_rank", "_local", "_pid")
    )
    pod_only = pods.join(best.select("node", "gpu"), on=["node", "gpu"], how="anti", nulls_equal=True).select(
        pl.lit(now, pl.Float64).alias("ts"), "node", "gpu", pl.col("_uuid").alias("gpu_uuid"),
        pl.format("{}/{}", pl.col("_ns").fill_null(""), "_pod").alias("job"), pl.lit("podresources").alias("source"),
    ).join(ranks, on=["node", "gpu"], how="left", nulls_equal=True).rename({"_rank": "rank", "_local": "local_rank", "_pid": "pid"})
    out = pl.concat([best, pod_only], how="diagonal_relaxed").join(pods, on=["node", "gpu"], how="left", nulls_equal=True)
    out = out.with_columns(pl.col("_pod").alias("pod"), pl.col("_ns").alias("namespace"), pl.coalesce("gpu_uuid", "_uuid").alias("gpu_uuid"))
    return schemas.conform(out.sort("gpu", "job", nulls_last=True), schemas.GPU_JOBS, stream="gpu_jobs")


__all__ = ["GpuProcess", "JobMapCollector", "ProcessOwner", "attribute_pid", "merge", "parse_pidinfo", "read_environ", "read_job_mapping_dir"]
