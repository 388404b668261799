"""The run loop (``sv.driver``): the bare jitted step, resume after SIGTERM, loggers, callbacks, progress, expect."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from driver_job import WALKERS, job, log_psi, params_of, pieces, potential
from meshes import mesh_of
from optional_imports import import_or_skip

import shardvmc as sv
import shardvmc.optax as svx
from shardvmc.testing import cpu_environment

pytestmark = pytest.mark.usefixtures("x64")  # float64

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "tests" / "driver_job.py"
N = 6  # steps of the job
WAIT_S = 600  # a bound against hangs only


@pytest.fixture(scope="module")
def uninterrupted():
    """The job on 8 devices, no checkpoints: the reference."""
    with jax.enable_x64(True):
        return {8: job(mesh_of(8), None, N, progress=False)}


def hand_loop(vmc, state, n, key):
    """The loop as a user writes it by hand with the documented keys: fold_in(key, t) for step t."""
    energies = []
    for t in range(n):
        state, stats = vmc.step(state, jax.random.fold_in(key, t))
        energies.append(float(stats["energy"]))
    return state, energies


def test_the_loop_equals_the_bare_jitted_step(uninterrupted):
    vmc, state = pieces(mesh_of(8))
    state, energies = hand_loop(vmc, state, N, jax.random.key(2))
    result = uninterrupted[8]
    assert result.status == "finished" and result.step == N and result.resumed_from is None
    assert result.history["energy"].tolist() == energies  # bit for bit
    assert params_of(result) == [float(state.params["a"]), float(state.params["b"])]
    assert set(result.history) == {"energy", "error", "variance", "acceptance", "step_time"}
    acceptance = result.history["acceptance"]
    assert np.all(result.history["step_time"] > 0) and np.all((0 < acceptance) & (acceptance < 1))


def test_the_pieces_build_the_hand_written_step():
    """VMC.step is docs/vmc.md's step: a measure kernel, the natural gradient with jacobian= and local_energies=."""
    mesh = mesh_of(8)
    vmc, state = pieces(mesh)
    opt = optax.chain(svx.natural_gradient(damping=1e-3), optax.scale_by_learning_rate(0.1))
    local_energy = sv.hamiltonian.local_energy(log_psi, potential)

    @sv.walker_parallel
    def measure(
        params: sv.Replicated[dict], w: sv.PerWalker[sv.mcmc.Walker]
    ) -> tuple[sv.PerWalker, sv.PerWalker, sv.Mean]:
        e = local_energy(params, w)
        return e, jax.grad(log_psi)(params, w.r), e

    @jax.jit
    def step(params, opt_state, sampler_state, key):
        sampler_state = vmc.sampler.step(params, sampler_state, key)
        e, jac, energy = measure(params, sampler_state.walkers)
        updates, opt_state = opt.update(params, opt_state, params, jacobian=jac, local_energies=e)
        return optax.apply_updates(params, updates), opt_state, sampler_state, energy

    params, opt_state, sampler_state = state
    ours = state
    for t in range(3):
        key = jax.random.fold_in(jax.random.key(2), t)
        params, opt_state, sampler_state, energy = step(params, opt_state, sampler_state, key)
        ours, stats = vmc.step(ours, key)
        np.testing.assert_allclose(float(stats["energy"]), float(energy), rtol=1e-13)
    np.testing.assert_allclose(
        [float(ours.params["a"]), float(ours.params["b"])], [float(params["a"]), float(params["b"])], rtol=1e-12
    )


def test_plain_optax_gets_the_energy_gradient():
    """With optax.sgd the update is -lr * 2 (<j e> - <j><e>), computed here with numpy from the same walkers."""
    vmc, state = pieces(mesh_of(8), optimiser=optax.sgd(0.1))
    key = jax.random.key(5)
    new, stats = vmc.step(state, key)
    walkers = vmc.sampler.step(state.params, state.sampler, key).walkers
    r = np.asarray(walkers.data.r)[: walkers.n_valid]
    e = np.asarray(
        jax.jit(jax.vmap(lambda x: sv.hamiltonian.kinetic_energy(log_psi, state.params, x) + potential(x)))(r)
    )
    j = jax.vmap(jax.grad(log_psi), in_axes=(None, 0))(state.params, jnp.asarray(r))
    for name in ("a", "b"):
        jn = np.asarray(j[name])
        gradient = 2 * (np.mean(jn * e) - jn.mean() * e.mean())
        expected = float(state.params[name]) - 0.1 * gradient
        assert float(new.params[name]) == pytest.approx(expected, rel=1e-10)
    assert float(stats["energy"]) == pytest.approx(e.mean(), rel=1e-12)
    assert float(stats["error"]) == pytest.approx(np.sqrt(e.var() / WALKERS), rel=1e-8)


