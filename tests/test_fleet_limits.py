"""Stream and bucket limits follow the config on a real nats-server: a changed
`rows_max_age_seconds`, `rows_max_bytes` or `lease_ttl_seconds` is applied to the existing streams
and buckets at start (it used to be ignored, or fail every process with a traceback), and a limit
the server cannot apply is one line naming the stream and the setting."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from typing import Any

import pytest
import yaml

from fleet_helpers import REPO, NatsServer

from gpuvigil.config.deploy import Fleet
from gpuvigil.errors import UserError
from gpuvigil.fleet import transport
from gpuvigil.fleet.transport import Subjects

pytestmark = [pytest.mark.services, pytest.mark.timeout(120)]


async def _limits(fleet: Fleet, *, apply: bool = True) -> dict[str, Any]:
    import nats

    nc = await nats.connect(servers=fleet.servers, connect_timeout=3)
    js = nc.jetstream(timeout=5)
    try:
        if apply:
            await transport.ensure(js, fleet, attempts=4)
        s = Subjects(fleet)
        out = {}
        for name in (s.rows_stream, s.findings_stream, f"KV_{s.leases_bucket}", f"KV_{s.ledger_bucket}"):
            c = (await js.stream_info(name)).config
            out[name] = (round(c.max_age or 0.0, 3), c.max_bytes, c.num_replicas)
        return out
    finally:
        await nc.close()


def test_changed_limits_are_applied_to_existing_streams_and_buckets(tmp_path):
    server = NatsServer(tmp_path, "")
    try:
        a = Fleet.model_validate({"servers": [server.url()], "partitions": 4, "rows_max_age_seconds": 900, "replay_seconds": 600,
                                  "rows_max_bytes": 64 * 2**20, "lease_ttl_seconds": 10})
        first = asyncio.run(_limits(a))
        assert first["GV_ROWS"] == (900.0, 64 * 2**20, 1)
        assert first["KV_gv_leases"][0] == 10.0 and first["KV_gv_act_ledger"][0] == 0.0

        b = a.model_copy(update={"rows_max_age_seconds": 1200.0, "rows_max_bytes": 96 * 2**20, "lease_ttl_seconds": 20.0})
        second = asyncio.run(_limits(b))
        assert second["GV_ROWS"] == (1200.0, 96 * 2**20, 1)
        assert second["KV_gv_leases"][0] == 20.0
        assert second["GV_FINDINGS"] == first["GV_FINDINGS"] and second["KV_gv_act_ledger"] == first["KV_gv_act_ledger"]

        # A process started with the new TTL now runs (a changed TTL used to fail every one).
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {"servers": [server.url()], "partitions": 4, "lease_ttl_seconds": 15}}))
        env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
        ok = subprocess.run([sys.executable, "-m", "gpuvigil", "detect", "--config", "fleet.yaml", "--duration", "1"], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60, env=env)
        assert ok.returncode == 0 and "Traceback" not in ok.stderr, ok.stderr[-2000:]
        assert asyncio.run(_limits(b, apply=False))["KV_gv_leases"][0] == 15.0

        # A bound over the server's store (max_file_store 1 GB) cannot be: one line, naming the
        # stream and the setting.
        with pytest.raises(UserError) as err:
            asyncio.run(_limits(b.model_copy(update={"rows_max_bytes": 8 * 2**30})))
        assert str(err.value).startswith("stream GV_ROWS: cannot apply fleet.rows_max_age_seconds / rows_max_bytes / replicas") and "\n" not in str(err.value)
        assert "insufficient storage" in str(err.value)
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {"servers": [server.url()], "partitions": 4, "rows_max_bytes": 8 * 2**30}}))
        bad = subprocess.run([sys.executable, "-m", "gpuvigil", "act", "--config", "fleet.yaml", "--duration", "1"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=60, env=env)
        lines = [ln for ln in bad.stderr.splitlines() if ln.strip()]
        assert bad.returncode != 0 and "Traceback" not in bad.stderr and "cannot apply" in lines[-1], bad.stderr[-2000:]
    finally:
        server.stop()
