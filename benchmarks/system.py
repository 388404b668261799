"""The benchmark workload: a Slater-Jastrow trial function and its local energy.

The realistic system is O2: sixteen electrons (9 up, 7 down, the triplet ground state)
around two oxygen nuclei. The orbitals are linear combinations of Slater-type s and p
functions on each nucleus; the Jastrow factor is a Pade electron-electron term with the
cusp conditions. The local energy takes the Laplacian of log|psi| with
``folx.forward_laplacian``, as FermiNet-style codes do. A two-electron helium version of
the same code keeps the quick run (and its test) fast.

Everything here is plain JAX on ONE walker; the benchmarks build the kernels around it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import folx
import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True, eq=False)
class System:
    """Nuclei, electrons and basis of a Slater-Jastrow trial function."""

    name: str
    atoms: np.ndarray  # (n_atoms, 3), bohr
    charges: np.ndarray  # (n_atoms,)
    n_up: int
    n_dn: int
    zetas: np.ndarray  # Slater exponents, each with an s and three p functions per atom

    @property
    def n_el(self) -> int:
        return self.n_up + self.n_dn

    @property
    def n_basis(self) -> int:
        return len(self.atoms) * len(self.zetas) * 4

    @functools.cached_property
    def _pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # int32: JAX 0.10 caches an int64 NumPy constant's 32-bit conversion while a float32 program that traced it
        # is alive, and indexing with it under jax.enable_x64 (the benchmarks' float64 oracle) then fails
        i, j = (k.astype(np.int32) for k in np.triu_indices(self.n_el, 1))
        return i, j, (i < self.n_up) == (j < self.n_up)

    def init_params(self, seed: int = 0) -> dict[str, jax.Array]:
        """Orbital coefficients and the Jastrow parameter (random, fixed by ``seed``)."""
        rng = np.random.default_rng(seed)
        scale = 1 / np.sqrt(self.n_basis)
        return {
            "w_up": jnp.asarray(rng.normal(size=(self.n_basis, self.n_up)) * scale, jnp.float32),
            "w_dn": jnp.asarray(rng.normal(size=(self.n_basis, self.n_dn)) * scale, jnp.float32),
            "b_ee": jnp.asarray(1.0, jnp.float32),
        }

    def init_walkers(self, n_walkers: int, seed: int = 1) -> np.ndarray:
        """``n_walkers`` configurations, shape ``(n_walkers, n_el, 3)``, around the nuclei."""
        rng = np.random.default_rng(seed)
        centres = self.atoms[np.arange(self.n_el) % len(self.atoms)]
        return (centres + rng.normal(size=(n_walkers, self.n_el, 3))).astype(np.float32)

    def _basis(self, r: jax.Array) -> jax.Array:
        d = r[:, None, :] - self.atoms[None, :, :]  # (el, atom, 3)
        dist = jnp.sqrt(jnp.sum(d**2, axis=-1))  # (el, atom)
        radial = jnp.exp(-self.zetas[None, None, :] * dist[..., None])  # (el, atom, zeta)
        angular = jnp.concatenate([jnp.ones_like(d[..., :1]), d], axis=-1)  # (el, atom, 4): s, px, py, pz
        return (radial[..., :, None] * angular[..., None, :]).reshape(self.n_el, self.n_basis)

    def _r_ee(self, r: jax.Array) -> jax.Array:
        i, j, _ = self._pairs
        return jnp.sqrt(jnp.sum((r[i] - r[j]) ** 2, axis=-1))

    def log_psi(self, params: dict[str, jax.Array], r: jax.Array, slogdet: Callable = jnp.linalg.slogdet) -> jax.Array:
        """``log|psi|`` of one walker (``(n_el, 3)`` or flattened); ``slogdet``: e.g. ``sv.linalg.slogdet``."""
        r = r.reshape(self.n_el, 3)
        phi = self._basis(r)
        logdet_up = _log_abs_det(phi[: self.n_up] @ params["w_up"], slogdet)
        logdet_dn = _log_abs_det(phi[self.n_up :] @ params["w_dn"], slogdet)
        r_ee = self._r_ee(r)
        cusp = jnp.where(self._pairs[2], 0.25, 0.5)
        return logdet_up + logdet_dn + jnp.sum(cusp * r_ee / (1.0 + params["b_ee"] * r_ee))

    def potential(self, r: jax.Array) -> jax.Array:
        """Coulomb energy of one walker: electron-electron, electron-nucleus, nucleus-nucleus."""
        r_en = jnp.sqrt(jnp.sum((r[:, None, :] - self.atoms[None]) ** 2, axis=-1))
        i, j = np.triu_indices(len(self.atoms), 1)
        v_nn = float(np.sum(self.charges[i] * self.charges[j] / np.linalg.norm(self.atoms[i] - self.atoms[j], axis=-1)))
        return jnp.sum(1.0 / self._r_ee(r)) - jnp.sum(self.charges / r_en) + v_nn

    def local_energy(self, params: dict[str, jax.Array], r: jax.Array) -> jax.Array:
        """``-(lap log psi + |grad log psi|^2) / 2 + V`` of one walker, by ``folx.forward_laplacian``."""
        out = folx.forward_laplacian(lambda x: self.log_psi(params, x))(r.reshape(-1))
        grad = out.jacobian.dense_array
        return -0.5 * (out.laplacian + jnp.sum(grad**2)) + self.potential(r)

    def local_energy_reference(self, params: dict[str, jax.Array], r: jax.Array) -> jax.Array:
        """The same local energy by ``jax.hessian`` (slow; checks ``local_energy``)."""
        x = r.reshape(-1)
        grad = jax.grad(lambda y: self.log_psi(params, y))(x)
        lap = jnp.trace(jax.hessian(lambda y: self.log_psi(params, y))(x))
        return -0.5 * (lap + jnp.sum(grad**2)) + self.potential(r)


def _log_abs_det(m: jax.Array, slogdet: Callable) -> jax.Array:
    """``log|det m|``; a 1x1 determinant is its entry (keeps helium's compiles, and the quick run, short)."""
    if m.shape == (1, 1):
        return jnp.log(jnp.abs(m[0, 0]))
    return slogdet(m)[1]


O2 = System(
    name="O2 (16 electrons, 9 up / 7 down, 24 s+p Slater functions)",
    atoms=np.array([[0.0, 0.0, -1.141], [0.0, 0.0, 1.141]], np.float32),
    charges=np.array([8.0, 8.0], np.float32),
    n_up=9,
    n_dn=7,
    zetas=np.array([7.7, 2.6, 1.4], np.float32),
)
HE = System(
    name="He (2 electrons, 1 up / 1 down, 4 s+p Slater functions)",
    atoms=np.zeros((1, 3), np.float32),
    charges=np.array([2.0], np.float32),
    n_up=1,
    n_dn=1,
    zetas=np.array([1.7], np.float32),
)
