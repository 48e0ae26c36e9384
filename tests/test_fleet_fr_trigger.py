"""The Flight Recorder trigger in the fleet: a real nats-server, a `gpuvigil agent` process on one
node reading dcgm-exporter (its `hpc_job` label maps the GPUs to a job) and a Flight Recorder
folder where the job's rank 0 has its debug-info pipe, and a `gpuvigil detect` process. The GPUs
go from training to the hung-collective signature (util pinned, power near idle); detect's
device-hang detector suspects the job (raised, or suppressed because the job is observable at
L1), and the agent of the node holding the job's ranks writes the pipe, as serve's trigger does.
"""

from __future__ import annotations

import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest
import yaml

from fleet_helpers import GvProc as Proc, NatsCluster, Probe, nats_binary
from services import wait_for

from gpuvigil.config.deploy import Fleet
from gpuvigil.fleet.transport import nats_mapping

pytestmark = [pytest.mark.services, pytest.mark.timeout(240)]
NODE = "gpu-node-07"
JOB = "job-7"
# Label sets as dcgm-exporter 4.x writes them (tests/data/dcgm/node07_constructed.prom), with the
# `hpc_job` label its HPC job mapping adds.
GPUS = [
    ('gpu="0",UUID="GPU-34d3dfff-b746-63b5-0224-9f470d7475f1",pci_bus_id="00000000:00:06.0",device="nvidia0",modelName="NVIDIA H200"'),
    ('gpu="1",UUID="GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae",pci_bus_id="00000000:00:07.0",device="nvidia1",modelName="NVIDIA H200"'),
]


class Exporter:
    """A dcgm-exporter page whose GPUs train (util 97%, 600 W) until `hang()`: then every GPU
    spins in the collective (util 100%) at near-idle power."""

    def __init__(self) -> None:
        self.hung = False
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server API)
                body = exporter.page().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def page(self) -> str:
        util, power = (100, 95.0) if self.hung else (97, 600.0)
        lines = []
        for name, kind, value in (("DCGM_FI_DEV_GPU_UTIL", "gauge", util), ("DCGM_FI_DEV_POWER_USAGE", "gauge", power),
                                  ("DCGM_FI_DEV_FB_USED", "gauge", 60000), ("DCGM_FI_DEV_FB_FREE", "gauge", 80000)):
            lines += [f"# HELP {name} {name}.", f"# TYPE {name} {kind}"]
            lines += [f'{name}{{{labels},Hostname="{NODE}",hpc_job="{JOB}"}} {value}' for labels in GPUS]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class PipeReader:
    """What torch's watchdog thread does with TORCH_NCCL_DEBUG_INFO_PIPE_FILE: hold the rank's
    FIFO open for reading and note every byte written to it."""

    def __init__(self, path: os.PathLike) -> None:
        os.mkfifo(path)
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        self.got = b""

    def read(self) -> bytes:
        try:
            self.got += os.read(self.fd, 64)
        except BlockingIOError:
            pass
        return self.got

    def close(self) -> None:
        os.close(self.fd)


def rows_stored(probe: Probe) -> int:
    async def go() -> int:
        return int((await probe.nc.jetstream(timeout=5).stream_info("GV_ROWS")).state.messages)

    try:
        return probe.call(go(), timeout=10)
    except Exception:  # noqa: BLE001 - the stream is not created yet
        return 0


