"""The field's clippings of the local energies in the VMC gradient: FermiNet's and DeepQMC's.

A few walkers near a node of the wavefunction have huge local energies; in the gradient
``E[(E_L - E) d log|psi|]`` they dominate the step. Every production code clips them
there (never in the reported energy):

- :class:`ClipMAD` is FermiNet's (``ferminet/loss.py``): the local energies clipped to
  ``center ± width · MAD``, the mean absolute deviation from the center (the mean by
  default; the median is DeepQMC's ``median_clip_and_mask``);
- :class:`ClipLogSqueeze` is DeepQMC's default (``median_log_squeeze_and_mask``): the
  deviations from the median squeezed logarithmically beyond a quantile of their size,
  with an optional mask that drops far outliers from the gradient altogether.

A clipping is called inside a walker-parallel kernel's body, on a walker's (or a
block's) local energy, and returns the clipped value and whether the walker enters the
gradient. Its statistics (mean, median, quantile) are over every valid walker of every
device (:data:`shardvmc.all_walkers`), so the clipped values do not depend on the device
count or on padding: DeepQMC's own ``all_device_median`` gathers every device's values
too, but its masked mean of the gradient is taken per device.

``sv.driver.VMC(..., clipping=...)`` applies one to the natural gradient and optax
optimisers; :func:`shardvmc.kfac.energy_loss` (and :class:`shardvmc.kfac.KFAC`) to KFAC.

Example:
    >>> import jax, jax.numpy as jnp, shardvmc as sv
    >>> @sv.walker_parallel
    ... def clip(e: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
    ...     clipped, keep = sv.loss.ClipMAD(width=5.0)(e)
    ...     return clipped
    >>> e = jnp.array([1.0] * 15 + [100.0])  # one outlier among 16 walkers
    >>> round(float(clip(e)[-1]), 3)
    65.195
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Protocol

import jax
import jax.numpy as jnp

from ._errors import CallError, message
from ._numerics import accurate
from ._stats import all_walkers

__all__ = ["ClipLogSqueeze", "ClipMAD", "Clipping", "log_squeeze"]


class Clipping(Protocol):
    """What ``clipping=`` takes: ``clipping(e) -> (clipped, keep)`` inside a kernel body.

    ``e`` is a walker's local energy (or a block's, in a ``batched=True`` body);
    ``clipped`` replaces it in the gradient, and walkers where ``keep`` is false leave
    the gradient's average.
    """

    def __call__(self, e: jax.Array) -> tuple[jax.Array, jax.Array]: ...


def log_squeeze(x: jax.Array) -> jax.Array:
    """DeepQMC's ``log_squeeze``: ``x`` near 0, growing like ``log|x|`` far away (odd, smooth).

    Example:
        >>> import jax.numpy as jnp, shardvmc as sv
        >>> [round(float(v), 3) for v in sv.loss.log_squeeze(jnp.array([0.01, 1.0, 100.0]))]
        [0.01, 0.811, 4.62]
    """
    # A TPU's own float32 log1p is up to thousands of ulps off: 5e-4 relative near the median, where the squeezed
    # energies are the energies themselves. Cephes' log1p there (accurate), jnp.log1p elsewhere.
    return accurate(_log_squeeze)(x)


def _log_squeeze(x: jax.Array) -> jax.Array:
    sign, x = jnp.sign(x), jnp.abs(x)
    return sign * jnp.log1p((x + x**2 / 2 + x**3) / (1 + x**2))


def _check_width(where: str, name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and value > 0):
        raise CallError(message(where, f"{name} must be a positive number.", got=repr(value), fix=f"pass {name}=5.0."))


@dataclasses.dataclass(frozen=True)
class ClipMAD:
    """FermiNet's clipping: the local energies clipped to ``center ± width · MAD``.

    ``MAD`` is the mean absolute deviation of the local energies from ``center`` (their
    mean, FermiNet's ``clip_local_energy=5.0``; or their median, DeepQMC's
    ``median_clip_and_mask``), over every valid walker. Walkers farther than
    ``exclude_width`` from the center (DeepQMC's mask, in Hartree) leave the gradient.

    Args:
        width: the half-width of the window, in MADs.
        center: ``"mean"`` (FermiNet) or ``"median"``.
        exclude_width: the distance from the center beyond which a walker leaves the gradient.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> @sv.walker_parallel
        ... def clip(e: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        ...     return sv.loss.ClipMAD(width=2.0, center="median")(e)[0]
        >>> [round(float(v), 3) for v in clip(jnp.array([0.0, 1.0, 2.0, 3.0, 50.0]))]
        [0.0, 1.0, 2.0, 3.0, 22.8]
    """

    width: float = 5.0
    center: Literal["mean", "median"] = "mean"
    exclude_width: float = math.inf

    def __post_init__(self) -> None:
        _check_width("shardvmc.loss.ClipMAD", "width", self.width)
        _check_width("shardvmc.loss.ClipMAD", "exclude_width", self.exclude_width)
        if self.center not in ("mean", "median"):
            raise CallError(
                message("shardvmc.loss.ClipMAD", "center must be 'mean' or 'median'.", got=repr(self.center))
            )

    def __call__(self, e: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The clipped local energies and the walkers kept in the gradient."""
        center = all_walkers.mean(e) if self.center == "mean" else all_walkers.median(e)
        deviation = jnp.abs(e - center)
        mad = all_walkers.mean(deviation)
        return jnp.clip(e, center - self.width * mad, center + self.width * mad), deviation < self.exclude_width


@dataclasses.dataclass(frozen=True)
class ClipLogSqueeze:
    """DeepQMC's clipping (``median_log_squeeze_and_mask``, its default): a logarithmic squeeze around the median.

    With ``m`` the median of the local energies and ``q`` the ``quantile`` of their
    absolute deviations from it (over every valid walker), ``w = width · q`` and the
    clipped energy is ``m + 2w · log_squeeze((e - m) / 2w)``: unchanged near the median,
    growing only logarithmically far from it. Walkers with ``|e - m| / q >=
    exclude_width`` leave the gradient.

    Args:
        width: DeepQMC's ``clip_width``.
        quantile: DeepQMC's ``quantile``.
        exclude_width: DeepQMC's ``exclude_width`` (in units of ``q``).

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> @sv.walker_parallel
        ... def clip(e: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        ...     return sv.loss.ClipLogSqueeze()(e)[0]
        >>> [round(float(v), 3) for v in clip(jnp.array([0.0, 1.0, 2.0, 3.0, 50.0]))]
        [0.0, 1.0, 2.0, 3.0, 45.733]
    """

    width: float = 1.0
    quantile: float = 0.95
    exclude_width: float = math.inf

    def __post_init__(self) -> None:
        _check_width("shardvmc.loss.ClipLogSqueeze", "width", self.width)
        _check_width("shardvmc.loss.ClipLogSqueeze", "exclude_width", self.exclude_width)
        if not 0 < self.quantile <= 1:
            raise CallError(
                message("shardvmc.loss.ClipLogSqueeze", "quantile must be in (0, 1].", got=repr(self.quantile))
            )

    def __call__(self, e: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The clipped local energies and the walkers kept in the gradient."""
        median = all_walkers.median(e)
        deviation = e - median
        q = all_walkers.quantile(jnp.abs(deviation), self.quantile)
        w = self.width * q
        # every energy at the median (an eigenstate): nothing to squeeze (DeepQMC's formula divides by zero there)
        spread = q > 0
        safe = jnp.where(spread, 2 * w, 1.0)
        clipped = jnp.where(spread, median + safe * log_squeeze(deviation / safe), e)
        return clipped, jnp.where(spread, jnp.abs(deviation) / jnp.where(spread, q, 1.0), 0.0) < self.exclude_width
