"""A private one-node Slurm cluster on 127.0.0.1 for the ``slurm`` tests.

Everything it writes lies under one temporary folder: ``slurm.conf`` (handed to every client through
``SLURM_CONF``), the munge key and socket, state, spool, logs and PID files; its ports are free
ports picked at start. It starts ``munged``, ``slurmctld`` and ``slurmd`` in the foreground as its
own children and stops exactly those PIDs: it never writes ``/etc`` and never signals a process it
did not start. Debian's ``slurm-wlm`` and ``munge`` are installed with apt-get when missing (root
only). It refuses, with one line, to start beside a system Slurm whose controller answers.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ddp_plugins.core.process import parent_death_signal
from ddp_plugins.testing import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")


class SlurmUnavailable(RuntimeError):
    """Slurm cannot run here (no root, no packages, or a system Slurm already runs)."""


def install_packages() -> None:
    """Installs Debian's slurm-wlm and munge when their daemons are missing (needs root and apt)."""
    if all(shutil.which(d) or Path(f"/usr/sbin/{d}").exists() for d in DAEMONS):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable("slurm-wlm and munge are not installed and cannot be (needs root and apt-get)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"],
    ):
        result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise SlurmUnavailable(f"cannot install slurm-wlm and munge: {result.stderr.strip()[-300:]}")


def job_fields(job: str) -> dict[str, str]:
    """The ``Key=Value`` fields of ``scontrol show job <job>`` (the cluster ``SLURM_CONF`` names)."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def submit_requeue_job(folder: Path, name: str, srun_line: str, env: dict[str, str]) -> tuple[str, Path]:
    """Submits a ``--requeue`` batch job of 2 tasks on 1 node running ``srun_line`` from ``folder``;
    returns its id and its app run folder (``outputs/slurm-<job>``). The loopback settings of ``env``
    (``OMP_NUM_THREADS``, ``GLOO_SOCKET_IFNAME``) are exported in the script."""
    exported = " ".join(f"{k}={v}" for k, v in env.items() if k in ("OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME"))
    script = folder / "job.sh"
    script.write_text(
        f"#!/bin/bash\n#SBATCH --job-name={name}\n#SBATCH --nodes=1\n#SBATCH --ntasks-per-node=2\n"
        f"#SBATCH --requeue\n#SBATCH --output=slurm-%j.out\nexport {exported}\n{srun_line}\n"
    )
    job = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={folder}", str(script)], capture_output=True, text=True, timeout=60,
        check=True, env=env,
    ).stdout.strip()  # fmt: skip
    return job, folder / "outputs" / f"slurm-{job}"


def release_when_requeued(job: str, fields: dict[str, str]) -> bool:
    """Slurm holds a requeued job for 2 minutes; an operator's release keeps the tests short.

    Returns True when ``fields`` show the job requeued once and pending, and it was released.
    The release waits for the next second of the clock: the requeue revoked the job's launch
    credential with a time stamp in whole seconds, and slurmd refuses a new credential created in
    that second ("Job credential revoked": the requeued job fails as soon as it starts).
    """
    if fields.get("Restarts") == "1" and fields.get("JobState") == "PENDING":
        second = int(time.time())  # pending by now, so revoked at this second or before
        while int(time.time()) <= second:
            time.sleep(0.05)
        subprocess.run(["scontrol", "update", f"jobid={job}", "StartTime=now"], timeout=30)
        return True
    return False


def system_slurm_answers() -> bool:
    """True when the machine's own Slurm controller (its default configuration) answers a ping."""
    if not Path("/etc/slurm/slurm.conf").exists() or not shutil.which("scontrol"):
        return False
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}
    try:
        result = subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True, timeout=20)
    except subprocess.TimeoutExpired:
        return False
    return "is UP" in result.stdout


