"""The chaos test: a run interrupted at random points, restarted on random layouts, ends as if never stopped.

The run (``tests/chaos_worker.py``: walkers as a ``sv.WalkerSet``, an asynchronous checkpoint every ``EVERY`` steps)
is of each method in turn (``METHODS``, the fixture's parameter): a VMC training run (minSR in a loop of its own) and
a fixed-node DMC run (``sv.dmc.DMC`` through ``sv.driver.run``). It starts on 2 processes x 2 fake CPU devices
through ``python -m shardvmc.launch`` and is interrupted once in each of three ways, in an order and at steps drawn
from a seed (the same plan for both methods):

- ``kill``: one process (drawn) sends itself SIGKILL, right after the step's save (if any) has started;
- ``term``: every process sends itself SIGTERM once its last save is committed, a preemption notice
  (``sv.distributed.reached_preemption``): the run saves the step the processes agree on and exits with
  ``sv.distributed.PREEMPTED_EXIT_CODE``;
- ``raise``: one process (drawn) raises an exception.

After the second interruption the test flips a byte in each array data file of the newest committed step. Every
restart resumes from the newest intact step (the damaged one skipped with a ``DamagedCheckpointWarning`` naming it).
Two sequences share the first run and the faults: one restarts on 2 x 2 after the first and the second interruption
and ends bit for bit as an uninterrupted 2 x 2 run (VMC: parameters, optimiser state, walkers, every step's energy;
DMC: the whole ``DMCState``, walkers and weights among it, and every step's statistics in the driver's history); the
other restarts after each of the three on a layout drawn among 1 x 1, 1 x 3, 2 x 2 and 1 x 8 (processes x devices)
and ends within the float64 round-off of a change of device count that ``docs/concepts.md`` states (``ROUND_OFF``),
and bit for bit up to the first step computed on another layout. The walker count, 13, is one that 3, 4 and 8
devices do not divide.

The faults happen at chosen steps (the worker is told where), never after a delay. A method's launches share one
XLA compilation cache, for single-process launches only (see ``_cached``). The seed is ``SHARDVMC_CHAOS_SEED``
(default 4) and the plan is printed, so a failing plan can be run again
(``SHARDVMC_CHAOS_SEED=5 python -m pytest tests/test_chaos.py -n 0 -s``, ``-k dmc`` for one method) and soak runs
can draw others. Every process a launch started is found by a marker in its environment and killed at the end,
whatever happened.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import shardvmc as sv

pytestmark = pytest.mark.end_to_end  # CI's second leg leaves it out (pyproject.toml's markers)
ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "chaos_worker.py"
# Seed 4 puts each kind of fault in a run of two processes (kill by SIGKILL of process 1; SIGTERM of both; an exception
# in process 0, the coordinator) and the restarts of the elastic sequence on 1 x 8, 2 x 2 and 1 x 1.
SEED = int(os.environ.get("SHARDVMC_CHAOS_SEED", "4"))
STEPS, EVERY = 18, 3
METHODS = ("vmc", "dmc")  # the worker's --method: each gets the whole test
ORIGINAL = (2, 2)  # processes x devices per process
LAYOUTS = ((1, 1), (1, 3), (2, 2), (1, 8))
# The steps the first, second and third interruption are drawn from. The second comes at step 9 or later, so the
# step it leaves newest (which is then damaged) has an older committed one to fall back to.
WINDOWS = ((2, 5), (9, 12), (13, 15))
ROUND_OFF = 1e-12  # docs/concepts.md: float64 runs on different device counts agree to 1e-12 of each leaf's scale
LAUNCH_TIMEOUT_S = 420  # the launcher's own --timeout, a bound against hangs only
EXIT = {"kill": 128 + signal.SIGKILL, "raise": 1, "term": sv.distributed.PREEMPTED_EXIT_CODE, None: 0}


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # "kill", "term" or "raise"
    at: int  # the step after which it happens
    process: int  # the process that fails (kill, raise), modulo the layout's process count

    def args(self, processes: int) -> list[str]:
        return ["--fault", self.kind, "--at", str(self.at), "--process", str(self.process % processes)]

    def __str__(self) -> str:
        who = "every process" if self.kind == "term" else f"process {self.process} (mod P)"
        return f"{self.kind} by {who} at step {self.at}"


@dataclasses.dataclass(frozen=True)
class Plan:
    """The faults (one of each kind) and the layouts of the elastic sequence's restarts, drawn from ``seed``."""

    seed: int
    faults: tuple[Fault, Fault, Fault]
    layouts: tuple[tuple[int, int], ...]  # one per restart of the elastic sequence

    @staticmethod
    def draw(seed: int) -> Plan:
        rng = random.Random(seed)
        kinds = rng.sample(["kill", "term", "raise"], 3)
        a, b, c = (Fault(kind, rng.randint(*window), rng.randrange(2)) for kind, window in zip(kinds, WINDOWS))
        return Plan(seed, (a, b, c), tuple(rng.choice(LAYOUTS) for _ in range(3)))

    def sequences(self) -> dict[str, list[tuple[tuple[int, int], Fault | None]]]:
        """Each sequence's launches after the shared first one: layout and fault (``None``: to the end)."""
        return {
            "same": [(ORIGINAL, self.faults[1]), (ORIGINAL, None)],
            "elastic": list(zip(self.layouts, [*self.faults[1:], None])),
        }

    def __str__(self) -> str:
        def launches(items: list[tuple[tuple[int, int], Fault | None]]) -> str:
            return "; ".join(f"{_name(layout)} {fault or 'to the end'}" for layout, fault in items)

        return "\n".join(
            [
                f"chaos plan of seed {self.seed} (SHARDVMC_CHAOS_SEED): {STEPS} steps, a save every {EVERY}; after "
                "the second interruption a byte is flipped in each array data file of the newest committed step",
                f"  first run (shared): {launches([(ORIGINAL, self.faults[0])])}",
                *(f"  then {name:8} {launches(items)}" for name, items in self.sequences().items()),
            ]
        )


