"""A FermiNet-style network (Pfau et al. 2020), per walker, in plain JAX.

One-electron stream: electron-nucleus vectors and distances. Two-electron stream:
electron-electron vectors and distances, the diagonal masked with ``jnp.eye(n)`` as real
codes do. Each layer mixes the one-electron stream with its means over same-spin and
opposite-spin electrons and with the means of the two-electron stream (permutation
equivariant). The head builds K spin-up and spin-down orbital matrices with exponential
envelopes and combines their signed ``slogdet`` s stably. A Jastrow factor with the
electron-electron cusp uses a range parameter found by a ``while_loop`` fixed point.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .constructs import babylonian_sqrt, positive
from .orbitals import dense, determinant_head, init_head
from .systems import System


def init(
    key: jax.Array,
    system: System,
    *,
    hidden_one: int = 16,
    hidden_two: int = 8,
    layers: int = 2,
    determinants: int = 2,
    dtype: jnp.dtype = jnp.float32,
) -> dict:
    """Parameters of a FermiNet with ``layers`` mixing layers of widths ``hidden_one``/``hidden_two``."""
    keys = jax.random.split(key, 2 * layers + 2)
    d_one, d_two = 4 * system.n_atoms, 4
    params: dict = {"layers": []}
    for i in range(layers):
        layer = {"one": dense(keys[2 * i], 3 * d_one + 2 * d_two, hidden_one, dtype)}
        if i < layers - 1:  # the last layer's two-electron stream would be unused
            layer["two"] = dense(keys[2 * i + 1], d_two, hidden_two, dtype)
        params["layers"].append(layer)
        d_one, d_two = hidden_one, hidden_two
    params["head"] = init_head(keys[-2], system, d_one, determinants, dtype)
    params["jastrow"] = {"beta": jnp.asarray(0.5, dtype)}
    return params


def input_features(r: jax.Array, system: System) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """One-electron features ``(n, 4M)``, two-electron ``(n, n, 4)``, ``r_ae (n, M)``, ``r_ee (n, n)``."""
    n = r.shape[0]
    coords, _ = system.nuclei(r.dtype)
    ae = r[:, None, :] - coords[None, :, :]
    r_ae = jnp.linalg.norm(ae, axis=-1)
    ee = r[None, :, :] - r[:, None, :]
    r_ee = jnp.linalg.norm(ee + jnp.eye(n)[..., None], axis=-1) * (1.0 - jnp.eye(n))
    one = jnp.concatenate([ae.reshape(n, -1), r_ae], axis=-1)
    two = jnp.concatenate([ee, r_ee[..., None]], axis=-1)
    return one, two, r_ae, r_ee


def spin_masks(system: System, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """Row-normalised ``(n, n)`` averaging matrices over same-spin and opposite-spin electrons."""
    up = jnp.arange(system.n_electrons) < system.n_up
    same = (up[:, None] == up[None, :]).astype(dtype)
    opposite = 1.0 - same
    return (
        same / jnp.maximum(same.sum(-1, keepdims=True), 1.0),
        opposite / jnp.maximum(opposite.sum(-1, keepdims=True), 1.0),
    )


def jastrow(params: dict, r_ee: jax.Array, system: System, sqrt: Callable = babylonian_sqrt) -> jax.Array:
    """``sum_{i<j} a_ij r_ij / (1 + b r_ij)`` with the cusp ``a`` = 1/4 (same spin) or 1/2 (opposite).

    ``b = sqrt(beta^2 + 1)``; ``sqrt`` is a fixed-point iteration by default (a
    ``custom_vjp`` in the corpus), ``jnp.sqrt`` where forward-mode derivatives in the
    parameters are needed (kfac-jax).
    """
    n = system.n_electrons
    up = jnp.arange(n) < system.n_up
    cusp = jnp.where(up[:, None] == up[None, :], 0.25, 0.5)
    b = sqrt(params["beta"] ** 2 + 1.0)
    pairs = jnp.triu(jnp.ones((n, n), r_ee.dtype), k=1)
    return jnp.sum(pairs * cusp * r_ee / (1.0 + b * r_ee))


def features(params: dict, r: jax.Array, system: System) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The one-electron stream after all layers ``(n, H)``, plus ``r_ae`` and ``r_ee``."""
    one, two, r_ae, r_ee = input_features(r, system)
    same, opposite = spin_masks(system, r.dtype)
    for layer in params["layers"]:
        mixed = jnp.concatenate(
            [
                one,
                same @ one,
                opposite @ one,
                jnp.einsum("ij,ijk->ik", same, two),
                jnp.einsum("ij,ijk->ik", opposite, two),
            ],
            axis=-1,
        )
        new_one = jnp.tanh(mixed @ layer["one"]["w"] + layer["one"]["b"])
        one = new_one + one if new_one.shape == one.shape else new_one
        if "two" in layer:
            new_two = jnp.tanh(two @ layer["two"]["w"] + layer["two"]["b"])
            two = new_two + two if new_two.shape == two.shape else new_two
    return one, r_ae, r_ee


def signed_log_psi(
    params: dict, r: jax.Array, system: System, *, forward_mode: bool = False
) -> tuple[jax.Array, jax.Array]:
    """``(sign psi, log|psi|)`` of one walker ``r`` of shape ``(n_electrons, 3)``.

    ``forward_mode``: ``jnp.abs`` and ``jnp.sqrt`` in place of the ``custom_vjp`` constructs,
    so that ``jax.jvp`` in the parameters works (kfac-jax takes jvps). Without a
    ``"jastrow"`` entry in ``params`` the network has no Jastrow factor.
    """
    h, r_ae, r_ee = features(params, r, system)
    sign, log_abs = determinant_head(params["head"], h, r_ae, system, jnp.abs if forward_mode else positive)
    if "jastrow" in params:
        log_abs = log_abs + jastrow(params["jastrow"], r_ee, system, jnp.sqrt if forward_mode else babylonian_sqrt)
    return sign, log_abs


def log_psi(params: dict, r: jax.Array, system: System, *, forward_mode: bool = False) -> jax.Array:
    """``log|psi|`` of one walker ``r`` of shape ``(n_electrons, 3)`` (``forward_mode``: see :func:`signed_log_psi`)."""
    return signed_log_psi(params, r, system, forward_mode=forward_mode)[1]
