"""Multi-process runs with real processes: 2 processes x 2 fake CPU devices, gloo, loopback only.

Every JAX group is started through the launcher (``python -m shardvmc.launch``). The
launches are started together when the module's first test needs them, in parallel,
and each test waits for its own; one launch of ``tests/mp_worker.py`` serves every
toolkit and kernel check. Results are compared with numpy and with the same code run in
this process on 4 devices.
"""

from __future__ import annotations

import importlib.util
import io
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc import _internals, distributed, launch
from shardvmc.testing import CPU_SCHEDULER_FLAG, cpu_environment

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "mp_worker.py"
EXAMPLE = ROOT / "examples" / "helium_vmc.py"
HELIUM_ARGS = ["--walkers", "256", "--steps", "3", "--eval-steps", "1", "--seed", "7"]
WAIT_S = 240  # a bound against hangs only; the launches take seconds

_spec = importlib.util.spec_from_file_location("mp_worker", WORKER)
assert _spec is not None and _spec.loader is not None
mp_worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mp_worker)


def _clean_env(devices: int | None = None) -> dict[str, str]:
    """This environment without the test process's device count and launcher variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDVMC_")}
    cpu_environment(env, devices, replace=True)  # the test process's own count must not leak into the children
    if devices is not None:
        env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def _launcher(*command: str, processes: int = 2, devices: int = 2, timeout: float = WAIT_S) -> list[str]:
    return [
        sys.executable,
        "-m",
        "shardvmc.launch",
        "--processes",
        str(processes),
        "--devices-per-process",
        str(devices),
        "--timeout",
        str(timeout),
        "--",
        *command,
    ]


class Run:
    """A started command; ``wait()`` gives its exit code and output, ``ended`` its end time."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        self.command = command
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.output = ""
        self.ended: float | None = None
        self._thread = threading.Thread(target=self._collect, daemon=True)
        self._thread.start()

    def _collect(self) -> None:
        self.output, _ = self.proc.communicate()
        self.ended = time.time()

    def wait(self) -> tuple[int, str]:
        self._thread.join(WAIT_S)
        if self._thread.is_alive():
            self.stop()
            pytest.fail(f"{' '.join(self.command)} did not finish within {WAIT_S} s:\n{self.output}")
        return self.proc.returncode, self.output

    def stop(self) -> None:
        """End the command: SIGTERM first, so that a launcher stops its processes, then SIGKILL."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._thread.join(30)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every multi-process launch of this module, started at once."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    (tmp / "toolkit").mkdir()
    started: dict[str, Any] = {"tmp": tmp}
    py = sys.executable
    try:
        started["toolkit"] = Run(_launcher(py, str(WORKER), "toolkit", str(tmp / "toolkit")), _clean_env())
        started["crash"] = Run(_launcher(py, str(WORKER), "crash", str(tmp)), _clean_env())
        if EXAMPLE.exists():
            started["helium"] = Run(
                _launcher(py, str(EXAMPLE), *HELIUM_ARGS, "--json", str(tmp / "helium_mp.json")), _clean_env()
            )
            started["helium_reference"] = Run(
                [py, str(EXAMPLE), *HELIUM_ARGS, "--devices", "4", "--json", str(tmp / "helium_1.json")],
                _clean_env(devices=4),
            )
        yield started
    finally:
        for run in started.values():
            if isinstance(run, Run):
                run.stop()


@pytest.fixture(scope="module")
def toolkit(runs: Any) -> list[dict[str, Any]]:
    """The results of process 0 and process 1 of the toolkit launch."""
    code, output = runs["toolkit"].wait()
    assert code == 0, output
    return [json.loads((runs["tmp"] / "toolkit" / f"result_{p}.json").read_text()) for p in (0, 1)]


@pytest.fixture(scope="module")
def single_process() -> dict[str, Any]:
    """The same checks in this one process, on a mesh of 4 of its devices."""
    return json.loads(json.dumps(mp_worker.checks(sv.create_mesh(jax.devices()[:4]))))


def assert_close(got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-6, where: str = "") -> None:
    """Compare nested dicts of (nested lists of) numbers, naming the key path that differs."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            assert_close(got[key], want[key], rtol, atol, f"{where}[{key!r}]")
        return
    try:
        want_array = np.asarray(want, np.float64)
    except ValueError:  # a list of outputs of different shapes (a tuple of kernel outputs)
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, rtol, atol, f"{where}[{i}]")
        return
    np.testing.assert_allclose(np.asarray(got, np.float64), want_array, rtol, atol, err_msg=where)


# ---------------------------------------------------------------- the group


def test_processes_form_one_group_of_four_devices(toolkit):
    for p, result in enumerate(toolkit):
        facts = result["facts"]
        assert facts["launched"] is True
        assert facts["process_index"] == p
        assert facts["process_count"] == 2
        assert facts["devices"] == 4
        assert facts["local_devices"] == facts["n_devices"] == 2
        assert facts["mesh_processes"] == [0, 0, 1, 1]  # sv.create_mesh() spans every process
        assert facts["fully_addressable"] is False


def test_initialize_selects_gloo_and_second_call(toolkit):
    for result in toolkit:
        facts = result["facts"]
        # The worker switched the CPU collectives off before initialize().
        assert facts["collectives"] == "gloo"
        assert facts["gloo_host"] == "127.0.0.1"  # gloo, like the coordinator, stays on loopback
        assert facts["initialize"]["same_again"] is True
        assert "already initialised" in facts["initialize"]["different"]
        assert "num_processes=3" in facts["initialize"]["different"]


def test_every_process_sees_the_same_results(toolkit):
    assert toolkit[0]["checks"] == toolkit[1]["checks"]


def test_the_collectives_connection_messages_are_left_out(runs, toolkit):
    # gloo prints "[Gloo] Rank i is connected to ..." for every device of every group it connects
    # (8 lines and more per run); the launcher drops them unless --verbose.
    _, output = runs["toolkit"].wait()
    assert "[0] " in output and "[1] " in output, output
    assert "[Gloo]" not in output, output


# ---------------------------------------------------------------- toolkit, against known values


