"""NATS security of the fleet: TLS and one credential per role on the client side, and the
nats-server configuration that gives each role only the subjects it needs (docs/security.md).

Roles and what NATS lets each of them do (`permissions`):

- agent: publish its rows, its node's findings and summary, and its clock; receive detect's
  requests for Flight Recorder dumps; nothing else. It has
  no JetStream API rights beyond reading stream info: it cannot publish a detect partition's
  findings (a forged page), write a lease or the act ledger, or change or delete a stream. With a
  credential the agent leaves the streams' creation to detect and act.
- detect: read the rows (pull consumers), hold leases, publish its partitions' findings,
  snapshot their carried-over state and ask agents for Flight Recorder dumps.
- act: read findings and node summaries, hold the leader lease, and own the act ledger.

Destructive JetStream calls (delete or purge a stream, delete a stored message) are denied to
every role: an operator does them with the server's system or admin user.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

from gpuvigil.config.deploy import Fleet, NatsCredential
from gpuvigil.errors import UserError
from gpuvigil.fleet.transport import Subjects

ROLES = ("agent", "detect", "act")
ACCOUNT = "GPUVIGIL"
# Environment variables nats-server reads each role's password from (the config names them).
PASSWORD_ENV = {"agent": "GV_AGENT_PASSWORD", "detect": "GV_DETECT_PASSWORD", "act": "GV_ACT_PASSWORD"}
# ... and the public nkey (U...) of a role that signs with an nkey seed (`nkey_seed`): the config
# names the variable, so it is generated without the seeds.
NKEY_ENV = {"agent": "GV_AGENT_NKEY", "detect": "GV_DETECT_NKEY", "act": "GV_ACT_NKEY"}
_DESTRUCTIVE = ["$JS.API.STREAM.DELETE.>", "$JS.API.STREAM.PURGE.>", "$JS.API.STREAM.MSG.DELETE.>", "$JS.API.ACCOUNT.PURGE.>"]


def _read(path: str, what: str) -> str:
    try:
        return Path(path).read_text().splitlines()[0].strip() if Path(path).stat().st_size else ""
    except OSError as exc:
        raise UserError(f"{what} {path}: {exc.strerror or exc}") from None


def tls_context(fleet: Fleet) -> ssl.SSLContext | None:
    if fleet.tls is None:
        return None
    t = fleet.tls
    try:
        ctx = ssl.create_default_context(cafile=t.ca)
        if t.cert and t.key:
            ctx.load_cert_chain(t.cert, t.key)
    except (OSError, ssl.SSLError) as exc:
        raise UserError(f"fleet.tls: {exc}") from None
    return ctx


def connect_options(fleet: Fleet, role: str | None) -> dict[str, Any]:
    """Keyword arguments for `nats.connect` that carry TLS and the role's credential."""
    out: dict[str, Any] = {}
    ctx = tls_context(fleet)
    if ctx is not None:
        out["tls"] = ctx
    cred: NatsCredential | None = fleet.credential(role) if role else None
    if cred is None:
        return out
    if cred.creds or cred.nkey_seed:
        try:
            import nkeys  # noqa: F401 - nats-py signs the server's nonce with it
        except ImportError:
            raise UserError(f"fleet.credentials.{role}: {cred.describe()} needs the nkeys package (pip install nkeys)") from None
        path = cred.creds or cred.nkey_seed
        if not Path(path).is_file():  # type: ignore[arg-type]
            raise UserError(f"fleet.credentials.{role}: {path}: no such file")
        if cred.nkey_seed:
            _check_seed(cred.nkey_seed, role)
        out["user_credentials" if cred.creds else "nkeys_seed"] = path
    else:
        out["user"] = cred.user
        out["password"] = _read(cred.password_file, f"fleet.credentials.{role}.password_file")  # type: ignore[arg-type]
    return out


def _check_seed(path: str, role: str) -> None:
    """A seed file nats-py cannot sign with fails inside its connect, which retries it like an
    unreachable server: say so at once instead."""
    import nkeys

    seed = _read(path, f"fleet.credentials.{role}.nkey_seed")
    try:
        nkeys.from_seed(bytearray(seed.encode()))
    except Exception:  # noqa: BLE001 - nkeys' errors (bad prefix, checksum, length, base32) share no base class
        raise UserError(f"fleet.credentials.{role}.nkey_seed {path}: not an nkey seed (expected one line starting with SU)") from None
    if not seed.startswith("SU"):
        raise UserError(f"fleet.credentials.{role}.nkey_seed {path}: the seed of a {seed[1:2]!r} key, not of a user (SU...)")