# ----------------------------------------------------------------------------- checkpoints, SIGTERM, resume


def _env(devices: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHARDVMC_")}
    cpu_environment(env, devices, replace=True)
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")]))
    return env


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, out)


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """The job on 8 devices in another process, sent SIGTERM by its own callback at step 0: saves and exits 75."""
    directory = tmp_path_factory.mktemp("driver") / "run"
    done = _run([sys.executable, str(JOB), str(directory), str(N), "--sigterm-at", "0"], _env(8))
    assert done.returncode == sv.distributed.PREEMPTED_EXIT_CODE, done.stdout
    return directory, done.stdout


def test_sigterm_saves_and_exits_with_the_preempted_code(preempted, uninterrupted):
    directory, output = preempted
    # Step 0's callbacks run once step 0 + ahead (2) is dispatched; the next step sees the notice: 4 steps saved.
    assert "preemption notice at step 4; saved to" in output and "exiting with 75" in output, output
    with sv.Checkpointer(directory / "state") as ckpt:
        saved = ckpt.latest_step()
    assert saved == 4
    log = sv.driver.read_log(directory / "log.jsonl")
    assert log["step"].tolist() == list(range(saved))
    # The steps before the notice are the uninterrupted run's (the same devices): bit for bit.
    assert log["energy"].tolist() == uninterrupted[8].history["energy"][:saved].tolist()


def test_resume_on_another_device_count_continues_the_trajectory(preempted, uninterrupted, tmp_path):
    directory, _ = preempted
    copy = tmp_path / "run"
    shutil.copytree(directory, copy)
    done = _run([sys.executable, str(JOB), str(copy), str(N)], _env(3))
    assert done.returncode == 0, done.stdout
    result = json.loads((copy / "result_0.json").read_text())
    assert result["status"] == "finished" and result["step"] == N and result["resumed_from"] == 4
    reference = uninterrupted[8]
    # Another device count: float64 round-off of the sums over devices (docs/concepts.md), no more.
    np.testing.assert_allclose(result["energy"], reference.history["energy"], rtol=0, atol=1e-10)
    np.testing.assert_allclose(result["params"], params_of(reference), rtol=1e-9)
    log = sv.driver.read_log(copy / "log.jsonl")
    assert log["step"].tolist() == list(range(N))  # every step once: the redone steps are not doubled
    np.testing.assert_allclose(log["energy"], result["energy"], rtol=0, atol=0)


def test_resume_on_the_same_device_count_is_bit_for_bit(preempted, uninterrupted, tmp_path):
    directory, _ = preempted
    shutil.copytree(directory, tmp_path / "run")
    result = job(mesh_of(8), str(tmp_path / "run"), N, progress=False)
    assert result.resumed_from is not None and result.step == N
    assert result.history["energy"].tolist() == uninterrupted[8].history["energy"].tolist()
    assert params_of(result) == params_of(uninterrupted[8])
    again = job(mesh_of(8), str(tmp_path / "run"), N, progress=False)  # a finished run: nothing left to do
    assert (
        again.resumed_from == N
        and again.step == N
        and again.history["energy"].tolist() == result.history["energy"].tolist()
    )


def test_a_checkpoint_of_another_key_or_beyond_n_steps_is_refused(preempted, tmp_path):
    directory, _ = preempted
    shutil.copytree(directory, tmp_path / "run")
    vmc, state = pieces(mesh_of(8))
    with pytest.raises(sv.CallError, match="another key"):
        sv.driver.run(vmc.step, state, N, key=jax.random.key(3), checkpoint=tmp_path / "run", progress=False)
    with pytest.raises(sv.CallError, match="beyond n_steps=2"):
        sv.driver.run(vmc.step, state, 2, key=jax.random.key(2), checkpoint=tmp_path / "run", progress=False)


