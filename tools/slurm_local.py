"""A one-node SLURM on 127.0.0.1 for the tests: ``python tools/slurm_local.py start DIR`` / ``stop DIR`` /
``run DIR [PYTEST ARGS]``.

``start`` installs Debian's ``slurm-wlm`` and ``munge`` with apt-get when ``slurmctld`` is absent (root only),
writes ``DIR/slurm.conf`` (this host, by ``hostname -s``, with ``NodeAddr=127.0.0.1``; every spool, state, log
and pid file under DIR), starts ``munged`` (as the ``munge`` user), ``slurmctld`` and ``slurmd``, and waits until
the node is idle. It prints ``SLURM_CONF=DIR/slurm.conf``: the variable every SLURM command run then needs.
``stop`` ends the three daemons by their pid files (and nothing else). ``run`` is start, the tests marked
``slurm`` (``tests/test_slurm.py`` of tlm-command, with this interpreter's pytest and ``TLM_SLURM_REQUIRED=1``:
a SLURM that does not answer fails them instead of skipping them), then, however they end (a failure, a
SIGTERM, SIGHUP or Ctrl-C), stop and each job's end state; its exit status is pytest's, else 1. ``nox -s tests``
runs ``run`` in the background beside its own pytest run; ``nox -s slurm`` runs it alone.

SLURM cannot be had when this is not root, or when ``slurmctld`` is absent and there is no apt-get to install it:
``unavailable()`` says why, and ``run`` then exits 1 with that line (``nox -s tests`` skips the leg, saying so,
only outside CI).
"""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CONF = """\
ClusterName=tlmtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=5,socket={dir}/munge/munge.socket
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
JobCompType=jobcomp/filetxt
JobCompLoc={dir}/jobcomp.log
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
MpiDefault=none
KillWait=15
MinJobAge=600
SchedulerParameters=sched_interval=1
MessageTimeout=20
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""

DAEMONS = ("slurmd", "slurmctld", "munged")


def unavailable() -> str | None:
    """Why no SLURM can be started here (``None``: root, with SLURM installed or apt-get to install it)."""
    if os.geteuid() != 0:  # slurmctld and slurmd run as root here (SlurmUser=root), munged as the munge user
        return "only root can start SLURM's daemons (and apt-get install slurm-wlm munge when absent)"
    if shutil.which("slurmctld") and shutil.which("munged"):
        return None
    if shutil.which("apt-get") is None:
        return "slurmctld is not installed, and there is no apt-get here to install slurm-wlm and munge"
    return None


def _install() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    reason = unavailable()
    if reason is not None:
        sys.exit(f"slurm_local: {reason}")
    print("slurm_local: apt-get install slurm-wlm munge", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["apt-get", "install", "-y", "-q", "--no-install-recommends", "slurm-wlm", "munge"],
        check=True, env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(folder: Path) -> None:
    _install()
    folder = folder.resolve()
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o755)  # munged runs as the munge user and must reach its folder inside (mkdtemp makes 0700)
    for sub in ("state", "spool", "munge"):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    conf = folder / "slurm.conf"
    conf.write_text(CONF.format(host=host, dir=folder, cpus=os.cpu_count() or 1, ctld_port=_free_port(),
                                d_port=_free_port()))  # fmt: skip
    env = {**os.environ, "SLURM_CONF": str(conf)}
    # munged: its own socket and pid file under DIR, run as the munge user (it refuses root).
    sock = folder / "munge" / "munge.socket"
    shutil.chown(folder / "munge", "munge", "munge")
    os.chmod(folder / "munge", 0o755)
    subprocess.run(
        ["su", "-s", "/bin/sh", "munge", "-c",
         f"/usr/sbin/munged --socket={sock} --pid-file={folder}/munge/munged.pid --log-file={folder}/munge/munged.log"
         f" --seed-file={folder}/munge/munged.seed"],
        check=True,
    )  # fmt: skip
    # Every SLURM program finds this munged through AuthInfo's socket= (a system munged, if any, is left alone).
    (folder / "munged.pid").symlink_to(folder / "munge" / "munged.pid")
    subprocess.run(["/usr/sbin/slurmctld"], check=True, env=env)
    subprocess.run(["/usr/sbin/slurmd"], check=True, env=env)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True).stdout.strip()
        if state in ("idle", "mix", "alloc"):
            print(f"SLURM_CONF={conf}")
            return
        time.sleep(0.5)
    stop(folder)
    sys.exit(f"slurm_local: the node did not become idle in 120 s (sinfo says {state!r}; see {folder}/*.log)")


def stop(folder: Path) -> None:
    for name in DAEMONS:
        pid_file = folder / f"{name}.pid"
        try:
            pid = int(pid_file.read_text().strip())
        except (OSError, ValueError):
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)


#: The tests that need this SLURM.
TESTS = Path(__file__).resolve().parents[1] / "packages" / "tlm-command" / "tests" / "test_slurm.py"


def job_states(folder: Path) -> list[str]:
    """One line per job record in SLURM's job-completion log (sacct needs slurmdbd, which this SLURM does not run).

    A requeued job leaves one record per run: the stopped run's state reads PENDING (it went back to the queue).
    """
    log = folder / "jobcomp.log"
    lines = []
    for line in log.read_text().splitlines() if log.is_file() else []:
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        when = f"{fields.get('StartTime')} .. {fields.get('EndTime')}, exit {fields.get('ExitCode')}"
        state = "requeued (PENDING)" if fields.get("JobState") == "PENDING" else fields.get("JobState")
        lines.append(f"job {fields.get('JobId')} {fields.get('Name')}: {state} ({when})")
    return lines


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run(folder: Path, pytest_args: list[str]) -> int:
    """start, the slurm tests, stop (always) and the job states; pytest's exit status."""
    began = time.monotonic()
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _interrupt)
    folder.mkdir(parents=True, exist_ok=True)
    status = 1
    try:
        start(folder)
        print(f"slurm_local: the node is up after {time.monotonic() - began:.0f} s", flush=True)
        env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf"), "TLM_SLURM_REQUIRED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        command = [sys.executable, "-m", "pytest", str(TESTS), "-m", "slurm", "-p", "no:cacheprovider", *pytest_args]
        status = subprocess.run(command, env=env, check=False).returncode
    finally:
        stop(folder)
        for line in job_states(folder):
            print(line)
        print(f"slurm_local: {time.monotonic() - began:.0f} s wall, pytest exit {status}", flush=True)
        if status == 0:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            print(f"slurm_local: the daemons' logs stay in {folder}", flush=True)
    return status


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("start", "stop", "run") or (sys.argv[1] != "run" and len(sys.argv) > 3):
        sys.exit("usage: python tools/slurm_local.py start|stop DIR, or run DIR [PYTEST ARGS]")
    if sys.argv[1] == "run":
        sys.exit(run(Path(sys.argv[2]), sys.argv[3:]))
    (start if sys.argv[1] == "start" else stop)(Path(sys.argv[2]))
