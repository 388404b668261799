"""The neural DMC example: the network's nodes, DMC from the trained state, its checkpoints, its command line."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv

pytestmark = pytest.mark.end_to_end  # CI's second leg leaves it out (pyproject.toml's markers)


@pytest.fixture(scope="module")
def li():
    """A small Li network (float64), its parameters and 5 walkers."""
    import network

    with jax.enable_x64(True):
        params = network.init(jax.random.key(0), network.LI, 8, 4, 2, 2, jnp.float64)
        keys = jax.random.split(jax.random.key(1), 5)
        walkers = jax.vmap(lambda k: network.init_walker(k, network.LI, jnp.float64))(keys)
    return network, params, walkers


def test_the_sign_flips_under_the_exchange_of_two_same_spin_electrons(li):
    # The oracle: antisymmetry. Exchanging the two up electrons of Li changes psi's sign and not |psi|;
    # exchanging an up and the down electron is no symmetry of psi, and need not.
    network, params, walkers = li
    with jax.enable_x64(True):
        for r in walkers:
            s, log_abs = network.signed_log_psi(params, r, network.LI)
            swapped = r[jnp.array([1, 0, 2])]
            s2, log_abs2 = network.signed_log_psi(params, swapped, network.LI)
            assert float(s) in (-1.0, 1.0) and float(s2) == -float(s)
            np.testing.assert_allclose(float(log_abs2), float(log_abs), rtol=1e-12)
            assert float(network.log_psi(params, r, network.LI)) == float(log_abs)
            assert float(network.sign(params, r, network.LI)) == float(s)


def test_dmc_keeps_each_walker_on_its_side_of_the_network_s_nodes(li):
    # Walkers of both signs, 40 steps at a large time step (many moves try to cross a node): each walker's
    # recorded sign is the network's sign at its position, and no move crossed (the fixed-node constraint).
    import functools

    network, params, _ = li
    system = network.LI
    with jax.enable_x64(True):
        keys = jax.random.split(jax.random.key(2), 24)
        start = jax.vmap(lambda k: network.init_walker(k, system, jnp.float64))(keys)
        sign = functools.partial(network.sign, system=system)
        dmc = sv.dmc.DMC(
            functools.partial(network.log_psi, system=system),
            functools.partial(sv.hamiltonian.coulomb, charges=system.charges, coords=system.coords),
            time_step=0.05,
            sign=sign,
        )
        state = dmc.init(params, start)
        initial = np.asarray(jax.vmap(sign, (None, 0))(params, start))
        assert set(initial.tolist()) == {-1.0, 1.0}  # both sides of the nodes are populated
        result = sv.driver.run(dmc.step, state, 40, key=jax.random.key(3), progress=False)
        final = result.state.walkers
        r = np.asarray(final.data.r)[: final.n_valid]
        recorded = np.asarray(final.data.sign)[: final.n_valid]
        np.testing.assert_array_equal(recorded, np.asarray(jax.vmap(sign, (None, 0))(params, jnp.asarray(r))))
        assert 0 < np.mean(result.history["acceptance"]) < 1


@pytest.fixture(scope="module")
def example(tmp_path_factory):
    """The quick run from the command line on 8 devices with a checkpoint, and again on 3 from that checkpoint."""
    import neural_dmc

    tmp = tmp_path_factory.mktemp("neural_dmc")
    args = ["--quick", "--walkers", "61", "--checkpoint", str(tmp / "run"), "--json", str(tmp / "li.json")]
    first = neural_dmc.main([*args, "--devices", "8"])
    again = neural_dmc.run(neural_dmc.Config(**{**neural_dmc.QUICK, "walkers": 61}), sv.create_mesh(jax.devices()[:3]),
                           checkpoint=str(tmp / "run"))  # fmt: skip
    return neural_dmc, first, again, tmp


def test_the_example_runs_dmc_from_the_trained_network_at_every_time_step(example, capsys):
    neural_dmc, first, _, tmp = example
    assert [r["time_step"] for r in first["dmc"]] == [0.02, 0.01]
    assert [r["steps"] for r in first["dmc"]] == [20, 40]  # projection time / tau
    assert all(np.isfinite([r["energy"], r["error"]]).all() and r["error"] > 0 for r in first["dmc"])
    # The extrapolation is the weighted line through the two time steps.
    e0, err = sv.dmc.extrapolate([0.02, 0.01], [(r["energy"], r["error"]) for r in first["dmc"]])
    assert (first["energy"], first["error"]) == (e0, err)
    assert first["fixed_node_error"] == e0 - first["exact"] and first["devices"] == 8
    saved = json.loads((tmp / "li.json").read_text())
    assert saved["dmc"] == first["dmc"] and saved["energy"] == first["energy"]
    assert len(saved["energies"]) == 40  # the last run's steps
    # Every run checkpointed in its own folder: the training's, and one per time step.
    assert sorted(p.name for p in (tmp / "run").iterdir()) == ["dmc-0.01", "dmc-0.02", "vmc"]
    lines = neural_dmc.report(first)
    assert lines[0].startswith("Li: 61 walkers on 8 cpu devices") and lines[1].startswith("VMC  E = ")
    assert lines[2].startswith("DMC  tau = 0.02: E = ") and "fixed-node error" in lines[-1]


def test_the_same_command_on_another_device_count_gives_the_saved_runs(example):
    # The training and both DMC runs are restored from their checkpoints (finished): the same energies,
    # bit for bit, on 3 devices; only the VMC evaluation is computed again (round-off apart).
    _, first, again, _ = example
    assert again["devices"] == 3
    assert [(r["energy"], r["error"]) for r in again["dmc"]] == [(r["energy"], r["error"]) for r in first["dmc"]]
    assert again["energy"] == first["energy"]
    np.testing.assert_allclose(again["vmc_energy"], first["vmc_energy"], rtol=1e-9)
