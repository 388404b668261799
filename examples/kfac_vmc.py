"""The neural example's network trained with KFAC (kfac-jax), FermiNet's way, on every device.

FermiNet's loss (``ferminet/loss.py``, ``make_loss``) is written for one device's block of
walkers, as under its ``pmap``: its means are ``pmean`` s over ``"qmc_pmap_axis"``, its
gradient a ``jax.custom_jvp`` (``E[(E_L - E) d log psi]`` with the local energies clipped),
and it registers the network's output for kfac-jax's curvature. ``shardvmc.kfac.Optimizer``
runs it on the walker-sharded batch. The network, the sampling, the evaluation, the run and
its checkpoints are ``neural_vmc.py``'s, on ``sv.driver.run`` (copy it, ``network.py`` and ``plumbing.py`` too).

    python examples/kfac_vmc.py --system Li
    python examples/kfac_vmc.py --quick --devices 2
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import neural_vmc as vmc
from network import SYSTEMS, System, log_psi

AXIS = "qmc_pmap_axis"


@dataclasses.dataclass(frozen=True)
class Config(vmc.Config):
    """The neural example's settings, with KFAC."""

    optimiser: str = "kfac"


# --8<-- [start:loss]
def make_loss(system: System, clip: float) -> Callable[..., Any]:
    """FermiNet's ``total_energy(params, key, walkers) -> (loss, aux)`` on one device's walkers."""
    import kfac_jax  # loads scipy and its OpenBLAS: only after plumbing.start set the threads per device

    batch_local_energy = jax.vmap(functools.partial(vmc.local_energy, system=system), in_axes=(None, 0))
    batch_network = jax.vmap(functools.partial(log_psi, system=system), in_axes=(None, 0))
    pmean = functools.partial(kfac_jax.utils.pmean_if_pmap, axis_name=AXIS)

    @jax.custom_jvp
    def total_energy(params: Any, key: jax.Array, walkers: jax.Array) -> tuple[jax.Array, dict]:
        e_l = batch_local_energy(params, walkers)
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
        psi, psi_tangent = jax.jvp(lambda p: batch_network(p, walkers), (params,), (tangents[0],))
        kfac_jax.register_normal_predictive_distribution(psi[:, None])
        return (loss, aux), (jnp.dot(psi_tangent, diff) / e_l.shape[0], aux)

    return total_energy


# --8<-- [end:loss]


# --8<-- [start:step]
@functools.cache
def make_steps(config: vmc.Config, mesh: Any) -> vmc.Steps:
    """KFAC with FermiNet's settings (``base_config.py``), except the step: the natural gradient's schedule and norm.

    FermiNet's lr 0.05 and norm constraint 1e-3 are made for 1e5 steps (``docs/neural.md``).
    """
    from shardvmc import kfac as svk  # loads kfac-jax (and scipy): only when asked for

    system = SYSTEMS[config.system]
    optimiser = svk.Optimizer(
        jax.value_and_grad(make_loss(system, config.clip), has_aux=True), l2_reg=0.0, mesh=mesh,
        pmap_axis_name=AXIS, value_func_has_aux=True, value_func_has_rng=True,
        learning_rate_schedule=config.schedule, norm_constraint=config.max_norm, estimation_mode="fisher_exact",
        inverse_update_period=1, curvature_ema=0.95, min_damping=1e-4, num_burnin_steps=0,
    )  # fmt: skip
    sampler = vmc.make_sampler(config, mesh)
    sample = jax.jit(sampler.step)

    def train(state: vmc.State, key: jax.Array) -> tuple[vmc.State, dict[str, jax.Array]]:
        walkers = sample(state.params, state.sampler, key)
        # FermiNet's loss computes, clips and differentiates the energy itself, on the walkers' positions.
        params, opt, stats = optimiser.step(state.params, state.opt, jax.random.fold_in(key, 1),
                                            batch=walkers.positions, momentum=0.0, damping=config.damping)  # fmt: skip
        energy, variance = stats["loss"], stats["aux"]["variance"]
        return vmc.State(params, opt, walkers), vmc.step_stats(energy, variance + energy**2, config.walkers,
                                                               walkers.acceptance)  # fmt: skip

    init = lambda params, positions, key: optimiser.init(params, key, positions)  # noqa: E731
    return vmc.Steps(init, train)


# --8<-- [end:step]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example from the command line; returns the summary."""
    return vmc.main(argv, make=make_steps, config_class=Config, optimisers=("kfac",))


if __name__ == "__main__":
    main(sys.argv[1:])