def test_shard_walker_from_host_data(toolkit):
    r = mp_worker.host_walkers()
    for p, result in enumerate(toolkit):
        out = result["checks"]["shard_walker"]
        np.testing.assert_array_equal(np.asarray(out["value"]["r"], np.float32), r)
        assert out["value"]["step"] == 3
        assert out["spec"] == {"r": "P('walkers',)", "step": "P()"}
        # Each process holds the rows of its own two devices, and they are the right ones.
        assert result["facts"]["shard_rows"] == [[4 * p, 4 * p + 2], [4 * p + 2, 4 * p + 4]]
        assert result["facts"]["shard_ok"] is True
        jax_input = result["checks"]["shard_walker_jax"]
        np.testing.assert_array_equal(np.asarray(jax_input["value"], np.float32), r)
        assert jax_input["spec"] == "P('walkers',)"


def test_replicate_from_host_data(toolkit):
    for result in toolkit:
        out = result["checks"]["replicate"]
        assert out["value"] == {"a": 1.5, "v": [0.0, 1.0, 2.0]}
        assert out["spec"] == {"a": "P()", "v": "P()"}
        assert out["fully_replicated"] == [True, True]


def test_initialize_walkers_sharded_matches_unsharded_reference(toolkit):
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.key(42), jnp.arange(mp_worker.N_UNEVEN))
    expected = jax.vmap(mp_worker.init_walker)(keys)
    for p, result in enumerate(toolkit):
        out = result["checks"]["initialize_walkers_sharded"]
        assert out["spec"] == {"r": "P('walkers',)", "w": "P('walkers',)"}
        for name in ("r", "w"):
            value = np.asarray(out["value"][name])
            assert value.shape[0] == 12  # padded to the 4 global devices
            np.testing.assert_allclose(value[: mp_worker.N_UNEVEN], expected[name], rtol=1e-6)
        # Process p created (and holds) only the walkers of its own devices: 3 per device.
        assert result["facts"]["init_rows"] == [[6 * p, 6 * p + 3], [6 * p + 3, 6 * p + 6]]
        host = result["checks"]["initialize_walkers_sharded_host"]
        assert host["value"] == [*range(10), 0, 0]  # padding repeats walker 0
        assert host["spec"] == "P('walkers',)"
        restarted = result["checks"]["initialize_walkers_sharded_global"]
        np.testing.assert_array_equal(np.asarray(restarted["value"], np.float32), mp_worker.host_walkers())
        assert restarted["spec"] == "P('walkers',)"
        uneven = mp_worker.host_walkers(mp_worker.N_UNEVEN)
        padded = result["checks"]["initialize_walkers_sharded_global_uneven"]
        np.testing.assert_array_equal(
            np.asarray(padded["value"], np.float32), np.concatenate([uneven, uneven[:1].repeat(2, 0)])
        )
        assert padded["spec"] == "P('walkers',)"


def test_assemble_sharded_from_local_pytrees(toolkit):
    for result in toolkit:
        out = result["checks"]["assemble_sharded"]
        assert out["value"] == {"r": [0, 1, 10, 11, 20, 21, 30, 31], "t": 7.0}
        assert out["spec"] == {"r": "P('walkers',)", "t": "P()"}


def test_reductions_are_replicated_and_correct(toolkit):
    r = mp_worker.host_walkers()
    jac, vec = mp_worker.host_jacobian()
    expected = {
        "walker_mean": r[:5].mean(0),
        "walker_mean_tree": {"a": r.mean(0), "b": vec.mean()},
        "walker_sum": vec.sum(),
        "walker_sum_host_uneven": np.arange(7.0).sum(),
        "jtj": jac[:6].T @ jac[:6],
        "jtv": jac[:6].T @ vec[:6],
    }
    for result in toolkit:
        for name, want in expected.items():
            got = result["checks"]["reductions"][name]
            assert got["fully_replicated"] is True, name
            assert_close(got["value"], want, where=name)


