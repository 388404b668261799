"""A complex log psi: a plane-wave phase times a real FermiNet amplitude.

``log psi(r) = log|amp(r)| + i k . sum_i r_i``: a current-carrying state whose local
energy is complex (``-1/2 (lap + grad.grad) log psi`` with an unconjugated square).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import ferminet
from .systems import System


def init(key: jax.Array, system: System, *, dtype: jnp.dtype = jnp.float32, **sizes: int) -> dict:
    """A FermiNet amplitude (``**sizes`` go to :func:`models.ferminet.init`) and a wave vector ``k``."""
    k_amp, k_k = jax.random.split(key)
    return {
        "amplitude": ferminet.init(k_amp, system, dtype=dtype, **sizes),
        "k": 0.3 * jax.random.normal(k_k, (3,), dtype),
    }


def log_psi(params: dict, r: jax.Array, system: System) -> jax.Array:
    """Complex ``log psi`` of one walker ``r`` of shape ``(n_electrons, 3)``."""
    phase = jnp.dot(params["k"], jnp.sum(r, axis=0))
    return jax.lax.complex(ferminet.log_psi(params["amplitude"], r, system), phase)


def log_abs_psi(params: dict, r: jax.Array, system: System) -> jax.Array:
    """``log|psi| = Re log psi`` of one walker."""
    return jnp.real(log_psi(params, r, system))


def exact_kinetic_shift(params: dict, system: System) -> jax.Array:
    """What the phase adds to the local energy's real part, ``n |k|^2 / 2`` (with ``-i k . sum grad log|amp|``)."""
    return 0.5 * system.n_electrons * jnp.sum(params["k"] ** 2)