def _name(layout: tuple[int, int]) -> str:
    return f"{layout[0]}x{layout[1]}"


# ---------------------------------------------------------------- running the launches


def _env(marker: str, cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDVMC_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    env["SHARDVMC_CHAOS_MARKER"] = marker  # (not a launcher variable) finds every process to clean up
    env["SHARDVMC_CHAOS_CACHE"] = str(cache)  # (read back by _launch)
    return env


def _cached(env: dict[str, str], processes: int) -> dict[str, str]:
    """``env`` with JAX's persistent compilation cache for a single process, without it for several.

    JAX writes the cache from process 0 only, and process 1's keys differ from process 0's, so process 1 of a
    launch compiles anyway; with the cache, process 0 would reach the first collective that much earlier, and
    under load more than the 30 s gloo waits for a peer when it sets up a communicator (DEADLINE_EXCEEDED).
    """
    if processes > 1:
        return env
    return env | {
        "JAX_COMPILATION_CACHE_DIR": env["SHARDVMC_CHAOS_CACHE"],
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    }


def _marked(marker: str) -> list[int]:
    """The processes whose environment holds ``marker``: the launchers and workers of this test."""
    pids = []
    needle = f"SHARDVMC_CHAOS_MARKER={marker}".encode()
    if not Path("/proc").is_dir():  # (not Linux: the launchers' own stopping is all there is)
        return pids
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:  # gone, or not ours
                pass
    return pids


@dataclasses.dataclass
class Launch:
    """One launch of the worker: its method, layout, what it was told, and how it ended."""

    method: str  # "vmc" or "dmc"
    name: str
    layout: tuple[int, int]
    fault: Fault | None
    expected_restore: int | None = None  # the newest intact committed step before it started
    damaged: int | None = None  # a step the test damaged just before it started
    committed: list[int] = dataclasses.field(default_factory=list)  # the committed steps once it ended
    seconds: float = 0.0  # wall-clock time of the launch
    cpu_seconds: float = 0.0  # CPU time of the launcher and its processes
    code: int | None = None
    output: str = ""
    records: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        what = str(self.fault) if self.fault else "runs to the end"
        return (
            f"{self.method} {self.name} on {_name(self.layout)} ({what}): exit {self.code}, resumed from "
            f"{self.expected_restore} (damaged: {self.damaged}), committed then {self.committed}, "
            f"records {self.records}"
        )


# The launcher gets SIGTERM, and stops its processes, if this process dies without cleaning up (SIGKILL): util-linux's
# setpriv sets the parent-death signal where it is installed.
ON_PARENT_DEATH = ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []


def _launch(directory: Path, launch: Launch, env: dict[str, str]) -> None:
    processes, devices = launch.layout
    command = [*ON_PARENT_DEATH, sys.executable, "-m", "shardvmc.launch", "--processes", str(processes)]
    command += ["--devices-per-process", str(devices), "--timeout", str(LAUNCH_TIMEOUT_S), "--"]
    command += [sys.executable, str(WORKER), str(directory), "--method", launch.method]
    command += ["--steps", str(STEPS), "--every", str(EVERY)]
    command += ["--name", launch.name, *(launch.fault.args(processes) if launch.fault else [])]
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=_cached(env, processes), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.append(proc.stdout.read() if proc.stdout else ""), daemon=True)
    reader.start()
    timer = threading.Timer(LAUNCH_TIMEOUT_S + 60, proc.kill)  # the launcher's own timeout failed: end it
    timer.start()
    try:
        # wait4 rather than proc.wait: the CPU time of the launcher and of the workers it waited for
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        timer.cancel()
    proc.returncode = launch.code = os.waitstatus_to_exitcode(status)
    launch.seconds, launch.cpu_seconds = time.monotonic() - started, usage.ru_utime + usage.ru_stime
    reader.join(60)
    if proc.stdout is not None:
        proc.stdout.close()
    launch.output = "".join(output)
    launch.records = [
        json.loads(path.read_text())
        for p in range(processes)
        if (path := directory / "records" / f"{launch.name}_{p}.json").exists()
    ]


