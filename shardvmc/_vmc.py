"""The VMC step built from its pieces (``VMC``), and evaluation at fixed parameters as one call (``expect``).

``VMC(log_psi, optimiser, potential)`` builds the step a user writes by hand (docs/vmc.md): Metropolis
moves (``sv.mcmc.Metropolis``), one walker-parallel measurement of the local energy
(``sv.hamiltonian.local_energy``) and of the walker's log-derivatives ``d log|psi| / d params``, and the optax
update with ``jacobian=`` and ``local_energies=`` (``shardvmc.optax``'s natural gradient reads them; any
other optax transformation gets the energy gradient ``2 (<j e> - <j><e>)`` as its ``updates``). Its
``step(state, key) -> (state, stats)`` is what :func:`shardvmc.driver.run` runs. ``expect`` samples at fixed
parameters through the same loop and returns ``sv.Stats`` of an observable over every walker and step.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import IO, Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from ._caches import bounded
from ._compiler import platform_jit
from ._decorator import WalkerParallel, walker_parallel
from ._driver import run
from ._errors import CallError, install, message
from ._internals import tracing
from ._markers import Mean, PerWalker, Replicated
from ._mcstats import Stats, StatsAccumulator
from ._mesh import entered_mesh, use_mesh
from ._placement import replicate
from ._reductions import walker_mean
from ._stats import all_walkers
from ._walkerset import WalkerSet
from .hamiltonian import local_energy as hamiltonian_local_energy
from .loss import Clipping
from .mcmc import Metropolis, SamplerState, Walker

__all__ = ["VMC", "VMCState", "expect"]


class VMCState(NamedTuple):
    """The state :class:`VMC` steps: a pytree (checkpointed whole by :func:`shardvmc.driver.run`).

    Attributes:
        params: the wavefunction's parameters, replicated.
        opt: the optimiser's state, replicated.
        sampler: the sampler's state (walkers with their cached ``log|psi|``, proposal width, acceptance).
    """

    params: Any
    opt: Any
    sampler: SamplerState


def _optax() -> Any:
    try:
        import optax
    except ImportError as err:  # pragma: no cover - optax comes with the optax extra
        raise ImportError(f"sv.driver.VMC needs optax: {install('optax')}.") from err
    return optax


@dataclasses.dataclass(frozen=True, eq=False)
class VMC:
    """A VMC optimisation from its pieces: ``init(params, walkers)`` and the jitted ``step(state, key)``.

    One step is what docs/vmc.md writes by hand: ``sampler.step`` (``n_steps`` Metropolis moves,
    the cached ``log|psi|`` refreshed for the current parameters), the measurement of every
    walker's local energy ``e`` and log-derivatives ``j`` (one walker-parallel kernel), and
    ``optimiser.update(g, opt, params, jacobian=j, local_energies=e)`` with ``g`` the energy
    gradient ``2 (<j e> - <j><e>)`` (the natural gradient of ``shardvmc.optax`` reads ``j`` and
    ``e`` and ignores ``g``'s values, so ``g`` is then never computed), then
    ``optax.apply_updates``. Its statistics: ``energy`` (the mean local energy), ``error``
    (``sqrt(variance / walkers)``, the walkers being independent chains), ``variance``,
    ``acceptance``; over the valid walkers only.

    ``clipping`` (``sv.loss.ClipMAD()``, FermiNet's; ``sv.loss.ClipLogSqueeze()``,
    DeepQMC's) clips the local energies the optimiser sees (``local_energies=`` and the
    gradient), never the reported energy; a walker the clipping drops from the gradient
    gets the clipped mean there (no pull on the parameters).

    ``optimiser`` may also be :class:`shardvmc.kfac.KFAC` (or any object with a
    ``vmc_optimizer(log_psi, local_energy, clipping, mesh)`` method returning an
    optimiser with kfac-jax's ``init(params, key, batch)`` and ``step(params, state,
    key, batch=)``): the step then samples and takes KFAC's step on the library's energy
    loss (:func:`shardvmc.kfac.energy_loss`), any walker count.

    ``log_psi`` returns a real ``log|psi|``; for a complex one, write the step yourself
    with the same protocol.

    Args:
        log_psi: ``log_psi(params, r)`` of ONE walker (real).
        optimiser: an optax transformation, e.g. ``optax.chain(svx.natural_gradient(...), ...)``.
        potential: ``potential(r)`` of one walker (for the default local energy).
        local_energy: the local energy, ``local_energy(params, r)`` of one walker or a
            walker-parallel kernel; default ``sv.hamiltonian.local_energy(log_psi, potential)``.
        sampler: default ``sv.mcmc.Metropolis(log_psi, mesh=mesh, batch_size=batch_size)``.
        mesh: the mesh of the step's kernels and optimiser (``None``: resolved at each call, as a kernel's:
            the ``sv.use_mesh`` mesh, else all devices).
        batch_size: the measurement's walkers per device at a time (and the default sampler's).
        clipping: the clipping of the local energies in the gradient (``sv.loss``), or ``None``.

    Raises:
        CallError: for both ``potential`` and ``local_energy``, or an optimiser that is not an optax
            transformation; at :meth:`init` (and :meth:`step`), parameters without an array leaf (``None``,
            ``{}``): there is nothing to optimise (:func:`expect` samples a wavefunction without parameters).

    Example:
        >>> import jax, jax.numpy as jnp, optax, shardvmc as sv, shardvmc.optax as svx
        >>> log_psi = lambda a, r: -a * jnp.sum(r**2)  # a 3-D harmonic oscillator: E = 1.5 at a = 0.5
        >>> opt = optax.chain(svx.natural_gradient(damping=1e-3), optax.scale_by_learning_rate(0.1))
        >>> vmc = sv.driver.VMC(log_psi, opt, lambda r: 0.5 * jnp.sum(r**2))
        >>> walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (1, 3)), 64, key=jax.random.key(0))
        >>> state = vmc.init(jnp.float32(0.4), walkers)
        >>> state, stats = vmc.step(state, jax.random.key(1))
        >>> sorted(stats), bool(stats["energy"] > 1.4)
        (['acceptance', 'energy', 'error', 'variance'], True)
    """

    log_psi: Callable[..., Any]
    optimiser: Any
    potential: Callable[..., Any] | None = None
    local_energy: Callable[..., Any] | None = None
    sampler: Metropolis | None = None
    mesh: Mesh | None = None
    batch_size: int | str | None = None
    clipping: Clipping | None = None
    step: Callable[..., Any] = dataclasses.field(init=False, repr=False)
    measure: WalkerParallel = dataclasses.field(init=False, repr=False)
    _update: Callable[..., Any] = dataclasses.field(init=False, repr=False)
    _walker_optimiser: Any = dataclasses.field(init=False, repr=False, default=None)
    _clip: WalkerParallel | None = dataclasses.field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        where = "shardvmc.driver.VMC"
        if self.potential is not None and self.local_energy is not None:
            raise CallError(
                message(where, "pass potential= or local_energy=, not both.", fix="put the potential in local_energy.")
            )
        computes_its_loss = callable(getattr(self.optimiser, "vmc_optimizer", None))
        if not computes_its_loss and not (
            callable(getattr(self.optimiser, "init", None)) and callable(getattr(self.optimiser, "update", None))
        ):
            raise CallError(
                message(
                    where,
                    "optimiser must be an optax transformation (init, update) or shardvmc.kfac.KFAC.",
                    got=repr(self.optimiser),
                    fix="pass e.g. optax.chain(svx.natural_gradient(damping=1e-3), optax.scale_by_learning_rate(0.05))"
                    ", or sv.kfac.KFAC() (see docs/driver.md).",
                )
            )
        options = {"mesh": self.mesh, "batch_size": self.batch_size}
        if self.sampler is None:
            object.__setattr__(self, "sampler", Metropolis(self.log_psi, **options))
        if self.local_energy is None:
            object.__setattr__(self, "local_energy", hamiltonian_local_energy(self.log_psi, self.potential))
        energy, log_psi, clipping = self.local_energy, self.log_psi, self.clipping
        assert energy is not None
        object.__setattr__(self, "step", platform_jit(self._step))
        if computes_its_loss:  # KFAC: its loss measures and clips the energies itself
            optimiser = self.optimiser.vmc_optimizer(log_psi, energy, clipping, self.mesh)
            object.__setattr__(self, "_walker_optimiser", optimiser)
            return

        def measure(
            params: Replicated[Any], w: PerWalker[Walker]
        ) -> tuple[PerWalker[jax.Array], PerWalker[Any], Mean[jax.Array], Mean[jax.Array]]:
            e = energy(params, w.r)
            return e, jax.grad(log_psi)(params, w.r), e, e * e

        measure.__qualname__ = "VMC.measure"
        object.__setattr__(self, "measure", walker_parallel(**options)(measure))
        if clipping is not None:
            # A kernel of its own, without batch_size: the clipping's statistics see every walker, which the
            # measurement's chunks cannot.

            def clip(e: PerWalker[jax.Array]) -> tuple[PerWalker[jax.Array], Mean[jax.Array]]:
                clipped, keep = clipping(e)
                seen = jnp.where(keep, clipped, all_walkers.mean(clipped))  # what the optimiser sees
                return seen, seen

            clip.__qualname__ = "VMC.clip"
            object.__setattr__(self, "_clip", walker_parallel(mesh=self.mesh)(clip))
        # any optax transformation takes the extra arguments (jacobian=, local_energies=): unused ones are ignored
        object.__setattr__(self, "_update", _optax().with_extra_args_support(self.optimiser).update)

    def init(self, params: Any, walkers: Any, *, width: float = 0.5) -> VMCState:
        """The state at ``params`` (replicated here) with the sampler's state of ``walkers`` and the optimiser's.

        Args:
            params: the initial parameters: a pytree with at least one array (or number) leaf.
            walkers: the walkers' positions (a ``sv.WalkerSet``, e.g. from ``sv.initialize_walkers_sharded``).
            width: the initial proposal width.

        Raises:
            CallError: ``params`` without a leaf (``None``, ``{}``): a VMC optimisation needs parameters.
        """
        _check_params(params, "shardvmc.driver.VMC.init")
        leaf = jax.tree_util.tree_leaves(walkers.data if isinstance(walkers, WalkerSet) else walkers)[0]
        sharding = getattr(leaf, "sharding", None)
        mesh = sharding.mesh if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh) else self.mesh
        params = replicate(params, mesh)
        # (eagerly, on the walkers' mesh: under a context mesh of other devices the optimiser's own
        # computations would meet arrays of another mesh; the step then names the mismatch)
        assert self.sampler is not None
        sampler = self.sampler.init(params, walkers, width)
        if self._walker_optimiser is not None:
            optimiser = self._walker_optimiser
            opt = optimiser.init(params, jax.random.key(0), sampler.positions)
            sharding = getattr(optimiser, "replicated_sharding", None)
            if sharding is not None and not tracing():  # where the step returns them: one compilation of it
                params = jax.device_put(params, sharding)
            return VMCState(params, opt, sampler)
        with entered_mesh(None if tracing() or mesh is None else mesh):
            opt = replicate(self.optimiser.init(params), mesh)
        return VMCState(params, opt, sampler)

    def _step(self, state: VMCState, key: jax.Array) -> tuple[VMCState, dict[str, jax.Array]]:
        # mesh=: every kernel of the step (the optimiser's too) computes there, as under sv.use_mesh(mesh)
        with contextlib.nullcontext() if self.mesh is None else use_mesh(self.mesh):
            return self._traced_step(state, key)

    def _traced_step(self, state: VMCState, key: jax.Array) -> tuple[VMCState, dict[str, jax.Array]]:
        optax = _optax()
        assert self.sampler is not None
        _check_params(state.params, "shardvmc.driver.VMC.step")  # (a state built by hand; on the traced structure)
        params = state.params
        sampler = self.sampler.step(params, state.sampler, key)
        if self._walker_optimiser is not None:
            params, opt, out = self._walker_optimiser.step(
                params, state.opt, jax.random.fold_in(key, 1), batch=sampler.positions
            )
            return VMCState(params, opt, sampler), _stats(out["aux"]["energy"], out["aux"]["variance"], sampler)
        e, j, e_mean, e2_mean = self.measure(params, sampler.walkers)
        e, seen_mean = (e, e_mean) if self._clip is None else self._clip(e)
        # The energy gradient as the updates: unused (and so not computed) by the natural gradient.
        centred = WalkerSet(e.data - seen_mean, e.n_valid)
        gradient = jax.tree_util.tree_map(lambda g: 2 * g, _weighted_mean(j, centred, self.mesh))
        updates, opt = self._update(gradient, state.opt, params, jacobian=j, local_energies=e)
        variance = jnp.maximum(e2_mean - e_mean**2, 0.0)  # round-off of an exact state must not give a nan error
        return VMCState(optax.apply_updates(params, updates), opt, sampler), _stats(e_mean, variance, sampler)

    def expect(
        self,
        state: VMCState,
        n_steps: int,
        *,
        key: jax.Array,
        observable: Callable[..., Any] | None = None,
        progress: bool | IO[str] | None = None,
    ) -> Stats:
        """:func:`expect` of the local energy (or ``observable``) at ``state``'s parameters, with its sampler.

        Example:
            >>> import jax, jax.numpy as jnp, optax, shardvmc as sv
            >>> vmc = sv.driver.VMC(lambda a, r: -a * jnp.sum(r**2), optax.sgd(0.1), lambda r: 0.5 * jnp.sum(r**2))
            >>> walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (1, 3)), 64,
            ...                                         key=jax.random.key(0))
            >>> energy = vmc.expect(vmc.init(jnp.float32(0.5), walkers), 10, key=jax.random.key(1))
            >>> round(float(energy.mean), 4), float(energy.error_of_mean) < 1e-5  # the exact ground state
            (1.5, True)
        """
        assert self.sampler is not None and self.local_energy is not None
        observable = self.local_energy if observable is None else observable
        return expect(self.sampler, observable, state.params, state.sampler, n_steps, key=key, progress=progress)


def _check_params(params: Any, where: str) -> None:
    """A ``CallError`` for parameters without a leaf: a VMC optimisation has nothing to optimise then."""
    if jax.tree_util.tree_leaves(params):
        return
    raise CallError(
        message(
            where,
            "params has no array leaf, so there is nothing to optimise: VMC's step updates the parameters that "
            "log_psi(params, r) reads.",
            got=f"params={params!r}",
            expected="the wavefunction's parameters: an array, a number, or a pytree of them (e.g. flax params)",
            fix="pass the initial parameters, e.g. vmc.init(jnp.float32(0.5), walkers). To estimate the energy of a "
            "wavefunction without parameters, sample it at params=None: sv.driver.expect(sampler, local_energy, "
            "None, sampler.init(None, walkers), n_steps, key=key) with sampler = sv.mcmc.Metropolis(log_psi) (or "
            "sv.dmc.DMC(log_psi, potential).init(None, walkers)).",
        )
    )


def _stats(energy: jax.Array, variance: jax.Array, sampler: SamplerState) -> dict[str, jax.Array]:
    """What a step reports: the mean local energy, its error bar over the walkers, the variance, acceptance."""
    return {
        "energy": energy,
        "error": jnp.sqrt(variance / sampler.walkers.n_valid),
        "variance": variance,
        "acceptance": sampler.acceptance,
    }


def _weighted_mean(j: Any, e: WalkerSet, mesh: Mesh | None) -> Any:
    """``<j e>`` over the valid walkers, for ``j`` a ``WalkerSet`` of per-walker pytrees and ``e`` per walker."""
    products = jax.tree_util.tree_map(lambda x: x * e.data.reshape(e.data.shape + (1,) * (x.ndim - 1)), j.data)
    return walker_mean(WalkerSet(products, e.n_valid), mesh=mesh)


def expect(
    sampler: Metropolis,
    observable: Callable[..., Any],
    params: Any,
    state: SamplerState,
    n_steps: int,
    *,
    key: jax.Array,
    progress: bool | IO[str] | None = None,
    max_blocks: int = 256,
) -> Stats:
    """The mean of a per-walker observable over ``n_steps`` steps of sampling at fixed ``params``: ``sv.Stats``.

    NetKet's ``vstate.expect(H)``: the walkers' cached ``log|psi|`` is computed once for
    ``params``, then each step moves them with ``sampler`` at a fixed proposal width
    (``state.width``: the chains then sample ``|psi|^2`` exactly) without recomputing it
    (``refresh=False``), evaluates ``observable`` on every walker and adds the values to a
    :class:`~shardvmc.StatsAccumulator` on the devices. The error bar accounts for each
    walker's autocorrelation along its chain (``sv.statistics``' estimator). It runs through
    :func:`shardvmc.driver.run` (step ``t`` gets ``fold_in(key, t)``; a progress bar shows
    ``mean ± error`` of each step), without callbacks or checkpoints. Its programs are kept
    per ``sampler`` and ``observable`` (the same objects: the same compiled evaluation).

    Args:
        sampler: the sampler (a :class:`shardvmc.mcmc.Metropolis`).
        observable: ``observable(params, r)`` of ONE walker (e.g. a local energy), or a
            walker-parallel kernel of the walkers.
        params: the parameters.
        state: the sampler's state (e.g. ``result.state.sampler`` after an optimisation).
        n_steps: the steps sampled (each of ``sampler.n_steps`` moves).
        key: ONE PRNG key.
        progress: as for :func:`shardvmc.driver.run`.
        max_blocks: the accumulator's blocks per walker (see :class:`~shardvmc.StatsAccumulator`).

    Returns:
        The :class:`~shardvmc.Stats` over every valid walker and step.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> sampler = sv.mcmc.Metropolis(lambda p, r: -jnp.sum(r**2) / 4)  # |psi|^2: a standard normal density
        >>> walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (1, 3)), 64, key=jax.random.key(0))
        >>> r2 = sv.driver.expect(sampler, lambda p, r: jnp.sum(r**2), None, sampler.init(None, walkers),
        ...                       200, key=jax.random.key(1), progress=False)
        >>> bool(abs(r2.mean - 3.0) < 5 * r2.error_of_mean)  # <r^2> = 3 for a 3-D standard normal
        True
    """
    fixed, kernel, evaluation = _programs(sampler, observable)
    walkers = fixed.evaluate(params, state.walkers)  # the cache for these parameters: no refresh in the steps
    first = jax.eval_shape(kernel, params, walkers)
    data = first.data if isinstance(first, WalkerSet) else first
    if not isinstance(data, jax.ShapeDtypeStruct) or data.ndim != 1:
        raise CallError(
            message(
                "shardvmc.driver.expect",
                "observable must give one scalar per walker.",
                got=repr(data),
                fix="return a scalar from the per-walker function (e.g. the local energy).",
            )
        )
    like = WalkerSet(walkers.data.log_psi.astype(data.dtype), walkers.n_valid)
    carry = (params, state._replace(walkers=walkers), StatsAccumulator.create(like, max_blocks=max_blocks))
    result = run(evaluation, carry, n_steps, key=key, out=None, callbacks=(), progress=progress)
    return result.state[2].statistics(mesh=sampler.mesh)


@bounded(32)  # one compilation per sampler and observable, whatever the number of calls
def _programs(sampler: Metropolis, observable: Callable[..., Any]) -> tuple[Metropolis, WalkerParallel, Any]:
    """The sampler at a fixed width, the observable as a kernel, and the jitted evaluation step."""
    fixed = sampler if sampler.adapt_rate == 0 else sampler.with_options(adapt_rate=0.0)
    mesh = sampler.mesh
    kernel = observable if isinstance(observable, WalkerParallel) else _per_walker(observable, mesh)
    return fixed, kernel, _evaluation(fixed, kernel, mesh)


def _per_walker(observable: Callable[..., Any], mesh: Mesh | None) -> WalkerParallel:
    def value(params: Replicated[Any], w: PerWalker[Any]) -> PerWalker[jax.Array]:
        return observable(params, w.r if isinstance(w, Walker) else w)

    value.__qualname__ = getattr(observable, "__qualname__", "observable")
    return walker_parallel(mesh=mesh)(value)


def _evaluation(sampler: Metropolis, observable: WalkerParallel, mesh: Mesh | None) -> Callable[..., Any]:
    @jax.jit
    def evaluate(carry: Any, key: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        with contextlib.nullcontext() if mesh is None else use_mesh(mesh):
            return evaluate_on_mesh(carry, key)

    def evaluate_on_mesh(carry: Any, key: jax.Array) -> tuple[Any, dict[str, jax.Array]]:
        params, state, acc = carry
        state = sampler.step(params, state, key, refresh=False)
        values = observable(params, state.walkers)
        mean, mean2 = walker_mean((values.data, jnp.abs(values.data) ** 2), values.n_valid, mesh=mesh)
        variance = jnp.maximum(mean2 - jnp.abs(mean) ** 2, 0.0)
        stats = {"mean": jnp.real(mean), "error": jnp.sqrt(variance / values.n_valid), "acceptance": state.acceptance}
        return (params, state, acc.update(values)), stats

    return evaluate
