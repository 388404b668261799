"""FermiNet's KFAC loss, as ``ferminet/loss.py`` (``make_loss``) writes it, on a small FermiNet-style network.

The loss is written for ONE device's block of walkers, as under FermiNet's ``pmap``:
means are ``kfac_jax.utils.pmean_if_pmap`` over ``"qmc_pmap_axis"``, the gradient is a
``jax.custom_jvp`` (``E[(E_L - E) d log psi]`` with the local energies clipped to five
mean absolute deviations), and the network's output is registered as a normal
predictive distribution for kfac-jax's curvature. The local energy has an optional
random term drawn from the loss's key, split per walker as FermiNet splits it, so a test
sees how the key reaches each device.

The network is the corpus FermiNet (:mod:`models.ferminet`) in its forward-mode form
(``jnp.abs`` and ``jnp.sqrt`` in place of its ``custom_vjp`` constructs: kfac-jax takes
jvps in the parameters), without the Jastrow factor unless asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from . import ferminet, hamiltonian
from .systems import System

AXIS = "qmc_pmap_axis"


def init(key: jax.Array, system: System, *, jastrow: bool = False, **sizes: Any) -> dict:
    """The corpus FermiNet's parameters, with its cusp Jastrow or (the default) without."""
    params = ferminet.init(key, system, **sizes)
    if not jastrow:
        del params["jastrow"]
    return params


def log_psi(params: dict, r: jax.Array, system: System) -> jax.Array:
    """``log|psi|`` of one walker: the corpus FermiNet in its forward-mode form."""
    return ferminet.log_psi(params, r, system, forward_mode=True)


def make_loss(
    system: System,
    *,
    clip: float = 5.0,
    noise: float = 0.0,
    method: str = "fori",
    vmap: Callable[..., Any] = jax.vmap,
    network: Callable[..., jax.Array] = log_psi,
) -> Callable[..., Any]:
    """FermiNet's ``total_energy(params, key, walkers) -> (loss, aux)`` for kfac-jax.

    Args:
        system: the atom or molecule.
        clip: the clipping window of the gradient's local energies, in mean absolute deviations.
        noise: the scale of a random term added to each local energy, drawn from the key.
        method: the Laplacian method of ``models.hamiltonian``.
        vmap: how the loss maps the network over its walkers (FermiNet: ``jax.vmap``).
        network: ``log_psi(params, r, system)``.
    """
    # Imported here, not with the module: kfac-jax loads scipy (and its OpenBLAS), which must come after
    # shardvmc.testing.set_cpu_devices has limited OpenBLAS to one thread per fake device.
    import kfac_jax

    psi = functools.partial(network, system=system)
    energy = hamiltonian.make_local_energy(psi, system, method)

    def local_energy(params: dict, key: jax.Array, r: jax.Array) -> jax.Array:
        return energy(params, r) + noise * jax.random.normal(key, (), r.dtype)

    batch_local_energy = vmap(local_energy, in_axes=(None, 0, 0))
    batch_network = vmap(psi, in_axes=(None, 0))
    pmean = functools.partial(kfac_jax.utils.pmean_if_pmap, axis_name=AXIS)

    @jax.custom_jvp
    def total_energy(params: dict, key: jax.Array, walkers: jax.Array) -> tuple[jax.Array, dict]:
        keys = jax.random.split(key, walkers.shape[0])
        e_l = batch_local_energy(params, keys, walkers)
        loss = pmean(jnp.mean(e_l))
        return loss, {"variance": pmean(jnp.mean((e_l - loss) ** 2)), "local_energy": e_l}

    @total_energy.defjvp
    def total_energy_jvp(primals: tuple[Any, ...], tangents: tuple[Any, ...]) -> tuple[Any, Any]:
        params, key, walkers = primals
        loss, aux = total_energy(params, key, walkers)
        e_l = aux["local_energy"]
        tv = pmean(jnp.mean(jnp.abs(e_l - loss)))
        clipped = jnp.clip(e_l, loss - clip * tv, loss + clip * tv)
        diff = clipped - pmean(jnp.mean(clipped))
        psi_primal, psi_tangent = jax.jvp(lambda p: batch_network(p, walkers), (params,), (tangents[0],))
        kfac_jax.register_normal_predictive_distribution(psi_primal[:, None])
        return (loss, aux), (jnp.dot(psi_tangent, diff) / e_l.shape[0], aux)

    return total_energy
