"""A preemption while a program starts is requeued: docs/cluster.md's batch script, run with stubs of SLURM.

SLURM's preemption sends SIGTERM (or the job's ``--signal``, SIGUSR1 in the docs' script) to every task. A program
that takes preemption notices (``sv.driver.run`` with ``checkpoint=``, ``sv.distributed.reached_preemption``) saves
and exits with 75 from its loop on; before it, while it imports, builds its mesh or compiles its state, the signal
ends it as it ends any program: 143 or 138 (``128 +`` the signal), nothing saved and nothing lost. The docs' script
requeues on these codes too. Here the script itself runs (its bash block, unchanged, with ``srun`` and ``scontrol``
stubbed on ``PATH``) around ``tests/startup_worker.py`` as ``vmc.py``, which reports when it is inside an import or
its first compilation and stays there; the test then signals every worker. ``srun`` runs the program as one task
(as ``srun`` does: a task ended by a signal gives ``128 + n``), or as a group of 2 under
``python -m shardvmc.launch``. Every process is ended, whatever happens (its process group killed).
"""

from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardvmc.testing import cpu_environment

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "startup_worker.py"
CLUSTER = ROOT / "docs" / "cluster.md"
WAIT_S = 300  # a bound against hangs only: a worker reports within seconds, and a signalled run ends at once
JOB_ID = "4242"
FENCE = re.compile(r"^```bash\n(?P<body>.*?)^```", re.M | re.S)


def _batch_script() -> str:
    """The docs' batch script: the bash block of docs/cluster.md that requeues."""
    scripts = [m["body"] for m in FENCE.finditer(CLUSTER.read_text()) if "scontrol requeue" in m["body"]]
    assert len(scripts) == 1, f"docs/cluster.md: {len(scripts)} batch scripts that requeue"
    assert "\nsrun python vmc.py\n" in scripts[0]
    return scripts[0]


def _executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def _job(tmp: Path, srun: str) -> tuple[list[str], dict[str, str]]:
    """The batch script in ``tmp`` with ``srun`` (its body), ``scontrol`` and ``python`` stubbed: (command, env)."""
    bin_ = tmp / "bin"
    bin_.mkdir()
    _executable(bin_ / "srun", f"#!/bin/sh\n{srun}\n")
    _executable(bin_ / "scontrol", '#!/bin/sh\necho "$*" >> "$SCONTROL_LOG"\n')
    _executable(bin_ / "python", f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this interpreter (its venv)
    (tmp / "vmc.py").write_text(f"import runpy\n\nrunpy.run_path({str(WORKER)!r}, run_name='__main__')\n")
    _executable(tmp / "job.sh", _batch_script())
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHARDVMC_", "SLURM_"))}
    cpu_environment(env, 1, replace=True)  # one fake CPU device per process, not the test process's 8
    env.update(
        JAX_PLATFORMS="cpu",
        PATH=f"{bin_}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")])),
        SLURM_JOB_ID=JOB_ID,
        SCONTROL_LOG=str(tmp / "scontrol.log"),
        STARTUP_WORKER_READY=str(tmp / "ready"),
    )
    return ["bash", str(tmp / "job.sh")], env


def _requeued(tmp: Path) -> list[str]:
    log = tmp / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def _kill_group(pgid: int) -> None:
    if pgid > 1:  # (never 0 or 1: killpg would reach this test's own group, or init's)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@pytest.mark.parametrize(
    ("tasks", "stage", "sig"),
    [
        ("srun", "imports", signal.SIGTERM),
        ("srun", "compile", signal.SIGUSR1),
        ("launch", "imports", signal.SIGUSR1),
        ("launch", "compile", signal.SIGTERM),
    ],
    ids=["srun-imports-SIGTERM", "srun-compile-SIGUSR1", "launch-imports-SIGUSR1", "launch-compile-SIGTERM"],
)
def test_a_signal_while_the_program_starts_requeues_the_job(tmp_path, tasks, stage, sig):
    processes = 1 if tasks == "srun" else 2
    srun = 'exec "$@"' if tasks == "srun" else 'exec python -m shardvmc.launch --processes 2 -- "$@"'
    command, env = _job(tmp_path, srun)
    env["STARTUP_WORKER_STAGE"] = stage
    ready = tmp_path / "ready"
    out = (tmp_path / "out.txt").open("w")
    job = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + WAIT_S
        while len(workers) < processes and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            lines = ready.read_text().splitlines() if ready.exists() else []
            workers = [int(line.split()[0]) for line in lines if line.endswith(f" {stage}")]
        output = (tmp_path / "out.txt").read_text()
        assert len(workers) == processes, f"the workers did not report {stage!r} (job: {job.poll()}):\n{output}"
        for pid in workers:  # every task, as SLURM signals them (each in its own process group under the launcher)
            assert pid > 1
            os.kill(pid, sig)
        code = job.wait(timeout=WAIT_S)
        output = (tmp_path / "out.txt").read_text()
        assert code == 128 + sig, f"the job exited with {code}:\n{output}"  # not 3: the worker was not signalled
        assert _requeued(tmp_path) == [f"requeue {JOB_ID}"], output
        if tasks == "launch":  # the launcher passes the signalled process's code on
            assert f"was killed by {signal.Signals(sig).name} (code {128 + sig})" in output, output
    finally:
        out.close()
        _kill_group(job.pid)  # the script, the stub srun, the launcher (or the one task)
        for pid in workers:  # launched processes lead groups of their own
            _kill_group(pid)
        job.wait(timeout=30)


@pytest.mark.parametrize("code", [0, 1, 3, 75, 134, 137, 138, 143])
def test_the_script_requeues_on_a_saved_preemption_and_on_a_signal_at_start_up_only(tmp_path, code):
    """75: the state is saved; 143, 138: SIGTERM or SIGUSR1 before the loop took notices. Not a success, a crash
    (1), a failure of the program's own (3), JAX's abort of a process whose peer is gone (134) or SIGKILL (137)."""
    command, env = _job(tmp_path, f"exit {code}")
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stdout + done.stderr  # the script exits with the job's code
    assert _requeued(tmp_path) == ([f"requeue {JOB_ID}"] if code in (75, 138, 143) else [])
