"""The neural-network VMC example: device-count invariance, resume, clipping, optimisers, checkpoints, CLI."""

import dataclasses
import doctest
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree

import shardvmc as sv

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "neural_vmc.py"
LIKE = {"r": jax.ShapeDtypeStruct((1, 3, 3), np.float64), "log_psi": jax.ShapeDtypeStruct((1,), np.float64)}
FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


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
    # The --quick settings with SPRING, so that its momentum state is in the checkpoints too;
    # 61 walkers: padded to 64 on 8 devices.
    return dataclasses.replace(neural.Config(**neural.QUICK), walkers=61, optimiser="spring")


@pytest.fixture(scope="module")
def runs(neural, quick, tmp_path_factory):
    """The quick run on 8 and on 1 device; interrupted after 3 steps and resumed on 8 and on 1."""
    tmp = tmp_path_factory.mktemp("neural")
    mesh1, mesh8 = sv.create_mesh(jax.devices()[:1]), sv.create_mesh(jax.devices()[:8])
    quiet = {"printer": lambda *_: None}
    out = {
        "8dev": neural.run(quick, mesh=mesh8, checkpoint=str(tmp / "full.ckpt"), **quiet),
        "1dev": neural.run(quick, mesh=mesh1, **quiet),
    }
    ckpt = tmp / "cut.ckpt"
    out["cut"] = neural.run(quick, mesh=mesh8, checkpoint=str(ckpt), checkpoint_every=2, stop_after=3, **quiet)
    with jax.enable_x64(True):  # read before the resumes overwrite it
        out["cut_checkpoint"] = sv.load_walkers(ckpt, LIKE, mesh8)
    for name, mesh in (("resumed8", mesh8), ("resumed1", mesh1)):
        (tmp / f"{name}.ckpt").write_bytes(ckpt.read_bytes())
        out[name] = neural.run(quick, mesh=mesh, checkpoint=str(tmp / f"{name}.ckpt"), resume=True, **quiet)
    out["full_checkpoint"] = tmp / "full.ckpt"
    return out


def test_quick_run_on_1_and_8_devices_gives_the_same_energies(runs, quick):
    one, eight = runs["1dev"], runs["8dev"]
    assert (one["devices"], eight["devices"]) == (1, 8) and eight["dtype"] == "float64"
    assert len(eight["energies"]) == quick.steps + quick.eval_steps
    assert np.all(np.isfinite(eight["energies"])) and 0 < eight["acceptance"] < 1
    # float64 round-off only: the same walker trajectories, reductions summed in another order;
    # the damped solve and the optimisation's feedback amplify it (seen: below 1e-9 in these steps).
    np.testing.assert_allclose(eight["energies"], one["energies"], rtol=0, atol=1e-7)
    np.testing.assert_allclose(eight["variances"], one["variances"], rtol=1e-6)
    assert eight["acceptances"] == one["acceptances"]  # counts of accepted moves: exact


def test_resume_after_an_interrupted_run_equals_the_uninterrupted_run(runs):
    assert runs["cut"]["steps_done"] == 3
    # Same device count: bit-identical (parameters, momentum and step size come back exactly).
    assert runs["resumed8"]["energies"] == runs["8dev"]["energies"]
    assert runs["resumed8"]["energy"] == runs["8dev"]["energy"]
    # Onto another device count: to round-off (amplified as above).
    np.testing.assert_allclose(runs["resumed1"]["energies"], runs["8dev"]["energies"], rtol=0, atol=1e-7)


def test_checkpoint_holds_walkers_parameters_optimiser_state_and_step(runs, quick, neural):
    walkers, n_valid, meta = runs["cut_checkpoint"]
    assert isinstance(walkers, sv.WalkerSet) and n_valid == walkers.n_valid == quick.walkers
    assert walkers.data["r"].shape == (64, 3, 3) and walkers.data["r"].dtype == jnp.float64
    assert meta["step"] == 3 and len(meta["history"]) == 3
    assert [h[0] for h in meta["history"]] == runs["8dev"]["energies"][:3]
    assert meta["config"] == dataclasses.asdict(quick) and meta["dtype"] == "float64"
    assert len(meta["params"]) == runs["8dev"]["n_params"] == len(meta["previous"])
    assert np.any(np.asarray(meta["previous"]) != 0)  # SPRING's previous update is carried
    assert meta["step_size"] > 0
    with jax.enable_x64(True):
        # The cached log|psi| of the walkers is that of the saved parameters.
        _, unravel = ravel_pytree(neural.init_params(quick, jnp.float64))
        params = unravel(jnp.asarray(meta["params"]))
        r = np.asarray(walkers.data["r"])[:n_valid]
        log_psi = jax.jit(jax.vmap(lambda x: neural.ferminet.log_psi(params, x, neural.SYSTEMS["Li"])))(r)
        np.testing.assert_allclose(log_psi, np.asarray(walkers.data["log_psi"])[:n_valid], rtol=1e-12)
        # The final checkpoint of a full run is written at its last step.
        final = sv.load_walkers(runs["full_checkpoint"], LIKE)
    assert final.metadata["step"] == quick.steps + quick.eval_steps


