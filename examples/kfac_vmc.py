"""The neural example's network trained with KFAC (kfac-jax), FermiNet's way, on every device.

FermiNet's loss (the mean local energy; its gradient with the local energies clipped to five
mean absolute deviations; the network's output registered for kfac-jax's curvature) is the
library's: ``sv.kfac.KFAC`` builds it (``sv.kfac.energy_loss``) with ``sv.loss.ClipMAD``, on
any walker count and the same on any device count. The network, the sampling, the evaluation,
the run and its checkpoints are ``neural_vmc.py``'s, on ``sv.driver.run`` (copy it,
``network.py`` and ``plumbing.py`` too).

    python examples/kfac_vmc.py --system Li
    python examples/kfac_vmc.py --quick --devices 2
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Sequence
from typing import Any

import jax
import neural_vmc as vmc
from network import SYSTEMS, log_psi

import shardvmc as sv


@dataclasses.dataclass(frozen=True)
class Config(vmc.Config):
    """The neural example's settings, with KFAC."""

    optimiser: str = "kfac"
    steps: int = 2000  # a KFAC step costs under half a minSR step: 1.2 times minSR's 700 steps' time (docs/neural.md)
    damping: float = 1e-3  # FermiNet's
    lr: float = 0.3  # with the norm bound and momentum 0.7: 0.1 levelled out 2 mHa above the exact energy
    max_norm: float = 0.005  # the largest lr^2 g.F^-1.g of a step (kfac-jax's norm_constraint)
    momentum: float = 0.7  # kfac-jax's heavy-ball momentum (FermiNet: 0): averages the steps' noise


# --8<-- [start:step]
@functools.cache
def make_steps(config: vmc.Config, mesh: Any) -> vmc.Steps:
    """KFAC with FermiNet's damping and curvature, but the schedule ``lr / (1 + t / lr_decay)``, ``max_norm``, momentum.

    FermiNet's lr 0.05, norm constraint 1e-3 and no momentum are made for 1e5 steps; with these,
    2000 steps end between 0.3 mHa below and 1.5 mHa above Li's exact energy (``docs/neural.md``, "KFAC's settings").
    """
    from shardvmc import kfac as svk  # loads kfac-jax (and scipy): only when asked for

    kfac = svk.KFAC(
        learning_rate=config.schedule, damping=config.damping, norm_constraint=config.max_norm, momentum=config.momentum
    )
    psi = functools.partial(log_psi, system=SYSTEMS[config.system])
    optimiser = kfac.vmc_optimizer(psi, vmc.energy_of(config.system), sv.loss.ClipMAD(config.clip), mesh)
    sampler = vmc.make_sampler(config, mesh)

    @jax.jit
    def train(state: vmc.State, key: jax.Array) -> tuple[vmc.State, dict[str, jax.Array]]:
        walkers = sampler.step(state.params, state.sampler, key)
        params, opt, stats = optimiser.step(state.params, state.opt, jax.random.fold_in(key, 1),
                                            batch=walkers.positions)  # fmt: skip
        energy, variance = stats["aux"]["energy"], stats["aux"]["variance"]
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
