"""GPU → job, rank (+ pod) attribution (collectors/jobmap.py) and its join in the pipeline.

Real parts: processes started here with a Slurm/torchrun environment (read back through the real
/proc), a real Slurm cluster answering `scontrol pidinfo` (services), dcgm-exporter's job-mapping
files, and a real gRPC server on a unix socket speaking the kubelet's PodResources API. The
server is a stand-in for the kubelet (no kubelet can run here); it answers `List` with the
messages of kubernetes' podresources/v1 api.proto.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent import futures
from pathlib import Path

import polars as pl
import pytest

from gpuvigil import schemas
from gpuvigil.collectors import podresources
from gpuvigil.collectors.jobmap import GpuProcess, JobMapCollector, attribute_pid, merge, parse_pidinfo, read_job_mapping_dir
from gpuvigil.pipeline.core import Pipeline

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def job_process():
    """A real process started the way srun + torchrun start a rank."""
    env = {**os.environ, "SLURM_JOB_ID": "4242", "SLURM_PROCID": "1", "RANK": "9", "LOCAL_RANK": "1", "SLURM_LOCALID": "1"}
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"], env=env, stdout=subprocess.PIPE, text=True)
    # Read only once it runs: between fork and exec /proc/PID/environ is still the parent's.
    assert proc.stdout is not None and proc.stdout.readline() == "up\n"
    yield proc
    proc.kill()
    proc.wait()


def test_a_real_process_environment_names_job_and_rank(job_process):
    owner = attribute_pid(job_process.pid)
    # RANK (torchrun's global rank, 9) wins over SLURM_PROCID (the launcher's task id, 1)
    assert (owner.job, owner.slurm_job, owner.rank, owner.local_rank, owner.job_from) == ("4242", "4242", 9, 1, "proc_environ")


@pytest.mark.parametrize(
    "text, job",
    [
        ("Slurm JobId=1 ends at Wed Dec 01 04:33:37 2027\nJob remaining time is 31536000 seconds\n", "1"),  # captured, Slurm 24.x
        ("Slurm job id 77 ends at Thu Jan  1 00:00:00 2026\n", "77"),  # older releases
        ("Failed to locate job for requested pid\n", None),
        ("", None),
    ],
)
def test_pidinfo_output(text, job):
    assert parse_pidinfo(text) == job


def test_hpc_job_mapping_dir(tmp_path):
    d = tmp_path / "dcgm-job-map"
    d.mkdir()
    (d / "0").write_text("1001\n")
    (d / "1").write_text("1001\n1002\n")  # a shared GPU: two jobs
    (d / "GPU-cafe").write_text("1003\n")
    (d / ".1.tmp").write_text("9999\n")  # a prolog's temporary file
    (d / "notagpu").write_text("1\n")
    assert read_job_mapping_dir(d, {"GPU-cafe": 3}) == {0: ["1001"], 1: ["1001", "1002"], 3: ["1003"]}
    assert read_job_mapping_dir(tmp_path / "missing") == {}
    col = JobMapCollector(node="n1", hpc_job_mapping_dir=d, uuid_to_gpu={"GPU-cafe": 3})
    out = col.collect(5.0)["gpu_jobs"]
    assert out.schema == schemas.GPU_JOBS
    assert out.select("gpu", "job", "source").rows() == [(0, "1001", "hpc_job_mapping"), (1, "1001", "hpc_job_mapping"), (1, "1002", "hpc_job_mapping"), (3, "1003", "hpc_job_mapping")]
    assert col.health() == {f"hpc_job_mapping:{d}": None}
    d.chmod(0o000)
    try:
        if not os.access(d, os.R_OK):  # root reads it anyway
            col.collect(6.0)
            assert "cannot read" in col.health()[f"hpc_job_mapping:{d}"]
    finally:
        d.chmod(0o755)


def test_processes_env_and_mapping_dir_merge(job_process, tmp_path):
    d = tmp_path / "map"
    d.mkdir()
    (d / "0").write_text("4242\n")
    col = JobMapCollector(node="n1", processes=lambda: [(0, "GPU-a", job_process.pid), (1, "GPU-b", job_process.pid)], hpc_job_mapping_dir=d)
    out = col.collect(1.0)["gpu_jobs"]
    rows = out.select("gpu", "gpu_uuid", "job", "rank", "local_rank", "pid", "source").rows()
    assert rows == [(0, "GPU-a", "4242", 9, 1, job_process.pid, "hpc_job_mapping"), (1, "GPU-b", "4242", 9, 1, job_process.pid, "proc_environ")]


def test_merge_keeps_a_pod_only_gpu_as_namespace_pod():
    rows = [
        {"ts": 1.0, "node": "n", "gpu": 0, "gpu_uuid": "GPU-a", "pod": "llama-worker-0", "namespace": "research", "source": "podresources"},
        {"ts": 1.0, "node": "n", "gpu": 0, "rank": 3, "local_rank": 0, "pid": 11, "source": "proc_environ"},  # torchrun, no job id
        {"ts": 1.0, "node": "n", "gpu": 1, "gpu_uuid": "GPU-b", "pod": "llama-worker-0", "namespace": "research", "source": "podresources"},
        {"ts": 1.0, "node": "n", "gpu": 1, "job": "777", "rank": 4, "pid": 12, "source": "proc_environ"},
    ]
    out = merge(rows, 1.0, "n")
    assert out.select("gpu", "job", "rank", "pod", "namespace", "source").rows() == [
        (0, "research/llama-worker-0", 3, "llama-worker-0", "research", "podresources"),
        (1, "777", 4, "llama-worker-0", "research", "proc_environ"),
    ]


# ---------------------------------------------------------------- kubelet PodResources over gRPC


@pytest.fixture
def kubelet(tmp_path):
    import grpc

    req_cls, resp_cls = podresources.messages()
    response = resp_cls()
    pod = response.pod_resources.add(name="llama-pretrain-worker-3", namespace="research")
    c = pod.containers.add(name="trainer")
    c.devices.add(resource_name="nvidia.com/gpu", device_ids=["GPU-34d3dfff-b746-63b5-0224-9f470d7475f1", "GPU-b::2"])
    c.devices.add(resource_name="rdma/ib", device_ids=["mlx5_0"])
    idle = response.pod_resources.add(name="coredns-1", namespace="kube-system")
    idle.containers.add(name="coredns")
    calls = []

    def handle(request, context):
        calls.append(request)
        return response

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    handler = grpc.method_handlers_generic_handler(
        "v1.PodResourcesLister",
        {"List": grpc.unary_unary_rpc_method_handler(handle, request_deserializer=req_cls.FromString, response_serializer=resp_cls.SerializeToString)},
    )
    server.add_generic_rpc_handlers((handler,))
    sock = tmp_path / "kubelet.sock"
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield sock, calls
    server.stop(None)


def test_podresources_over_a_real_grpc_unix_socket(kubelet):
    sock, calls = kubelet
    got = podresources.list_gpu_assignments(str(sock))
    assert [(a.device_id, a.pod, a.namespace, a.container) for a in got] == [
        ("GPU-34d3dfff-b746-63b5-0224-9f470d7475f1", "llama-pretrain-worker-3", "research", "trainer"),
        ("GPU-b", "llama-pretrain-worker-3", "research", "trainer"),
    ]
    col = JobMapCollector(node="n1", podresources_socket=sock, uuid_to_gpu={"GPU-34d3dfff-b746-63b5-0224-9f470d7475f1": 0, "GPU-b": 1})
    out = col.collect(3.0)["gpu_jobs"]
    assert out.select("gpu", "job", "pod", "namespace", "source").rows() == [
        (0, "research/llama-pretrain-worker-3", "llama-pretrain-worker-3", "research", "podresources"),
        (1, "research/llama-pretrain-worker-3", "llama-pretrain-worker-3", "research", "podresources"),
    ]
    assert col.health() == {f"podresources:{sock}": None} and len(calls) == 2


def test_podresources_unreachable_is_reported(tmp_path):
    col = JobMapCollector(node="n1", podresources_socket=tmp_path / "nothing.sock", timeout_seconds=2.0)
    assert col.collect(1.0)["gpu_jobs"].is_empty()
    reason = col.health()[f"podresources:{tmp_path / 'nothing.sock'}"]
    assert reason and "UNAVAILABLE" in reason and col.errors == 1


# ---------------------------------------------------------------- the join in the pipeline


class Frames:
    """Replays fixed frames (a stand-in for the hook/kernel-log collectors' output)."""

    def __init__(self, name, frames):
        self.name, self.errors, self.frames = name, 0, frames
        self.streams = {s: df.schema for s, df in frames.items()}

    def collect(self, now):
        return {s: df.with_columns(ts=pl.lit(now)) for s, df in self.frames.items()}


def test_pipeline_fills_job_and_rank_and_extends_allocations(tmp_path):
    d = tmp_path / "map"
    d.mkdir()
    (d / "0").write_text("4242\n")
    (d / "1").write_text("4242\n")
    progress = schemas.frame(
        [
            {"ts": 0.0, "job": None, "rank": 0, "node": "n1", "gpu": 0, "pg": "0", "last_enqueued_seq": 5, "last_completed_seq": 5},
            {"ts": 0.0, "job": "other", "rank": None, "node": "n1", "gpu": 1, "pg": "0"},  # another job named: rank not taken
        ],
        schemas.RANK_PROGRESS,
    )
    events = schemas.frame([{"ts": 0.0, "node": "n1", "gpu": 1, "source": "kernel", "kind": "xid", "xid": 79}], schemas.EVENTS)
    jm = JobMapCollector(node="n1", hpc_job_mapping_dir=d, processes=lambda: [GpuProcess(1, "GPU-b", os.getpid())])
    pipe = Pipeline([Frames("logs", {"rank_progress": progress, "events": events}), jm], [])
    pipe.tick(1.0)
    rp = pipe.window.get("rank_progress").sort("gpu")
    assert rp.select("job", "rank").rows() == [("4242", 0), ("other", None)]
    ev = pipe.window.get("events")
    assert ev.select("job", "rank").rows() == [("4242", None)]
    allocs = pipe.window.get("allocations").sort("gpu")
    assert allocs.select("node", "gpu", "job").rows() == [("n1", 0, "4242"), ("n1", 1, "4242")]
    assert pipe.window.get("gpu_jobs").height == 2
    # the map empties when the job ends: allocations follow
    for f in d.iterdir():
        f.unlink()
    pipe.tick(2.0)
    assert pipe.window.get("allocations").is_empty()


@pytest.mark.services
@pytest.mark.timeout(300)
def test_scontrol_pidinfo_on_a_real_slurm_job(tmp_path, monkeypatch):
    from slurm_cluster import SlurmCluster, missing_binaries

    if missing_binaries():
        pytest.skip(f"Slurm not installed: {', '.join(missing_binaries())}")
    cluster = SlurmCluster(tmp_path / "slurm", nodes=("gvnode1",)).start()
    try:
        pidfile = tmp_path / "pid"
        job = cluster.sbatch("--wrap", f"echo $$ > {pidfile}; exec sleep 120")
        pid = int(cluster.wait_for(lambda: pidfile.exists() and pidfile.read_text().strip(), 60, "the job to start"))
        monkeypatch.setenv("SLURM_CONF", str(cluster.conf))
        procs = [GpuProcess(0, "GPU-a", pid), GpuProcess(1, "GPU-b", os.getpid())]  # the second is no job's
        col = JobMapCollector(node="gvnode1", processes=lambda: procs, scontrol="scontrol")
        out = col.collect(time.time())["gpu_jobs"]
        assert out.select("gpu", "job", "rank", "source").rows()[0] == (0, job, 0, "slurm_pidinfo")
        assert col.health()["scontrol"] is None
    finally:
        cluster.stop()


def test_the_hang_detector_names_the_job_from_the_node_map(tmp_path):
    """Progress rows that carry no job (e.g. from a source that knows ranks but not jobs) are
    joined to the node's job map, so the hang finding names the job and the culprit rank."""
    from gpuvigil.detectors.hang import HangDetector

    d = tmp_path / "map"
    d.mkdir()
    for gpu in range(4):
        (d / str(gpu)).write_text("4242\n")

    class Ranks:
        name, errors = "ranks", 0
        streams = {"rank_progress": schemas.RANK_PROGRESS}

        def collect(self, now):
            # ranks 0, 1, 3 entered collective 6 and wait; rank 2 never enqueued it
            return {"rank_progress": schemas.frame(
                [{"ts": now, "rank": r, "node": "n1", "gpu": r, "pg": "0", "last_enqueued_seq": 5 if r == 2 else 6,
                  "last_completed_seq": 5, "current_op": None if r == 2 else "ALLREDUCE"} for r in range(4)],
                schemas.RANK_PROGRESS,
            )}

    pipe = Pipeline([Ranks(), JobMapCollector(node="n1", hpc_job_mapping_dir=d)], [HangDetector()])
    found = [f for t in range(1, 30) for f in pipe.tick(float(t)).new_findings]
    assert [(f.kind.value, f.job, f.culprit_ranks) for f in found] == [("collective_hang", "4242", [2])]


def test_the_scheduler_placement_wins_and_is_kept_between_its_snapshots(tmp_path):
    d = tmp_path / "map"
    d.mkdir()
    for gpu in (0, 1):
        (d / str(gpu)).write_text("4242\n")

    class Sched:
        name, errors, ticks = "sched", 0, 0
        streams = {"allocations": schemas.ALLOCATIONS}

        def collect(self, now):
            self.ticks += 1
            if self.ticks > 1:
                return {}  # a scheduler snapshot only now and then
            return {"allocations": schemas.frame([{"job": "sched-7", "rank": 3, "node": "n1", "gpu": 0}], schemas.ALLOCATIONS)}

    pipe = Pipeline([Sched(), JobMapCollector(node="n1", hpc_job_mapping_dir=d)], [])
    for t in (1.0, 2.0):
        pipe.tick(t)
        assert pipe.window.get("allocations").sort("gpu").select("gpu", "job", "rank").rows() == [(0, "sched-7", 3), (1, "4242", None)]


def test_dcgm_exporter_labels_are_a_job_map_on_a_dcgm_only_node():
    """dcgm-exporter's scrape (tests/data/dcgm: GPU 1 under a Kubernetes pod) names the job of
    kernel XIDs on that GPU without any JobMapCollector."""
    from gpuvigil.collectors import dcgm

    text = (Path(__file__).parent / "data" / "dcgm" / "node07_constructed.prom").read_text()
    samples, workloads, _extra = dcgm.parse_text(text, ts=1.0)
    node = workloads["node"][0]
    xid = schemas.frame([{"ts": 0.0, "node": node, "gpu": 1, "source": "kernel", "kind": "xid", "xid": 48}], schemas.EVENTS)
    pipe = Pipeline([Frames("dcgm", {"gpu_workloads": workloads}), Frames("kernel", {"events": xid})], [])
    pipe.tick(1.0)
    pod = workloads.filter(pl.col("gpu") == 1).row(0, named=True)
    assert pipe.window.get("events")["job"].to_list() == [f"{pod['namespace']}/{pod['pod']}"]
    assert pipe.window.get("allocations").select("gpu", "job").rows() == [(1, f"{pod['namespace']}/{pod['pod']}")]


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_row = st.fixed_dictionaries(
    {"ts": st.just(1.0), "node": st.just("n"), "gpu": st.one_of(st.none(), st.integers(0, 3)), "source": st.sampled_from(sorted({"hpc_job_mapping", "slurm_pidinfo", "proc_environ", "proc_cgroup", "podresources"}))},
    optional={
        "job": st.one_of(st.none(), st.sampled_from(["1", "2", "ns/p"])),
        "rank": st.one_of(st.none(), st.integers(0, 8)),
        "pod": st.one_of(st.none(), st.sampled_from(["p", "q"])),
        "namespace": st.sampled_from(["ns", "kube-system"]),
        "pid": st.integers(1, 10),
    },
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_row, max_size=12), st.text(max_size=60))
def test_merge_and_pidinfo_never_crash_and_keep_one_row_per_gpu_and_job(rows, pidinfo_text):
    out = merge(rows, 1.0, "n")
    assert out.schema == schemas.GPU_JOBS
    keys = out.select("node", "gpu", "job").rows()
    assert len(keys) == len(set(keys)) and all(j is not None for _, _, j in keys)
    parse_pidinfo(pidinfo_text)
