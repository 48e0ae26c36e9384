"""NATS security of the fleet on a real nats-server: TLS with client certificates (a throwaway CA
made with openssl), one user per role, and the permissions `gpuvigil agent --print-nats-config`
generates (gpuvigil.fleet.security).

Asserts:
- a wrong password, an unknown user, and a client without a certificate are refused, and the
  fleet's connect says so in one line instead of retrying;
- an agent's credential publishes rows (stored in the rows stream through the partition
  mapping), but a detect partition's findings it publishes are refused and never stored, and it
  can neither write a lease nor touch the act ledger;
- detect publishes findings and holds leases but cannot write the ledger; act owns the ledger
  but cannot publish findings; nobody can delete a stream;
- a real `gpuvigil agent` with its credential from flags ships rows that detect's credential
  reads; with a wrong password it exits at once with one line;
- with nkey users (seeds made in the test), the same: each role signs in with its seed under its
  permissions, and a seed the server does not list, or no user seed at all, is one line.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleet_helpers import REPO, NatsServer, make_tls, nats_binary

from gpuvigil.config.deploy import Fleet
from gpuvigil.errors import UserError
from gpuvigil.fleet import connection, security, transport
from gpuvigil.fleet.transport import Subjects

pytestmark = [pytest.mark.services, pytest.mark.timeout(180)]
PASSWORDS = {"agent": "agent-secret-1", "detect": "detect-secret-2", "act": "act-secret-3"}


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Any:
    nats_binary()
    work = tmp_path_factory.mktemp("natssec")
    tls = make_tls(work)
    creds = {}
    for role, pw in PASSWORDS.items():
        (work / f"{role}.pw").write_text(pw + "\n")
        creds[role] = {"user": f"gv-{role}", "password_file": str(work / f"{role}.pw")}
    base = Fleet.model_validate({"partitions": 4, "credentials": creds,
                                 "tls": {"ca": str(tls["ca.crt"]), "cert": str(tls["client.crt"]), "key": str(tls["client.key"])}})
    body = (f'tls {{ cert_file: "{tls["server.crt"]}", key_file: "{tls["server.key"]}", ca_file: "{tls["ca.crt"]}", verify: true }}\n'
            + security.accounts_block(base))
    env = {security.PASSWORD_ENV[r]: pw for r, pw in PASSWORDS.items()} | {"NATS_ADMIN_PASSWORD": "admin-secret"}
    server = NatsServer(work, body, env)
    fleet = base.model_copy(update={"servers": [server.url("tls")]})
    yield work, tls, fleet, server
    server.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _connect(fleet: Fleet, role: str, errors: list[str] | None = None) -> Any:
    import nats

    async def on_error(exc: Exception) -> None:
        if errors is not None:
            errors.append(str(exc))

    return await nats.connect(servers=fleet.servers, error_cb=on_error, connect_timeout=3, max_reconnect_attempts=0,
                              **security.connect_options(fleet, role))


def with_cred(fleet: Fleet, role: str, **cred: str) -> Fleet:
    return fleet.model_copy(update={"credentials": {**fleet.credentials, role: fleet.credentials[role].model_copy(update=cred)}})


def test_wrong_or_missing_credentials_are_refused_in_one_line(secured):
    work, tls, fleet, _server = secured
    (work / "wrong.pw").write_text("not-the-password\n")
    cases = {
        "wrong password": with_cred(fleet, "agent", password_file=str(work / "wrong.pw")),
        "unknown user": with_cred(fleet, "agent", user="gv-mallory"),
        "no client certificate": fleet.model_copy(update={"tls": fleet.tls.model_copy(update={"cert": None, "key": None})}),
        "no credential": fleet.model_copy(update={"credentials": {}}),
    }
    for what, bad in cases.items():
        t0 = time.monotonic()
        with pytest.raises(UserError) as err:
            run(connection.connect(bad, "gpuvigil-agent-test", first_connect_seconds=30, role="agent"))
        # Refused at once (not after the 30 s the first connect retries an unreachable server).
        assert time.monotonic() - t0 < 15, what
        assert "refused gpuvigil-agent-test" in str(err.value) and "\n" not in str(err.value), (what, str(err.value))
    # The right credential gets in.
    async def good() -> bool:
        nc = await connection.connect(fleet, "gpuvigil-agent-test", role="agent")
        ok = nc.is_connected
        await nc.close()
        return ok

    assert run(good())


def test_each_role_can_publish_only_its_own_subjects(secured):
    _work, _tls, fleet, _server = secured
    s = Subjects(fleet)

    async def go() -> dict[str, Any]:
        out: dict[str, Any] = {}
        detect_nc = await _connect(fleet, "detect")
        djs = detect_nc.jetstream(timeout=5)
        await transport.ensure(djs, fleet)  # detect (or act) creates the streams; the agent may not

        agent_errors: list[str] = []
        agent_nc = await _connect(fleet, "agent", agent_errors)
        ajs = agent_nc.jetstream(timeout=2)
        out["rows"] = await ajs.publish(s.rows("train-a"), b"rows", headers={"Gv-Now": "1.0"})
        out["node findings"] = await ajs.publish(s.findings_node("n0"), transport.findings_payload("agent", 1.0, [], node="n0"))
        for what, coro in (
            ("forged partition findings", ajs.publish(s.findings_part(0), transport.findings_payload("detect", 1.0, [], partition=0))),
            ("lease", ajs.publish(f"$KV.{s.leases_bucket}.part.0", b"mallory")),
            ("ledger", ajs.publish(f"$KV.{s.ledger_bucket}.hint.x", b"mallory")),
            ("delete stream", ajs.delete_stream(s.findings_stream)),
            ("create stream", ajs.add_stream(name="EVIL", subjects=["evil.>"])),
        ):
            try:
                await coro
                out[f"agent {what}"] = "accepted"
            except Exception as exc:  # noqa: BLE001 - refused: a timeout after the server's -ERR
                out[f"agent {what}"] = f"refused {type(exc).__name__}"
        out["agent errors"] = list(agent_errors)

        # What the streams hold, read with detect's credential.
        info = await djs.stream_info(s.findings_stream, subjects_filter=f"{s.prefix}.findings.>")
        out["findings subjects"] = sorted((info.state.subjects or {}).keys())
        rows = await djs.stream_info(s.rows_stream)
        out["rows stored"] = rows.state.messages

        detect_errors: list[str] = []
        det = await _connect(fleet, "detect", detect_errors)
        dj = det.jetstream(timeout=2)
        out["detect findings"] = await dj.publish(s.findings_part(1), transport.findings_payload("detect", 1.0, [], partition=1))
        kv = await dj.key_value(s.leases_bucket)
        out["detect lease"] = await kv.create("part.1", b"d1")
        for what, coro in (("ledger", dj.publish(f"$KV.{s.ledger_bucket}.hint.x", b"d")), ("delete stream", dj.delete_stream(s.rows_stream))):
            try:
                await coro
                out[f"detect {what}"] = "accepted"
            except Exception as exc:  # noqa: BLE001
                out[f"detect {what}"] = f"refused {type(exc).__name__}"

        act = await _connect(fleet, "act")
        aj = act.jetstream(timeout=2)
        ledger = await aj.key_value(s.ledger_bucket)
        out["act ledger"] = await ledger.create("hint.h1", b"{}")
        try:
            await aj.publish(s.findings_part(2), b"{}")
            out["act findings"] = "accepted"
        except Exception as exc:  # noqa: BLE001
            out["act findings"] = f"refused {type(exc).__name__}"
        info = await djs.stream_info(s.findings_stream, subjects_filter=f"{s.prefix}.findings.>")
        out["findings subjects after"] = sorted((info.state.subjects or {}).keys())
        for nc in (agent_nc, detect_nc, det, act):
            await nc.close()
        return out

    out = run(go())
    # The agent's own subjects are stored (rows through the mapping into the rows stream).
    assert out["rows"].stream == "GV_ROWS" and out["node findings"].stream == "GV_FINDINGS"
    assert out["rows stored"] == 1
    for what in ("forged partition findings", "lease", "ledger", "delete stream", "create stream"):
        assert out[f"agent {what}"].startswith("refused"), (what, out)
    assert any("permissions violation" in e.lower() and "gv.findings.part.0" in e for e in out["agent errors"]), out["agent errors"]
    # No forged partition findings stored: only the agent's node findings.
    assert out["findings subjects"] == ["gv.findings.node.n0"]
    assert out["detect findings"].stream == "GV_FINDINGS" and out["detect lease"] >= 1
    assert out["detect ledger"].startswith("refused") and out["detect delete stream"].startswith("refused")
    assert out["act ledger"] >= 1 and out["act findings"].startswith("refused")
    assert out["findings subjects after"] == ["gv.findings.node.n0", "gv.findings.part.1"]


def test_agent_process_with_flags_ships_rows_and_a_wrong_password_exits_in_one_line(secured, tmp_path):
    work, tls, fleet, server = secured
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {"partitions": 4, "servers": fleet.servers}}))
    flags = ["--nats-ca", str(tls["ca.crt"]), "--nats-cert", str(tls["client.crt"]), "--nats-key", str(tls["client.key"]), "--nats-user", "gv-agent"]
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    (tmp_path / "bad.pw").write_text("guess\n")
    bad = subprocess.run([sys.executable, "-m", "gpuvigil", "agent", "--config", "fleet.yaml", "--port", "-1", *flags,
                          "--nats-password-file", str(tmp_path / "bad.pw"), "--nodes", "2"], cwd=tmp_path, capture_output=True, text=True, timeout=60, env=env)
    assert bad.returncode != 0
    errors = [ln for ln in bad.stderr.splitlines() if ln.strip()]
    assert errors and "refused gpuvigil-agent-" in errors[-1] and "Traceback" not in bad.stderr, bad.stderr[-2000:]

    s = Subjects(fleet)

    async def stored() -> int:
        nc = await _connect(fleet, "detect")
        js = nc.jetstream(timeout=5)
        await transport.ensure(js, fleet)
        n = (await js.stream_info(s.rows_stream)).state.messages
        await nc.close()
        return n

    before = run(stored())
    good = subprocess.run([sys.executable, "-m", "gpuvigil", "agent", "--config", "fleet.yaml", "--port", "-1", *flags,
                           "--nats-password-file", str(work / "agent.pw"), "--nodes", "2", "--speed", "5", "--duration", "4"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=90, env=env)
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert run(stored()) > before


def test_generated_server_config_is_the_shipped_one_and_nats_server_accepts_it(tmp_path):
    cfg = REPO / "deploy" / "fleet.yaml"
    out = subprocess.run([sys.executable, "-m", "gpuvigil", "agent", "--config", str(cfg), "--print-nats-config"],
                         capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    shipped = REPO / "deploy" / "nats" / "nats-server.conf"
    assert out.stdout == shipped.read_text(), "deploy/nats/nats-server.conf is stale: regenerate it with the command in its header"
    # nats-server parses it (-t: test the configuration), certificates present.
    tls = make_tls(tmp_path)
    text = out.stdout.replace("/etc/nats/tls/server.crt", str(tls["server.crt"])).replace("/etc/nats/tls/server.key", str(tls["server.key"]))
    text = text.replace("/etc/nats/tls/ca.crt", str(tls["ca.crt"])).replace("/var/lib/nats/jetstream", str(tmp_path / "js"))
    (tmp_path / "n.conf").write_text(text)
    env = {"SERVER_NAME": "nats-0", "NATS_ADMIN_PASSWORD": "a", **{v: "x" for v in security.PASSWORD_ENV.values()}}
    check = subprocess.run([nats_binary(), "-t", "-c", str(tmp_path / "n.conf")], capture_output=True, text=True, timeout=30, env=env)
    assert check.returncode == 0, check.stdout + check.stderr


def test_credential_config_is_strict():
    from gpuvigil.config.deploy import fleet_from_config

    for bad, message in (
        ({"credentials": {"agent": {"user": "a"}}}, "user and password_file go together"),
        ({"credentials": {"agent": {"creds": "a.creds", "user": "a", "password_file": "p"}}}, "exactly one of"),
        ({"credentials": {"agnet": {"creds": "a.creds"}}}, "credentials.agnet"),
        ({"tls": {"cert": "c.pem"}}, "cert and key go together"),
    ):
        with pytest.raises(UserError) as err:
            fleet_from_config({"fleet": bad})
        assert message in str(err.value), str(err.value)
    # A password file that cannot be read is one line naming it.
    f = Fleet.model_validate({"credentials": {"act": {"user": "a", "password_file": "/nonexistent/pw"}}})
    with pytest.raises(UserError, match="fleet.credentials.act.password_file /nonexistent/pw"):
        security.connect_options(f, "act")


def test_permissions_follow_the_prefix():
    f = Fleet.model_validate({"prefix": "blue"})
    agent = security.permissions(f, "agent")
    assert agent["publish"]["allow"][:5] == ["blue.rows.*", "blue.part.*.*", "blue.findings.node.*", "blue.cluster.node.*", "blue.clock.*"]
    assert not any(p.startswith("$KV") or p == "$JS.API.>" for p in agent["publish"]["allow"])
    assert "blue.findings.part.*" in security.permissions(f, "detect")["publish"]["allow"]
    assert "$KV.blue_act_ledger.>" in security.permissions(f, "act")["publish"]["allow"]
    assert "$KV.blue_act_ledger.>" in security.permissions(f, "detect")["publish"]["deny"]
    assert Path(REPO / "docs" / "security.md").read_text().count("NATS") >= 3


def _user_seed(path: Path) -> str:
    """A new user nkey (nacl's Ed25519 key, nkeys' encoding) with its seed written to `path`;
    returns the public key (U...)."""
    import nkeys
    from nacl.signing import SigningKey

    seed = nkeys.encode_seed(bytes(SigningKey.generate()), nkeys.PREFIX_BYTE_USER)
    path.write_bytes(seed + b"\n")
    return nkeys.from_seed(bytearray(seed)).public_key.decode()


def test_nkey_seeds_sign_in_with_their_roles_permissions_and_a_wrong_seed_exits_in_one_line(tmp_path):
    """Each role signs in with an nkey seed; the server lists the roles' public nkeys with the
    permissions gpuvigil generates (`accounts_block`, public keys from the environment)."""
    nkeys = pytest.importorskip("nkeys", reason="nkeys not installed (pip install 'gpuvigil[fleet]')")
    nats_binary()
    public = {role: _user_seed(tmp_path / f"{role}.nk") for role in security.ROLES}
    fleet = Fleet.model_validate({"partitions": 4, "credentials": {role: {"nkey_seed": str(tmp_path / f"{role}.nk")} for role in security.ROLES}})
    body = security.accounts_block(fleet)
    assert "password" not in body.split("SYS")[0] and all(f"nkey: ${security.NKEY_ENV[r]}" in body for r in security.ROLES)
    server = NatsServer(tmp_path, body, {security.NKEY_ENV[r]: key for r, key in public.items()} | {"NATS_ADMIN_PASSWORD": "admin-secret"})
    try:
        fleet = fleet.model_copy(update={"servers": [server.url()]})
        s = Subjects(fleet)

        async def go() -> dict[str, Any]:
            out: dict[str, Any] = {}
            detect = await connection.connect(fleet, "gpuvigil-detect-test", role="detect")
            djs = detect.jetstream(timeout=5)
            await transport.ensure(djs, fleet)
            out["detect findings"] = (await djs.publish(s.findings_part(1), transport.findings_payload("detect", 1.0, [], partition=1))).stream
            agent = await connection.connect(fleet, "gpuvigil-agent-test", role="agent")
            ajs = agent.jetstream(timeout=2)
            out["agent rows"] = (await ajs.publish(s.rows("train-a"), b"rows", headers={"Gv-Now": "1.0"})).stream
            try:
                await ajs.publish(s.findings_part(0), transport.findings_payload("detect", 1.0, [], partition=0))
                out["agent forged findings"] = "accepted"
            except Exception as exc:  # noqa: BLE001 - refused: a timeout after the server's -ERR
                out["agent forged findings"] = f"refused {type(exc).__name__}"
            info = await djs.stream_info(s.findings_stream, subjects_filter=f"{s.prefix}.findings.>")
            out["findings subjects"] = sorted((info.state.subjects or {}).keys())
            for nc in (agent, detect):
                await nc.close()
            return out

        out = run(go())
        assert out["detect findings"] == "GV_FINDINGS" and out["agent rows"] == "GV_ROWS"
        assert out["agent forged findings"].startswith("refused") and out["findings subjects"] == ["gv.findings.part.1"], out

        # A seed the server does not list (another user's key), and a file that is no seed: refused
        # at once, in one line.
        _user_seed(tmp_path / "stranger.nk")
        (tmp_path / "garbage.nk").write_text("SUnot-a-seed\n")
        (tmp_path / "account.nk").write_bytes(nkeys.encode_seed(b"\0" * 32, nkeys.PREFIX_BYTE_ACCOUNT) + b"\n")
        for name, message in (("stranger", "refused gpuvigil-agent-test"), ("garbage", "not an nkey seed"), ("account", "not of a user")):
            bad = fleet.model_copy(update={"credentials": {**fleet.credentials, "agent": fleet.credentials["agent"].model_copy(update={"nkey_seed": str(tmp_path / f"{name}.nk")})}})
            t0 = time.monotonic()
            with pytest.raises(UserError) as err:
                run(connection.connect(bad, "gpuvigil-agent-test", first_connect_seconds=30, role="agent"))
            assert time.monotonic() - t0 < 15 and message in str(err.value) and "\n" not in str(err.value), (name, str(err.value))

        # The agent process, its seed from a flag: the stranger's exits with one line, its own
        # ships rows.
        (tmp_path / "fleet.yaml").write_text(yaml.safe_dump({"fleet": {"partitions": 4, "servers": fleet.servers}}))
        env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}

        def agent(seed: str, *extra: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "gpuvigil", "agent", "--config", "fleet.yaml", "--port", "-1", "--nats-nkey-seed", seed,
                                   "--nodes", "2", *extra], cwd=tmp_path, capture_output=True, text=True, timeout=90, env=env)

        refused = agent("stranger.nk")
        errors = [ln for ln in refused.stderr.splitlines() if ln.strip()]
        assert refused.returncode != 0 and errors and "refused gpuvigil-agent-" in errors[-1] and "Traceback" not in refused.stderr, refused.stderr[-2000:]

        async def stored() -> int:
            nc = await connection.connect(fleet, "gpuvigil-detect-test", role="detect")
            n = (await nc.jetstream(timeout=5).stream_info(s.rows_stream)).state.messages
            await nc.close()
            return n

        before = run(stored())
        good = agent("agent.nk", "--speed", "5", "--duration", "4")
        assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
        assert run(stored()) > before
    finally:
        server.stop()