def permissions(fleet: Fleet, role: str) -> dict[str, Any]:
    """The publish/subscribe allow and deny lists of one role (nats-server's `permissions`)."""
    s = Subjects(fleet)
    p = s.prefix
    leases = f"$KV.{s.leases_bucket}.>"
    ledger = f"$KV.{s.ledger_bucket}.>"
    state = f"$KV.{s.state_bucket}.>"
    if role == "agent":
        # The server checks the subject after the partition mapping (rows.<job> → part.<p>.<job>).
        pub = [f"{p}.rows.*", f"{p}.part.*.*", f"{p}.findings.node.*", f"{p}.cluster.node.*", f"{p}.clock.*", "$JS.API.INFO", "$JS.API.STREAM.INFO.*"]
        return {"publish": {"allow": pub}, "subscribe": {"allow": ["_INBOX.>", f"{p}.fr.request.*"]}}
    # detect and act run JetStream consumers and manage the streams' limits; what they may
    # write is their own findings (and detect's partition state) or the ledger, and the leases.
    api = ["$JS.API.>", "$JS.ACK.>", "$JS.FC.>"]
    if role == "detect":
        pub = [f"{p}.findings.part.*", f"{p}.fr.request.*", leases, state, *api]
        deny = [ledger, *_DESTRUCTIVE]
    elif role == "act":
        pub = [leases, ledger, *api]
        deny = [f"{p}.findings.>", f"{p}.rows.>", state, *_DESTRUCTIVE]
    else:
        raise ValueError(role)
    return {"publish": {"allow": pub, "deny": deny}, "subscribe": {"allow": ["_INBOX.>", f"{p}.clock.>"]}}


def _conf_value(value: Any, indent: int) -> str:
    pad = "  " * indent
    if isinstance(value, dict):
        inner = "\n".join(f"{pad}  {k}: {_conf_value(v, indent + 1)}" for k, v in value.items())
        return "{\n" + inner + f"\n{pad}}}"
    if isinstance(value, list):
        return "[" + ", ".join(_conf_value(v, indent) for v in value) + "]"
    if isinstance(value, str) and value.startswith("$") and value[1:].isidentifier():
        return value  # a nats-server variable (an environment variable at load time)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _signs_with_nkey(fleet: Fleet, role: str) -> bool:
    cred = fleet.credential(role)
    return cred is not None and cred.nkey_seed is not None


def accounts_block(fleet: Fleet) -> str:
    """The `accounts` block: the fleet's account (JetStream, the partition mapping) and one user
    per role with its permissions: a user name and password, or, for a role whose credential is
    an nkey seed, its public nkey. Both come from the environment (PASSWORD_ENV, NKEY_ENV), so the
    file holds no secret and is generated without the seeds."""
    from gpuvigil.fleet.transport import nats_mapping

    users = []
    for role in ROLES:
        cred = fleet.credential(role)
        if _signs_with_nkey(fleet, role):
            who = "nkey: $" + NKEY_ENV[role]
        else:
            name = cred.user if cred is not None and cred.user else f"{fleet.prefix}-{role}"
            who = "user: " + _conf_value(name, 0) + ", password: $" + PASSWORD_ENV[role]
        users.append("      { " + who + ",\n        permissions: " + _conf_value(permissions(fleet, role), 4) + " }")
    return (
        "accounts {\n"
        f"  {ACCOUNT} {{\n"
        "    jetstream: enabled\n"
        f"    {nats_mapping(fleet)}\n"
        "    users: [\n" + ",\n".join(users) + "\n    ]\n"
        "  }\n"
        "  SYS { users: [ { user: admin, password: $NATS_ADMIN_PASSWORD } ] }\n"
        "}\n"
        "system_account: SYS\n"
    )


def server_config(fleet: Fleet, *, verify_clients: bool = True) -> str:
    """A nats-server node's config for this fleet: client TLS (client certificates required when
    `verify_clients`), a 3-node JetStream cluster whose routes are the `fleet.servers` hosts
    (port 6222, TLS too), the monitoring port for Prometheus, and `accounts_block`. The node's
    name and the routes' hosts come from the environment/`fleet.servers`; certificates are read
    from /etc/nats/tls."""
    from urllib.parse import urlsplit

    hosts = [urlsplit(u).hostname for u in fleet.servers]
    env = [(NKEY_ENV if _signs_with_nkey(fleet, r) else PASSWORD_ENV)[r] for r in ROLES]
    routes = ", ".join(f'"nats-route://{h}:6222"' for h in hosts)
    tls = ('  cert_file: "/etc/nats/tls/server.crt"\n  key_file: "/etc/nats/tls/server.key"\n  ca_file: "/etc/nats/tls/ca.crt"\n'
           + ("  verify: true\n" if verify_clients else ""))
    return (
        f"# nats-server for the gpuvigil fleet (prefix {fleet.prefix}, {fleet.partitions} partitions).\n"
        "# Generated: gpuvigil agent --config fleet.yaml --print-nats-config (docs/security.md).\n"
        f"# Environment: SERVER_NAME (this node: nats-0, nats-1, nats-2), {env[0]},\n"
        f"# {', '.join(env[1:])}, NATS_ADMIN_PASSWORD.\n"
        "server_name: $SERVER_NAME\n"
        "listen: 0.0.0.0:4222\n"
        "http: 0.0.0.0:8222\n"
        f"tls {{\n{tls}}}\n"
        'jetstream { store_dir: "/var/lib/nats/jetstream", max_file_store: 200GB, max_memory_store: 1GB }\n'
        "cluster {\n  name: gpuvigil\n  listen: 0.0.0.0:6222\n"
        f"  routes: [{routes}]\n"
        '  tls { cert_file: "/etc/nats/tls/server.crt", key_file: "/etc/nats/tls/server.key", ca_file: "/etc/nats/tls/ca.crt", verify: true }\n'
        "}\n" + accounts_block(fleet)
    )
