"""The neural-network VMC example: device-count invariance, resume, checkpoints, preemption, optimisers, CLI."""

import dataclasses
import importlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from optional_imports import import_or_skip

import shardvmc as sv
from shardvmc._memory import format_bytes
from shardvmc.testing import cpu_environment

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
EXAMPLE = EXAMPLES / "neural_vmc.py"
pytestmark = pytest.mark.end_to_end  # CI's second leg leaves it out (pyproject.toml's markers)
COPIED = ("neural_vmc.py", "kfac_vmc.py", "network.py", "plumbing.py")  # what a researcher copies


@pytest.fixture(scope="module")
def neural():
    spec = importlib.util.spec_from_file_location("neural_vmc", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["neural_vmc"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("neural_vmc", None)


@pytest.fixture(scope="module")
def quick(neural):
    # The --quick settings with SPRING, so that its previous direction is in the optimiser state;
    # 61 walkers: padded to 64 on 8 devices.
    return dataclasses.replace(neural.Config(**neural.QUICK), walkers=61, optimiser="spring")


@pytest.fixture(scope="module")
def runs(neural, quick, tmp_path_factory):
    """The quick run on 8 and on 1 device; stopped after 3 steps and resumed on 8 and on 1 (the same call)."""
    tmp = tmp_path_factory.mktemp("neural")
    mesh1, mesh8 = sv.create_mesh(jax.devices()[:1]), sv.create_mesh(jax.devices()[:8])
    out = {
        "8dev": neural.run(quick, mesh8, checkpoint=str(tmp / "full"), checkpoint_every=4),
        "1dev": neural.run(quick, mesh1),
        "cut": neural.run(quick, mesh8, checkpoint=str(tmp / "cut"), checkpoint_every=2, stop_after=3),
    }
    for name, mesh in (("resumed8", mesh8), ("resumed1", mesh1)):
        shutil.copytree(tmp / "cut", tmp / name)
        out[name] = neural.run(quick, mesh, checkpoint=str(tmp / name))
    out["dirs"] = tmp
    return out


def test_quick_run_on_1_and_8_devices_gives_the_same_energies(runs, quick):
    one, eight = runs["1dev"], runs["8dev"]
    assert (one["devices"], eight["devices"]) == (1, 8) and eight["status"] == "finished"
    assert len(eight["energies"]) == quick.steps  # the training's; the evaluation is sv.driver.expect's
    assert np.all(np.isfinite(eight["energies"])) and 0 < np.mean(eight["acceptances"]) < 1
    # float64 round-off only: the same walker trajectories, reductions summed in another order;
    # the damped solve and the optimisation's feedback amplify it (seen: below 1e-9 in these steps).
    np.testing.assert_allclose(eight["energies"], one["energies"], rtol=0, atol=1e-7)
    np.testing.assert_allclose(eight["variances"], one["variances"], rtol=1e-6)
    assert eight["acceptances"] == one["acceptances"]  # counts of accepted moves: exact
    # The evaluation's estimate (over every walker and step) is the same on both device counts, to round-off.
    assert eight["energy"] == pytest.approx(one["energy"], abs=1e-7) and eight["error"] > 0


def test_resume_after_an_interrupted_run_equals_the_uninterrupted_run(runs):
    assert runs["cut"]["status"] == "stopped" and runs["cut"]["steps_done"] == 3 and runs["cut"]["energy"] is None
    # Same device count: bit-identical (parameters, optimiser state and step size come back exactly).
    assert runs["resumed8"]["energies"] == runs["8dev"]["energies"]
    assert runs["resumed8"]["energy"] == runs["8dev"]["energy"] and runs["resumed8"]["error"] == runs["8dev"]["error"]
    # Onto another device count: to round-off (amplified as above).
    np.testing.assert_allclose(runs["resumed1"]["energies"], runs["8dev"]["energies"], rtol=0, atol=1e-7)


def test_checkpoint_holds_walkers_parameters_optimiser_state_and_statistics(runs, quick, neural):
    directory = runs["dirs"] / "cut"
    mesh8 = sv.create_mesh(jax.devices()[:8])
    with jax.enable_x64(True), sv.Checkpointer(directory / "state") as ckpt:
        assert ckpt.steps() == [2, 3]  # every 2 steps, and where the run stopped
        like = neural.initial_state(quick, mesh8, neural.make_steps(quick, mesh8))
        saved, meta = ckpt.restore({"state": like, "key": np.zeros(2, np.uint32)}, mesh=mesh8)
        assert meta["step"] == 3 and meta["user"]["clip"] == quick.clip and meta["user"]["steps"] == 0
        state = saved["state"]
        walkers = state.sampler.walkers
        assert isinstance(walkers, sv.WalkerSet) and walkers.n_valid == 61 and walkers.data.r.shape == (64, 3, 3)
        spring, fisher, scale = state.opt
        assert int(fisher.count) == int(scale.count) == 3 and np.any(np.asarray(spring.previous) != 0)
        # The sampler's adapted width and last acceptance come back with it.
        assert float(state.sampler.width) != quick.step_size and 0 < float(state.sampler.acceptance) < 1
    log = sv.driver.read_log(directory / "log.jsonl")
    assert log["step"].tolist() == [0, 1, 2] and {"energy", "variance", "acceptance", "step_time"} <= set(log)
    assert log["energy"].tolist() == runs["8dev"]["energies"][:3]  # exact: shortest round-trip floats
    with sv.Checkpointer(runs["dirs"] / "full" / "state") as ckpt:
        assert ckpt.steps() == [4, 6]  # the last one where the training ends


def test_resume_refuses_a_checkpoint_of_other_settings(runs, quick, neural):
    other = dataclasses.replace(quick, clip=quick.clip + 1)  # the same network and optimiser
    with pytest.raises(sv.CallError, match="other settings: clip"):
        neural.run(other, sv.create_mesh(jax.devices()[:8]), checkpoint=str(runs["dirs"] / "full"))


def clip_reference(e: np.ndarray, width: float = 5.0) -> np.ndarray:
    """NumPy reference of the example's clipping: to mean +- width mean absolute deviations."""
    mean = e.mean()
    mad = np.abs(e - mean).mean()
    return np.clip(e, mean - width * mad, mean + width * mad)


def test_clip_reference_itself():
    assert float(clip_reference(np.array([0.0] * 19 + [100.0])).max()) == 52.5  # mean 5 + 5 x 9.5


def test_clipping_against_numpy(neural):
    # 29 valid walkers (one outlier) padded to 32 with garbage that must not enter the window.
    rng = np.random.default_rng(0)
    e = rng.normal(-7.4, 0.3, size=29)
    e[5] = 40.0
    padded = np.concatenate([e, [1e6, np.nan, -1e6]])
    with jax.enable_x64(True):
        clip = neural.clip.with_options(mesh=sv.create_mesh(jax.devices()[:8]))
        clipped, mean, mean2 = clip(sv.WalkerSet(jnp.asarray(padded), n_valid=29), 5.0)
    assert clipped.n_valid == 29
    got = np.asarray(clipped.data)[:29]
    np.testing.assert_allclose(got, clip_reference(e), rtol=1e-12)
    assert got[5] < 40.0 and np.all(got[np.arange(29) != 5] == e[np.arange(29) != 5])
    np.testing.assert_allclose([float(mean), float(mean2)], [e.mean(), (e**2).mean()], rtol=1e-12)


def test_settings_from_the_command_line(neural):
    def parse(argv, config=neural.Config, optimisers=neural.OPTIMISERS):
        return neural.plumbing.parse_args(argv, config, "", quick=neural.QUICK, choices={"optimiser": optimisers})[1]

    assert parse([]) == neural.Config()  # minSR, the CPU default too
    for name in neural.OPTIMISERS:
        assert parse(["--optimiser", name]).optimiser == name
    spring = parse(["--optimiser", "spring", "--lr", "0.02", "--max-norm", "1e-3", "--hidden-two", "6"])
    assert (spring.lr, spring.lr_decay, spring.max_norm, spring.hidden_two) == (0.02, neural.Config.lr_decay, 1e-3, 6)
    quick = parse(["--quick", "--walkers", "100", "--system", "Be", "--float32", "--batch-size", "8"])
    assert (
        quick.walkers == 100
        and quick.system == "Be"
        and quick.layers == neural.QUICK["layers"]
        and quick.dtype == "float32"
    )
    assert quick.batch_size == 8
    with pytest.raises(SystemExit):
        parse(["--optimiser", "kfac"])  # the KFAC example's
    kfac = importlib.import_module("kfac_vmc")
    assert parse([], kfac.Config, ("kfac",)) == kfac.Config() and kfac.Config().optimiser == "kfac"
    assert kfac.Config().walkers == neural.Config().walkers  # the same settings otherwise


def test_reports_say_what_the_run_is(neural, runs):
    finished = neural.report(runs["8dev"], quick=True)
    assert re.fullmatch(r"E = -\d\.\d{5} \+- \d\.\d{5} Ha \(exact -7\.47806\)", finished[1]), finished
    assert "smoke test" in finished[2] and not any("correlation" in line for line in finished)
    stopped = neural.report(runs["cut"], quick=False)
    assert stopped[1] == "stopped after step 3 of 6: the same command goes on" and len(stopped) == 2
    full = dict(runs["8dev"], correlation_fraction=0.991, best_average_50=-7.4770, chemical_accuracy_step=332)
    assert neural.report(full, quick=False)[2:] == [
        "correlation energy recovered: 99.1 %",
        "50-step average: best -7.47700 Ha; reached -7.4765 at step 332",
    ]


def test_chemical_accuracy_step_is_where_the_50_step_average_first_reaches_it(neural, quick):
    config = dataclasses.replace(quick, steps=120, eval_steps=0)
    energies = np.full(120, -7.40)
    energies[70:] = -7.50  # steps 71 to 120; the window ending at step s holds s - 70 of them
    target = neural.SYSTEMS["Li"].exact_energy + neural.CHEMICAL_ACCURACY
    needed = int(np.ceil(50 * (target + 7.40) / (-7.50 + 7.40)))  # low steps the window needs: 39
    history = {"energy": energies, "variance": np.full(120, 0.1), "acceptance": np.full(120, 0.5),
               "step_time": np.full(120, 0.1)}  # fmt: skip
    summary = neural.summarise(config, history, None, "finished", sv.create_mesh(jax.devices()[:1]), 0, 1.0)
    assert needed == 39 and summary["chemical_accuracy_step"] == 70 + needed and summary["energy"] is None
    assert summary["best_average_50"] == pytest.approx(-7.50)


def test_systems_are_data(neural):
    assert set(neural.SYSTEMS) == {"Li", "LiH", "Be", "Ne", "N2", "bicyclobutane"}  # tests/test_molecules.py
    li, lih, be = (neural.SYSTEMS[n] for n in ("Li", "LiH", "Be"))
    assert (li.exact_energy, li.hf_energy, be.exact_energy, be.hf_energy) == (-7.47806, -7.43273, -14.66736, -14.57302)
    assert lih.exact_energy == -8.07050 and lih.coords[1][2] == 3.015 and lih.charges == (3.0, 1.0)


def test_command_line_json_and_plot(neural, tmp_path, capsys):
    # In-process, with the settings of the `runs` fixture: its compiled steps are reused.
    path = tmp_path / "li.json"
    args = ["--quick", "--walkers", "61", "--optimiser", "spring", "--devices", "8"]
    summary = neural.main([*args, "--json", str(path), "--plot", str(tmp_path / "li.png"), "--print-every", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    progress = [line for line in lines if re.match(r"step \d/6  energy = ", line)]
    assert len(progress) == 6 and all(k in progress[-1] for k in ("variance = ", "acceptance = ", "step_time = "))
    assert any(line.startswith("Li, spring: 61 walkers on 8 cpu devices, ") for line in lines)
    assert any("smoke test" in line for line in lines) and not any("correlation" in line for line in lines)
    saved = json.loads(path.read_text())
    assert saved["devices"] == 8 and saved["system"] == "Li" and saved["status"] == "finished"
    assert saved["energies"] == summary["energies"] and len(saved["energies"]) == 6
    assert (tmp_path / "li.png").stat().st_size > 0  # matplotlib: the test extra brings it (through arviz)


def _copied_example(tmp_path: Path) -> Path:
    """The examples, their network and their plumbing alone in a folder, as a user copies them."""
    folder = tmp_path / "research"
    folder.mkdir()
    for name in COPIED:
        shutil.copy(EXAMPLES / name, folder)
    return folder


def _env() -> dict[str, str]:
    # shardvmc installed, nothing of this repository on the path; the example sets up its own devices: the suite's
    # device count leaves XLA_FLAGS, its fast-compile flags stay (the root conftest.py; each process compiles in
    # about 30 % less time: 18 s instead of 25 s for the 1-device run, measured).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("SHARDVMC")}
    cpu_environment(env, None, replace=True)
    return env


def test_a_copied_kfac_run_stops_on_sigterm_and_resumes_on_another_device_count(tmp_path):
    import_or_skip("kfac_jax")
    folder = _copied_example(tmp_path)
    # 60 steps: the notice, sent at the first progress line, arrives while many steps are left, however busy the CPU.
    command = [sys.executable, "-u", "kfac_vmc.py", "--quick", "--steps", "60"]
    command += ["--print-every", "1", "--checkpoint", "run"]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True}
    proc = subprocess.Popen([*command, "--devices", "2"], cwd=folder, env=_env(), **pipes)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step  1/60"):  # the handlers are installed (at step 0, before any line)
                proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
    out = "".join(lines)
    assert code == sv.distributed.PREEMPTED_EXIT_CODE == 75, out
    match = re.search(r"preemption notice at step (\d+); saved to 'run', exiting with 75", out)
    assert match, out
    stopped = int(match.group(1))
    assert 1 < stopped < 60 and "Li, kfac" not in out  # the process ended at the notice: no evaluation, no report
    with sv.Checkpointer(folder / "run" / "state") as ckpt:
        assert ckpt.latest_step() == stopped
    done = subprocess.run(
        [*command, "--devices", "1"], cwd=folder, env=_env(), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"resumed from 'run' at step {stopped}" in done.stderr
    assert "Li, kfac: 64 walkers on 1 cpu devices" in done.stdout
    assert re.search(r"^E = -\d\.\d{5} \+- \d\.\d{5} Ha", done.stdout, re.MULTILINE), done.stdout
    log = sv.driver.read_log(folder / "run" / "log.jsonl")
    assert log["step"].tolist() == list(range(60))  # every step once (the steps after the save redone, not doubled)


def test_molecules_quick_train_on_the_cpu_mesh_with_every_electron(neural):
    """``--system N2 --quick`` (14 electrons) and ``--system bicyclobutane --quick`` (30) train on 2 devices.

    The command line's settings, without the burn-in and the evaluation (each its own compilation; the evaluation
    is the same code for every system, run for Li above): what CI can afford, some 20 s.
    """
    mesh = sv.create_mesh(jax.devices()[:2])
    for name, electrons in (("N2", 14), ("bicyclobutane", 30)):
        argv = ["--system", name, "--quick", "--steps", "3", "--burn-in", "0", "--eval-steps", "0"]
        config = neural.plumbing.parse_args(argv, neural.Config, "", quick=neural.QUICK, sizes=neural.SIZES)[1]
        result = neural.train(config, mesh)
        walkers = result.state.sampler.walkers
        assert walkers.n_valid == 64 and walkers.data.r.shape == (64, electrons, 3), (name, walkers.data.r.shape)
        energies = np.asarray(result.history["energy"])
        # A tiny network after 3 steps: far above the exact energy, but a molecule's (N2: about -47 Ha, not Li's -7).
        assert energies.shape == (3,) and np.all(np.isfinite(energies)), (name, energies)
        assert np.all(energies < 0.25 * neural.SYSTEMS[name].exact_energy), (name, energies)


def test_a_run_whose_optimiser_cannot_fit_is_refused_before_anything_compiles(neural):
    compiles = []

    def on_event(name, seconds, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    argv = ["--system", "N2", "--quick", "--devices", "2", "--memory-budget", "100000", "--optimiser", "spring"]
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        with pytest.raises(sv.CallError) as refused:
            neural.main(argv)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert compiles == [], f"{len(compiles)} compilations before the refusal"
    config, mesh = neural.Config(**{**neural.QUICK, "system": "N2"}), sv.create_mesh(jax.devices()[:2])
    with sv.precision_policy(config.dtype, mesh=mesh).context():  # float64, as the run's
        sizes = neural.network_sizes(config, mesh)
        shapes = jax.eval_shape(lambda: neural.init(jax.random.key(0), neural.SYSTEMS["N2"], *sizes))
    p = sum(x.size for x in jax.tree.leaves(shapes))
    plan = sv.natural_gradient_memory(64, shapes, method="spring", devices=2, memory_budget=100000)
    assert plan.jacobian_bytes == 32 * p * 8 and not plan.fits  # 32 walkers per device, float64
    text = str(refused.value)
    assert f"needs about {format_bytes(plan.total_bytes)} per device" in text, text
    assert "budget of 97.66 KiB" in text and f"x {p} parameters" in text, text
    assert "walkers per device fit" in text and "--walkers" in text and "examples/kfac_vmc.py" in text, text
