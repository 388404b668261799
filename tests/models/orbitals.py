"""The head shared by the networks: orbitals times envelopes, and a log-sum of signed determinants."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .constructs import positive
from .systems import System


def dense(key: jax.Array, n_in: int, n_out: int, dtype: jnp.dtype) -> dict:
    """A dense layer's parameters, ``w`` scaled by ``1/sqrt(n_in)`` and ``b`` small."""
    kw, kb = jax.random.split(key)
    return {
        "w": jax.random.normal(kw, (n_in, n_out), dtype) / jnp.sqrt(jnp.asarray(n_in, dtype)),
        "b": 0.1 * jax.random.normal(kb, (n_out,), dtype),
    }


def init_head(key: jax.Array, system: System, hidden: int, determinants: int, dtype: jnp.dtype) -> dict:
    """Orbital layers and envelope parameters for each spin with electrons, and determinant weights."""
    params = {"det_weights": jnp.ones((determinants,), dtype)}
    for spin, n_spin, k in (("up", system.n_up, 0), ("down", system.n_down, 1)):
        if n_spin == 0:
            continue
        kk = jax.random.fold_in(key, k)
        width = determinants * n_spin
        k1, k2, k3 = jax.random.split(kk, 3)
        params[spin] = {
            **dense(k1, hidden, width, dtype),
            "sigma": 1.0 + 0.1 * jax.random.normal(k2, (system.n_atoms, width), dtype),
            "pi": 1.0 + 0.1 * jax.random.normal(k3, (system.n_atoms, width), dtype),
        }
    return params


def orbital_matrices(
    params: dict, h: jax.Array, r_ae: jax.Array, determinants: int, absolute: Callable = positive
) -> jax.Array:
    """``(K, n_s, n_s)`` orbital matrices of one spin from features ``h (n_s, H)`` and ``r_ae (n_s, M)``.

    Each orbital is a linear function of the features times an exponential envelope
    ``sum_m pi_m exp(-|sigma_m| |r - R_m|)``; ``absolute`` is the ``custom_vjp`` :func:`positive`
    by default, ``jnp.abs`` where forward-mode derivatives in the parameters are needed (kfac-jax).
    """
    n_s = h.shape[0]
    phi = h @ params["w"] + params["b"]  # (n_s, K * n_s)
    env = jnp.sum(params["pi"][None] * jnp.exp(-absolute(params["sigma"])[None] * r_ae[:, :, None]), axis=1)
    return jnp.transpose((phi * env).reshape(n_s, determinants, n_s), (1, 0, 2))


def log_sum_dets(signs: jax.Array, logdets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sign, log|sum_k w_k sign_k exp(logdet_k)|)``, shifted by the largest ``logdet`` for stability."""
    shift = jax.lax.stop_gradient(jnp.max(logdets))
    total = jnp.sum(weights * signs * jnp.exp(logdets - shift))
    return jnp.sign(total), jnp.log(jnp.abs(total)) + shift


def determinant_head(
    params: dict, h: jax.Array, r_ae: jax.Array, system: System, absolute: Callable = positive
) -> tuple[jax.Array, jax.Array]:
    """``(sign, log|psi|)`` of K spin-up times spin-down determinants of features ``h (n, H)``."""
    determinants = params["det_weights"].shape[0]
    signs = jnp.ones((determinants,), h.dtype)
    logdets = jnp.zeros((determinants,), h.dtype)
    for spin, rows in (("up", slice(0, system.n_up)), ("down", slice(system.n_up, system.n_electrons))):
        if spin not in params:
            continue
        s, ld = jnp.linalg.slogdet(orbital_matrices(params[spin], h[rows], r_ae[rows], determinants, absolute))
        signs, logdets = signs * s, logdets + ld
    return log_sum_dets(signs, logdets, params["det_weights"])