def test_a_hang_detect_suspects_makes_the_agent_of_its_node_write_the_ranks_pipe(tmp_path):
    nats_binary()
    fleet = Fleet(partitions=2, lease_ttl_seconds=4.0, findings_refresh_seconds=2, replay_seconds=60, rows_max_age_seconds=300)
    cluster = NatsCluster(tmp_path, 1, nats_mapping(fleet))
    exporter = Exporter()
    fr_root = tmp_path / "fr"
    (fr_root / JOB).mkdir(parents=True)
    pipe = PipeReader(fr_root / JOB / "fr_pipe_0.pipe")
    procs: list[Proc] = []
    probe = None
    try:
        cluster.wait_ready()
        cfg = {
            "fleet": {**fleet.model_dump(), "servers": cluster.urls},
            "sources": {"node": NODE, "dcgm": [exporter.url], "flight_recorder": str(fr_root)},
            # A few seconds of hold and of training baseline instead of 25 and 5: the signature is
            # the same, the test shorter.
            "detectors": {"hang_device": {"hold_seconds": 3.0, "min_baseline_samples": 2}},
        }
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(cfg))
        common = ["--config", "fleet.yaml", "--log-level", "info"]
        detect = Proc("detect", ["detect", *common, "--id", "detect-1", "--metrics-port", "0"], tmp_path)
        agent = Proc("agent", ["agent", *common, "--port", "-1"], tmp_path)
        procs += [detect, agent]
        probe = Probe(cluster.urls)
        wait_for(lambda: "rebuilt from the stream" in detect.text() or None, 60, 0.3, "detect to hold its partitions")
        # The GPUs' training baseline: ticks of the job's rows stored, and detect reading them.
        wait_for(lambda: rows_stored(probe) >= 6 or None, 90, 0.3, "six ticks of the job's rows")
        time.sleep(2.0)
        assert pipe.read() == b"", "a pipe written before any suspicion"
        exporter.hung = True
        try:
            wait_for(lambda: pipe.read() or None, 60, 0.2, "the agent to write the hung job's pipe")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{detect.tail()}\n{agent.tail()}") from None
        assert pipe.got.startswith(b"1")
        assert f"asks node {NODE} for Flight Recorder dumps of job {JOB}" in detect.text()
        assert f"detect asks Flight Recorder dumps of job {JOB} (on_demand): pipes written" in agent.text()
        sent = httpx.get(detect.metrics_url(), timeout=10).text
        assert any(line.startswith('gpuvigil_detect_fr_dump_requests_total{replica="detect-1"}') and float(line.split()[-1]) >= 1
                   for line in sent.splitlines()), sent
    finally:
        if probe is not None:
            probe.close()
        for p in procs:
            p.stop()
        pipe.close()
        exporter.close()
        cluster.stop()


@pytest.mark.parametrize("data, written", [
    (b'{"job": "job-7", "how": "on_demand"}', True),
    (b'{"job": "../escape"}', False),  # a folder outside the Flight Recorder root
    (b'{"job": "job-7/../../escape"}', False),
    (b'{"job": ".."}', False),
    (b'{"job": 7}', False),
    (b'{"job": ""}', False),
    (b'{"how": "on_demand"}', False),
    (b"\x80\x81 not json", False),
    (b'["job-7"]', False),
])
def test_a_dump_request_is_untrusted(tmp_path, data, written):
    """Anyone on the bus could send one: only a job folder under the agent's Flight Recorder root
    is written to, and garbage is logged and dropped."""
    import asyncio
    from types import SimpleNamespace

    from gpuvigil.cli.main import build_parser
    from gpuvigil.fleet.agent import Agent

    root = tmp_path / "fr"
    (root / JOB).mkdir(parents=True)
    (tmp_path / "escape").mkdir()
    inside, outside = PipeReader(root / JOB / "fr_pipe_0.pipe"), PipeReader(tmp_path / "escape" / "fr_pipe_0.pipe")
    (tmp_path / "agent.yaml").write_text(yaml.safe_dump({"sources": {"node": NODE, "flight_recorder": str(root)}}))
    argv = ["agent", "--config", str(tmp_path / "agent.yaml"), "--port", "-1"]
    agent = Agent(build_parser(argv).parse_args(argv))
    try:
        asyncio.run(agent._on_dump_request(SimpleNamespace(subject=f"gv.fr.request.{NODE}", data=data), agent.dump_askers[NODE]))
        assert (inside.read() != b"") is written and outside.read() == b""
        assert (JOB in agent.dump_askers[NODE].requests.asked) is written
    finally:
        agent.close()
        inside.close()
        outside.close()