class SlurmCluster:
    """One node (this machine's cores) and one partition, ``debug``; ``env`` points clients at it.

    Example::

        with SlurmCluster() as cluster:
            subprocess.run(["sbatch", "job.sh"], env={**os.environ, **cluster.env})
    """

    def __init__(self, root: str | os.PathLike | None = None) -> None:
        # Under ``root`` (kept, with the daemons' logs) or a new temporary folder (removed at stop).
        self._owns_root = root is None
        self.root = Path(tempfile.mkdtemp(prefix="ddp-slurm-") if root is None else root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.conf = self.root / "slurm.conf"
        self.env = {"SLURM_CONF": str(self.conf)}
        self._procs: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        """The daemons this cluster started (munged, slurmctld, slurmd)."""
        return [proc.pid for proc in self._procs]

    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        install_packages()
        if system_slurm_answers():
            raise SlurmUnavailable(
                "a system Slurm controller answers on this machine; the test cluster will not start beside it"
            )
        root = self.root
        for sub in ("state", "spool", "log", "run"):
            (root / sub).mkdir()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = root / "run" / "munge.socket"
        self._spawn("munged", [
            "munged", "--foreground", "--force", f"--key-file={key}", f"--socket={sock}",
            f"--pid-file={root / 'run' / 'munged.pid'}", f"--log-file={root / 'log' / 'munged.log'}",
            f"--seed-file={root / 'state' / 'munged.seed'}",
        ])  # fmt: skip
        _wait(
            lambda: self._alive() or sock.exists(), 30, "munged did not create its socket", root / "log" / "munged.log"
        )
        host = socket.gethostname().split(".")[0]
        cpus = os.cpu_count() or 1
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) // 1024 - 1024
        self.conf.write_text("\n".join([
            "# a private test cluster: tests/helpers/slurm.py",
            "ClusterName=ddptest", f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={sock}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "ReturnToService=2",
            "SchedulerType=sched/backfill", "SchedulerParameters=sched_interval=2",
            f"StateSaveLocation={root / 'state'}", f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
            f"PlugStackConfig={root / 'plugstack.conf'}",
            "SlurmUser=root", "SlurmdUser=root", "MpiDefault=none", "JobRequeue=1", "KillWait=30",
            "InactiveLimit=0", "MinJobAge=600",
            # Lightning's port for a Slurm job is 15000 + its id's last 4 digits: a cluster numbering
            # from 1 would share port 15001 with any other job 1 on this machine (another cluster,
            # a test faking SLURM_JOB_ID=1)
            f"FirstJobId={random.randint(2000, 8999)}",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={mem} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
        ]) + "\n")  # fmt: skip
        (root / "plugstack.conf").write_text("")
        env = {**os.environ, **self.env}
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)], env)
        self._spawn("slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", host], env)

        def idle() -> bool:
            self._alive()
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
            if any(s in out.stdout for s in ("idle", "mixed", "allocated")):
                return True
            subprocess.run(
                ["scontrol", "update", f"nodename={host}", "state=resume"], env=env, capture_output=True, timeout=30
            )
            return False

        _wait(idle, 60, "the test cluster's node did not come up", root / "log" / "slurmctld.log")

    def stop(self) -> None:
        """Stops the daemons this cluster started (by PID); removes the folder it made itself."""
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self._procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        self._procs.clear()
        # A job step still ending when slurmd stopped: killed, and waited for. SIGKILL is delivered
        # asynchronously, so a scan right after os.kill could still find it alive (the cluster test
        # once did); one that slurmd had forked just before it stopped shows up in a later scan.
        deadline = time.monotonic() + 10
        while (left := self.step_daemons()) and time.monotonic() < deadline:
            for pid in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        if self._owns_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def step_daemons(self) -> list[int]:
        """The live ``slurmstepd`` processes of this cluster's jobs. They detach from slurmd (their
        parent is init), so they are found by this cluster's own ``SLURM_CONF`` in their environment."""
        mine = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and (entry / "comm").read_text().startswith("slurmstepd"):
                    if mine in (entry / "environ").read_bytes().split(b"\0"):
                        pids.append(int(entry.name))
            except OSError:  # gone meanwhile, or not ours to read
                continue
        return pids

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the controller's and the node daemon's logs (for a failing test's message)."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / "log" / name
            text = path.read_text(errors="replace") if path.exists() else "(none)"
            parts.append(f"--- {name}\n{text[-chars:]}")
        return "\n".join(parts)

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> None:
        log = open(self.root / "log" / f"{name}.out", "wb")
        # The daemons end with the test process even when it is killed before its teardown runs
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                preexec_fn=parent_death_signal(signal.SIGTERM))  # fmt: skip
        log.close()
        self._procs.append(proc)

    def _alive(self) -> None:
        for proc in self._procs:
            if proc.poll() is not None:
                log = self.root / "log" / f"{Path(proc.args[0]).name}.out"
                raise RuntimeError(
                    f"{proc.args[0]} exited with {proc.returncode}: {log.read_text(errors='replace')[-1500:]}"
                )


def _wait(ready, seconds: float, what: str, log: Path) -> None:
    deadline = time.monotonic() + seconds
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise RuntimeError(f"{what} within {seconds:.0f} s; {log.name}:\n{tail}")
        time.sleep(0.2)