def test_kernels_match_numpy(toolkit):
    r = mp_worker.host_walkers()
    ru = mp_worker.host_walkers(mp_worker.N_UNEVEN)
    alpha = 0.7
    norms = np.linalg.norm(r, axis=-1).sum(-1)
    noise = jax.vmap(lambda i: jax.random.normal(jax.random.fold_in(jax.random.key(3), i)))(jnp.arange(10))
    for result in toolkit:
        k = result["checks"]["kernels"]
        np.testing.assert_allclose(k["mean_host"], alpha * (r**2).sum((1, 2)).mean(), rtol=1e-5)
        np.testing.assert_allclose(k["mean_sharded_n_valid"], alpha * (r[:5] ** 2).sum((1, 2)).mean(), rtol=1e-5)
        np.testing.assert_allclose(k["mean_uneven"], alpha * (ru**2).sum((1, 2)).mean(), rtol=1e-5)
        np.testing.assert_allclose(k["per_walker_key"], alpha * r.sum((1, 2)) + noise[:8], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(k["per_walker_key_uneven"], alpha * ru.sum((1, 2)) + noise, rtol=1e-5, atol=1e-6)
        scaled, mean_grad, total = k["tuple_n_valid"]
        np.testing.assert_allclose(scaled, -2.0 * norms, rtol=1e-5)  # d log_psi / d alpha, per walker
        np.testing.assert_allclose(mean_grad, -norms[:6].mean(), rtol=1e-5)
        np.testing.assert_allclose(total, r[:6].sum(0).sum(0), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(k["shard_vmap"], (r**2).sum((1, 2)), rtol=1e-6)
        assert result["checks"]["kernel_specs"] == {"per_walker_key": "P('walkers',)", "mean_host": "P()"}


def test_everything_equals_the_single_process_run(toolkit, single_process):
    for result in toolkit:
        multi = result["checks"]
        assert multi.keys() == single_process.keys()
        for name in multi:
            if name.endswith("spec") or name.endswith("specs"):
                assert multi[name] == single_process[name], name
            elif name in ("kernels", "reductions"):
                assert_close(multi[name], single_process[name], rtol=1e-6, atol=1e-7, where=name)
            elif name in ("kfac", "dmc"):  # float64: the round-off of the sums over devices, no more
                assert_close(multi[name], single_process[name], rtol=1e-10, atol=1e-12, where=name)
            else:  # placement: exactly the same values and shardings
                assert multi[name] == single_process[name], name


def test_kfac_with_the_fields_losses_takes_one_devices_step_on_two_processes(toolkit):
    """KFAC with FermiNet's and DeepQMC's clippings on 2 x 2 devices and 10 walkers: the step of one device."""
    if not toolkit[0]["checks"]["kfac"]:
        pytest.skip("kfac-jax cannot be imported here (kfac-jax 0.0.8 needs JAX < 0.11)")
    one = json.loads(json.dumps(mp_worker.kfac_checks(sv.create_mesh(jax.devices()[:1]))))
    for result in toolkit:
        got = result["checks"]["kfac"]
        for name in ("ferminet", "deepqmc"):
            assert got[name]["n"] == mp_worker.N_UNEVEN
            assert abs(got[name]["params"]["a"] - 0.4) > 1e-4, "the steps must move the parameters"
        assert_close(got, one, rtol=1e-10, atol=1e-12, where="kfac")


def test_dmc_on_two_processes_is_the_run_of_one_device(toolkit):
    """DMC on 2 x 2 devices and 13 walkers: every step's statistics and the final walkers of one device.

    The comb's copies cross the processes by the halos and, where they reach farther, by the all-gather
    fallback: both routes run (the fallback statistic says which), and neither changes the run.
    """
    one = json.loads(json.dumps(mp_worker.dmc_checks(sv.create_mesh(jax.devices()[:1]))))
    assert one["steps"]["fallback"] == [0.0] * 4  # (one device: nothing to gather)
    for result in toolkit:
        got = result["checks"]["dmc"]
        fallback = got["steps"].pop("fallback")
        assert 0.0 in fallback and 1.0 in fallback, fallback
        steps = {name: value for name, value in one["steps"].items() if name != "fallback"}
        assert got["steps"].keys() == steps.keys()
        assert_close(got["steps"], steps, rtol=1e-10, atol=1e-12, where="dmc steps")
        assert_close(got["walkers"], one["walkers"], rtol=1e-10, atol=1e-12, where="dmc walkers")


# ---------------------------------------------------------------- the example


def test_helium_example_matches_one_process_with_four_devices(runs):
    if "helium" not in runs:
        pytest.fail(f"{EXAMPLE} does not exist; the multi-process example run cannot be checked.")
    code, output = runs["helium"].wait()
    assert code == 0, output
    ref_code, ref_output = runs["helium_reference"].wait()
    assert ref_code == 0, ref_output
    multi = json.loads((runs["tmp"] / "helium_mp.json").read_text())
    single = json.loads((runs["tmp"] / "helium_1.json").read_text())
    assert (multi["processes"], multi["devices"]) == (2, 4)
    assert (single["processes"], single["devices"]) == (1, 4)
    assert len(multi["energies"]) == len(single["energies"]) == 3  # the optimisation's steps
    assert np.all(np.isfinite(multi["energies"]))
    np.testing.assert_allclose(multi["energies"], single["energies"], rtol=1e-5)
    # Process 0 alone reports.
    lines = output.splitlines()
    assert any(line.startswith("[0] ") and "E =" in line for line in lines), output
    assert not any(line.startswith("[1] ") and "E =" in line for line in lines), output


# ---------------------------------------------------------------- failures end the run


def test_a_crashing_process_ends_the_run_promptly(runs):
    """The crashing worker, with initialize's defaults: it leaves without JAX's shutdown barrier."""
    code, output = runs["crash"].wait()
    assert code == 3, output
    assert "[launch] process 1 exited with code 3; stopping the others." in output
    crashed_at = float(output.split("crashing at ")[1].split()[0])
    # Process 0 would sleep for 600 s: the launcher stopped it (a hang guard, not a benchmark).
    assert runs["crash"].ended - crashed_at < 30, output


def test_a_failing_process_runs_the_exit_handlers_registered_before_initialize(runs):
    """The failing process skips only JAX's shutdown barrier: the program's own exit handlers run, and its own
    ``sys.exit`` is the one called."""
    code, output = runs["crash"].wait()
    assert code == 3, output
    assert "[1] user sys.exit(3)" in output
    assert "[1] exit handler registered before initialize ran" in output


def _launch_quietly(
    command: list[str], processes: int, timeout: float | None = None, grace: float = 0.5
) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = launch.launch(command, processes, timeout=timeout, grace=grace, env=_clean_env(), stdout=out, stderr=err)
    return code, out.getvalue(), err.getvalue()


# A launched process that ignores SIGTERM, as does a child it starts in its group; process 1
# exits with code 5 when asked to (`fail DIR`), once process 0 has said (a file in DIR) that it ignores
# SIGTERM and has printed: on a loaded machine process 0 may still be starting when process 1 fails,
# and the launcher's SIGTERM would then end it before it could report. Only SIGKILL to the whole group
# ends them.
STUBBORN = (
    "import os, pathlib, signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"  # inherits SIG_IGN
    "pid = int(os.environ['SHARDVMC_PROCESS_ID'])\n"
    "print('hello from', pid, 'of', os.environ['SHARDVMC_NUM_PROCESSES'], flush=True)\n"
    "print('group', os.getpgid(0), 'child', child.pid, flush=True)\n"
    "if sys.argv[1:2] == ['fail']:\n"
    "    ready, deadline = pathlib.Path(sys.argv[2]), time.monotonic() + 300\n"
    "    (ready / f'ready{pid}').touch()\n"
    "    while pid == 1 and not (ready / 'ready0').exists() and time.monotonic() < deadline:\n"
    "        time.sleep(0.05)\n"
    "    pid == 1 and sys.exit(5)\n"
    "time.sleep(600)\n"
)


def _groups(output: str) -> list[int]:
    """The process groups the stubborn processes reported (one per process)."""
    return [int(line.split()[2]) for line in output.splitlines() if line.split()[1:2] == ["group"]]


def _kill_groups(pgids: list[int]) -> None:
    """SIGKILL what is left of these process groups (cleanup after a test, whatever happened)."""
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (each launched process leads its own group)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _group_gone(pgid: int, wait: float = 10) -> bool:
    """No live (non-zombie) process is left in group ``pgid`` within ``wait`` seconds (zombies wait for init)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        members = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                members.append(stat.parent.name)
        if not members:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def test_launcher_exit_code_and_prefixes_without_jax(tmp_path):
    code, out, err = _launch_quietly([sys.executable, "-c", STUBBORN, "fail", str(tmp_path)], 2)
    assert code == 5
    lines = sorted(line for line in out.splitlines() if "hello" in line)
    assert lines == ["[0] hello from 0 of 2", "[1] hello from 1 of 2"]
    assert "process 1 exited with code 5; stopping the others" in err
    groups = _groups(out)
    assert len(groups) == 2
    # Process 0 ignored SIGTERM and the child of process 1 outlived it: SIGKILL to the groups ended all.
    assert all(_group_gone(pgid) for pgid in groups), out


@pytest.mark.parametrize(
    ("sig", "when"),
    [(signal.SIGINT, "running"), (signal.SIGTERM, "running"), (signal.SIGINT, "stopping")],
    ids=["SIGINT", "SIGTERM", "SIGINT-during-grace"],
)
def test_an_interrupted_launcher_leaves_no_process_behind(sig, when, tmp_path):
    """Interrupted while the processes run, or during the grace period after a failure (then a long one)."""
    grace, fail = ("0.5", []) if when == "running" else ("120", ["fail", str(tmp_path)])
    command = [sys.executable, "-m", "shardvmc.launch", "-n", "2", "--grace", grace, "--"]
    command += [sys.executable, "-c", STUBBORN, *fail]
    with _Started(command) as run:
        assert run.wait_for(lambda: len(_groups(run.out())) == 2), "the processes did not start"
        if when == "stopping":  # process 1 failed: the launcher is waiting out the grace period
            assert run.wait_for(lambda: "process 1 exited with code 5; stopping the others" in run.err())
        run.proc.send_signal(sig)
        assert run.wait_for(lambda: run.proc.poll() is not None, 60), f"no exit within 60 s of {sig.name}"
        run.close()
        assert run.proc.returncode == 128 + sig, run.err()
        assert f"got {sig.name}; stopped every process" in run.err()
        assert all(_group_gone(pgid) for pgid in _groups(run.out())), run.out()


class _Started:
    """A launcher started in its own session, its output read by threads.

    On leaving (whatever happened: an assertion, a hang) it kills the launcher's session and the
    process groups it reported, and closes the pipes. ``wait_for`` bounds every wait: generous
    bounds against hangs, which hold on a loaded machine.
    """

    def __init__(self, command: list[str]) -> None:
        self.proc = subprocess.Popen(
            command,
            cwd=ROOT,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        self._out: list[str] = []
        self._err: list[str] = []
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self._out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self._err), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream: Any, into: list[str]) -> None:
        for line in iter(stream.readline, ""):
            into.append(line)

    def out(self) -> str:
        return "".join(self._out)

    def err(self) -> str:
        return "".join(self._err)

    def wait_for(self, condition: Any, timeout: float = WAIT_S) -> bool:
        return _wait_for(condition, timeout)

    def close(self) -> None:
        """Kill what is left, reap the launcher, read the last output and close the pipes."""
        if self.proc.poll() is None:  # its children too, also those that did not report their group yet
            _kill_groups([self.proc.pid, *_children(self.proc.pid)])
        _kill_groups([pgid for pgid in _groups(self.out()) if not _group_gone(pgid, wait=0)])
        self.proc.wait(timeout=30)
        for reader in self._readers:
            reader.join(timeout=30)
        for stream in (self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> _Started:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class _SignalOnMessage(io.StringIO):
    """The launcher's stderr, which sends this process SIGINT the moment ``text`` is written.

    The signal then lands right after the launcher's message, before it starts stopping the
    processes: the window a test that signals on reading the message hits on a loaded machine.
    """

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def write(self, s: str) -> int:
        written = super().write(s)
        if self.text in s:
            os.kill(os.getpid(), signal.SIGINT)
        return written


def test_a_signal_right_after_the_failure_message_cuts_the_grace_short(monkeypatch, tmp_path):
    """``launch.main`` in this process: process 1 fails, and SIGINT arrives as the launcher says so.

    Process 0 ignores SIGTERM and the grace is 120 s: only a signal that is not lost in that window
    ends the launcher well before the grace runs out, with 130 and no process left.
    """
    started: list[subprocess.Popen[bytes]] = []

    class Recorded(subprocess.Popen):  # type: ignore[type-arg]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            started.append(self)

    monkeypatch.setattr(launch.subprocess, "Popen", Recorded)
    err = _SignalOnMessage("stopping the others")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    monkeypatch.setattr(sys, "stderr", err)
    began = time.monotonic()
    try:
        code = launch.main(["-n", "2", "--grace", "120", "--", sys.executable, "-c", STUBBORN, "fail", str(tmp_path)])
        took = time.monotonic() - began
        assert len(started) == 2
        assert all(_group_gone(p.pid) for p in started), err.getvalue()
    finally:
        _kill_groups([p.pid for p in started])
    assert code == 130, err.getvalue()
    assert "got SIGINT; stopped every process" in err.getvalue()
    assert took < 60, err.getvalue()  # the grace is 120 s (a hang guard, not a benchmark)


# ---------------------------------------------------------------- each way a process fails ends the run
#
# Two processes of one device each run tests/mp_fail_worker.py with initialize's defaults. The
# launcher's --timeout (FAIL_TIMEOUT_S) bounds each run, far below the 300 s that JAX's shutdown
# barrier would keep a failing process: a run that ends with the failing process's own code ended
# through fail-fast, not through the barrier (which ends every process with 134 when it gives up)
# and not through the timeout (124). All launches start together; signals go to a process once
# every process of its group said it is ready.

FAIL_WORKER = ROOT / "tests" / "mp_fail_worker.py"
FAIL_TIMEOUT_S = 150
JAX_DEFAULT_HEARTBEAT_S = 100  # what jax.distributed.initialize would use without shardvmc's default


class _Bare:
    """The processes of a group started without the launcher (as a scheduler without kill-on-failure would)."""

    def __init__(self, tmp: Path, how: str, peer: str, processes: int = 2) -> None:
        coordinator = f"127.0.0.1:{launch.free_port()}"
        self.logs = [tmp / f"bare_{i}.log" for i in range(processes)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for i, log in enumerate(self.logs):
            with open(log, "wb") as out:
                self.procs.append(
                    subprocess.Popen(
                        [sys.executable, str(FAIL_WORKER), how, peer],
                        cwd=ROOT,
                        env=launch.process_env(_clean_env(), coordinator, processes, i, devices_per_process=1),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )

    def out(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace")

    def close(self) -> None:
        _kill_groups([p.pid for p in self.procs])
        for p in self.procs:
            p.wait(timeout=30)


def _ready_pid(output: str, process: int) -> int | None:
    """The pid that process ``process`` reported as ready (launcher-prefixed or bare output)."""
    for line in output.splitlines():
        words = line.removeprefix(f"[{process}] ").split()
        if words[:1] == ["ready"] and (line.startswith(f"[{process}] ") or not line.startswith("[")):
            return int(words[1])
    return None


def _wait_for(condition: Any, timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def failing_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every failing launch of this module, started together; the signalled ones get their signal when ready."""
    tmp = tmp_path_factory.mktemp("failing")
    py, worker = sys.executable, str(FAIL_WORKER)

    def launched(how: str, peer: str, *file: str) -> list[str]:
        return _launcher(py, worker, how, peer, *file, devices=1, timeout=FAIL_TIMEOUT_S)

    runs: dict[str, Any] = {"tmp": tmp}
    try:
        for how, peer in [("exit", "sleep"), ("raise", "compute"), ("coordinator", "sleep"), ("ok", "sleep")]:
            file = [str(tmp / f"{how}.log")] if how in ("exit", "raise") else []
            runs[how] = Run(launched(how, peer, *file), _clean_env())
        runs["SIGKILL"] = _Started(launched("wait", "compute"))
        runs["SIGTERM"] = _Started(launched("wait", "sleep"))
        runs["bare"] = _Bare(tmp, "wait", "compute")
        signalled: dict[str, float] = {}
        for name, sig in [("SIGKILL", signal.SIGKILL), ("SIGTERM", signal.SIGTERM), ("bare", signal.SIGKILL)]:
            run = runs[name]
            outputs = (lambda r=run: [r.out(0), r.out(1)]) if name == "bare" else (lambda r=run: [r.out()] * 2)
            ready = _wait_for(lambda o=outputs: all(_ready_pid(out, p) for p, out in enumerate(o())))
            assert ready, f"{name}: the processes did not start: {outputs()}"
            pid = _ready_pid(outputs()[1], 1)
            assert pid is not None and pid > 1  # (never 0 or -1: os.kill would signal whole groups)
            os.kill(pid, sig)
            signalled[name] = time.time()
        runs["signalled"] = signalled
        yield runs
    finally:
        for run in runs.values():
            if isinstance(run, Run):
                run.stop()
            elif isinstance(run, (_Started, _Bare)):
                run.close()


def _failed_at(output: str) -> float:
    return float(output.split("failing at ")[1].split()[0])


@pytest.mark.parametrize(
    ("how", "code", "ending"),
    [("exit", 3, "exited with code 3"), ("raise", 1, "exited with code 1")],
    ids=["sys.exit(3)-peer-sleeping", "uncaught-exception-peer-computing"],
)
def test_a_failing_exit_ends_the_run_with_its_own_code(failing_runs, how, code, ending):
    got, output = failing_runs[how].wait()
    assert got == code, output  # not 134 (the barrier giving up) nor 124 (the launcher's timeout)
    assert f"[launch] process 1 {ending}; stopping the others." in output
    assert "[1] failing at " in output and "[0] failing at " not in output
    if how == "raise":
        assert "[1] RuntimeError: process 1 fails" in output
    # what the program wrote to a file it left open reached the file, as at a normal exit
    assert (failing_runs["tmp"] / f"{how}.log").read_text() == "written before the failure\n"
    assert failing_runs[how].ended - _failed_at(output) < FAIL_TIMEOUT_S  # (the timeout is a hang guard)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_signalled_process_ends_the_run_with_128_plus_the_signal(failing_runs, sig):
    """SIGTERM too: the program never called reached_preemption, so JAX's notifier does not hold SIGTERM."""
    run = failing_runs[sig.name]
    assert run.wait_for(lambda: run.proc.poll() is not None), run.out() + run.err()
    assert run.proc.returncode == 128 + sig, run.out() + run.err()
    assert f"[launch] process 1 was killed by {sig.name} (code {128 + sig}); stopping the others." in run.err()


def test_the_coordinators_failure_is_the_cause_and_the_peers_abort_is_summarised(failing_runs):
    """Process 0 hosts JAX's coordination service: when it fails, JAX aborts process 1 at once (134, with a
    C++ stack trace). The launcher names process 0 and its code, and leaves out process 1's runtime noise."""
    code, output = failing_runs["coordinator"].wait()
    assert code == 3, output
    assert "[launch] process 0 exited with code 3" in output
    assert "process 1 exited" not in output and "process 1 aborted" not in output
    noise = ("Terminating process because", "Check failure stack trace", "coordination_service")
    assert not [line for line in output.splitlines() if line.startswith("[1] ") and any(n in line for n in noise)]


def test_a_successful_run_is_untouched(failing_runs):
    """Both succeed, process 1 three seconds before process 0: it waits for process 0 in JAX's barrier, as
    JAX's own exit does, and the launcher says nothing."""
    code, output = failing_runs["ok"].wait()
    assert code == 0, output
    assert "[launch]" not in output
    finished = {p: float(output.split(f"[{p}] finished at ")[1].split()[0]) for p in (0, 1)}
    left = {p: float(output.split(f"[{p}] left the barrier at ")[1].split()[0]) for p in (0, 1)}
    assert finished[1] < finished[0] <= left[1], output  # process 1 left only once process 0 had finished


def test_without_a_launcher_the_peers_of_a_killed_process_end_by_the_heartbeat(failing_runs):
    """No launcher stops process 0 (computing, holding the interpreter): JAX's coordination service, in process 0,
    declares process 1 dead once its heartbeats stop and ends process 0, before JAX's own default (100 s) could."""
    bare, killed_at = failing_runs["bare"], failing_runs["signalled"]["bare"]
    assert _wait_for(lambda: bare.procs[0].poll() is not None, JAX_DEFAULT_HEARTBEAT_S - 10), bare.out(0)
    ended = time.time()
    assert bare.procs[1].wait(timeout=30) == -signal.SIGKILL
    assert bare.procs[0].returncode == -signal.SIGABRT, bare.out(0)
    assert "stopped sending heartbeats" in bare.out(0) and "Terminating process because" in bare.out(0)
    assert ended - killed_at < JAX_DEFAULT_HEARTBEAT_S


# A program that joins a group of its own (one process) and sends itself SIGTERM: MODE is `default`
# (initialize's defaults), `own` (its own Python handler, installed before initialize), `notice`
# (reached_preemption called first) or `jax` (initialize(fail_fast=False): JAX's notifier from the start).
SIGTERM_PROGRAM = """
import os, signal, sys, time
import shardvmc as sv
from shardvmc.launch import free_port
mode = sys.argv[1]
if mode == "own":
    signal.signal(signal.SIGTERM, lambda *_: print("own handler", flush=True))
sv.distributed.initialize(f"127.0.0.1:{free_port()}", 1, 0, fail_fast=mode != "jax")
step = 0
if mode == "notice":
    print("notice before the signal:", sv.distributed.reached_preemption(step), flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(3)  # JAX's notifier looks for the signal every second
if mode == "notice":
    while not sv.distributed.reached_preemption(step := step + 1) and step < 100:
        time.sleep(0.1)
    print("notice at step", step, flush=True)
print("carried on", flush=True)
"""


@pytest.mark.parametrize("mode", ["default", "own", "notice", "jax"])
def test_sigterm_ends_the_process_unless_the_program_takes_it(mode):
    env = {**_clean_env(), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", SIGTERM_PROGRAM, mode], capture_output=True, text=True, env=env, timeout=WAIT_S, cwd=ROOT
    )
    if mode == "default":
        assert proc.returncode == -signal.SIGTERM, proc.stdout + proc.stderr
        assert "carried on" not in proc.stdout
        return
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "carried on" in proc.stdout
    if mode == "own":  # initialize did not let JAX's notifier displace the program's handler
        assert "own handler" in proc.stdout
    if mode == "notice":  # JAX's preemption sync point saw the notice
        assert "notice before the signal: False" in proc.stdout
        assert "notice at step 100" not in proc.stdout, proc.stdout


GLOO_LINE = "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected peer ranks is : 3"
GLOO_SHORT = "[Gloo] Rank 1 is connected to 2 peer ranks. Expected number of connected peer ranks is : 3"
GLOO_MISSING = "[Gloo] Rank 1 is NOT connected to: [2]"
# Lines like them that are not gloo's: kept.
NEAR_MISSES = ["Rank 0 is connected to 3 peer ranks.", "[Gloo] Rank 0 failed: Connection refused", "3", "", "hi"]


@pytest.mark.parametrize("verbose", [False, True])
def test_launcher_drops_the_connection_messages_unless_verbose(verbose, capfd):
    """The lines jaxlib 0.10.2's gloo prints, also the short count that a busy machine gives (its connections
    complete a moment later, asynchronously), are left out; lines that only look like them are kept."""
    lines = [GLOO_LINE, GLOO_SHORT, GLOO_MISSING, *NEAR_MISSES]
    script = f"print(*{lines!r}, sep='\\n')"
    code = launch.main([*(["--verbose"] if verbose else []), "-n", "1", "--", sys.executable, "-c", script])
    assert code == 0
    got = capfd.readouterr().out.splitlines()
    assert got == [f"[0] {line}" for line in (lines if verbose else NEAR_MISSES)]


# The pieces in which jaxlib 0.10.2's gloo writes its message with std::cout (separate strings in
# libjax_common.so), the numbers between them, and the newline of std::endl. Two devices of one
# process write theirs from two threads at once, so the output can be any merge of the two sequences.
def _gloo_pieces(rank: int, connected: int, expected: int) -> list[str]:
    pieces = ["[Gloo] Rank ", str(rank), " is connected to ", str(connected), " peer ranks. "]
    pieces += ["Expected number of connected peer ranks is : ", str(expected), "\n"]
    if connected < expected:
        pieces += ["[Gloo] Rank ", str(rank), " is NOT connected to: [", "2", "]", "\n"]
    return pieces


def _merge(a: list[str], b: list[str], from_a: tuple[int, ...]) -> str:
    """The output of two writers: the pieces at positions ``from_a`` come from ``a``, the others from ``b``."""
    ia, ib, text = iter(a), iter(b), []
    for k in range(len(a) + len(b)):
        text.append(next(ia) if k in from_a else next(ib))
    return "".join(text)


def _forwarded(text: str) -> list[str]:
    """What the launcher writes for ``text`` read from process 0 (one process's output)."""
    out = io.StringIO()
    output = launch._Output(1, out, threading.Lock(), verbose=False)
    for line in text.splitlines():
        output.line(0, line)
    return out.getvalue().splitlines()


def test_connection_messages_of_two_threads_merged_in_any_order_are_left_out():
    """The flake of the gloo test, reproduced deterministically: a line that held pieces of two messages got
    through. Every merge of two devices' messages is left out, the program's line after them kept (as is a
    number it prints, which is what the rest of a merged message can look like, when no merge came before),
    also when the merge came in the middle of the program's own line."""
    a, b = _gloo_pieces(0, 3, 3), _gloo_pieces(1, 3, 3)
    merges = [_merge(a, b, set(pos)) for pos in itertools.combinations(range(len(a) + len(b)), len(a))]
    assert len(merges) == 12870 and any(len(m.splitlines()) == 2 and m.count("[Gloo]") == 2 for m in merges)
    # a short count with its "NOT connected" line from one thread, merged with the other's message: a sample
    rng = random.Random(34)
    short = _gloo_pieces(1, 2, 3)
    merges += [_merge(short, a, set(rng.sample(range(len(short) + len(a)), len(short)))) for _ in range(3000)]
    for text in merges:
        assert _forwarded(text + "hi\n3\n") == ["[0] hi", "[0] 3"], repr(text)
        # The program's print wrote "hello", then its newline after gloo's first flush (one line of the merge)
        first, _, rest = text.partition("\n")
        assert _forwarded(f"hello{first}\n\n{rest}bye\n") == ["[0] hello", "[0] bye"], repr(text)
    assert _forwarded("3\n") == ["[0] 3"]
    assert _forwarded("\n\n") == ["[0] ", "[0] "]  # the program's empty lines are its own


# What JAX's runtime wrote in process 0 when process 1 was gone (jaxlib 0.10.2, shortened): the coordination
# service's error, its continuation lines, the fatal line that ends the process, and its stack trace.
RUNTIME_ABORT = [
    "E1203 08:36:53.410120   19400 coordination_service.cc:1549] [8399] Use error polling to propagate the "
    "following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):",
    "1",
    "The tasks have crashed. Check the task logs for an earlier error, or scheduler events to debug further.",
    "F1203 08:36:53.410932   19411 client.h:80] Terminating process because the JAX distributed service detected "
    "fatal errors. This most likely indicates that another task died; see the other task logs for more details.",
    "RPC: /xla.coordination.CoordinationService/PollForError [type.googleapis.com/tensorflow.CoordinationService]",
    "*** Check failure stack trace: ***",
    "    @     0x7f7e75640634  absl::lts_20260107::log_internal::LogMessage::SendToLog()",
    "    @     0x7f7e7cca71f5  (unknown)",
]
SIGTERM_CAUGHT = "W1203 09:00:35.536204   28058 preemption_notifier.cc:90] SIGTERM caught at 2026-12-03T09:00:35"


def _output(processes: int = 2) -> tuple[launch._Output, io.StringIO]:
    out = io.StringIO()
    return launch._Output(processes, out, threading.Lock(), verbose=False), out


def test_the_runtime_abort_of_the_other_processes_is_left_out_after_a_failure():
    """Process 1 failed first; process 0 wrote a line of its own, then JAX aborted it: its runtime lines are left
    out, counted, and it is known as a consequence. Lines that came before the failure was known are held, so
    they are left out too (they arrive with the cause's end, and the launcher names the cause after)."""
    output, out = _output()
    output.line(0, "step 5")
    output.line(0, RUNTIME_ABORT[0])  # before the launcher knows of the failure: held
    output.failed.add(1)
    for line in [*RUNTIME_ABORT[1:], "a line of the program"]:
        output.line(0, line)
    output.line(1, "RuntimeError: process 1 fails")
    output.settle({1: 1})  # the cause is not named yet: nothing of process 0 is written
    assert out.getvalue() == "[0] step 5\n[1] RuntimeError: process 1 fails\n"
    output.cause = 1
    output.settle({1: 1, 0: -6})
    assert out.getvalue() == "[0] step 5\n[1] RuntimeError: process 1 fails\n"  # what follows the runtime's too
    assert output.terminated == [True, False] and output.left_out == [len(RUNTIME_ABORT) + 1, 0]


def test_after_a_failure_a_stopped_process_keeps_its_own_lines_and_loses_the_runtimes():
    """Process 0 took preemption notices: the launcher's SIGTERM makes JAX's notifier log, and it carries on."""
    output, out = _output()
    output.failed.add(1)
    output.cause = 1
    for line in [SIGTERM_CAUGHT, "saving step 7", "I1203 09:00:35.6 28058 file.cc:1] info"]:
        output.line(0, line)
    output.settle({1: 3})
    assert out.getvalue() == ""  # held until process 0 ends
    output.settle({1: 3, 0: 75})
    assert out.getvalue() == "[0] saving step 7\n" and output.left_out == [2, 0] and output.terminated == [False] * 2


def test_runtime_errors_of_the_failing_or_a_healthy_process_are_shown():
    """The cause's own runtime lines explain its failure; a running process's are written once they wait no more."""
    output, out = _output()
    output.line(1, RUNTIME_ABORT[3])  # a fatal line of process 1 itself, which then ends first
    output.line(1, RUNTIME_ABORT[5])
    output.failed.add(1)
    output.cause = 1
    output.settle({1: -6})
    assert out.getvalue().splitlines() == [f"[1] {RUNTIME_ABORT[3]}", f"[1] {RUNTIME_ABORT[5]}"]
    healthy, out = _output()
    healthy.line(0, SIGTERM_CAUGHT)
    healthy.line(0, "still running")
    healthy.settle({})
    assert out.getvalue() == ""  # held for a moment: a failure elsewhere would make it a consequence
    healthy.settle({}, final=True)
    assert out.getvalue().splitlines() == [f"[0] {SIGTERM_CAUGHT}", "[0] still running"]


def test_the_first_failure_is_the_earliest_end_that_the_runtime_did_not_cause():
    ended_at = {0: 10.0, 1: 10.2, 2: 10.1}
    assert launch._first_failure({0, 1, 2}, ended_at, [False, False, False]) == 0
    assert launch._first_failure({0, 1, 2}, ended_at, [True, False, False]) == 2  # 0 was aborted by JAX
    assert launch._first_failure({0, 1}, ended_at, [True, True, False]) == 0  # all aborted: the earliest
    assert launch._first_failure({1, 2}, {1: 5.0}, [False] * 3) == 1  # no time seen: after those seen


def test_launcher_timeout():
    code, _, err = _launch_quietly([sys.executable, "-c", "import time; time.sleep(600)"], 2, timeout=0.5)
    assert code == launch.TIMEOUT_EXIT_CODE
    assert "timeout after 0.5 s" in err


def test_launcher_environment_is_loopback_only():
    env = launch.process_env({"XLA_FLAGS": "--foo --xla_force_host_platform_device_count=8"}, "127.0.0.1:5555", 3, 2, 2)
    assert env["SHARDVMC_COORDINATOR_ADDRESS"] == "127.0.0.1:5555"
    assert env["JAX_COORDINATOR_BIND_ADDRESS"] == "127.0.0.1:5555"  # not JAX's default of every interface
    assert (env["SHARDVMC_NUM_PROCESSES"], env["SHARDVMC_PROCESS_ID"]) == ("3", "2")
    assert env["XLA_FLAGS"] == "--foo --xla_force_host_platform_device_count=2 " + CPU_SCHEDULER_FLAG
    assert env["JAX_PLATFORMS"] == "cpu"
    assert "JAX_PLATFORMS" not in launch.process_env({}, "127.0.0.1:5555", 2, 0)


@pytest.mark.parametrize(
    "argv",
    [
        ["--processes", "2"],
        ["--processes", "0", "--", "true"],
        ["--processes", "2", "--devices-per-process", "0"],
        ["--processes", "2", "--grace", "-1", "--", "true"],
    ],
)
def test_launcher_rejects_bad_command_lines(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        launch.main(argv)
    assert exc.value.code == 2


# ---------------------------------------------------------------- initialize in this (single) process


def test_is_launched_reads_the_launcher_variables(monkeypatch):
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    assert not sv.distributed.is_launched()
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    assert not sv.distributed.is_launched()
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "1")
    assert sv.distributed.is_launched()


def test_initialize_after_devices_were_touched_explains(monkeypatch):
    jax.devices()  # this test process's backend is running
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(sv.CallError, match="before anything touches a device"):
        sv.distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0)
    assert not jax.distributed.is_initialized()


@pytest.fixture
def initialize_without_a_group(monkeypatch):
    """``sv.distributed.initialize`` in this process, with JAX's own initialize recorded instead of run.

    Yields the calls: ``(kwargs, CPU collectives in place at the call)``. The platform is left unset
    (no ``JAX_PLATFORMS``), as on a machine where JAX would detect it.
    """
    calls: list[tuple[dict[str, Any], Any]] = []
    for name in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: calls.append((kw, _collectives())))
    monkeypatch.setattr(_internals, "backends_initialized", lambda: False)  # this process's backend runs
    monkeypatch.setattr(distributed, "_SETTINGS", None)
    monkeypatch.setattr(sys, "exit", sys.exit)  # put back whatever initialize may install
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    before = jax.config.jax_platforms, _collectives()
    jax.config.update("jax_platforms", None)
    try:
        yield calls
    finally:
        jax.config.update("jax_platforms", before[0])
        jax.config.update("jax_cpu_collectives_implementation", before[1])


