"""Monte Carlo statistics of walker-sharded series: ``statistics`` and the streaming ``StatsAccumulator``.

Each walker is one Markov chain; a series is ``(walkers, steps)``, sharded over the
walkers. Everything along the steps of one walker (its mean, its autocovariance by FFT)
is computed on the device that holds the walker, and the walkers are combined by two
all-reduces (:data:`~shardvmc.all_walkers` inside one ``batched=True`` kernel), so the
series is never gathered and padding walkers never enter.

The estimators are those of Vehtari et al. 2021 (arXiv:1903.08008), the ones Stan and
ArviZ use for the mean (no rank normalisation):

- the chains are split in halves (``2 x walkers`` chains of ``steps // 2``; the middle
  step of an odd length is left out of these two);
- the autocorrelation is the walkers' average autocovariance, combined with the
  between-chain variance (``rho_t = 1 - (W - mean_acov_t) / var_plus``), so chains that
  have not mixed show up as a long correlation;
- the integrated autocorrelation time is summed by Geyer's initial monotone sequence;
- ``ess = steps * walkers / (1 + 2 sum_t rho_t)``, ``error_of_mean = sqrt(variance / ess)``;
- ``R_hat`` is the split-R-hat: ``sqrt(((n - 1) / n W + B / n) / W)`` over the halves.

The streaming accumulator keeps block means (and block variances) per walker and feeds
them to the same code, so while no block has been merged it returns exactly what
:func:`statistics` returns for the stored series.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh

from ._caches import bounded
from ._decorator import walker_parallel
from ._errors import CallError, message
from ._markers import PerWalker, Replicated
from ._placement import replicate
from ._stats import all_walkers
from ._walkerset import split_walker_set

__all__ = ["Stats", "StatsAccumulator", "statistics"]

_WHERE = "statistics"


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["mean", "error_of_mean", "variance", "tau_corr", "R_hat", "ess"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class Stats:
    """Monte Carlo estimates of a series of shape ``(walkers, steps)`` (a pytree of scalars).

    The field names are NetKet's (``nk.stats.Stats``), plus ``ess``. Printed, a
    ``Stats`` reads ``mean ± error_of_mean [σ²=variance, τ=tau_corr, R̂=R_hat]``.

    Attributes:
        mean: the mean over every valid walker and step (complex for complex data).
        error_of_mean: the standard error of ``mean``, autocorrelation included:
            ``sqrt(variance / ess)``. Real.
        variance: the variance of the samples, ``sum |x - mean|^2 / (N - 1)`` over all
            ``N = walkers x steps`` samples.
        tau_corr: the integrated autocorrelation time in steps, in the convention
            ``tau = 1/2 + sum_{t>=1} rho_t`` (``N / (2 ess)``): 0.5 for independent
            samples, ``(1 + phi) / (2 (1 - phi))`` for an AR(1) series with coefficient
            ``phi``. NetKet's default ``tau_corr`` is ``sum_{t>=1} rho_t``, 0.5 less; its
            optional FFT estimator and emcee report ``1 + 2 sum rho_t``, twice this.
        R_hat: the split-R-hat over the walkers (chains); near 1 when the chains have
            mixed (values above 1.01 suggest they have not).
        ess: the effective sample size of the mean, ``N / (2 tau_corr)``.
    """

    mean: jax.Array
    error_of_mean: jax.Array
    variance: jax.Array
    tau_corr: jax.Array
    R_hat: jax.Array
    ess: jax.Array

    def __str__(self) -> str:
        try:
            mean, err, var, tau, rhat = (
                np.asarray(v) for v in (self.mean, self.error_of_mean, self.variance, self.tau_corr, self.R_hat)
            )
        except Exception:  # traced fields (inside jit): no numbers to print
            return repr(self)
        err_f = float(err)
        digits = max(math.ceil(-math.log10(err_f)), 0) + 1 if math.isfinite(err_f) and err_f > 1e-12 else 4
        if np.iscomplexobj(mean):
            value = complex(mean)
            mean_s = f"{value.real:.{digits}f}{value.imag:+.{digits}f}j"
        else:
            mean_s = f"{float(mean):.{digits}f}"
        return f"{mean_s} ± {err_f:.{digits}f} [σ²={float(var):.{digits}f}, τ={float(tau):.1f}, R̂={float(rhat):.4f}]"


# ----------------------------------------------------------------------------- the estimators


def _real(x: jax.Array) -> jax.Array:
    return jnp.real(x * jnp.conj(x)) if jnp.iscomplexobj(x) else x * x


def _autocovariance(u: jax.Array) -> jax.Array:
    """``sum_s u[s + t] conj(u[s])`` (real part) for every lag ``t``, along the last axis; ``u`` zero-padded.

    By FFT, but for 64-bit data on a TPU, which has no float64 FFT: there lag by lag.
    """
    if jnp.finfo(u.dtype).bits == 64:
        return jax.lax.platform_dependent(u, tpu=_autocovariance_by_lags, default=_autocovariance_by_fft)
    return _autocovariance_by_fft(u)


def _autocovariance_by_fft(u: jax.Array) -> jax.Array:
    n = u.shape[-1]
    if jnp.iscomplexobj(u):
        f = jnp.fft.fft(u, 2 * n)
        return jnp.fft.ifft(f * jnp.conj(f)).real[..., :n]
    f = jnp.fft.rfft(u, 2 * n)
    return jnp.fft.irfft(_real(f), 2 * n)[..., :n]


def _autocovariance_by_lags(u: jax.Array) -> jax.Array:
    """What :func:`_autocovariance_by_fft` computes, one lag at a time: ``n`` passes over ``u``, no FFT."""
    n = u.shape[-1]
    padded = jnp.concatenate([u, jnp.zeros_like(u)], axis=-1)

    def lag(t: jax.Array) -> jax.Array:
        shifted = jax.lax.dynamic_slice_in_dim(padded, t, n, axis=-1)  # u[t:], then zeros
        return jnp.sum(jnp.real(shifted * jnp.conj(u)), axis=-1)

    return jnp.moveaxis(jax.lax.map(lag, jnp.arange(n)), 0, -1)


def _geyer(rho: jax.Array, n: Any) -> jax.Array:
    """``1 + 2 sum rho_t`` truncated by Geyer's initial monotone sequence, for chains of ``n`` draws.

    The same truncation as ArviZ's ``_ess`` (Stan's): sums of pairs ``P_k = rho_2k +
    rho_2k+1`` while they stay positive (and the lag stays below ``n - 3``), made
    non-increasing, plus the last positive even term. Vectorised: ``n`` may be traced.
    """
    rho = jnp.pad(rho, (0, max(4 - rho.shape[0], 0)))  # series of 1-3 steps: no pairs are summed
    pairs = rho.shape[0] // 2
    p = rho[0 : 2 * pairs : 2] + rho[1 : 2 * pairs : 2]
    k = jnp.arange(pairs)
    going = jnp.cumprod((p > 0).astype(jnp.int32)) > 0  # P_0..P_k all positive
    computed = (k >= 1) & (2 * k - 1 < n - 3) & jnp.concatenate([jnp.ones(1, bool), going[:-1]])
    last = jnp.sum(computed.astype(jnp.int32))  # the last pair looked at
    monotone = jnp.sum(jnp.where(k < last, jax.lax.cummin(p), 0.0))
    even = rho[2 * last]
    extra = jnp.where((p[last] >= 0) | (even > 0), even, 0.0)
    return -1.0 + 2.0 * monotone + extra


def _estimate(
    block_mean: jax.Array,
    block_m2: jax.Array | None,
    partial_block: tuple[jax.Array, jax.Array] | None,
    n_blocks: Any,
    block_size: Any,
    partial: Any,
) -> Stats:
    """:class:`Stats` of series given as block means per walker, inside a ``batched=True`` body.

    ``block_mean`` is this device's ``(walkers, K)`` block means, of which the first
    ``n_blocks`` are filled, each the mean of ``block_size`` steps (``block_m2``: their
    sums of squared deviations; ``None`` for blocks of one step); ``partial_block`` is the
    mean and sum of squared deviations of a last, incomplete block of ``partial`` steps
    (``None``: none). The raw series is the
    case ``K = n_blocks = steps``, ``block_size = 1``. Mean, variance and R-hat are
    those of the raw samples; the autocorrelation is that of the block means.
    """
    dtype = block_mean.dtype
    real = jnp.finfo(dtype).dtype
    zero = jnp.zeros((), dtype)
    width = block_mean.shape[1]
    cols = jnp.arange(width)
    filled = cols < n_blocks
    k, size = jnp.asarray(n_blocks, real), jnp.asarray(block_size, real)
    c = jnp.asarray(partial, real)
    per_walker = k * size + c
    m = all_walkers.count().astype(real)
    total = m * per_walker

    def with_partial(blocks: jax.Array, rest: jax.Array | None) -> jax.Array:
        return blocks if rest is None else blocks + c * rest

    # Pass 1: the mean, to centre everything on (no cancellation in float32 sums of squares).
    block_mean = jnp.where(filled, block_mean, zero)
    partial_mean = None if partial_block is None else partial_block[0]
    mu = all_walkers.sum(with_partial(size * block_mean.sum(axis=1), partial_mean)) / total

    # Pass 2: per walker, on this device, then one all-reduce of every sum.
    y = jnp.where(filled, block_mean - mu, zero)
    rest = None if partial_block is None else partial_block[0] - mu
    d = with_partial(size * y.sum(axis=1), rest) / per_walker  # walker mean - mu
    m2 = size * jnp.sum(jnp.where(filled, _real(y - d[:, None]), 0.0), axis=1)
    if block_m2 is not None:
        m2 = m2 + jnp.sum(jnp.where(filled, block_m2, 0.0), axis=1)
    if partial_block is not None:
        m2 = m2 + partial_block[1] + c * _real(partial_block[0] - mu - d)

    half = n_blocks // 2  # split chains: the first and the last `half` blocks
    starts = jnp.stack([jnp.zeros_like(jnp.asarray(half)), n_blocks - half])
    in_half = cols < half
    index = jnp.clip(starts[:, None] + cols[None, :], 0, width - 1)  # (2, K)
    z = jnp.where(in_half, y[:, index], zero)  # (walkers, 2, K)
    half_f = jnp.asarray(half, real)
    z_mean = z.sum(axis=-1) / half_f
    u = jnp.where(in_half, z - z_mean[..., None], zero)
    half_m2 = size * jnp.sum(_real(u), axis=-1)
    if block_m2 is not None:
        half_m2 = half_m2 + jnp.sum(jnp.where(in_half, block_m2[:, index], 0.0), axis=-1)
    e = y.sum(axis=1) / k  # the walker's mean over its complete blocks - mu
    sums = all_walkers.sum(
        {
            "d": d,
            "d2": _real(d),
            "m2": m2,
            "e": e,
            "e2": _real(e),
            "s2": jnp.sum(jnp.where(filled, _real(y - e[:, None]), 0.0), axis=1),
            "acov": _autocovariance(u).sum(axis=1) / half_f,
            "half_var": jnp.sum(half_m2, axis=-1) / (half_f * size - 1),
            "z": z_mean.sum(axis=-1),
            "z2": jnp.sum(_real(z_mean), axis=-1),
        }
    )

    def spread(sq: jax.Array, s: jax.Array, count: jax.Array) -> jax.Array:
        """``sum |v - mean v|^2`` of ``count`` values from ``sum |v|^2`` and ``sum v``, never below 0.

        Only ever applied to values already centred on ``mu`` (walker means, block means),
        so the difference loses no digits that matter; on a constant series it is
        round-off of either sign, and a negative one would make the error NaN.
        """
        return jnp.maximum(sq - _real(s) / count, 0.0)

    # The sums of squares split within walkers (each walker's own, centred on its own mean: no cancellation)
    # and between walkers (centred on mu first), so that a constant series gives 0, not round-off of either sign.
    mean = mu + sums["d"] / m
    between_walkers = spread(sums["d2"], sums["d"], m)
    variance = (sums["m2"] + per_walker * between_walkers) / (total - 1)
    n_b = m * k  # block means in all
    block_var = (sums["s2"] + k * spread(sums["e2"], sums["e"], m)) / (n_b - 1)
    chains = 2 * m
    z_var = spread(sums["z2"], sums["z"], chains) / (chains - 1)  # between the split chains
    mean_acov = sums["acov"] / chains
    within = mean_acov[0] * half_f / (half_f - 1)
    var_plus = within * (half_f - 1) / half_f + z_var
    rho = (1.0 - (within - mean_acov) / var_plus).at[0].set(1.0)  # lag 0 by definition (not var/var_plus)
    draws = chains * half_f
    tau2 = jnp.maximum(_geyer(rho, half), 1.0 / jnp.log10(draws))  # 1 + 2 sum rho, in blocks
    ess_blocks = jnp.where(var_plus > 0, draws / tau2, draws)
    error2 = block_var / ess_blocks
    # Under four blocks there is no autocorrelation to speak of: the walkers' means, independent chains.
    between = between_walkers / (m - 1) / m
    error2 = jnp.where(k >= 4, error2, between)
    ess = jnp.where(error2 > 0, variance / error2, total)

    n_half = half_f * size  # raw steps per split chain
    # Chains that agree exactly (B = 0, a constant series) add nothing, even when they do not vary (W = 0);
    # constant chains that differ from each other give infinity.
    between_over_within = jnp.where(z_var > 0, n_half * z_var / (sums["half_var"] / chains), 0.0)
    r_hat = jnp.sqrt((between_over_within + n_half - 1) / n_half)
    return Stats(
        mean=mean.astype(dtype),
        error_of_mean=jnp.sqrt(error2).astype(real),
        variance=variance.astype(real),
        tau_corr=(total / (2 * ess)).astype(real),
        R_hat=r_hat.astype(real),
        ess=ess.astype(real),
    )


# ----------------------------------------------------------------------------- the kernels


def _named(name: str) -> Any:
    """Name a block function after the public call that runs it, for its kernel's errors.

    A kernel's errors (a bad ``n_valid=`` or ``mesh=``) name its function; the user called
    ``sv.statistics``, not this module's private block function.
    """

    def rename(block: Any) -> Any:
        block.__module__, block.__qualname__ = "shardvmc", name
        return block

    return rename


@_named("statistics")
def _series_block(x: PerWalker[jax.Array]) -> Replicated[Stats]:
    steps = x.shape[1]
    return _estimate(x, None, None, steps, 1, 0)


@_named("StatsAccumulator.statistics")
def _blocks_block(
    block_mean: PerWalker[jax.Array],
    block_m2: PerWalker[jax.Array],
    partial_mean: PerWalker[jax.Array],
    partial_m2: PerWalker[jax.Array],
    counts: Replicated[jax.Array],
) -> Replicated[Stats]:
    return _estimate(block_mean, block_m2, (partial_mean, partial_m2), counts[0], counts[1], counts[2])


def _kernel(where: str, block: Any, mesh: Mesh | None, axis_name: Any) -> Any:
    if not isinstance(axis_name, str) and not (
        isinstance(axis_name, tuple) and axis_name and all(isinstance(a, str) for a in axis_name)
    ):
        raise CallError(
            message(
                where,
                "axis_name must be the name of the mesh's walker axis, or a tuple of names.",
                got=repr(axis_name),
                fix='pass e.g. axis_name="walkers", the default.',
            )
        )
    return _cached_kernel(block, mesh, axis_name)


@bounded(32)
def _cached_kernel(block: Any, mesh: Mesh | None, axis_name: str | tuple[str, ...]) -> Any:
    return walker_parallel(block, mesh=mesh, axis_name=axis_name, batched=True)


def _check_numbers(where: str, name: str, data: Any) -> None:
    """Refuse data that are not numbers (strings, objects) before JAX fails on them with its own words."""
    if np.dtype(data.dtype).kind not in "biufc":
        raise CallError(
            message(
                where,
                f"{name} must hold numbers.",
                got=f"dtype {data.dtype}",
                fix="pass a real or complex observable, e.g. the local energies.",
            )
        )


def _series(where: str, x: Any) -> Any:
    """``x``, a ``(walkers, steps)`` series (array or ``WalkerSet``), checked and as floats."""
    data, count = split_walker_set(x)
    if not hasattr(data, "shape") or not hasattr(data, "dtype"):
        data = np.asarray(data)
    if np.ndim(data) != 2 or 0 in np.shape(data):
        fix = (
            "pass x[:, None] for one value per walker (one step), or x[None, :] for one chain"
            if np.ndim(data) == 1
            else "pass one scalar observable per walker and step, e.g. the local energies stacked along axis 1"
        )
        raise CallError(
            message(
                where,
                "x must be a series of shape (walkers, steps), walker axis first.",
                got=f"{type(data).__name__} of shape {tuple(np.shape(data))}",
                expected="a 2-D array (or a WalkerSet of one) with at least one walker and one step",
                fix=fix + ".",
            )
        )
    _check_numbers(where, "x", data)
    if not jnp.issubdtype(data.dtype, jnp.inexact):
        data = jnp.asarray(data, jnp.result_type(float))
    return data if count is None else x.replace(data=data)


def statistics(
    x: Any, *, n_valid: Any = None, mesh: Mesh | None = None, axis_name: str | tuple[str, ...] = "walkers"
) -> Stats:
    """Mean, error of the mean, variance, autocorrelation time, split-R-hat and ESS of MCMC chains.

    ``x[i, t]`` is an observable (a local energy, say) of walker ``i`` at step ``t``;
    each walker is one Markov chain. Computed where the walkers are: each device works
    on its own walkers' series and two all-reduces combine them, so ``x`` is never
    gathered; walkers at index ``>= n_valid`` are padding and never enter, whatever
    they hold. Works under ``jax.jit``, on real and complex data (for complex data the
    variance is that of ``|x - mean|^2`` and the error is real).

    The error of the mean accounts for the autocorrelation along the steps through the
    integrated autocorrelation time, estimated as ArviZ and Stan do for the mean
    (Vehtari et al. 2021; see ``docs/statistics.md``): the walkers' average FFT
    autocovariance combined with the between-chain variance of split chains, summed by
    Geyer's initial monotone sequence. That needs no tuning constant (no blocking
    plateau to pick, no window constant), is exact on the data it is given, and has a
    standard implementation to check against. With fewer than 4 steps it falls back to
    the walkers' means as independent samples.

    Args:
        x: the series, ``(walkers, steps)``: an array (placed walker-sharded or not) or a
            :class:`WalkerSet` of one, whose count is used.
        n_valid: the number of real walkers (the first ones); ``None``: all of them.
        mesh: the mesh; defaults to the ``use_mesh`` one, else all devices.
        axis_name: the walker axis of ``mesh``.

    Returns:
        A :class:`Stats` of replicated scalars.

    Raises:
        CallError: when ``x`` is not 2-D, or ``n_valid`` is out of range or disagrees
            with the ``WalkerSet``'s count.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> x = -2.9 + 0.1 * jax.random.normal(jax.random.key(0), (64, 100))  # 64 walkers, 100 steps
        >>> stats = sv.statistics(x)
        >>> print(stats)  # mean ± error [variance, autocorrelation time, split-R-hat]
        -2.9004 ± 0.0012 [σ²=0.0103, τ=0.5, R̂=1.0007]
        >>> bool(abs(stats.mean + 2.9) < 5 * stats.error_of_mean), int(stats.ess) > 5000
        (True, True)
    """
    # A WalkerSet's count and n_valid= are reconciled (and a disagreement refused) by the kernel.
    return _kernel(_WHERE, _series_block, mesh, axis_name)(_series(_WHERE, x), n_valid=n_valid)


# ----------------------------------------------------------------------------- streaming


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["block_mean", "block_m2", "partial_mean", "partial_m2", "counts"],
    meta_fields=["n_valid"],
)
@dataclasses.dataclass(frozen=True)
class StatsAccumulator:
    """The statistics of a long series, accumulated step by step on the devices.

    Holds, per walker, the means (and sums of squared deviations) of blocks of
    consecutive steps, in a buffer of ``max_blocks`` blocks; when the buffer is full,
    neighbouring blocks are merged and the block size doubles, so the memory stays
    ``walkers x max_blocks`` whatever the number of steps. :meth:`update` is a few
    elementwise operations per walker (jitted; inside an outer ``jax.jit`` or
    ``lax.scan`` it adds no transfer and no collective); :meth:`statistics` runs the
    estimator of :func:`statistics` on the blocks.

    What equals :func:`statistics` of the stored series: the mean and the variance
    always (to round-off); everything while the buffer has not been merged (up to
    ``max_blocks x block_size`` steps with ``block_size=1``: the blocks are then the
    series itself); ``R_hat`` whenever the series holds an even number of complete
    blocks. After a merge, ``error_of_mean``, ``tau_corr`` and ``ess`` come from the
    autocorrelation of the block means, another consistent estimate of the same
    quantity, slightly low when there are few blocks per walker (keep ``max_blocks``
    large): within 5 % of the stored series' error, and 10 % of its ``tau_corr``, in
    the tests (64 AR(1) chains of 4096 steps in 128 blocks, ``tau_corr`` up to 9.5
    steps; ``docs/statistics.md`` has the measurements). ``R_hat`` then comes from a
    split at a block boundary.

    A pytree: carry it through ``jax.jit`` and ``lax.scan``. Its walker arrays are
    sharded like the per-walker values fed to it; ``n_valid`` is part of the pytree
    structure, as in :class:`WalkerSet`.

    Attributes:
        block_mean: ``(walkers, max_blocks)`` block means (the filled ones first).
        block_m2: ``(walkers, max_blocks)`` sums of squared deviations within each block.
        partial_mean: ``(walkers,)`` mean of the incomplete block.
        partial_m2: ``(walkers,)`` its sum of squared deviations.
        counts: ``int32[3]``: complete blocks, steps per block, steps in the incomplete block.
        n_valid: the number of real walkers (``None``: all).

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> x = jax.random.normal(jax.random.key(0), (16, 40))  # 16 walkers, 40 steps
        >>> acc = sv.StatsAccumulator.create(x[:, 0])
        >>> for t in range(40):
        ...     acc = acc.update(x[:, t])
        >>> acc.n_steps
        40
        >>> streamed, stored = acc.statistics(), sv.statistics(x)
        >>> bool(jnp.allclose(streamed.error_of_mean, stored.error_of_mean))
        True
    """

    block_mean: jax.Array
    block_m2: jax.Array
    partial_mean: jax.Array
    partial_m2: jax.Array
    counts: jax.Array
    n_valid: int | None = None

    @classmethod
    def create(
        cls, like: Any, *, max_blocks: int = 256, block_size: int = 1, n_valid: int | None = None
    ) -> StatsAccumulator:
        """An empty accumulator for per-walker values like ``like`` (``(walkers,)``, placed as they will be).

        Args:
            like: one step's per-walker values (an array or a ``WalkerSet``, whose count
                is kept); only its shape, dtype and sharding are used.
            max_blocks: blocks held per walker (even, at least 4); the memory is
                ``2 x walkers x max_blocks`` numbers.
            block_size: steps per block to start with (1: the series itself until the
                buffer is full).
            n_valid: the number of real walkers, for a plain array with padding.
        """
        where = "StatsAccumulator.create"
        data, count = split_walker_set(like)
        if count is not None:
            n_valid = None if count == np.shape(data)[0] else count
        if np.ndim(data) != 1:
            raise CallError(
                message(
                    where,
                    "like must hold one value per walker, of shape (walkers,).",
                    got=f"shape {tuple(np.shape(data))}",
                    fix="pass one step's per-walker values, e.g. the local energies of the first step.",
                )
            )
        _check_numbers(where, "like", data)
        walkers = np.shape(data)[0]
        if n_valid is not None and (
            not isinstance(n_valid, (int, np.integer)) or isinstance(n_valid, bool) or not 1 <= n_valid <= walkers
        ):
            raise CallError(
                message(
                    where,
                    f"n_valid={n_valid!r} is not a walker count in 1..{walkers}, the number of walkers of like.",
                    fix="pass the count returned by sv.pad_walker (the real walkers come first), or omit n_valid.",
                )
            )
        if not isinstance(max_blocks, int) or max_blocks < 4 or max_blocks % 2:
            raise CallError(
                message(where, "max_blocks must be an even int >= 4.", got=repr(max_blocks), fix="pass e.g. 256.")
            )
        if not isinstance(block_size, int) or block_size < 1:
            raise CallError(
                message(where, "block_size must be a positive int.", got=repr(block_size), fix="pass e.g. 1.")
            )
        dtype = jnp.result_type(data) if jnp.issubdtype(jnp.result_type(data), jnp.inexact) else float
        zeros = jnp.zeros_like(data, dtype=dtype)
        real = jnp.real(zeros)
        return cls(
            block_mean=jnp.repeat(zeros[:, None], max_blocks, axis=1),
            block_m2=jnp.repeat(real[:, None], max_blocks, axis=1),
            partial_mean=zeros,
            partial_m2=real,
            counts=_replicated_like(jnp.asarray([0, block_size, 0], jnp.int32), data),
            n_valid=None if n_valid is None else int(n_valid),
        )

    @property
    def n_steps(self) -> int:
        """Steps accumulated so far (concrete accumulators only)."""
        k, size, partial = (int(v) for v in np.asarray(self.counts))
        return k * size + partial

    def update(self, x: Any) -> StatsAccumulator:
        """The accumulator with one more step: ``x`` holds each walker's value, ``(walkers,)``.

        Jitted; no transfer to the host and no collective.
        """
        data, count = split_walker_set(x)
        if count is not None and count != np.shape(data)[0] and count != self.n_valid:
            raise CallError(
                message(
                    "StatsAccumulator.update",
                    f"x is a WalkerSet with n_valid={count}, the accumulator counts {self.n_valid}.",
                    fix="feed the values of the walkers the accumulator was created for.",
                )
            )
        if np.shape(data) != self.partial_mean.shape:
            raise CallError(
                message(
                    "StatsAccumulator.update",
                    "x must hold one value per walker, like the accumulator was created for.",
                    got=f"shape {tuple(np.shape(data))}",
                    expected=f"shape {tuple(self.partial_mean.shape)}",
                )
            )
        _check_numbers("StatsAccumulator.update", "x", data)
        return _update(self, data)

    def statistics(self, *, mesh: Mesh | None = None, axis_name: str | tuple[str, ...] = "walkers") -> Stats:
        """The :class:`Stats` of the steps accumulated so far (at least one), as :func:`statistics` computes them.

        Raises:
            CallError: when no step has been accumulated (checked on concrete
                accumulators; under ``jax.jit`` an empty one gives NaN).
        """
        where = "StatsAccumulator.statistics"
        if not isinstance(self.counts, Tracer) and self.n_steps == 0:
            raise CallError(
                message(
                    where,
                    "no step has been accumulated: there is nothing to estimate.",
                    fix="call acc = acc.update(x) with each step's per-walker values first.",
                )
            )
        kernel = _kernel(where, _blocks_block, mesh, axis_name)
        return kernel(
            self.block_mean, self.block_m2, self.partial_mean, self.partial_m2, self.counts, n_valid=self.n_valid
        )


@jax.jit
def _update(acc: StatsAccumulator, x: jax.Array) -> StatsAccumulator:
    k, size, partial = acc.counts[0], acc.counts[1], acc.counts[2] + 1
    x = x.astype(acc.partial_mean.dtype)
    delta = x - acc.partial_mean  # Welford's update of the incomplete block
    mean = acc.partial_mean + delta / partial.astype(acc.partial_m2.dtype)
    m2 = acc.partial_m2 + jnp.real(jnp.conj(delta) * (x - mean))
    full = partial == size
    width = acc.block_mean.shape[1]
    # A block completes into a full buffer: merge neighbours (blocks twice as long), and the completed
    # block becomes the first half of the next, incomplete one.
    merging = full & (k == width)
    stored = full & ~merging
    put = (jnp.arange(width) == k) & stored
    block_mean = jnp.where(put, mean[:, None], acc.block_mean)
    block_m2 = jnp.where(put, m2[:, None], acc.block_m2)

    def merge(args: tuple[jax.Array, ...]) -> tuple[jax.Array, ...]:
        block_mean, block_m2, size = args
        a, b = block_mean[:, 0::2], block_mean[:, 1::2]
        merged_m2 = block_m2[:, 0::2] + block_m2[:, 1::2] + jnp.real(jnp.conj(a - b) * (a - b)) * (size / 2)
        return (
            jnp.concatenate([(a + b) / 2, jnp.zeros_like(a)], axis=1),
            jnp.concatenate([merged_m2, jnp.zeros_like(merged_m2)], axis=1),
            size * 2,
        )

    block_mean, block_m2, new_size = jax.lax.cond(merging, merge, lambda args: args, (block_mean, block_m2, size))
    k = jnp.where(merging, width // 2, k + stored.astype(k.dtype))
    return StatsAccumulator(
        block_mean=block_mean,
        block_m2=block_m2,
        partial_mean=jnp.where(stored, jnp.zeros_like(mean), mean),
        partial_m2=jnp.where(stored, jnp.zeros_like(m2), m2),
        counts=jnp.stack([k, new_size, jnp.where(stored, 0, partial)]).astype(jnp.int32),
        n_valid=acc.n_valid,
    )


def _replicated_like(x: jax.Array, like: Any) -> jax.Array:
    """``x`` replicated over the mesh of ``like``'s sharding, where it has one.

    A jitted ``update`` returns its counters replicated on the walkers' mesh; counters made on the default device
    would give the same program another input sharding at the next call, and so a second compilation.
    """
    sharding = getattr(like, "sharding", None)
    if isinstance(like, Tracer) or not isinstance(sharding, jax.sharding.NamedSharding):
        return x
    if not isinstance(sharding.mesh, Mesh):  # an abstract mesh: no devices to place on
        return x
    return replicate(x, sharding.mesh)  # (placed as every replicated leaf is, in a job of several processes too)