def test_checkpoints_every_n_steps_and_by_time(tmp_path):
    result = job(mesh_of(8), str(tmp_path / "steps"), N, checkpoint_every=4, progress=False)
    with sv.Checkpointer(tmp_path / "steps" / "state") as ckpt:
        assert ckpt.steps() == [4, 6]  # the cadence and the end
        saved, meta = ckpt.restore({"state": result.state, "key": np.asarray(jax.random.key_data(jax.random.key(2)))})
    assert meta == {"step": 6, "user": {}}  # the statistics are in the log, not in every checkpoint
    assert sv.driver.read_log(tmp_path / "steps" / "log.jsonl")["energy"].tolist() == result.history["energy"].tolist()
    job(mesh_of(8), str(tmp_path / "timed"), 4, checkpoint_every=None, checkpoint_seconds=1e-9, keep=None)
    with sv.Checkpointer(tmp_path / "timed" / "state") as ckpt:
        assert ckpt.steps() == [2, 4]  # due after step 0, saved at the next one; again after the save; the end


def test_a_sigterm_while_the_first_step_compiles_requeues_as_a_late_one(tmp_path):
    """The notice arrives before any step ran (the step sends it as it is traced): saved, exit 75, not killed (143)."""
    directory = tmp_path / "run"
    done = _run([sys.executable, str(JOB), str(directory), str(N), "--sigterm-while-compiling"], _env(8))
    assert done.returncode == sv.distributed.PREEMPTED_EXIT_CODE, done.stdout
    assert "preemption notice at step 1; saved to" in done.stdout, done.stdout  # the first step that could see it
    with sv.Checkpointer(directory / "state") as ckpt:
        assert ckpt.steps() == [1]
    assert sv.driver.read_log(directory / "log.jsonl")["step"].tolist() == [0]


def test_a_notice_before_the_first_step_saves_the_state_it_has(monkeypatch, tmp_path):
    """A notice taken before the loop's first step (one that came while restoring, say): the state saved, exit 75."""
    calls = []
    monkeypatch.setattr(sv.distributed, "reached_preemption", lambda step: calls.append(step) or True)
    with pytest.raises(SystemExit) as exited:
        sv.driver.run(STEP, jnp.float64(0.0), 4, key=jax.random.key(0), checkpoint=tmp_path)
    assert exited.value.code == sv.distributed.PREEMPTED_EXIT_CODE and calls == [0]  # (no step ran)
    with sv.Checkpointer(tmp_path / "state") as ckpt:
        assert ckpt.steps() == [0]
    early = sv.driver.run(STEP, jnp.float64(0.0), 4, key=jax.random.key(0), checkpoint=tmp_path, on_preemption="return")
    assert early.status == "preempted" and early.reason == "preemption notice at step 0" and early.step == 0
    monkeypatch.setattr(sv.distributed, "reached_preemption", lambda step: False)
    result = sv.driver.run(STEP, jnp.float64(0.0), 4, key=jax.random.key(0), checkpoint=tmp_path)
    assert result.resumed_from == 0 and result.history["energy"].tolist() == [0.0, 0.5, 1.0, 1.5]


def _statistics_step(x, key):
    return x + 1, {"energy": x * 0.5, "error": jnp.float64(0.25), "variance": jnp.sqrt(x)}


STATISTICS_STEP = jax.jit(_statistics_step)


class _CrashAt:
    """A callback that raises at step ``at``: a run that dies after logging steps its checkpoint does not have."""

    def __init__(self, at: int) -> None:
        self.at = at

    def __call__(self, step, stats):
        if step == self.at:
            raise RuntimeError(f"crash at step {step}")


def test_a_resumed_run_has_the_whole_history_and_its_log_each_step_once(tmp_path):
    reference = sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 10, key=jax.random.key(0))
    with pytest.raises(RuntimeError, match="crash at step 6"):
        sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 10, key=jax.random.key(0), checkpoint=tmp_path,
                      checkpoint_every=4, callbacks=[_CrashAt(6)])  # fmt: skip
    log = tmp_path / "log.jsonl"
    assert sv.driver.read_log(log)["step"].tolist() == list(range(7))  # 4, 5 and 6 after the checkpoint at 4
    with open(log, "a") as f:
        f.write('{"step": 7, "energy": 3.')  # and a line cut off by a kill
    result = sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 10, key=jax.random.key(0), checkpoint=tmp_path)
    assert result.resumed_from == 4 and result.step == 10
    for name in ("energy", "error", "variance"):
        assert result.history[name].tolist() == reference.history[name].tolist(), name
    back = sv.driver.read_log(log)
    assert back["step"].tolist() == list(range(10))  # each step once: steps 4-6 of the first run are gone
    for name in ("energy", "error", "variance", "step_time"):
        assert back[name].tolist() == result.history[name].tolist(), name  # exact floats, as the result has them
    again = sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 10, key=jax.random.key(0), checkpoint=tmp_path)
    assert again.resumed_from == 10 and again.history["step_time"].tolist() == result.history["step_time"].tolist()


