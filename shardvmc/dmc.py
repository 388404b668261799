"""Fixed-node diffusion Monte Carlo from a per-walker ``log|psi|``: ``DMC``, its estimator, time-step extrapolation.

``DMC(log_psi, potential, time_step=...)`` projects the trial function ``psi`` (real, written for ONE
walker) onto the lowest state of its nodal pocket with the algorithm of Umrigar, Nightingale and Runge
(J. Chem. Phys. 99, 2865 (1993), "UNR"), every walker's work in walker-parallel kernels:

- **the move**: a drift-diffusion proposal ``r' = r + tau vbar(r) + sqrt(tau) chi`` with the drift
  ``v = grad log|psi|`` limited per electron near the nodes, ``vbar = 2 v / (1 + sqrt(1 + 2 a v^2 tau))``
  (UNR's ``(-1 + sqrt(1 + 2 a v^2 tau)) / (a v^2 tau) v``), accepted by Metropolis with the drift-diffusion
  Green's function, and rejected when it crosses a node (``sign=`` changes) or reaches a point where
  ``log|psi|``, its gradient or the local energy is not finite;
- **the effective time step** ``tau_eff = tau <p dR^2> / <dR^2>``, accumulated over the run;
- **the weights**: ``w <- w exp(tau_eff (E_T - (S(R) + S(R')) / 2))`` with ``S`` the local energy clipped
  to ``E_T +- E_cut``, ``E_cut = energy_cutoff / sqrt(tau)`` (UNR's cutoff); a walker whose weight or
  local energy is not finite gets weight 0 (counted in the statistics);
- **a fixed global population** of the walkers given to :meth:`DMC.init` (any count: a
  :class:`~shardvmc.WalkerSet` whose padding never enters a sum), resampled by one global comb
  (systematic resampling, as stochastic reconfiguration: Assaraf, Caffarel and Khelif, Phys. Rev. E 61,
  4566 (2000)) in walker-index order whenever the weights' effective count falls below
  ``resample_threshold`` times the population (by default every step);
- **the mixed estimator** ``sum_k P_k sum_i w_ik E_L(R_ik) / sum_k P_k sum_i w_ik`` with the population
  control undone over the last ``T_p`` steps by ``P_k``, the product of the steps' mean weights at a
  fixed trial energy (UNR), and an error bar from :func:`shardvmc.statistics` (:func:`energy`).

What travels between devices per step (docs/dmc.md): ONE all-gather, of 13 numbers per device (its sums of
the step's 10 statistics, its weight total: its offset in the global prefix sum, and two prefix sums that
tell every device how far its neighbours' halos reach) and of its halos: its first and last ``halo`` walkers
(every field but the weight, bit for bit, and their prefix sums), packed in one buffer; the copies then
move to their slots from a device's own walkers and its neighbours' halos. Whether every copy is within
reach, and the ``fallback`` statistic, every device computes from the all-gather, the same bits
everywhere: no all-reduce. On many devices, where the halos of all would make the all-gather large, the
halos go by one ``ppermute`` each way instead. Only when some device's copies reach farther than its
neighbours' halos (a weight imbalance of more than ``halo`` walkers at a device boundary, counted in the
statistics as ``fallback``) every walker is all-gathered instead (one buffer). No position is read on the
host; the step is one jitted program.

With one key the run is the same on any device count: walker ``i`` draws from ``fold_in(key, i)``
(its global index), and the comb works in global walker order, so every decision is the same up to the
round-off of sums over devices (docs/concepts.md).

Example:
    >>> import jax, jax.numpy as jnp, shardvmc as sv
    >>> log_psi = lambda p, r: -0.5 * jnp.sum(r**2)  # the 3-D oscillator's ground state: E = 1.5 exactly
    >>> dmc = sv.dmc.DMC(log_psi, lambda r: 0.5 * jnp.sum(r**2), time_step=0.05)
    >>> walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (1, 3)), 50, key=jax.random.key(0))
    >>> result = sv.driver.run(dmc.step, dmc.init(None, walkers), 20, key=jax.random.key(1), progress=False)
    >>> round(float(sv.dmc.energy(result.history).mean), 4)
    1.5
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from ._compiler import platform_jit
from ._decorator import WalkerParallel, walker_parallel
from ._errors import CallError, describe, message
from ._internals import tracing
from ._markers import Mean, PerWalker, Replicated, Static, Sum, WalkerKey
from ._mcstats import Stats, statistics
from ._mesh import create_mesh, mesh_of_arrays, use_mesh
from ._numerics import accurate
from ._placement import replicate
from ._stats import current_body
from ._walkerset import WalkerSet
from .hamiltonian import LAPLACIANS, value_laplacian_gradient
from .mcmc import SamplerState, Walker, float_positions, log_psi_value

__all__ = ["DMC", "DMCState", "DMCWalker", "energy", "extrapolate"]

_WHERE = "shardvmc.dmc.DMC"


class DMCWalker(NamedTuple):
    """One DMC walker: its positions and what the next move needs there, and its weight.

    As a :class:`~shardvmc.WalkerSet`'s data, every field has the walker axis first.

    Attributes:
        r: the positions, ``(n_electrons, ndim)`` (rows are the particles the drift is limited for).
        log_psi: ``log|psi|`` at ``r``.
        sign: the sign of ``psi`` at ``r`` (``1`` without ``sign=``).
        grad: ``grad log|psi|`` at ``r``, the drift (``r``'s shape).
        local_energy: ``E_L(r)``.
        weight: the walker's weight, normalised to a mean of 1 over the population after every step (1 after
            a resampling).
    """

    r: jax.Array
    log_psi: jax.Array
    sign: jax.Array
    grad: jax.Array
    local_energy: jax.Array
    weight: jax.Array


class DMCState(NamedTuple):
    """The state :meth:`DMC.step` steps: a pytree of replicated arrays and one walker set.

    :func:`shardvmc.driver.run` checkpoints it whole and restores it onto any device count.

    Attributes:
        params: the trial function's parameters, replicated.
        walkers: a :class:`~shardvmc.WalkerSet` of :class:`DMCWalker`.
        trial_energy: ``E_T``, the running estimate of the energy: the centre of the local-energy cutoff and
            the reference of the weights (with a fixed population it does not change the walk).
        accepted_r2: ``sum p dR^2`` over every walker and step so far (``p`` the acceptance probability).
        proposed_r2: ``sum dR^2`` over every walker and step so far: ``tau_eff = tau accepted_r2 / proposed_r2``.
        steps: the steps done (an int32 scalar).
    """

    params: Any
    walkers: WalkerSet
    trial_energy: jax.Array
    accepted_r2: jax.Array
    proposed_r2: jax.Array
    steps: jax.Array


def _limited_drift(grad: jax.Array, tau: jax.Array, a: float) -> jax.Array:
    """UNR's drift limited per particle (a row of ``grad``): ``2 v / (1 + sqrt(1 + 2 a |v|^2 tau))``.

    The same as ``(-1 + sqrt(1 + 2 a v^2 tau)) / (a v^2 tau) v``, written without the division by ``v^2``
    (finite at ``v = 0``, where it is ``v``); near a node, where ``|v| -> inf``, it tends to
    ``sqrt(2 / (a tau)) v / |v|``: a step of at most about ``sqrt(2 tau / a)``.
    """
    g = grad if grad.ndim >= 2 else grad[None]
    v2 = jnp.sum(g * g, axis=-1, keepdims=True)
    limited = 2.0 * g / (1.0 + jnp.sqrt(1.0 + 2.0 * a * v2 * tau))
    return limited.reshape(grad.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class DMC:
    """Fixed-node diffusion Monte Carlo of a real trial function (UNR 1993), on walker-sharded populations.

    Args:
        log_psi: ``log_psi(params, r)`` of ONE walker: the real ``log|psi|`` (``r`` of shape
            ``(n_electrons, ndim)``; the drift is limited per row).
        potential: ``potential(r)`` of one walker (for the default local energy,
            ``-1/2 (lap log|psi| + |grad log|psi||^2) + V``, computed with ``log|psi|`` and its gradient in one
            forward-Laplacian pass).
        time_step: ``tau`` (hartree^-1), > 0. The bias is about linear in ``tau``: :func:`extrapolate`.
        sign: ``sign(params, r)`` of one walker, the sign of ``psi`` (``+-1``); a move that changes it crosses
            a node and is rejected (the fixed-node constraint). ``None``: ``psi`` has no node (a ground state
            of bosons, or of two electrons of opposite spin), or ``log|psi|`` diverges there.
        local_energy: ``local_energy(params, r)`` of one walker (or a walker-parallel kernel), instead of
            ``potential``; ``log|psi|`` and its gradient are then computed with ``jax.value_and_grad``.
        laplacian: ``"auto"`` (default: the platform's fastest), ``"folx"`` or ``"jvp"``, as
            ``sv.hamiltonian.local_energy``'s.
        energy_cutoff: the local energy in the weights is clipped to ``E_T +- energy_cutoff / sqrt(tau)``
            (UNR's ``2 / sqrt(tau)`` by default); ``None``: no clipping.
        resample_threshold: resample when the weights' effective count ``(sum w)^2 / sum w^2`` falls below this
            fraction of the population; ``1.0`` (default): every step.
        limit_energy: UNR's damping of the local energy in the weights where the drift is limited,
            ``S = E_T - (E_T - E_L) |vbar| / |v|`` (before the cutoff). Off by default: it removes the divergence
            of ``E_L`` at a node, but near a nucleus, where the drift is large too, it adds a bias of order
            ``tau`` (helium at ``tau = 0.1``: 0.004 Ha above the exact energy, against 0.0004 without it).
        drift_scale: UNR's ``a`` of the drift limit (1: the plain limit).
        halo: walkers each device sends to each neighbouring device when the copies move to their slots (see
            the module); ``None``: ``32``, at most the walkers per device.
        mesh: the mesh of the kernels (``None``: the mesh of the state's walkers, else as a kernel's).
        axis_name: the walker axis (or axes) of the mesh.
        batch_size: each device's walkers this many at a time in the move (bounds the Laplacian's memory).

    Attributes:
        move: the move and the weights as a walker-parallel kernel,
            ``move(params, walkers, key, constants) -> (walkers, sums)`` (``sums``: the step's ``Sum``
            statistics).
        resample: the global comb as a ``batched=True`` kernel,
            ``resample(walkers, u, resample, alive, population, halo) -> (walkers, fallback)``.
        evaluate: ``evaluate(params, r) -> (walkers, sums)``: walkers of weight 1 at positions ``r``.

    Raises:
        CallError: ``time_step <= 0`` (or not a number), both or neither of ``potential`` and
            ``local_energy``, an unknown ``laplacian``, a ``resample_threshold`` outside ``(0, 1]``, a
            non-positive ``energy_cutoff``, ``drift_scale`` or ``halo``.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> dmc = sv.dmc.DMC(lambda p, r: -p * jnp.sum(r**2), lambda r: 0.5 * jnp.sum(r**2), time_step=0.02)
        >>> walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (1, 3)), 13, key=jax.random.key(0))
        >>> state = dmc.init(jnp.float32(0.3), walkers)  # a trial function that is not the ground state
        >>> state, stats = dmc.step(state, jax.random.key(1))
        >>> state.walkers.n_valid, sorted(stats)[:4]
        (13, ['acceptance', 'effective_walkers', 'energy', 'error'])
    """

    log_psi: Callable[..., Any]
    potential: Callable[..., Any] | None = None
    time_step: float = 0.01
    sign: Callable[..., Any] | None = None
    local_energy: Callable[..., Any] | None = None
    laplacian: str = "auto"
    energy_cutoff: float | None = 2.0
    resample_threshold: float = 1.0
    limit_energy: bool = False
    drift_scale: float = 1.0
    halo: int | None = None
    mesh: Mesh | None = None
    axis_name: str | tuple[str, ...] = "walkers"
    batch_size: int | str | None = None
    move: WalkerParallel = dataclasses.field(init=False, repr=False)
    resample: WalkerParallel = dataclasses.field(init=False, repr=False)
    evaluate: WalkerParallel = dataclasses.field(init=False, repr=False)
    _move_rows: WalkerParallel = dataclasses.field(init=False, repr=False)
    _branch: WalkerParallel = dataclasses.field(init=False, repr=False)
    _step: Any = dataclasses.field(init=False, repr=False)  # a jax.jit (lower, compile)

    def __post_init__(self) -> None:
        tau = self.time_step
        if isinstance(tau, bool) or not isinstance(tau, (int, float, np.floating, np.integer)) or not tau > 0:
            raise CallError(
                message(
                    _WHERE,
                    "time_step must be a positive number (hartree^-1).",
                    got=repr(tau),
                    fix="pass e.g. time_step=0.01; the time-step bias is about linear in it (sv.dmc.extrapolate).",
                )
            )
        if not math.isfinite(float(tau)):
            raise CallError(message(_WHERE, "time_step must be finite.", got=repr(tau)))
        object.__setattr__(self, "time_step", float(tau))
        if (self.potential is None) == (self.local_energy is None):
            raise CallError(
                message(
                    _WHERE,
                    "pass exactly one of potential= and local_energy=.",
                    got=f"potential={self.potential!r}, local_energy={self.local_energy!r}",
                    fix="pass potential=lambda r: ... (the local energy is then computed from log_psi), or your "
                    "own local_energy(params, r).",
                )
            )
        if self.laplacian not in LAPLACIANS:
            raise CallError(
                message(_WHERE, f"laplacian={self.laplacian!r} is not a known method.", expected=str(LAPLACIANS))
            )
        if not (isinstance(self.resample_threshold, (int, float)) and 0 < self.resample_threshold <= 1):
            raise CallError(
                message(
                    _WHERE,
                    "resample_threshold must be a fraction in (0, 1].",
                    got=repr(self.resample_threshold),
                    fix="1.0 resamples every step; 0.5 when the weights' effective count falls below half the walkers.",
                )
            )
        if self.energy_cutoff is not None and not (
            isinstance(self.energy_cutoff, (int, float)) and self.energy_cutoff > 0
        ):
            raise CallError(
                message(_WHERE, "energy_cutoff must be a positive number or None.", got=repr(self.energy_cutoff))
            )
        if not (isinstance(self.drift_scale, (int, float)) and self.drift_scale > 0):
            raise CallError(message(_WHERE, "drift_scale must be a positive number.", got=repr(self.drift_scale)))
        if self.halo is not None and (isinstance(self.halo, bool) or not isinstance(self.halo, int) or self.halo < 1):
            raise CallError(message(_WHERE, "halo must be a positive int or None.", got=repr(self.halo)))
        options = {"mesh": self.mesh, "axis_name": self.axis_name}
        evaluate_one = _make_evaluate(
            self.log_psi,
            _one_number(self.sign, "sign", "sign(params, r)"),
            _one_number(self.potential, "potential", "potential(r)"),
            _one_number(self.local_energy, "local_energy", "local_energy(params, r)"),
            self.laplacian,
        )
        move, move_rows = _make_move(evaluate_one, self.drift_scale, self.limit_energy)
        object.__setattr__(self, "move", walker_parallel(batch_size=self.batch_size, **options)(move))
        object.__setattr__(self, "_move_rows", walker_parallel(batch_size=self.batch_size, **options)(move_rows))
        object.__setattr__(self, "resample", walker_parallel(batched=True, **options)(_resample))
        object.__setattr__(self, "_branch", walker_parallel(batched=True, **options)(_branch))
        object.__setattr__(
            self, "evaluate", walker_parallel(batch_size=self.batch_size, **options)(_make_init(evaluate_one))
        )
        object.__setattr__(self, "_step", platform_jit(self._traced_step, static_argnames="mesh"))

    def with_options(self, **changes: Any) -> DMC:
        """The same DMC with other settings (any of the constructor's arguments), e.g. ``time_step=``.

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> dmc = sv.dmc.DMC(lambda p, r: -jnp.sum(r**2), lambda r: 0.0 * jnp.sum(r), time_step=0.02)
            >>> dmc.with_options(time_step=0.01).time_step
            0.01
        """
        return dataclasses.replace(self, **changes)

    def init(self, params: Any, walkers: Any = None) -> DMCState:
        """The DMC state of walkers at ``walkers``' positions, each of weight 1, at ``params``.

        Args:
            params: the trial function's parameters; or a VMC state: any state with the parameters as
                ``params`` and a :class:`shardvmc.mcmc.SamplerState` as ``sampler`` (``sv.driver.VMCState``, the
                neural template's; e.g. ``result.state`` of a VMC run), whose parameters and sampler's walkers
                are then the start.
            walkers: the walkers: a :class:`~shardvmc.WalkerSet` of positions (from
                ``sv.initialize_walkers_sharded``) or of :class:`shardvmc.mcmc.Walker` (a sampler's), or an
                array (all walkers valid). Their count is the population of the whole run.

        Returns:
            A :class:`DMCState`: ``log|psi|``, the drift and the local energy computed at every walker,
            ``E_T`` their mean local energy.

        Raises:
            CallError: no walkers given, or ``log|psi|`` or the local energy not finite at any walker; a
                ``log_psi``, ``potential``, ``local_energy`` or ``sign`` that is not one real number per walker
                (e.g. a potential that returns one number per electron).
        """
        if walkers is None and isinstance(getattr(params, "sampler", None), SamplerState) and hasattr(params, "params"):
            params, walkers = params.params, params.sampler.walkers
        if walkers is None:
            raise CallError(
                message(
                    "shardvmc.dmc.DMC.init",
                    "no walkers given.",
                    fix="pass dmc.init(params, walkers), or dmc.init(vmc_state) for a VMC run's state.",
                )
            )
        if not isinstance(walkers, WalkerSet):
            walkers = WalkerSet(walkers)
        if isinstance(walkers.data, Walker):
            walkers = WalkerSet(walkers.data.r, walkers.n_valid)
        mesh = self.mesh if self.mesh is not None else mesh_of_arrays(walkers.data, self.axis_name)
        params = replicate(params, mesh) if mesh is not None else params
        evaluated, sums = self.evaluate(params, walkers)
        finite = sums["finite"]
        if not tracing() and not finite.is_fully_addressable:  # (a multi-process run: this process's copy)
            finite = finite.addressable_data(0)
        if not tracing() and not float(finite) > 0:
            raise CallError(
                message(
                    "shardvmc.dmc.DMC.init",
                    "log|psi| or the local energy is not finite at any walker.",
                    got=f"{walkers.n_valid} walkers, none finite",
                    fix="start from walkers where psi is not 0 (e.g. a VMC run's), and check log_psi and the "
                    "potential there.",
                )
            )
        dtype = evaluated.data.local_energy.dtype
        e_t = sums["energy"] / jnp.maximum(sums["finite"], 1)
        scalars = (e_t.astype(dtype), jnp.zeros((), dtype), jnp.zeros((), dtype), jnp.zeros((), jnp.int32))
        if mesh is not None and not tracing():
            scalars = replicate(scalars, mesh)
        return DMCState(params, evaluated, *scalars)

    def step(self, state: DMCState, key: jax.Array) -> tuple[DMCState, dict[str, jax.Array]]:
        """One DMC step: every walker moved, weighted, and the population resampled: ``(state, stats)``.

        One jitted program (no host round trip); :func:`shardvmc.driver.run` runs it
        (``sv.driver.run(dmc.step, state, n_steps, key=...)``) with checkpoints and resume on any device count.
        With ``mesh=None`` it computes on the mesh of ``state``'s walkers.

        Args:
            state: the state (from :meth:`init` or the last step).
            key: ONE key for this step (walker ``i`` moves with ``fold_in(key, i)``).

        Returns:
            The new state, and the step's statistics (replicated scalars): ``energy`` (the step's mixed
            estimate ``sum w E_L / sum w``), ``error`` (``sqrt(variance / effective walkers)``, the step's own,
            not the run's), ``variance`` (of the local energy, weighted), ``growth_energy``
            (``E_T - log(mean weight) / tau_eff``), ``trial_energy`` (``E_T``), ``tau_eff``, ``acceptance``,
            ``effective_walkers`` (``(sum w)^2 / sum w^2``), ``nonfinite`` (walkers whose weight or local
            energy was not finite: weight 0), ``node_crossings`` (moves rejected for crossing a node),
            ``rejected_nonfinite`` (moves rejected because ``log|psi|``, its gradient or ``E_L`` was not finite
            at the proposed positions),
            ``resampled`` (1 when the comb ran) and ``fallback`` (1 when the copies moved by an all-gather).
            :func:`energy` makes the run's estimate from them.

        Raises:
            CallError: a ``key`` that is not ONE PRNG key (an int, a float array, one key per walker).
        """
        _check_step_key(key)
        mesh = self.mesh
        if mesh is None:
            mesh = mesh_of_arrays(state.walkers.data, self.axis_name)
        return self._step(state, key, mesh=mesh)

    def _traced_step(self, state: DMCState, key: jax.Array, mesh: Mesh | None) -> tuple[DMCState, dict[str, jax.Array]]:
        with contextlib.nullcontext() if mesh is None else use_mesh(mesh):
            return self._step_on_mesh(state, key)

    def _step_on_mesh(self, state: DMCState, key: jax.Array) -> tuple[DMCState, dict[str, jax.Array]]:
        walkers = state.walkers
        n = walkers.n_valid
        dtype = walkers.data.local_energy.dtype
        tau = jnp.asarray(self.time_step, dtype)
        # UNR's running effective time step: the accepted share of the diffusion, accumulated over the run
        # (before the first step: tau itself)
        tau_eff = jnp.where(state.proposed_r2 > 0, tau * state.accepted_r2 / state.proposed_r2, tau)
        e_t = state.trial_energy
        e_cut = jnp.asarray(
            jnp.inf if self.energy_cutoff is None else self.energy_cutoff / math.sqrt(self.time_step), dtype
        )
        constants = {"tau": tau, "tau_eff": tau_eff, "trial_energy": e_t, "cutoff": e_cut}
        k_move, k_comb = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(2))  # fold_in(key, 0), (key, 1)
        # the move (no collective), then the statistics and the comb: one all-gather (with the halos in it)
        moved, rows = self._move_rows(state.params, walkers, k_move, constants)
        u = jax.random.uniform(k_comb, (), dtype)
        halo = self.halo if self.halo is not None else 32
        resampled, summed, flags = self._branch(moved, rows, u, tau_eff, n, halo, self.resample_threshold)
        sums = dict(zip(_SUMS, summed))
        energy, variance, effective, _, _ = _estimates(sums, tau_eff, n, self.resample_threshold)
        alive, resample, fallback = flags
        mean_weight = sums["weight"] / n
        growth = e_t - jnp.log(mean_weight) / tau_eff
        # E_T: the mean of the mixed estimates over about one hartree^-1 of imaginary time (at least 10 steps,
        # at most 1000): it centres the cutoff; with a fixed population it does not change the walk.
        memory = min(max(10, math.ceil(1.0 / self.time_step)), 1000)
        count = state.steps.astype(dtype) + 1
        rate = 1.0 / jnp.minimum(count, memory)
        e_t_new = jnp.where(alive, e_t + rate * (energy - e_t), e_t)
        new = DMCState(
            state.params,
            resampled,
            e_t_new.astype(dtype),
            (state.accepted_r2 + sums["accepted_r2"]).astype(dtype),
            (state.proposed_r2 + sums["proposed_r2"]).astype(dtype),
            state.steps + 1,
        )
        stats = {
            "energy": energy,
            "error": jnp.sqrt(variance / effective),
            "variance": variance,
            "growth_energy": growth,
            "trial_energy": e_t,
            "tau_eff": tau_eff,
            "acceptance": sums["accepted"] / n,
            "effective_walkers": effective,
            "nonfinite": sums["nonfinite"],
            "node_crossings": sums["node_crossings"],
            "rejected_nonfinite": sums["rejected_nonfinite"],
            "resampled": resample.astype(dtype),
            "fallback": fallback.astype(dtype),
        }
        return new, stats


# ----------------------------------------------------------------------------- the per-walker pieces

# What each of the user's per-walker functions must return for one walker, and how to fix another return.
_ONE_NUMBER_FIX = {
    "potential": "return the walker's potential energy as one number: sum its terms, e.g. "
    "jnp.sum(per_electron_terms). potential(r) is called for ONE walker, r of shape (n_electrons, ndim).",
    "local_energy": "return the walker's local energy as one number (sum its terms, e.g. jnp.sum(...)); "
    "local_energy(params, r) is called for ONE walker, r of shape (n_electrons, ndim), with no batch axis.",
    "sign": "return the sign of psi at the walker as one number (+1 or -1), e.g. jnp.sign(jnp.linalg.det(...)) "
    "of one walker's orbitals, or the product of the spin blocks' signs.",
}


def _one_number(fn: Callable[..., Any] | None, name: str, call: str) -> Callable[..., Any] | None:
    """``fn`` refused (``CallError``, on the traced shape: free in the compiled program) unless it returns a scalar.

    A potential written for a batch of electrons (one number per electron) would otherwise give every walker a
    vector of local energies, which no statistic of a walker can hold.
    """
    if fn is None:
        return None

    def checked(*args: Any) -> Any:
        out = fn(*args)
        leaves = jax.tree_util.tree_leaves(out)
        one = len(leaves) == 1 and leaves[0] is out
        if one and jnp.shape(out) == ():
            return out
        what = f"shape {tuple(jnp.shape(out))}" if one else f"a {type(out).__name__}"
        raise CallError(
            message(
                _WHERE,
                f"{call} returned {what} for one walker, not one number.",
                got=f"{describe(out)} for r of shape {tuple(jnp.shape(args[-1]))}",
                expected="one real number per walker: a scalar, shape ()",
                fix=_ONE_NUMBER_FIX[name],
            )
        )

    return checked


def _check_step_key(key: Any) -> None:
    """A ``CallError`` unless ``key`` is ONE PRNG key: typed of shape ``()``, or raw ``uint32[2]``."""
    dtype = getattr(key, "dtype", None)
    typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
    if (typed and jnp.shape(key) == ()) or (not typed and dtype == np.uint32 and jnp.shape(key) == (2,)):
        return
    raise CallError(
        message(
            "shardvmc.dmc.DMC.step",
            "key is not ONE PRNG key.",
            got=describe(key) if dtype is not None else f"{type(key).__name__} {key!r}",
            expected="one key: jax.random.key(seed) (typed, shape ()) or jax.random.PRNGKey(seed) (uint32[2])",
            fix="pass ONE key per step, dmc.step(state, jax.random.key(seed)) (walker i moves with fold_in(key, i)); "
            "sv.driver.run(dmc.step, state, n_steps, key=...) gives step t the key fold_in(key, t).",
        )
    )


def _make_evaluate(
    log_psi: Callable[..., Any],
    sign: Callable[..., Any] | None,
    potential: Callable[..., Any] | None,
    local_energy: Callable[..., Any] | None,
    laplacian: str,
) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array, jax.Array]]:
    """``evaluate(params, x) -> (log|psi|, sign, grad log|psi|, E_L)`` of one walker at positions ``x``."""

    def value(params: Any, x: jax.Array) -> jax.Array:
        out = log_psi_value(log_psi, params, x, _WHERE)
        if jnp.iscomplexobj(out):
            raise CallError(
                message(
                    _WHERE,
                    "log_psi returned a complex number: fixed-node DMC needs a real log|psi| (and sign=).",
                    got=describe(out),
                    fix="return log|psi| (jnp.real of a complex log psi is not enough: the phase would be lost); a "
                    "complex trial function needs fixed-phase DMC, which shardvmc.dmc does not do.",
                )
            )
        return out.astype(x.dtype)

    def evaluate(params: Any, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        shape = x.shape
        s = jnp.ones((), x.dtype) if sign is None else jnp.sign(jnp.asarray(sign(params, x))).astype(x.dtype)
        if local_energy is not None:
            lp, g = jax.value_and_grad(value, argnums=1)(params, x)
            return lp, s, g, jnp.asarray(local_energy(params, x)).astype(x.dtype)

        def flat_value(flat: jax.Array) -> jax.Array:
            return value(params, flat.reshape(shape))

        # log|psi|, its gradient (the drift) and its Laplacian (one forward pass with folx)
        lp, lap, g = value_laplacian_gradient(flat_value, x.reshape(-1), laplacian, 0)
        assert potential is not None
        e = -0.5 * (lap + jnp.sum(g * g)) + jnp.asarray(accurate(potential)(x)).astype(x.dtype)
        return lp, s, g.reshape(shape), e

    return evaluate


def _make_init(evaluate: Callable[..., Any]) -> Callable[..., Any]:
    def init(params: Replicated[Any], r: PerWalker[jax.Array]) -> tuple[PerWalker[DMCWalker], Sum[dict]]:
        x = float_positions(r)
        lp, s, g, e = evaluate(params, x)
        finite = jnp.isfinite(lp) & jnp.isfinite(e) & jnp.all(jnp.isfinite(g))
        walker = DMCWalker(x, lp, s, g, e, jnp.ones((), x.dtype))
        return walker, {"energy": jnp.where(finite, e, 0.0), "finite": finite.astype(x.dtype)}

    init.__qualname__ = "DMC.evaluate"
    return init


def _make_move(evaluate: Callable[..., Any], a: float, limit_energy: bool) -> tuple[Callable[..., Any], ...]:
    """The move of one walker as two kernels' bodies: ``DMC.move`` (the statistics summed) and the step's (per walker).

    The step sums the statistics itself, in the comb's one all-gather (:func:`_branch`): no all-reduce of its own.
    """

    def body(params: Any, w: DMCWalker, key: jax.Array, c: dict) -> tuple[DMCWalker, dict]:
        x = w.r
        dtype = x.dtype
        tau, tau_eff = c["tau"].astype(dtype), c["tau_eff"].astype(dtype)
        k_move, k_accept = jax.random.split(key)
        chi = jax.random.normal(k_move, x.shape, dtype)
        step = tau * _limited_drift(w.grad, tau, a) + jnp.sqrt(tau) * chi
        y = x + step
        lp_y, s_y, g_y, e_y = evaluate(params, y)
        # the Green's function ratio G(x <- y) / G(y <- x) of the drift-diffusion proposal
        back = x - y - tau * _limited_drift(g_y, tau, a)
        log_ratio = 2.0 * (lp_y - w.log_psi) + (jnp.sum(chi * chi) * tau - jnp.sum(back * back)) / (2.0 * tau)
        finite_y = jnp.isfinite(lp_y) & jnp.isfinite(e_y) & jnp.all(jnp.isfinite(g_y))
        same_side = s_y == w.sign
        p = jnp.where(finite_y & same_side, jnp.exp(jnp.minimum(log_ratio, 0.0)), 0.0)
        p = jnp.where(jnp.isfinite(p), p, 0.0)
        accept = jax.random.uniform(k_accept, (), dtype) < p
        new = DMCWalker(
            jnp.where(accept, y, x),
            jnp.where(accept, lp_y, w.log_psi),
            jnp.where(accept, s_y, w.sign),
            jnp.where(accept, g_y, w.grad),
            jnp.where(accept, e_y, w.local_energy),
            w.weight,
        )
        e_t, cut = c["trial_energy"].astype(dtype), c["cutoff"].astype(dtype)

        def branching_energy(e: jax.Array, g: jax.Array) -> jax.Array:
            if limit_energy:  # UNR: E_T - (E_T - E_L) |vbar| / |v|, damped where the drift is limited
                v2 = jnp.sum(g * g)
                vbar = _limited_drift(g, tau, a)
                ratio = jnp.where(v2 > 0, jnp.sqrt(jnp.sum(vbar * vbar) / jnp.where(v2 > 0, v2, 1.0)), 1.0)
                e = e_t - (e_t - e) * ratio
            return jnp.clip(e, e_t - cut, e_t + cut)

        s_old = branching_energy(w.local_energy, w.grad)
        s_new = branching_energy(new.local_energy, new.grad)
        weight = w.weight * jnp.exp(tau_eff * (e_t - 0.5 * (s_old + s_new)))
        good = jnp.isfinite(weight) & jnp.isfinite(new.local_energy) & jnp.isfinite(new.log_psi)
        weight = jnp.where(good, weight, 0.0)
        e = jnp.where(good, new.local_energy, 0.0)
        dr2 = jnp.where(jnp.isfinite(step).all(), jnp.sum(step * step), 0.0)
        w_old = jnp.where(jnp.isfinite(w.weight), w.weight, 0.0)
        sums = {
            "weight": weight,
            "weight2": weight * weight,
            "weighted_energy": weight * e,
            "weighted_energy2": weight * e * e,
            "accepted": accept.astype(dtype),
            "accepted_r2": w_old * p * dr2,
            "proposed_r2": w_old * dr2,
            "nonfinite": (~good).astype(dtype),
            "rejected_nonfinite": (~finite_y).astype(dtype),
            "node_crossings": (finite_y & ~same_side).astype(dtype),
        }
        return new._replace(weight=weight), sums

    def move(
        params: Replicated[Any], w: PerWalker[DMCWalker], key: WalkerKey, c: Replicated[dict]
    ) -> tuple[PerWalker[DMCWalker], Sum[dict]]:
        return body(params, w, key, c)

    def move_rows(
        params: Replicated[Any], w: PerWalker[DMCWalker], key: WalkerKey, c: Replicated[dict]
    ) -> tuple[PerWalker[DMCWalker], PerWalker[jax.Array]]:
        new, sums = body(params, w, key, c)
        return new, jnp.stack([sums[k] for k in _SUMS])  # one row of the statistics (in _SUMS' order)

    move.__qualname__ = "DMC.move"
    move_rows.__qualname__ = "DMC.step.move"
    return move, move_rows


# ----------------------------------------------------------------------------- the global comb

# The step's statistics: each device's sums over its walkers travel in the comb's all-gather (:func:`_branch`).
_SUMS: tuple[str, ...] = (
    "weight",
    "weight2",
    "weighted_energy",
    "weighted_energy2",
    "accepted",
    "accepted_r2",
    "proposed_r2",
    "nonfinite",
    "rejected_nonfinite",
    "node_crossings",
)


def _estimates(
    sums: Mapping[str, jax.Array], tau_eff: jax.Array, population: int, threshold: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """``(energy, variance, effective walkers, alive, resample)`` of a step, from its global sums."""
    total = sums["weight"]
    # No move accepted in the whole run (tau_eff = 0): the population cannot diffuse, nothing is estimated.
    energy = jnp.where(tau_eff > 0, sums["weighted_energy"] / total, jnp.nan)
    variance = jnp.maximum(sums["weighted_energy2"] / total - energy**2, 0.0)
    effective = total**2 / sums["weight2"]
    # Not finite when every weight is 0 (a collapsed population): the statistics say so (energy nan), and
    # the walkers are kept as they were, with weight 1.
    alive = jnp.isfinite(total) & (total > 0) & jnp.isfinite(energy)
    resample = alive & (True if threshold >= 1 else effective < threshold * population)
    return energy, variance, effective, alive, resample


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` (walker axis first) as uint32 words, ``(walkers, words)``: every dtype travels exactly."""
    rows = x.shape[0]
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).reshape(rows, -1)
    width = x.dtype.itemsize
    if width in (4, 8):  # (8: a trailing axis of two words)
        return jax.lax.bitcast_convert_type(x, jnp.uint32).reshape(rows, -1)
    narrow = {1: jnp.uint8, 2: jnp.uint16}[width]
    return jax.lax.bitcast_convert_type(x, narrow).astype(jnp.uint32).reshape(rows, -1)


def _from_words(words: jax.Array, like: jax.Array) -> jax.Array:
    """The inverse of :func:`_words`, for rows shaped and typed as ``like``'s."""
    shape = (words.shape[0],) + like.shape[1:]
    if like.dtype == jnp.bool_:
        return words.reshape(shape) != 0
    width = like.dtype.itemsize
    if width == 8:
        return jax.lax.bitcast_convert_type(words.reshape(shape + (2,)), like.dtype)
    if width == 4:
        return jax.lax.bitcast_convert_type(words.reshape(shape), like.dtype)
    narrow = {1: jnp.uint8, 2: jnp.uint16}[width]
    return jax.lax.bitcast_convert_type(words.reshape(shape).astype(narrow), like.dtype)


def _pack(tree: Any) -> tuple[jax.Array, Callable[[jax.Array], Any]]:
    """``tree`` (walker axis first) as ONE ``(walkers, k)`` buffer, and its unpacking, bit for bit.

    A collective of the buffer is one message, where JAX would send one per leaf. The buffer has the leaves'
    dtype when they share one (a DMC walker's fields and prefix sums), else it holds their bits in uint32 words.
    """
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    same = len({x.dtype for x in leaves}) == 1
    parts = [x.reshape(x.shape[0], -1) if same else _words(x) for x in leaves]
    sizes = np.cumsum([p.shape[1] for p in parts])[:-1].tolist()

    def back(values: jax.Array, like: jax.Array) -> jax.Array:
        return values.reshape((values.shape[0],) + like.shape[1:]) if same else _from_words(values, like)

    def unpack(buffer: jax.Array) -> Any:
        pieces = jnp.split(buffer, sizes, axis=1)
        return jax.tree_util.tree_unflatten(treedef, [back(p, x) for p, x in zip(pieces, leaves)])

    return jnp.concatenate(parts, axis=1), unpack


# The halos travel inside the all-gather (one collective a step) while what every device then receives, the
# halos of all, stays below this many bytes; beyond, by one ppermute each way (their bytes do not grow with p).
_HALOS_IN_GATHER_BYTES = 2**18


def _comb(
    w: DMCWalker,
    extra: jax.Array,
    u: jax.Array,
    population: int,
    halo: int,
    decide: Callable[[jax.Array], tuple[jax.Array, jax.Array]],
) -> tuple[DMCWalker, jax.Array, jax.Array]:
    """The comb over the global population, in walker-index order, from this device's block of walkers.

    Slot ``m`` (``m < population``) takes a copy of walker ``i`` when the comb's tooth ``(m + u) W / population``
    falls in walker ``i``'s share ``[C_{i-1}, C_i)`` of the prefix sums ``C`` of the weights (total ``W``).

    What travels: ONE all-gather per step of a few numbers per device (its weight total: its offset in the
    global prefix sum; the prefix sums at the ends of its halos, from which every device knows every device's
    reach; and ``extra``, e.g. the step's statistics) and of its halos: its first and last ``halo`` walkers,
    every field but the weight and their prefix sums packed in one buffer. (When every device's halos together
    exceed ``_HALOS_IN_GATHER_BYTES``, the halos go by one ``ppermute`` each way to the neighbours instead.)
    When some device's slots reach past its neighbours' halos (every device knows it from the all-gather, the
    same bits everywhere), every device all-gathers the whole population instead (``fallback``), one buffer.

    Args:
        w: this device's block of walkers.
        extra: numbers to sum over the devices in the same all-gather, ``(k,)``.
        u: the comb's offset in ``[0, 1)``, replicated.
        population: the valid walkers in all (the rest is padding: its slots keep their walker).
        halo: walkers sent to each neighbour.
        decide: ``decide(extra summed over the devices) -> (resample, alive)``, replicated booleans: whether
            the comb runs (else the weights are normalised to a mean of 1), and whether any weight is left (else
            they are set to 1).

    Returns:
        ``(walkers, fallback, extra summed)``: ``fallback`` (replicated) is true when the comb ran and the
        copies came by the all-gather of every walker.
    """
    body = current_body()
    assert body is not None
    axes = body.axes
    n = w.weight.shape[0]
    dtype = w.weight.dtype
    d = jax.lax.axis_index(axes)
    n_dev = jax.lax.axis_size(axes)
    h = min(halo, n)
    slots = d * n + jnp.arange(n)
    valid = slots < population
    weight = jnp.where(valid & jnp.isfinite(w.weight), w.weight, 0.0)
    local = jnp.cumsum(weight)
    zero = jnp.zeros((1,), dtype)
    # The block's prefix sums where the halos' shares end: before the last h walkers (the start of the halo
    # sent forward) and at the first h walkers' last but the block's (the end of the halo sent backward; the
    # block's own end is its total's).
    before_tail = jnp.max(jnp.concatenate([zero, local[: n - h]]))
    head_end = jnp.max(jnp.concatenate([zero, local[: min(h, n - 1)]]))
    row = jnp.concatenate([local[-1:], before_tail[None], head_end[None], extra.astype(dtype)])
    fields = w._replace(weight=None)  # every field but the weight (a copy's weight is 1)
    # A walker travels as its fields and its prefix sum in the block (the receiver makes its share's end), the
    # halos (the first and the last h walkers) in one buffer each. The all-gather's result is the same bits on
    # every device ("invarying": JAX proves the step's sums replicated).
    tail, unpack = _pack(jax.tree_util.tree_map(lambda x: x[n - h :], (fields, local)))
    head, _ = _pack(jax.tree_util.tree_map(lambda x: x[:h], (fields, local)))
    if n_dev > 1 and n_dev * (head.size + tail.size) * head.dtype.itemsize <= _HALOS_IN_GATHER_BYTES:
        message = jnp.concatenate([row, tail.reshape(-1), head.reshape(-1)])
        gathered = jax.lax.all_gather(message, axes, to="invarying")  # (devices, numbers and halos)
        table, halos = gathered[:, : row.size], gathered[:, row.size :].reshape(n_dev, 2, h, tail.shape[1])
        left, right = halos[jnp.maximum(d - 1, 0), 0], halos[jnp.minimum(d + 1, n_dev - 1), 1]
    else:
        table = jax.lax.all_gather(row, axes, to="invarying")  # (devices, numbers)
        left = jax.lax.ppermute(tail, axes, [(i, i + 1) for i in range(n_dev - 1)]) if n_dev > 1 else None
        right = jax.lax.ppermute(head, axes, [(i + 1, i) for i in range(n_dev - 1)]) if n_dev > 1 else None
    summed = jnp.sum(table[:, 3:], axis=0)
    resample, alive = decide(summed)
    inclusive = jnp.cumsum(table[:, 0])
    exclusive = jnp.concatenate([zero, inclusive[:-1]])
    total = inclusive[-1]
    scale = population / total

    def teeth_below(c: jax.Array) -> jax.Array:
        """How many teeth ``(m + u) W / population`` lie below ``c``: the first slot after walker ``c``'s share."""
        count = jnp.ceil(c * scale - u)
        return jnp.clip(jnp.where(jnp.isfinite(count), count, 0), 0, population).astype(jnp.int32)

    def ends_of(e: jax.Array | int, prefix: jax.Array, last: bool) -> jax.Array:
        """The ends of the shares of device ``e``'s walkers whose prefix sums in their block are ``prefix``.

        ``last``: the last of them is the block's last walker (its end is the block's total's). Every device
        computes them from the same gathered totals, so a walker's end is the same bits wherever it is computed;
        they ascend (teeth_below is monotone, as the prefix sums are but for round-off).
        """
        c = exclusive[e] + prefix
        return teeth_below(c.at[-1].set(inclusive[e]) if last else c)

    def sources(ends: jax.Array) -> jax.Array:
        """For each slot of this device, the first walker whose share's end (of ``ends``) lies past it.

        ``searchsorted(ends, slots, side="right")`` for ascending ``ends``, as the count of the ends at or below
        each slot (clipped to the last walker): a histogram of the ends over this device's slots and its prefix
        sum. (A count is defined whatever the order: where round-off leaves two neighbouring ends one tooth out
        of order, a slot takes the neighbour.)
        """
        bins = jnp.clip(ends - d * n, 0, n)
        below = jnp.cumsum(jnp.zeros((n + 1,), jnp.int32).at[bins].add(1))[:n]
        return jnp.minimum(below, ends.shape[0] - 1)

    ends = ends_of(d, local, True)
    if n_dev > 1:
        # Every device's reach, the same bits on every device: the first slot of its left halo's first walker's
        # share (0 for the first device) and the last slot of its right halo's last walker's share (+1; the
        # population for the last device), of the largest prefix sums before and in them.
        reach_lo = jnp.concatenate([jnp.zeros((1,), jnp.int32), teeth_below(exclusive[:-1] + table[:-1, 1])])
        reach_hi = teeth_below(exclusive[1:] + table[1:, 2])
        if h == n:  # the right halo is the neighbour's whole block: its last end is its total's
            reach_hi = jnp.maximum(reach_hi, teeth_below(inclusive[1:]))
        reach_hi = jnp.concatenate([reach_hi, jnp.full((1,), population, jnp.int32)])
        first = jnp.arange(n_dev) * n
        last = jnp.minimum(first + n, population)
        within = jnp.all((first >= population) | ((reach_lo <= first) & (last <= reach_hi)))
        assert left is not None and right is not None
        # the halos' ends; beyond the first and the last device: empty shares before every slot, after every one
        left_ends = jnp.where(d == 0, 0, ends_of(jnp.maximum(d - 1, 0), unpack(left)[1], True))
        right_ends = ends_of(jnp.minimum(d + 1, n_dev - 1), unpack(right)[1], h == n)
        right_ends = jnp.where(d == n_dev - 1, population, right_ends)
        halos = (left, right, jnp.concatenate([left_ends, ends, right_ends]))
    else:
        within, halos = jnp.array(True), None

    padded = n * n_dev > population  # (else every slot is valid)

    def combed(operands: Any) -> DMCWalker:
        """The copies in every valid slot; padding slots keep their walker."""
        fields, local, halos = operands
        if halos is None:  # one device: every copy from its own walkers, field by field
            index = sources(ends)

            def copy(x: jax.Array) -> jax.Array:
                taken = jnp.take(x, index, axis=0)
                return jnp.where(valid.reshape((n,) + (1,) * (x.ndim - 1)), taken, x) if padded else taken

            return jax.tree_util.tree_map(copy, fields)
        buffer, unpack = _pack((fields, local))

        def from_window(_: Any) -> jax.Array:
            left, right, window_ends = halos
            return jnp.take(jnp.concatenate([left, buffer, right]), sources(window_ends), axis=0)

        def from_everyone(_: Any) -> jax.Array:
            everyone = jax.lax.all_gather(buffer, axes, tiled=True)
            blocks = unpack(everyone)[1].reshape(n_dev, n)
            all_ends = jax.vmap(lambda e, p: ends_of(e, p, True))(jnp.arange(n_dev), blocks)
            return jnp.take(everyone, sources(all_ends.reshape(-1)), axis=0)

        copies = jax.lax.cond(within, from_window, from_everyone, None)
        return unpack(jnp.where(valid[:, None], copies, buffer) if padded else copies)[0]

    # The copies where the comb runs. Both ways keep the operands computed once (else XLA fuses the move's
    # arithmetic into every use of them, the copies' gathers included).
    def branched(operands: Any) -> DMCWalker:  # a branch: no copies when the comb does not run
        return jax.lax.cond(resample, combed, lambda o: o[0], operands)

    def selected(operands: Any) -> DMCWalker:  # on a GPU a conditional sends its predicate to the host and waits
        kept = jax.lax.optimization_barrier(operands)
        return jax.tree_util.tree_map(lambda c, f: jnp.where(resample, c, f), combed(kept), operands[0])

    out = jax.lax.platform_dependent((fields, local, halos), cpu=branched, default=selected)
    # weights: 1 after a comb; else normalised to a mean of 1; 1 again after a collapse (nothing left to weigh)
    normalised = jnp.where(alive, weight * (population / total), 1.0)
    out = out._replace(weight=jnp.where(resample | ~valid, jnp.ones((n,), dtype), normalised))
    return out, ~within & resample, summed


def _resample(
    w: PerWalker[DMCWalker],
    u: Replicated[jax.Array],
    resample: Replicated[jax.Array],
    alive: Replicated[jax.Array],
    population: Static[int],
    halo: Static[int],
) -> tuple[PerWalker[DMCWalker], Mean[jax.Array]]:
    """The comb over the global population (:func:`_comb`), resampling when ``resample``: ``(walkers, fallback)``.

    Each device needs only the offset of its block in the global prefix sum: an all-gather of one total per
    device (and of the two prefix sums that tell every device's reach). The slots' sources are then found among
    this device's walkers and a halo of ``halo`` walkers of each neighbouring device (in the same all-gather, or
    by one ``ppermute`` each way on many devices); when some slot's source is farther, every device all-gathers
    the whole population instead (``fallback``, counted). Padding slots keep their own walker.
    """
    n = w.weight.shape[0]
    extra = jnp.zeros((0,), w.weight.dtype)
    out, fallback, _ = _comb(w, extra, u, population, halo, lambda _: (resample, alive))
    return out, jnp.full((n,), fallback.astype(w.weight.dtype))  # a Mean of a block: the flag


def _branch(
    w: PerWalker[DMCWalker],
    rows: PerWalker[jax.Array],
    u: Replicated[jax.Array],
    tau_eff: Replicated[jax.Array],
    population: Static[int],
    halo: Static[int],
    threshold: Static[float],
) -> tuple[PerWalker[DMCWalker], Replicated[jax.Array], Replicated[jax.Array]]:
    """The step's statistics and comb in one: ``(walkers, sums, flags)``, replicated ``sums`` (of :data:`_SUMS`)
    and ``flags`` (alive, resample, fallback).

    Each device's sums of the move's statistics (``rows``, one row of :data:`_SUMS` per walker) travel in the
    comb's all-gather (:func:`_comb`), with the halos: the step's one collective (on many devices, where the
    halos of all would make it large, they go beside it, by one ``ppermute`` each way).
    """
    body = current_body()
    assert body is not None
    n = w.weight.shape[0]
    valid = jax.lax.axis_index(body.axes) * n + jnp.arange(n) < population
    local = jnp.sum(jnp.where(valid[:, None], rows, 0.0), axis=0)
    decided = []

    def decide(summed: jax.Array) -> tuple[jax.Array, jax.Array]:
        *_, alive, resample = _estimates(dict(zip(_SUMS, summed)), tau_eff, population, threshold)
        decided.extend([alive, resample])
        return resample, alive

    out, fallback, summed = _comb(w, local, u, population, halo, decide)
    return out, summed, jnp.stack([*decided, fallback])


# ----------------------------------------------------------------------------- the estimator


def _column(history: Mapping[str, Any], name: str) -> np.ndarray:
    if name not in history:
        raise CallError(
            message(
                "shardvmc.dmc.energy",
                f"history has no {name!r} statistic.",
                got=f"statistics {sorted(history)}",
                fix="pass the history of a DMC run (sv.driver.run(dmc.step, ...).history, or sv.driver.read_log of "
                "its log).",
            )
        )
    return np.asarray(history[name], np.float64).reshape(-1)


def energy(
    history: Any,
    *,
    discard: int | float = 0.2,
    population_steps: int | None = None,
) -> Stats:
    """The run's mixed estimate of the energy and its error bar, from its steps' statistics.

    ``E = sum_k P_k w_k E_k / sum_k P_k w_k`` over the steps ``k`` kept, with ``E_k`` the step's mixed estimate
    and ``P_k`` the product of the steps' mean weights at a fixed trial energy over the last
    ``population_steps`` steps (UNR 1993): ``log P_k = sum_{j=k-T_p+1}^{k} tau_eff_j (E_0 - growth_energy_j)``.
    It undoes the bias of keeping the population fixed (of order ``1 / walkers``); ``population_steps=0``
    leaves it in. The error bar is that of the mean of ``P_k (E_k - E) / mean(P)``, a series of the steps,
    from :func:`shardvmc.statistics` (its autocorrelation time included).

    Args:
        history: the statistics of a DMC run: :class:`shardvmc.driver.RunResult`, its ``history``, or
            ``sv.driver.read_log`` of its log.
        discard: the steps left out at the start (equilibration): a count, or a fraction of the steps (a float
            below 1).
        population_steps: ``T_p``; ``None``: about ``2 / tau`` steps (two hartree^-1 of imaginary time), at most
            a tenth of the steps kept.

    Returns:
        A :class:`~shardvmc.Stats` (host values): ``mean`` the energy, ``error_of_mean`` its error,
        ``variance`` the mean variance of the local energy, ``tau_corr``, ``R_hat`` and ``ess`` of the steps'
        series.

    Raises:
        CallError: a history without the DMC statistics, or fewer than 4 steps left.

    Example:
        >>> import numpy as np, shardvmc as sv
        >>> steps = 200
        >>> history = {"energy": np.full(steps, -2.9), "growth_energy": np.full(steps, -2.9),
        ...            "tau_eff": np.full(steps, 0.01), "variance": np.full(steps, 0.1)}
        >>> round(float(sv.dmc.energy(history).mean), 6)
        -2.9
    """
    history = getattr(history, "history", history)
    e = _column(history, "energy")
    growth = _column(history, "growth_energy")
    tau_eff = _column(history, "tau_eff")
    variance = _column(history, "variance") if "variance" in history else np.full_like(e, np.nan)
    n = e.shape[0]
    first = int(round(discard * n)) if isinstance(discard, float) and discard < 1 else int(discard)
    if n - first < 4:
        raise CallError(
            message(
                "shardvmc.dmc.energy",
                "fewer than 4 steps are left after the equilibration steps.",
                got=f"{n} steps, discard={discard!r}",
                fix="run more steps, or pass a smaller discard=.",
            )
        )
    if population_steps is None:
        tau = float(np.nanmedian(tau_eff[first:]))
        population_steps = min(math.ceil(2.0 / tau), max((n - first) // 10, 1))
    t_p = int(population_steps)
    e0 = float(np.mean(growth[first:]))
    log_factor = np.concatenate([[0.0], np.cumsum(tau_eff * (e0 - growth))])
    index = np.arange(first, n)
    log_p = log_factor[index + 1] - log_factor[np.maximum(index + 1 - t_p, 0)] if t_p > 0 else np.zeros(n - first)
    p = np.exp(log_p - np.max(log_p))
    p /= np.mean(p)
    kept = e[first:]
    mean = float(np.sum(p * kept) / np.sum(p))
    y = p * (kept - mean)  # the linearised ratio estimator: its mean's error is E's
    with use_mesh(create_mesh(jax.local_devices()[:1])):  # a host series: this process's first device
        stats = statistics(np.asarray(y[None, :]))
    stats = jax.tree_util.tree_map(lambda v: np.asarray(v, np.float64), stats)
    return dataclasses.replace(stats, mean=np.float64(mean), variance=np.float64(np.nanmean(variance[first:])))


def extrapolate(time_steps: Any, energies: Any) -> tuple[float, float]:
    """The energy at zero time step from DMC energies at several: a weighted linear fit ``E(tau) = E_0 + b tau``.

    DMC's time-step bias is linear in ``tau`` for small ``tau`` (UNR's Green's function with Metropolis
    acceptance: its error is ``O(tau)`` in the energy, and small); two or more time steps fix the line.

    Args:
        time_steps: the time steps ``tau`` (at least 2 different ones, each positive and finite).
        energies: for each, a :class:`~shardvmc.Stats` (from :func:`energy`) or a pair ``(mean, error)``, both
            finite, the error positive.

    Returns:
        ``(E_0, error)``: the intercept and its standard error (from the energies' error bars).

    Raises:
        CallError: not one energy per time step, fewer than 2 different time steps, a time step that is not
            positive and finite, an energy that is not finite (a run that stopped: NaN), an error bar that is not
            positive and finite.

    Example:
        >>> import shardvmc as sv
        >>> e0, err = sv.dmc.extrapolate([0.02, 0.01], [(-2.9017, 0.001), (-2.9027, 0.001)])
        >>> round(e0, 4), round(err, 4)
        (-2.9037, 0.0022)
    """
    where = "shardvmc.dmc.extrapolate"
    tau = np.asarray(time_steps, np.float64).reshape(-1)
    pairs = [
        (float(s.mean), float(s.error_of_mean)) if isinstance(s, Stats) else tuple(map(float, s)) for s in energies
    ]
    if len(pairs) != tau.shape[0] or np.unique(tau).shape[0] < 2:
        raise CallError(
            message(
                where,
                "needs one energy per time step, and at least 2 different time steps.",
                got=f"{tau.shape[0]} time steps ({np.unique(tau).shape[0]} different), {len(pairs)} energies",
                fix="pass the time step of each run and its energy (sv.dmc.energy of its history), in the same order.",
            )
        )
    bad_tau = [i for i, t in enumerate(tau) if not (math.isfinite(t) and t > 0)]
    if bad_tau:
        raise CallError(
            message(
                where,
                f"time_steps[{bad_tau[0]}] is not a positive finite time step: the fit is to tau -> 0 from tau > 0.",
                got=f"time_steps={tau.tolist()}",
                fix="pass each run's DMC time_step (hartree^-1, > 0), as given to sv.dmc.DMC(time_step=...).",
            )
        )
    e = np.array([m for m, _ in pairs])
    err = np.array([s for _, s in pairs])
    bad_e = [i for i, m in enumerate(e) if not math.isfinite(m)]
    if bad_e:
        i = bad_e[0]
        raise CallError(
            message(
                where,
                f"energies[{i}] (at time step {float(tau[i])!r}) is not finite: a fit through it would be NaN.",
                got=f"(mean, error) = ({float(e[i])!r}, {float(err[i])!r})",
                fix="leave that run out, or rerun it: a NaN energy is a run that stopped (its log says why, e.g. "
                "StopOnNonFinite's 'energy is nan at step k').",
            )
        )
    bad_err = [i for i, s in enumerate(err) if not (math.isfinite(s) and s > 0)]
    if bad_err:
        i = bad_err[0]
        raise CallError(
            message(
                where,
                f"the error bar of energies[{i}] (at time step {float(tau[i])!r}) is not positive and finite: the fit "
                "weighs each energy by 1 / error^2.",
                got=f"errors={err.tolist()}",
                fix="pass each run's error bar (sv.dmc.energy(...).error_of_mean; it needs enough steps to be "
                "finite), or run longer.",
            )
        )
    a = np.stack([np.ones_like(tau), tau], axis=1) / err[:, None]
    cov = np.linalg.inv(a.T @ a)
    coef = cov @ (a.T @ (e / err))
    return float(coef[0]), float(math.sqrt(cov[0, 0]))