def committed(directory: Path) -> list[int]:
    """The committed steps of the run's checkpoints (orbax renames a step's directory into place on commit)."""
    state = directory / "state"
    return sorted(int(p.name) for p in state.iterdir() if p.name.isdigit()) if state.is_dir() else []


@dataclasses.dataclass
class Damage:
    step: int
    file: Path
    offset: int
    value: int

    def present(self) -> bool:
        """Whether the step still holds the flipped byte (a run may have replaced or removed it)."""
        try:
            data = self.file.read_bytes()
        except OSError:
            return False
        return len(data) > self.offset and data[self.offset] == self.value


def flip_bytes(directory: Path, rng: random.Random) -> list[Damage]:
    """Flip one byte in each array data file of the newest committed step (the ``d/`` files of its OCDBT store).

    One in each, not one in all: a multi-process save leaves the data in the merged store (``arrays/d``) and
    its per-process files (``arrays/ocdbt.process_*/d``) unread, so a flip there alone changes nothing read.
    """
    step = committed(directory)[-1]
    arrays = directory / "state" / str(step) / "arrays"
    files = sorted((p for p in arrays.glob("**/d/*") if p.is_file()), key=lambda p: (str(p.parent), p.stat().st_size))
    assert files, f"step {step} has no array data files: {sorted(arrays.rglob('*'))}"
    damage = []
    for file in files:  # (sorted by folder and size: the names are random)
        data = bytearray(file.read_bytes())
        offset = rng.randrange(len(data))
        data[offset] ^= rng.randrange(1, 256)
        file.write_bytes(bytes(data))
        damage.append(Damage(step, file, offset, data[offset]))
    return damage


