"""The helium VMC example: energy, JSON summary, device-count invariance, CLI."""

import doctest
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import shardvmc as sv
from shardvmc.testing import cpu_environment

pytestmark = pytest.mark.end_to_end  # CI's second leg leaves it out (pyproject.toml's markers)
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "helium_vmc.py"
# Small settings: 301 walkers (padded by the library to 304 on 8 devices), 20 SR steps.
SMALL = {"walkers": 301, "steps": 20, "eval_steps": 32, "seed": 1}
# The variational optimum of this two-parameter trial function (long runs: -2.8902 +- 0.0004).
ANSATZ_OPTIMUM = -2.8902


@pytest.fixture(scope="module")
def helium():
    spec = importlib.util.spec_from_file_location("helium_vmc", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["helium_vmc"] = module  # chex dataclasses and annotations resolve through the module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("helium_vmc", None)


@pytest.fixture(scope="module")
def runs(helium):
    """The same small run on 1 device, on 8 devices, and on 3 devices with batch_size."""
    config = helium.Config(**SMALL)
    return {
        "1dev": helium.run(config, sv.create_mesh(jax.devices()[:1])),
        "8dev": helium.run(config, sv.create_mesh(jax.devices()[:8])),
        "3dev_batched": helium.run(helium.Config(**SMALL, batch_size=16), sv.create_mesh(jax.devices()[:3])),
    }


def test_energy_shows_correlation(helium, runs):
    out = runs["8dev"]
    assert out["devices"] == 8 and out["walkers"] == 301 and out["dtype"] == "float64"
    assert 0 < out["error"] < 0.01 and out["tau_corr"] > 0 and 0.9 < out["R_hat"] < 1.1
    assert len(out["energies"]) == SMALL["steps"]  # the optimisation's; the evaluation is sv.driver.expect's
    # Below Hartree-Fock by many error bars: the Jastrow factor's correlation energy shows,
    assert out["energy"] + 4 * out["error"] < helium.HARTREE_FOCK
    # and consistent with the variational optimum of this trial function.
    assert abs(out["energy"] - ANSATZ_OPTIMUM) < 5 * out["error"] + 0.003
    assert 1.75 < out["parameters"]["alpha"] < 1.95 and 0.2 < out["parameters"]["beta"] < 0.5
    assert 0.2 < out["acceptance"] < 0.5 and 0.02 < out["variance"] < 0.5


def test_same_seed_same_energies_on_1_and_8_devices(runs):
    one, eight = runs["1dev"], runs["8dev"]
    assert one["devices"] == 1
    # float64 round-off only: identical walker trajectories, reductions summed in another order.
    np.testing.assert_allclose(eight["energies"], one["energies"], rtol=0, atol=1e-10)
    for name in ("alpha", "beta"):
        assert eight["parameters"][name] == pytest.approx(one["parameters"][name], abs=1e-10)
    assert eight["energy"] == pytest.approx(one["energy"], abs=1e-10)
    assert eight["error"] == pytest.approx(one["error"], rel=1e-6)


def test_batch_size_and_padding_do_not_change_energies(runs):
    batched = runs["3dev_batched"]  # 301 walkers padded to 303, 101 per device in chunks of 16
    assert batched["devices"] == 3 and batched["batch_size"] == 16
    np.testing.assert_allclose(batched["energies"], runs["1dev"]["energies"], rtol=0, atol=1e-10)


def test_another_seed_gives_other_energies(helium, runs):
    other = helium.run(helium.Config(**{**SMALL, "seed": 2, "steps": 2, "eval_steps": 0}), sv.create_mesh())
    assert other["energies"][0] != runs["8dev"]["energies"][0]


def test_a_step_communicates_only_reduced_statistics(helium):
    # The compiled optimisation step holds no gather of walkers or of the Jacobian: its
    # only collectives are all-reduces of a few numbers (acceptance; means; the dense solver's
    # Gram matrix of [Jc | ec], 3 x 3 for the two parameters).
    mesh = sv.create_mesh(jax.devices()[:8])
    with jax.enable_x64(True), sv.use_mesh(mesh):
        positions = sv.initialize_walkers_sharded(helium.init_walker, SMALL["walkers"], key=jax.random.key(0))
        params = sv.replicate(helium.Params(alpha=jax.numpy.asarray(1.7), beta=jax.numpy.asarray(0.3)))
        sampler, optimiser, step = helium.make_step(mesh, None, 10, 0.2, 1e-3)
        state = helium.State(params, optimiser.init(params), sampler.init(params, positions, 0.5))
        hlo = step.lower(state, jax.random.key(1)).compile().as_text()
    for collective in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert collective not in hlo
    reduced = re.findall(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(", hlo)
    assert reduced, "expected the statistics to be all-reduced"
    sizes = [
        int(np.prod([int(d) for d in re.findall(r"\d+", dims)] or [1]))
        for dims in re.findall(r"f64\[([\d,]*)\]", " ".join(reduced))
    ]
    assert sum(sizes) <= 24, reduced  # scalars, 2-vectors and the 3x3 Gram matrix; never 301 walkers


def test_example_doctests(helium):
    result = doctest.testmod(helium, verbose=False)
    assert result.attempted > 0 and result.failed == 0


def test_command_line_writes_json(tmp_path):
    env = dict(os.environ)
    cpu_environment(env, None, replace=True)  # --devices creates the devices; the suite's fast-compile flags stay
    env["JAX_PLATFORMS"] = "cpu"
    path = tmp_path / "he.json"
    args = ["--walkers", "101", "--steps", "5", "--eval-steps", "32", "--devices", "3", "--seed", "4"]
    args += ["--print-every", "1"]
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), *args, "--json", str(path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    estimate = r"E = -2\.\d{5} \+- 0\.\d{5} Ha \(exact -2\.903724\), autocorrelation \d+\.\d steps, R_hat \d\.\d{3}"
    assert re.fullmatch(estimate, lines[-1]), lines[-1]
    progress = [line for line in lines if re.match(r"step \d/5  energy = -2\.\d+ ± 0\.\d+  ", line)]
    assert len(progress) == 5 and "acceptance = " in progress[0] and "variance = " in progress[0], lines
    summary = json.loads(path.read_text())
    expected = {"energy", "error", "tau_corr", "R_hat", "variance", "acceptance", "parameters", "devices", "seconds"}
    assert expected <= set(summary)
    assert summary["devices"] == 3 and summary["walkers"] == 101 and summary["seed"] == 4
    assert set(summary["parameters"]) == {"alpha", "beta"}
    assert summary["seconds"] > 0 and 0 < summary["acceptance"] < 1 and summary["variance"] > 0
    assert f"{summary['energy']:.5f} +- {summary['error']:.5f}" in lines[-1]
