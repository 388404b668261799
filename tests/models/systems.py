"""Atoms and molecules as data: nuclei, charges, spins, and reference energies (hartree)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class System:
    """Nuclei (bohr), their charges, the electron spins, and reference energies.

    Frozen and made of tuples, so it is hashable and can be a ``Static`` argument.
    """

    name: str
    coords: tuple[tuple[float, float, float], ...]
    charges: tuple[float, ...]
    n_up: int
    n_down: int
    exact_energy: float
    hf_energy: float | None = None

    @property
    def n_electrons(self) -> int:
        """Number of electrons."""
        return self.n_up + self.n_down

    @property
    def n_atoms(self) -> int:
        """Number of nuclei."""
        return len(self.charges)

    def nuclei(self, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
        """Nuclear positions ``(n_atoms, 3)`` and charges ``(n_atoms,)`` as arrays of ``dtype``."""
        return jnp.asarray(self.coords, dtype), jnp.asarray(self.charges, dtype)


LI = System("Li", ((0.0, 0.0, 0.0),), (3.0,), 2, 1, exact_energy=-7.47806, hf_energy=-7.43273)
LIH = System("LiH", ((0.0, 0.0, 0.0), (0.0, 0.0, 3.015)), (3.0, 1.0), 2, 2, exact_energy=-8.07050)
BE = System("Be", ((0.0, 0.0, 0.0),), (4.0,), 2, 2, exact_energy=-14.66736, hf_energy=-14.57302)
H2 = System("H2", ((0.0, 0.0, -0.7), (0.0, 0.0, 0.7)), (1.0, 1.0), 1, 1, exact_energy=-1.17447, hf_energy=-1.13363)

SYSTEMS = {s.name: s for s in (LI, LIH, BE, H2)}


def init_walkers(key: jax.Array, system: System, n_walkers: int, dtype: jnp.dtype = jnp.float32) -> jax.Array:
    """``n_walkers`` walkers ``(n_walkers, n_electrons, 3)``: electrons near nuclei, spread by charge.

    Electrons are assigned to nuclei round-robin (heaviest first) and displaced by a unit
    Gaussian, so no two electrons coincide and no electron sits on a nucleus.
    """
    coords, _ = system.nuclei(dtype)
    order = sorted(range(system.n_atoms), key=lambda m: -system.charges[m])
    owner = jnp.asarray([order[i % system.n_atoms] for i in range(system.n_electrons)])
    noise = jax.random.normal(key, (n_walkers, system.n_electrons, 3), dtype)
    return coords[owner][None] + noise