def test_a_checkpoint_of_every_steps_history_still_resumes(tmp_path):
    """Checkpoints of 0.4.0 in development carried every step's statistics: their history comes from there."""
    key = jax.random.key(0)
    reference = sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 6, key=key)
    history = {k: v[:4].tolist() for k, v in reference.history.items()}
    with sv.Checkpointer(tmp_path / "state") as ckpt:
        like = {"state": jnp.float64(4.0), "key": np.asarray(jax.random.key_data(key))}
        ckpt.save(4, like, metadata={"step": 4, "history": history, "user": {}})
    result = sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 6, key=key, checkpoint=tmp_path)  # (no log.jsonl)
    assert result.resumed_from == 4 and result.history["energy"].tolist() == reference.history["energy"].tolist()
    assert result.history["step_time"][:4].tolist() == history["step_time"]
    log = sv.driver.read_log(tmp_path / "log.jsonl")  # written from the checkpoint's history, then the new steps
    assert log["step"].tolist() == list(range(6)) and log["energy"].tolist() == result.history["energy"].tolist()


def test_a_lost_log_leaves_nan_in_the_history_and_says_so(tmp_path):
    sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 4, key=jax.random.key(0), checkpoint=tmp_path)
    lines = (tmp_path / "log.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "log.jsonl").write_text("".join(lines[:1] + lines[3:]))  # steps 1 and 2 lost
    with pytest.warns(UserWarning, match=r"lacks the statistics of steps 1-2 of the 4 the checkpoint holds"):
        result = sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 6, key=jax.random.key(0), checkpoint=tmp_path)
    energy = result.history["energy"]
    assert np.isnan(energy[1:3]).all() and energy[[0, 3, 4, 5]].tolist() == [0.0, 1.5, 2.0, 2.5]


def _step_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def test_a_checkpoint_does_not_grow_with_the_steps_run(tmp_path):
    """A save at step 1,000 is the size of one at step 2 (sizes, not times; each step's statistics added ~60 B)."""
    sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 2, key=jax.random.key(0), checkpoint=tmp_path, progress=False)
    sv.driver.run(STATISTICS_STEP, jnp.float64(0.0), 1000, key=jax.random.key(0), checkpoint=tmp_path,
                  checkpoint_every=None, keep=None, progress=False)  # fmt: skip
    early, late = (tmp_path / "state" / "2"), (tmp_path / "state" / "1000")
    header = [(step / "shardvmc" / "metadata").stat().st_size for step in (early, late)]
    assert header[1] - header[0] <= 8, header  # the step's digits (written twice)
    # The whole step: orbax's array store splits its data into a varying number of files (a few hundred bytes).
    assert _step_bytes(late) < _step_bytes(early) + 2048, (_step_bytes(early), _step_bytes(late))
    assert len(sv.driver.read_log(tmp_path / "log.jsonl")["step"]) == 1000


# ----------------------------------------------------------------------------- loggers


def _counting_step(x, key):
    return x + 1, {"energy": x * 0.5, "error": jnp.float64(0.25)}


STEP = jax.jit(_counting_step)


