"""The template's systems are data that hold: neutral, the published spins, the nuclear repulsion, finite log psi.

Cheap checks on the CPU (a network of 4 hidden units, one walker per system); the energies and geometries
come from the sources cited beside each system in ``examples/network.py``.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from network import SYSTEMS, init, init_walker, log_psi, owners

import shardvmc as sv

# Unpaired electrons of each ground state (n_up - n_down): Li a doublet, the rest singlets.
SPIN = {"Li": 1, "LiH": 0, "Be": 0, "Ne": 0, "N2": 0, "bicyclobutane": 0}
ALL = pytest.mark.parametrize("name", sorted(SYSTEMS))


def nuclear_repulsion(system) -> float:
    """``sum_{a<b} Z_a Z_b / |R_a - R_b|`` by a plain loop in float64."""
    total = 0.0
    for a, b in itertools.combinations(range(len(system.charges)), 2):
        distance = np.linalg.norm(np.subtract(system.coords[a], system.coords[b]))
        total += system.charges[a] * system.charges[b] / distance
    return total


def test_the_table_of_systems_is_the_one_tested_here():
    assert set(SYSTEMS) == set(SPIN)


@ALL
def test_neutral_with_the_published_spin(name):
    system = SYSTEMS[name]
    assert system.n_up + system.n_down == sum(system.charges)
    assert system.n_up - system.n_down == SPIN[name]
    assert len(system.coords) == len(system.charges) and all(len(c) == 3 for c in system.coords)
    assert system.hf_energy is None or system.exact_energy < system.hf_energy < 0.0  # HF is variational


@ALL
def test_each_nucleus_starts_with_its_charge_in_electrons_of_both_spins(name):
    system = SYSTEMS[name]
    owner = owners(system)
    up, down = owner[: system.n_up], owner[system.n_up :]
    for m, z in enumerate(system.charges):
        assert up.count(m) + down.count(m) == z, (m, owner)
        assert abs(up.count(m) - down.count(m)) <= 1, (m, owner)  # no nucleus with only up electrons


@ALL
def test_the_library_s_nuclear_repulsion_is_the_plain_loop_s(name):
    system = SYSTEMS[name]
    # One electron a light year away: the electron terms vanish (below 1e-14 Ha), the nuclei's remain.
    far = np.array([[0.0, 0.0, 1e17]])
    with jax.enable_x64(True):
        total = float(sv.hamiltonian.coulomb(jnp.asarray(far), system.charges, system.coords))
    assert total == pytest.approx(nuclear_repulsion(system), rel=1e-12, abs=1e-12)


def test_n2_nuclear_repulsion_is_z_squared_over_r():
    assert nuclear_repulsion(SYSTEMS["N2"]) == pytest.approx(49 / 2.068, rel=1e-12)  # 23.694...
    assert 23.694 < nuclear_repulsion(SYSTEMS["N2"]) < 23.695


def test_bicyclobutane_is_ferminets_geometry_in_bohr():
    coords = np.asarray(SYSTEMS["bicyclobutane"].coords) * 0.52917721067  # back to angstrom
    assert coords[0] == pytest.approx([1.0487346562, 0.5208579773, 0.2375867187])
    distances = [np.linalg.norm(coords[a] - coords[b]) for a, b in itertools.combinations(range(10), 2)]
    assert 1.07 < min(distances) < 1.10  # a C-H bond, in angstrom


@ALL
def test_log_psi_of_a_tiny_network_is_finite_at_one_walker(name):
    system = SYSTEMS[name]
    params = init(jax.random.key(0), system, 4, 4, 1, 1, jnp.float32)
    r = init_walker(jax.random.key(1), system, jnp.float32)
    assert r.shape == (system.n_up + system.n_down, 3)
    value = jax.jit(log_psi, static_argnums=2)(params, r, system)
    assert value.shape == () and bool(jnp.isfinite(value))
