"""A real, throw-away Slurm cluster for tests: munged + slurmctld + N slurmd on loopback.

Everything lives in one temp directory: munge key and socket, slurm.conf/gres.conf, state and
spool dirs, logs, and 8 placeholder GPU device files per node (character devices aliasing
/dev/null where mknod is allowed, plain files otherwise — slurmd only logs a warning for those).
Ports are free loopback ports below the kernel's ephemeral range (services.free_port). Daemons run in the foreground (-D) in
their own sessions (setsid); `stop()` cancels jobs, shuts Slurm down and kills whatever of
ours is left (daemons by pid, slurmstepd by the SLURM_CONF in its environment), even after a
failed start.

One cluster runs on the machine at a time (a lock file in the temp dir, held from `start()` to
`stop()`): two throw-away clusters started by parallel test workers have the same node names,
ports aside, and job ids.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from services import free_port

BINARIES = ("munged", "slurmctld", "slurmd", "scontrol", "sbatch", "squeue", "sinfo", "scancel")


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmCluster:
    def __init__(self, root: Path, nodes: tuple[str, ...] = ("gvnode1", "gvnode2"), gpus_per_node: int = 8):
        self.root = Path(root)
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: dict[str, subprocess.Popen] = {}
        self._lock: int | None = None
        # slurmstepd binds a unix socket in the spool dir (108 bytes at most for its path): a
        # test's tmp_path under pytest-xdist is too long for it, so the spool lives in a short one.
        self.spool = Path(tempfile.mkdtemp(prefix="gvslurm-"))
        for n in nodes:
            (self.spool / n).mkdir()

    # -- set-up -------------------------------------------------------------------------------
    def _write_config(self) -> None:
        r = self.root
        for d in ("munge", "state", "log", "dev"):
            (r / d).mkdir(parents=True, exist_ok=True)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        for i in range(self.gpus_per_node):
            dev = r / "dev" / f"nvidia{i}"
            try:
                os.mknod(dev, 0o600 | 0o020000, os.makedev(1, 3))  # char device, like /dev/nvidiaN
            except (PermissionError, OSError):
                dev.touch()
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        self.ports = {"slurmctld": ctld_port, **dict(zip(self.nodes, node_ports, strict=True))}
        host = socket.gethostname()
        lines = [
            "ClusterName=gvtest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={node_ports[0]}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # cred_expire also bounds how long a requeued job waits before it may start again.
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={self.spool}/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "JobRequeue=1",
            "ReturnToService=2",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=1",
            "MinJobAge=600",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "KillWait=2",
        ]
        for n in self.nodes:
            lines.append(
                f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.ports[n]} CPUs=2 RealMemory=1000 "
                f"Gres=gpu:{self.gpus_per_node} Feature=rack-a State=UNKNOWN"
            )
        lines.append(f"PartitionName=gpu Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        self.conf.write_text("\n".join(lines) + "\n")
        (r / "gres.conf").write_text(
            f"NodeName={','.join(self.nodes)} Name=gpu File={r}/dev/nvidia[0-{self.gpus_per_node - 1}]\n"
        )

    def _spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        # stdin from /dev/null: under pytest-xdist a worker's stdin is its channel to the
        # controller, which no daemon of the cluster has any business holding.
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        log.close()

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        self._lock = os.open(os.path.join(tempfile.gettempdir(), "gpuvigil-tests-slurm.lock"), os.O_CREAT | os.O_RDWR, 0o600)
        fcntl.flock(self._lock, fcntl.LOCK_EX)  # waits while another worker's cluster runs
        try:
            self._write_config()
            m = self.root / "munge"
            self._spawn(
                "munged",
                [_which("munged"), "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={m}/munge.key",
                 f"--pid-file={m}/munged.pid", f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed"],
            )
            self._wait(lambda: self.munge_socket.exists(), 15, "munged socket")
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-f", str(self.conf)])
            self._wait(lambda: self.scontrol_ok("ping"), timeout, "slurmctld to answer scontrol ping")
            for n in self.nodes:
                self._spawn(f"slurmd-{n}", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", n])
            self._wait(self._all_idle, timeout, "every node idle in sinfo")
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{self.logs()}")
            if ok():
                return
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}:\n{self.logs()}")

    def scontrol_ok(self, *args: str) -> bool:
        return self.cmd("scontrol", *args, check=False).returncode == 0

    def _all_idle(self) -> bool:
        out = self.cmd("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split("\n")
        states = dict(line.split() for line in out if line.strip())
        return all(states.get(n) == "idle" for n in self.nodes)

    # -- use ----------------------------------------------------------------------------------
    def cmd(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        p = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {p.stderr.strip()}")
        return p

    def sbatch(self, *args: str) -> str:
        out = self.cmd("sbatch", "--parsable", "-o", str(self.root / "log" / "job-%j.out"), *args).stdout
        return out.strip().split(";")[0]

    def job_field(self, job: str, field: str) -> str:
        out = self.cmd("scontrol", "-o", "show", "job", job).stdout
        for token in out.split():
            if token.startswith(field + "="):
                return token.split("=", 1)[1]
        raise KeyError(field)

    def node_state(self, node: str) -> tuple[str, str]:
        out = self.cmd("sinfo", "-h", "-n", node, "-N", "-o", "%T|%E").stdout.strip().splitlines()[0]
        state, _, reason = out.partition("|")
        return state, reason

    def wait_for(self, ok, timeout: float, what: str):
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = ok()
            if last:
                return last
            time.sleep(0.25)
        states = self.cmd("sinfo", "-h", "-N", "-o", "%N %T %E", check=False).stdout.strip().replace("\n", "; ")
        jobs = self.cmd("squeue", "-h", "-t", "all", "-o", "%i %T %r %N", check=False).stdout.strip().replace("\n", "; ")
        raise TimeoutError(f"timed out after {timeout:g}s waiting for {what} (last: {last!r}; nodes: {states}; jobs: {jobs})\n{self.logs(20)}")

    def _idle(self) -> bool:
        return all(self.node_state(n)[0] == "idle" for n in self.nodes)

    def reset(self) -> None:
        """Between tests: no jobs, every node idle. A cancelled job's completion message is now
        and then lost on this single-host set-up and Slurm would hold the node ~60 s until it
        re-sends the kill; cycling the node DOWN→RESUME releases it at once (an admin's remedy)."""
        jobs = self.cmd("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if jobs:
            self.cmd("scancel", *jobs, check=False)
        for n in self.nodes:
            if "drain" in self.node_state(n)[0]:
                self.cmd("scontrol", "update", f"NodeName={n}", "State=RESUME")
        try:
            self.wait_for(lambda: self._idle() or None, 10, "nodes idle")
            return
        except TimeoutError:
            pass
        for n in self.nodes:
            if self.node_state(n)[0] != "idle":
                self.cmd("scontrol", "update", f"NodeName={n}", "State=DOWN", "Reason=test reset")
                self.cmd("scontrol", "update", f"NodeName={n}", "State=RESUME")
        self.wait_for(lambda: self._idle() or None, 60, "nodes idle after DOWN/RESUME")

    def logs(self, lines: int = 15) -> str:
        out = []
        for f in sorted((self.root / "log").glob("*")):
            text = f.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {f.name}\n" + "\n".join(text))
        return "\n".join(out)

    # -- tear-down ----------------------------------------------------------------------------
    def _our_stepds(self) -> list[int]:
        """slurmstepd processes of this cluster (they daemonise away from slurmd's session)."""
        pids = []
        marker = f"SLURM_CONF={self.conf}".encode()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                if not (proc / "cmdline").read_bytes().startswith(b"slurmstepd"):
                    continue
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                continue
        return pids

    def stop(self) -> None:
        ctld = self.procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            try:
                jobs = self.cmd("squeue", "-h", "-o", "%i", check=False, timeout=10).stdout.split()
                if jobs:
                    self.cmd("scancel", *jobs, check=False, timeout=10)
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline and self.cmd("squeue", "-h", "-t", "R,CG", "-o", "%i", check=False, timeout=10).stdout.strip():
                        time.sleep(0.2)
                self.cmd("scontrol", "shutdown", check=False, timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                pass
        for pid in self._our_stepds():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # Slurm daemons first (they need munged to shut down cleanly), munged last.
        for name in sorted(self.procs, key=lambda n: n == "munged"):
            p = self.procs[name]
            if p.poll() is None:
                try:
                    p.wait(timeout=5 if name != "munged" else 0.1)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None:
                for sig in (signal.SIGTERM, signal.SIGKILL):
                    try:
                        os.killpg(p.pid, sig)  # its own session: the daemon and its helpers only
                    except ProcessLookupError:
                        break
                    try:
                        p.wait(timeout=5)
                        break
                    except subprocess.TimeoutExpired:
                        continue
        self.procs.clear()
        shutil.rmtree(self.spool, ignore_errors=True)
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the lock
            self._lock = None