def test_every_logger_writes_what_the_steps_gave(tmp_path, capsys):
    tensorboard = import_or_skip("tensorboardX")
    out = [
        sv.driver.JsonLog(tmp_path / "log.jsonl"),
        sv.driver.CSVLog(tmp_path / "log.csv"),
        sv.driver.TensorBoardLog(tmp_path / "tb"),
        sv.driver.PrintLog(every=2),
    ]
    result = sv.driver.run(STEP, jnp.float64(0.0), 5, key=jax.random.key(0), out=out, progress=False)
    energies = [0.0, 0.5, 1.0, 1.5, 2.0]
    assert result.history["energy"].tolist() == energies
    for path in ("log.jsonl", "log.csv"):
        log = sv.driver.read_log(tmp_path / path)
        assert log["step"].tolist() == [0, 1, 2, 3, 4] and log["energy"].tolist() == energies
        assert log["step_time"].tolist() == result.history["step_time"].tolist()  # exact floats
    assert (tmp_path / "log.csv").read_text().splitlines()[0] == "step,energy,error,step_time"
    scalars = _tensorboard_scalars(tmp_path / "tb", tensorboard)
    assert scalars["energy"] == list(enumerate(energies)) and [s for s, _ in scalars["error"]] == [0, 1, 2, 3, 4]
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["step 2/5", "step 4/5", "step 5/5"]
    assert lines[0].startswith("step 2/5  energy = 0.50 ± 0.25  step_time = ")


def _tensorboard_scalars(logdir: Path, tensorboard) -> dict[str, list[tuple[int, float]]]:
    """The scalars of the event files, read with their own record format (length, CRC, Event proto, CRC)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(logdir.iterdir()):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def test_a_resumed_log_drops_the_rows_it_redoes(tmp_path):
    for log in (sv.driver.JsonLog(tmp_path / "log.jsonl"), sv.driver.CSVLog(tmp_path / "log.csv")):
        log.open(0, 5)
        for t in range(5):
            log.write(t, {"energy": float(t)})
        log.close()
        log.open(3, 5)  # a run resumed at step 3 (steps 3 and 4 were written after its checkpoint)
        log.write(3, {"energy": 30.0})
        log.close()
    for name in ("log.jsonl", "log.csv"):
        back = sv.driver.read_log(tmp_path / name)
        assert back["step"].tolist() == [0, 1, 2, 3] and back["energy"].tolist() == [0.0, 1.0, 2.0, 30.0]


def test_the_progress_bar_shows_the_energy_and_the_time_left():
    import_or_skip("tqdm")
    sink = io.StringIO()
    sv.driver.run(STEP, jnp.float64(0.0), 20, key=jax.random.key(0), progress=sink, description="opt")
    final = sink.getvalue().split("\r")[-1]
    assert final.startswith("opt: 100%") and "20/20" in final and "E = 9.50 ± 0.25" in final, final
    assert "<00:00" in final  # tqdm's elapsed<remaining


# ----------------------------------------------------------------------------- callbacks


def _nan_at_3(x, key):
    return x + 1, {"energy": jnp.where(x == 3, jnp.nan, x)}


def test_a_non_finite_energy_stops_the_run_without_saving_it(tmp_path):
    result = sv.driver.run(
        jax.jit(_nan_at_3), jnp.float64(0.0), 20, key=jax.random.key(0), checkpoint=tmp_path, checkpoint_every=2
    )
    assert result.status == "stopped" and result.reason == "energy is nan at step 3"
    # The save due after step 3 reads every step first: the nan stops the run there, and is not saved.
    assert result.step == 4 and np.isnan(result.history["energy"][3])
    with sv.Checkpointer(tmp_path / "state") as ckpt:
        assert ckpt.steps() == [2]
    log = sv.driver.read_log(tmp_path / "log.jsonl")
    assert log["step"].tolist() == list(range(4))


def test_a_stop_takes_effect_after_the_steps_in_flight():
    result = sv.driver.run(jax.jit(_nan_at_3), jnp.float64(0.0), 20, key=jax.random.key(0))
    assert result.step == 6 and float(result.state) == 6.0  # steps 4 and 5 were dispatched (ahead=2)
    assert result.history["energy"].tolist()[4:] == [4.0, 5.0]
    result = sv.driver.run(jax.jit(_nan_at_3), jnp.float64(0.0), 20, key=jax.random.key(0), ahead=0)
    assert result.step == 4 and float(result.state) == 4.0


def test_a_timeout_and_a_user_condition_stop_the_run_with_a_checkpoint(tmp_path):
    result = sv.driver.run(
        STEP, jnp.float64(0.0), 50, key=jax.random.key(0), callbacks=[sv.driver.Timeout(1e-9)], checkpoint=tmp_path
    )
    assert result.status == "stopped" and result.reason.startswith("the time limit of 1e-09 s was reached at step 0")
    with sv.Checkpointer(tmp_path / "state") as ckpt:
        assert ckpt.steps() == [result.step]  # a timed-out run is saved, to go on later
    seen = []

    def condition(step, stats):
        seen.append(step)
        return stats["energy"] >= 2.0  # a plain function: a true value stops

    stopped = sv.driver.run(STEP, jnp.float64(0.0), 50, key=jax.random.key(0), callbacks=condition, ahead=1)
    assert seen == [0, 1, 2, 3, 4] and stopped.step == 6 and stopped.reason.startswith("<function ")
    assert sv.driver.run(STEP, jnp.float64(0.0), 8, key=jax.random.key(0), callbacks=()).status == "finished"


def test_bad_steps_and_arguments_are_explained():
    with pytest.raises(sv.CallError, match="dict of scalars"):
        sv.driver.run(jax.jit(lambda x, k: (x, x)), jnp.float64(0.0), 3, key=jax.random.key(0))
    with pytest.raises(sv.CallError, match="'e' of step 0 is not a real scalar"):
        sv.driver.run(jax.jit(lambda x, k: (x, {"e": jnp.ones(2)})), jnp.float64(0.0), 3, key=jax.random.key(0))
    with pytest.raises(sv.CallError, match="ONE PRNG key"):
        sv.driver.run(STEP, jnp.float64(0.0), 3, key=jax.random.split(jax.random.key(0)))
    with pytest.raises(sv.CallError, match="on_preemption"):
        sv.driver.run(STEP, jnp.float64(0.0), 3, key=jax.random.key(0), on_preemption="ignore")


# ----------------------------------------------------------------------------- expect


def test_expect_equals_the_statistics_of_the_stored_series():
    """expect's accumulator against sv.statistics of the same local energies, sampled by hand."""
    vmc, state = pieces(mesh_of(8))
    key, n = jax.random.key(7), 12
    stats = vmc.expect(state, n, key=key, progress=False)
    sampler = vmc.sampler.with_options(adapt_rate=0.0)
    walkers = state.sampler._replace(walkers=sampler.evaluate(state.params, state.sampler.walkers))
    series = []
    for t in range(n):
        walkers = sampler.step(state.params, walkers, jax.random.fold_in(key, t), refresh=False)
        series.append(vmc.local_energy(state.params, walkers.walkers).data)
    reference = sv.statistics(jnp.stack(series, axis=1), n_valid=WALKERS)
    for field in ("mean", "error_of_mean", "variance", "tau_corr", "R_hat"):
        assert float(getattr(stats, field)) == pytest.approx(float(getattr(reference, field)), rel=1e-9), field


