"""The whole VMC job in a few calls: ``run`` (progress, logs, callbacks, checkpoints, resume), ``VMC``, ``expect``.

- :func:`run` runs any jitted step ``step(state, key) -> (state, stats)`` for ``n_steps`` steps: step ``t``
  gets the key ``jax.random.fold_in(key, t)``, its statistics reach the host ``ahead`` steps later (the
  device never waits for the host), a tqdm bar shows ``E = mean ± error`` and the time left, loggers
  (:class:`JsonLog`, :class:`CSVLog`, :class:`TensorBoardLog`, :class:`PrintLog`) write every step on
  process 0, callbacks (:class:`StopOnNonFinite`, :class:`Timeout`, any function) stop it, and with
  ``checkpoint=DIR`` it saves every ``checkpoint_every`` steps and at a preemption notice, and the same call
  resumes from the newest intact step on any device count.
- :class:`VMC` builds that step from the pieces: ``log_psi``, a potential (or local energy), an optax
  optimiser (``shardvmc.optax``'s natural gradient among them), ``sv.mcmc.Metropolis``.
- :func:`expect` estimates a per-walker observable at fixed parameters: ``sv.Stats``, as NetKet's
  ``vstate.expect(H)``.

Example:
    >>> import jax, jax.numpy as jnp, optax, shardvmc as sv, shardvmc.optax as svx
    >>> log_psi = lambda a, r: -a * jnp.sum(r**2)  # ONE walker, r: (1, 3); a 3-D oscillator
    >>> opt = optax.chain(svx.natural_gradient(damping=1e-3), optax.scale_by_learning_rate(0.2))
    >>> vmc = sv.driver.VMC(log_psi, opt, potential=lambda r: 0.5 * jnp.sum(r**2))
    >>> init = lambda k: jax.random.normal(k, (1, 3))
    >>> walkers = sv.initialize_walkers_sharded(init, 128, key=jax.random.key(0))
    >>> result = sv.driver.run(vmc.step, vmc.init(jnp.float32(0.3), walkers), 40, key=jax.random.key(1))
    >>> energy = vmc.expect(result.state, 20, key=jax.random.key(2))
    >>> round(float(energy.mean), 2)  # the exact 1.5 at a = 0.5
    1.5
"""

from ._callbacks import Callback as Callback
from ._callbacks import StopOnNonFinite as StopOnNonFinite
from ._callbacks import Timeout as Timeout
from ._driver import RunResult as RunResult
from ._driver import run as run
from ._loggers import CSVLog as CSVLog
from ._loggers import JsonLog as JsonLog
from ._loggers import Logger as Logger
from ._loggers import PrintLog as PrintLog
from ._loggers import TensorBoardLog as TensorBoardLog
from ._loggers import read_log as read_log
from ._vmc import VMC as VMC
from ._vmc import VMCState as VMCState
from ._vmc import expect as expect

__all__ = [
    "CSVLog",
    "Callback",
    "JsonLog",
    "Logger",
    "PrintLog",
    "RunResult",
    "StopOnNonFinite",
    "TensorBoardLog",
    "Timeout",
    "VMC",
    "VMCState",
    "expect",
    "read_log",
    "run",
]