def _run_sequence(directory: Path, launches: list[Launch], env: dict[str, str], seed: int) -> None:
    """Run the launches one after another in ``directory``, damaging a step where planned; stop at a surprise."""
    rng = random.Random(f"{seed}-flip")
    damage: list[Damage] = []
    for i, launch in enumerate(launches):
        damaged = {d.step for d in damage if d.present()}  # (unless a run replaced the step)
        intact = [s for s in committed(directory) if s not in damaged]
        launch.expected_restore = intact[-1] if intact else None
        _launch(directory, launch, env)
        launch.committed = committed(directory)
        if launch.code != EXIT[launch.fault.kind if launch.fault else None]:
            return  # the tests report it; the next launch would not tell more
        if i == 0 and i + 1 < len(launches):  # after the second interruption (the first launch of a sequence)
            damage = flip_bytes(directory, rng)
            launches[i + 1].damaged = damage[0].step


def _result(directory: Path) -> dict[str, np.ndarray] | None:
    path = directory / "result.npz"
    if not path.exists():
        return None
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


@pytest.fixture(scope="module", params=METHODS)
def chaos(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Of one method: the uninterrupted run and both interrupted sequences (which share their first run)."""
    method: str = request.param
    plan = Plan.draw(SEED)
    print(f"{method}: {plan}", flush=True)
    tmp = tmp_path_factory.mktemp(f"chaos_{method}")
    marker = uuid.uuid4().hex
    env = _env(marker, tmp / "xla_cache")
    first = Launch(method, "run0", ORIGINAL, plan.faults[0])
    sequences = {
        name: [Launch(method, f"{name}{i + 1}", layout, fault) for i, (layout, fault) in enumerate(items)]
        for name, items in plan.sequences().items()
    }
    reference = Launch(method, "reference", ORIGINAL, None)
    started = time.monotonic()
    try:
        # The uninterrupted run goes alongside; the sequences go on from a copy of their shared first run.
        threads = [threading.Thread(target=_launch, args=(tmp / "reference", reference, env))]
        threads[0].start()
        _run_sequence(tmp / "first", [first], env, SEED)
        if first.code == EXIT[plan.faults[0].kind]:
            for name, launches in sequences.items():
                shutil.copytree(tmp / "first", tmp / name)
                threads.append(threading.Thread(target=_run_sequence, args=(tmp / name, launches, env, SEED)))
                threads[-1].start()
        for thread in threads:
            thread.join()
    finally:
        for pid in _marked(marker):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    took = time.monotonic() - started
    print(f"chaos {method}: every launch done in {took:.0f} s; per launch (wall, CPU):", flush=True)
    for launch in [reference, first, *sequences["same"], *sequences["elastic"]]:
        if launch.code is not None:
            what = str(launch.fault) if launch.fault else "to the end"
            print(f"  {launch.name:9} {_name(launch.layout)} {what:50} exit {launch.code:3} "
                  f"{launch.seconds:5.1f} s {launch.cpu_seconds:5.1f} s")  # fmt: skip
    return {
        "method": method,
        "plan": plan,
        "first": first,
        "reference": reference,
        **sequences,
        "results": {name: _result(tmp / name) for name in ("reference", "same", "elastic")},
    }


# ---------------------------------------------------------------- the checks


def _sequence(chaos: dict[str, Any], name: str) -> list[Launch]:
    return [chaos["first"], *chaos[name]]


def _context(chaos: dict[str, Any], name: str) -> str:
    launches = "\n".join(launch.describe() for launch in _sequence(chaos, name) if launch.code is not None)
    return f"{chaos['method']}: {chaos['plan']}\n{launches}"


@pytest.mark.parametrize("name", ["same", "elastic"])
def test_every_interruption_ends_the_run_as_planned(chaos: dict[str, Any], name: str) -> None:
    for launch in _sequence(chaos, name):
        expected = EXIT[launch.fault.kind if launch.fault else None]
        ignored = any(r.get("notice_ignored") for r in launch.records)
        why = "the preemption notice was never acted on: reached_preemption never said so\n" if ignored else ""
        assert launch.code == expected, f"{why}{launch.describe()}\n{launch.output}\n{_context(chaos, name)}"
        fault = launch.fault
        if fault is not None and fault.kind == "raise":
            assert f"chaos: the planned failure of process {fault.process % launch.layout[0]}" in launch.output
        if fault is not None and fault.kind == "term":
            # The processes saved the same step and left with PREEMPTED_EXIT_CODE. (The launcher stops the others
            # once the first has left, so a slower one may not have written its record.)
            left = {(r.get("left"), r.get("step")) for r in launch.records} - {(None, None)}
            assert len(left) == 1 and next(iter(left))[0] == "preempted", launch.describe()
            step = next(iter(left))[1]
            assert isinstance(step, int) and step >= fault.at and step in launch.committed, launch.describe()
        if fault is None:
            assert [r["left"] for r in launch.records] == ["finished"] * launch.layout[0], launch.describe()


@pytest.mark.parametrize("name", ["same", "elastic"])
def test_every_restart_resumes_from_the_newest_intact_step(chaos: dict[str, Any], name: str) -> None:
    for launch in _sequence(chaos, name)[1:]:
        assert launch.records, f"{launch.describe()}\n{launch.output}\n{_context(chaos, name)}"
        for record in launch.records:
            assert record["layout"] == list(launch.layout), launch.describe()
            assert record["restored"] == launch.expected_restore, f"{launch.describe()}\n{_context(chaos, name)}"
            if launch.damaged is not None:  # the damaged step is named in a warning
                pattern = rf"DamagedCheckpointWarning: .*\b{launch.damaged}\b"
                named = [w for w in record["warnings"] if re.match(pattern, w)]
                assert named, f"no warning names the damaged step {launch.damaged}: {record['warnings']}"
    assert any(launch.damaged is not None for launch in chaos[name]), _context(chaos, name)


def _differences(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> dict[str, float]:
    """Per array: the largest difference relative to the array's largest magnitude (at least 1)."""
    assert got.keys() == want.keys()
    return {
        k: float(np.max(np.abs(got[k] - want[k])) / max(1.0, float(np.max(np.abs(want[k]))))) if want[k].size else 0.0
        for k in want
    }


def test_restarts_on_the_original_layout_end_bit_for_bit_as_the_uninterrupted_run(chaos: dict[str, Any]) -> None:
    reference, got = chaos["results"]["reference"], chaos["results"]["same"]
    assert reference is not None, f"{chaos['reference'].describe()}\n{chaos['reference'].output}"
    assert got is not None, _context(chaos, "same")
    assert got.keys() == reference.keys()
    differ = {k: v for k, v in _differences(got, reference).items() if not np.array_equal(got[k], reference[k])}
    assert not differ, f"differ from the uninterrupted run: {differ}\n{_context(chaos, 'same')}"


def test_restarts_on_other_layouts_end_as_the_uninterrupted_run_to_round_off(chaos: dict[str, Any]) -> None:
    reference, got = chaos["results"]["reference"], chaos["results"]["elastic"]
    assert reference is not None, f"{chaos['reference'].describe()}\n{chaos['reference'].output}"
    assert got is not None, _context(chaos, "elastic")
    differences = _differences(got, reference)
    print(f"{chaos['method']}: elastic sequence vs the uninterrupted run, largest relative differences: {differences}")
    assert max(differences.values()) <= ROUND_OFF, f"{differences}\n{_context(chaos, 'elastic')}"
    # Up to the first step computed on another layout, the energies are the uninterrupted run's exactly.
    other = [launch.expected_restore or 0 for launch in chaos["elastic"] if launch.layout != ORIGINAL]
    exact = min(other, default=STEPS)
    np.testing.assert_array_equal(got["energies"][:exact], reference["energies"][:exact])
    if not other:  # every restart happened to keep the original layout: bit for bit
        for k in reference:
            np.testing.assert_array_equal(got[k], reference[k], err_msg=k)