# ----------------------------------------------------------------------------- several processes


def test_only_process_0_prints_and_logs(tmp_path):
    directory = tmp_path / "run"
    command = [sys.executable, "-m", "shardvmc.launch", "--processes", "2", "--devices-per-process", "2",
               "--timeout", str(WAIT_S), "--", sys.executable, str(JOB), str(directory), "3", "--print",
               "--no-checkpoint"]  # fmt: skip
    done = _run(command, _env(None))
    assert done.returncode == 0, done.stdout
    printed = [line for line in done.stdout.splitlines() if "/3  " in line and "  energy = " in line]
    assert [line.split("  ")[0] for line in printed] == ["[0] step 1/3", "[0] step 2/3", "[0] step 3/3"], done.stdout
    log = sv.driver.read_log(directory / "log.jsonl")
    assert log["step"].tolist() == [0, 1, 2]  # written once, by process 0
    results = [json.loads((directory / f"result_{p}.json").read_text()) for p in (0, 1)]
    assert results[0]["energy"] == results[1]["energy"] == log["energy"].tolist()


def test_preemption_is_watched_only_with_a_checkpoint(monkeypatch, tmp_path):
    calls, watched = [], []
    monkeypatch.setattr(sv.distributed, "reached_preemption", lambda step: calls.append(step) or False)
    monkeypatch.setattr(sv.distributed, "_watch_preemption", lambda **kw: watched.append(kw) or False)
    sv.driver.run(STEP, jnp.float64(0.0), 3, key=jax.random.key(0))  # no signal handler installed
    assert calls == [] and watched == []
    sv.driver.run(STEP, jnp.float64(0.0), 3, key=jax.random.key(0), checkpoint=tmp_path)
    assert calls == [0, 1, 2, 3] and len(watched) == 1  # the handlers before the restore; a notice before step 0