def _collectives() -> Any:
    return jax.config.jax_cpu_collectives_implementation


def test_gloo_is_chosen_with_an_accelerator_plugin_installed_and_no_gpu(initialize_without_a_group, monkeypatch):
    """A CUDA plugin is installed but JAX will run on CPU: the CPU collectives must still be gloo, or every
    cross-process computation on CPU arrays fails. They serve CPU arrays only, so no platform guess is needed."""
    import importlib.machinery
    import importlib.util

    find_spec = importlib.util.find_spec

    def with_plugin(name: str, *args: Any) -> Any:
        return importlib.machinery.ModuleSpec(name, None) if name == "jax_cuda12_plugin" else find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", with_plugin)
    jax.config.update("jax_cpu_collectives_implementation", None)
    exit_before = sys.exit
    sv.distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0, fail_fast=False)
    [(kwargs, collectives)] = initialize_without_a_group
    assert collectives == "gloo"
    assert "fail_fast" not in kwargs and kwargs["num_processes"] == 2
    assert sys.exit is exit_before  # fail_fast=False installs nothing


@pytest.fixture
def exit_watch(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A fresh failing-exit watch for ``initialize``, and ``sys.last_value`` as it was, both put back after."""
    watch = distributed._ExitWatch()
    monkeypatch.setattr(distributed, "_EXIT_WATCH", watch)
    monkeypatch.setattr(sys, "last_value", getattr(sys, "last_value", None), raising=False)
    yield watch
    watch.stop()


def test_initialize_passes_its_timeouts_to_jax_and_watches_for_failing_exits(initialize_without_a_group, exit_watch):
    exit_before = sys.exit
    sv.distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0)
    [(kwargs, _)] = initialize_without_a_group
    assert kwargs["heartbeat_timeout_seconds"] == 10 and kwargs["shutdown_timeout_seconds"] == 300
    assert exit_watch.active and sys.exit is not exit_before and sys.exit.__wrapped__ is exit_before


def test_initialize_timeouts_can_be_changed_and_are_checked(initialize_without_a_group, exit_watch):
    sv.distributed.initialize("127.0.0.1:1", 2, 0, heartbeat_timeout_seconds=60, shutdown_timeout_seconds=30)
    [(kwargs, _)] = initialize_without_a_group
    assert (kwargs["heartbeat_timeout_seconds"], kwargs["shutdown_timeout_seconds"]) == (60, 30)
    for bad in (0, 2.5, True, "20"):
        with pytest.raises(sv.CallError, match="heartbeat_timeout_seconds must be a whole number of seconds"):
            sv.distributed.initialize("127.0.0.1:1", 2, 0, heartbeat_timeout_seconds=bad)


def test_the_watch_knows_the_code_python_exits_with(exit_watch):
    """``sys.exit(code)`` in the main thread (the last call counts) or an uncaught exception (1; SIGINT for a
    KeyboardInterrupt, as Python ends then); ``None`` for a successful exit."""
    exit_watch.start()
    assert exit_watch.failing_code() is None
    for status, code in [(3, 3), ("a message", 1), (256 + 7, 7), (0, None), (False, None), (None, None)]:
        with pytest.raises(SystemExit):
            sys.exit(status)
        assert exit_watch.failing_code() == code, status

    def exit_in_a_thread() -> None:
        try:
            sys.exit(5)  # ends that thread only, not the process
        except SystemExit:
            pass

    thread = threading.Thread(target=exit_in_a_thread)
    thread.start()
    thread.join()
    assert exit_watch.failing_code() is None
    sys.last_value = RuntimeError("uncaught")  # what Python sets before it shows an uncaught exception
    assert exit_watch.failing_code() == 1
    sys.last_value = KeyboardInterrupt()
    assert exit_watch.failing_code() == -signal.SIGINT
    exit_watch.stop()
    assert not exit_watch.active and sys.exit is exit_watch.found_exit


@pytest.mark.parametrize("chosen", ["mpi", "megascale"])
def test_a_chosen_cpu_collectives_implementation_is_kept(initialize_without_a_group, chosen):
    jax.config.update("jax_cpu_collectives_implementation", chosen)
    sv.distributed.initialize("127.0.0.1:1", num_processes=2, process_id=0, fail_fast=False)
    [(_, collectives)] = initialize_without_a_group
    assert collectives == chosen