def test_resume_refuses_a_checkpoint_of_other_settings(runs, quick, neural):
    other = dataclasses.replace(quick, clip=quick.clip + 1)  # the same network: no compilation
    with pytest.raises(SystemExit, match="other settings.*clip"):
        neural.run(other, mesh=sv.create_mesh(jax.devices()[:8]), checkpoint=str(runs["full_checkpoint"]), resume=True)


def test_clipping_against_numpy(neural):
    # 29 valid walkers (one outlier) padded to 32 with garbage that must not enter the window.
    rng = np.random.default_rng(0)
    e = rng.normal(-7.4, 0.3, size=29)
    e[5] = 40.0
    padded = np.concatenate([e, [1e6, np.nan, -1e6]])
    kernels = neural.make_kernels(sv.create_mesh(jax.devices()[:8]), None)
    with jax.enable_x64(True):
        clipped, mean, mean2 = kernels.clip(sv.WalkerSet(jnp.asarray(padded), n_valid=29), 5.0)
    assert clipped.n_valid == 29
    got = np.asarray(clipped.data)[:29]
    np.testing.assert_allclose(got, neural.clip_reference(e), rtol=1e-12)
    assert got[5] < 40.0 and np.all(got[np.arange(29) != 5] == e[np.arange(29) != 5])
    np.testing.assert_allclose([float(mean), float(mean2)], [e.mean(), (e**2).mean()], rtol=1e-12)


def test_optimiser_choice_from_the_command_line(neural):
    assert neural.config_from_args(neural.parse_args([])).optimiser == "cg"  # CPU: matrix-free
    for name in neural.OPTIMISERS:
        assert neural.config_from_args(neural.parse_args(["--optimiser", name])).optimiser == name
    quick = neural.config_from_args(neural.parse_args(["--quick", "--walkers", "100", "--system", "Be"]))
    assert quick.walkers == 100 and quick.system == "Be" and quick.layers == neural.QUICK["layers"]
    with pytest.raises(SystemExit):
        neural.parse_args(["--optimiser", "adam"])


def test_systems_are_data(neural):
    assert set(neural.SYSTEMS) == {"Li", "LiH", "Be"}
    li, lih, be = (neural.SYSTEMS[n] for n in ("Li", "LiH", "Be"))
    assert (li.exact_energy, li.hf_energy, be.exact_energy, be.hf_energy) == (-7.47806, -7.43273, -14.66736, -14.57302)
    assert lih.exact_energy == -8.07050 and lih.coords[1][2] == 3.015 and lih.charges == (3.0, 1.0)


def test_module_turns_off_the_concurrency_optimised_scheduler(neural):
    assert FLAG in os.environ["XLA_FLAGS"]
    assert "before JAX starts" in EXAMPLE.read_text()


def test_example_doctests(neural):
    result = doctest.testmod(neural, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_command_line_json_and_plot(neural, quick, tmp_path, capsys):
    # In-process, with the settings of the `runs` fixture: its compiled steps are reused.
    path = tmp_path / "li.json"
    args = ["--quick", "--walkers", "61", "--optimiser", "spring", "--devices", "8", "--no-bar"]
    summary = neural.main([*args, "--json", str(path), "--plot", str(tmp_path / "li.png"), "--print-every", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    progress = [line for line in lines if re.match(r"(opt |eval) step +\d+/10 +E = ", line)]
    assert len(progress) == 10 and all(k in progress[-1] for k in ("var = ", "acc = ", "walkers/s = ", "ETA"))
    e_line = r"E = -\d\.\d{5} \+- \d\.\d{5} Ha \(exact -7\.47806\)"
    assert any(re.fullmatch(e_line, line) for line in lines[-2:]), lines[-2:]
    saved = json.loads(path.read_text())
    assert saved["devices"] == 8 and saved["system"] == "Li" and saved["config"] == dataclasses.asdict(quick)
    assert saved["energies"] == summary["energies"] and len(saved["energies"]) == 10
    assert saved["correlation_fraction"] == pytest.approx((-7.43273 - saved["energy"]) / (-7.43273 + 7.47806))
    try:
        import matplotlib  # noqa: F401

        assert (tmp_path / "li.png").stat().st_size > 0
    except ImportError:
        assert lines[-1].startswith("--plot needs matplotlib") and not (tmp_path / "li.png").exists()


def test_script_starts_with_the_flags_set(tmp_path):
    # A subprocess without XLA_FLAGS: the module sets the scheduler flag itself, before JAX starts.
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    # python examples/neural_vmc.py puts examples/ first on sys.path (its model corpus); runpy does not
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE.parent), str(ROOT), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    code = (
        f"import os, runpy; module = runpy.run_path({str(EXAMPLE)!r}); "
        "print(os.environ['XLA_FLAGS']); module['parse_args'](['--help'])"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].split() == [FLAG]
    assert "--checkpoint-every" in proc.stdout and "--optimiser" in proc.stdout
