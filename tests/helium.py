"""A small two-electron trial function of one walker, shared by the tests (not a test module)."""

import jax
import jax.numpy as jnp


def log_psi(params, r):
    """Slater-Jastrow log|psi| of one walker ``r`` of shape (2, 3)."""
    d = jnp.linalg.norm(r, axis=-1)
    r12 = jnp.linalg.norm(r[0] - r[1])
    return -params["alpha"] * jnp.sum(d) + r12 / (2 * (1 + params["beta"] * r12))


PARAMS = {"alpha": jnp.float32(1.8), "beta": jnp.float32(0.4)}


def positions(n, seed=0):
    """``n`` random walkers of two electrons."""
    return jax.random.normal(jax.random.key(seed), (n, 2, 3))
