"""Metropolis-Hastings sampling of ``|psi|^2``, built from a per-walker ``log psi``.

``Metropolis(log_psi)`` turns a wavefunction written for ONE walker,
``log_psi(params, r)`` with ``r`` of shape ``(n_electrons, ndim)`` (real ``log|psi|``,
or complex ``log psi``: the density is ``exp(2 Re log psi)``), into a sampler whose
moves are one walker-parallel kernel: ``n_steps`` moves per call fused in a
``jax.lax.fori_loop`` inside the per-walker body, each walker carrying its positions
and its cached ``log|psi|`` (a :class:`Walker`), its own random stream
(``fold_in(key, i)`` for walker ``i``: the chains are the same on any device count), and
the acceptance averaged over the valid walkers only (padding never counts).

Moves (``move=``):

- ``"gaussian"``: all electrons at once, ``r' = r + width * N(0, 1)`` (NetKet's
  ``MetropolisGaussian``, FermiNet's default);
- ``"one-electron"``: a Gaussian move of one electron at a time, each accepted or
  rejected on its own; one step is a sweep over the electrons (the rows of ``r``);
- ``"mala"``: Metropolis-adjusted Langevin, ``r' = r + width^2 grad log|psi| + width * N(0, 1)``
  with the Hastings correction for the asymmetric proposal.

The width adapts after every call (``adapt_rate > 0``) toward ``target_acceptance`` with
:func:`adapt_width`, a Robbins-Monro step on ``log width`` computed inside the
program (FermiNet's rule instead reads the acceptance on the host and changes the width by
10 % every 100 steps when it leaves [0.5, 0.55]).

Example:
    >>> import jax, jax.numpy as jnp, shardvmc as sv
    >>> def log_psi(alpha, r):                 # ONE walker: r has shape (2, 3)
    ...     return -alpha * jnp.sum(r**2)
    >>> sampler = sv.mcmc.Metropolis(log_psi, n_steps=5)
    >>> r = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), 100, key=jax.random.key(0))
    >>> state = sampler.init(jnp.float32(0.5), r, width=0.5)
    >>> state = sampler.step(jnp.float32(0.5), state, jax.random.key(1))
    >>> state.walkers.n_valid, state.walkers.data.r.shape[1:], 0.0 < float(state.acceptance) < 1.0
    (100, (2, 3), True)
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from ._decorator import WalkerParallel, walker_parallel
from ._errors import CallError, describe, message
from ._markers import Mean, PerWalker, Replicated, Static, WalkerKey
from ._placement import replicate
from ._walkerset import WalkerSet

__all__ = ["MOVES", "Metropolis", "SamplerState", "Walker", "adapt_width"]
# (float_positions and log_psi_value are also hamiltonian's: module functions, not public API)

MOVES = ("gaussian", "one-electron", "mala")
"""The proposals :class:`Metropolis` knows (its ``move=``)."""

_WHERE = "shardvmc.mcmc.Metropolis"


class Walker(NamedTuple):
    """One walker of the chain: its positions and ``log|psi|`` there (for the parameters it was computed with).

    As a :class:`~shardvmc.WalkerSet`'s data, every field has the walker axis first.

    Attributes:
        r: the positions, e.g. ``(n_electrons, ndim)``.
        log_psi: ``Re log psi(params, r)`` (real, also for a complex ``log psi``).
    """

    r: jax.Array
    log_psi: jax.Array


class SamplerState(NamedTuple):
    """The state of a :class:`Metropolis` sampler: a pytree, to carry through ``jax.jit`` steps.

    Attributes:
        walkers: a :class:`~shardvmc.WalkerSet` of :class:`Walker`.
        width: the proposal width (a scalar, the same on every device).
        acceptance: the acceptance rate of the last call, over the valid walkers (``nan`` before the first).
    """

    walkers: WalkerSet
    width: jax.Array
    acceptance: jax.Array

    @property
    def positions(self) -> WalkerSet:
        """The walkers' positions alone, as a :class:`~shardvmc.WalkerSet` with the same count."""
        return WalkerSet(self.walkers.data.r, self.walkers.n_valid)


def adapt_width(width: jax.Array, acceptance: jax.Array, target: float = 0.5, rate: float = 0.5) -> jax.Array:
    """The proposal width moved toward ``target`` acceptance: ``width * exp(rate * (acceptance - target))``.

    A Robbins-Monro step on ``log width``. Its only fixed point is the width whose
    expected acceptance is ``target`` (the acceptance falls as the width grows, from 1
    to 0 for any normalisable ``|psi|^2``), the width stays positive, and it runs inside
    the jitted step (no host round trip). Near an acceptance of 0.5 the acceptance of a
    random-walk proposal falls by about 0.43 per unit of ``log width`` (the optimal-scaling
    limit, ``2 Phi(-l sqrt(I) / 2)``), so a ``rate`` below about 2 converges without
    oscillating; the width then wanders by about ``rate`` times the noise of the
    acceptance (small for many walkers). A ``nan`` acceptance (none measured) keeps the
    width. FermiNet's rule (a 10 % step every 100 calls when the mean acceptance leaves
    [0.5, 0.55]) reads the acceptance on the host, and correcting a width 10 times off
    takes it 25 adjustments, 2,500 calls; this rule takes a few tens of calls.

    Args:
        width: the current width (a scalar array).
        acceptance: the acceptance rate of the last call (a :class:`SamplerState`'s).
        target: the acceptance to aim for.
        rate: the gain; 0 keeps the width.

    Returns:
        The new width, of ``width``'s dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardvmc.mcmc import adapt_width
        >>> round(float(adapt_width(jnp.float32(1.0), jnp.float32(0.9), target=0.5, rate=0.5)), 4)
        1.2214
    """
    width = jnp.asarray(width)
    acceptance = jnp.asarray(acceptance, width.dtype)
    new = width * jnp.exp(jnp.asarray(rate, width.dtype) * (acceptance - jnp.asarray(target, width.dtype)))
    return jnp.where(jnp.isfinite(acceptance), new, width)  # no acceptance measured (nan): keep the width


def _positions(r: Any) -> jax.Array:
    """The positions of one walker given as positions or as a :class:`Walker`, as floats (:func:`float_positions`)."""
    return float_positions(r.r if isinstance(r, Walker) else r)


def float_positions(r: Any) -> jax.Array:
    """Positions as the floats they are sampled and differentiated in.

    Integer and boolean positions (``np.zeros((n, 2, 3), int)``, a lattice of integers)
    become JAX's default float dtype, as ``jnp.asarray(r, float)`` makes them: float32, or
    float64 under ``jax_enable_x64``. Float and complex positions are kept as they are.
    """
    r = jnp.asarray(r)
    if jnp.issubdtype(r.dtype, jnp.integer) or jnp.issubdtype(r.dtype, jnp.bool_):
        return r.astype(jnp.asarray(0.0).dtype)
    return r


def log_psi_value(log_psi: Callable[..., Any], params: Any, r: jax.Array, where: str = _WHERE) -> Any:
    """``log_psi(params, r)`` of one walker, refused (``CallError``) unless it is one number.

    The check is on the traced shape: it costs nothing in the compiled program.
    """
    out = log_psi(params, r)
    leaves = jax.tree_util.tree_leaves(out)
    if len(leaves) != 1 or leaves[0] is not out:
        raise CallError(
            message(
                where,
                f"log_psi(params, r) returned a {type(out).__name__} for one walker, not one number.",
                got=describe(out),
                expected="log|psi| (real) or log psi (complex) of the walker: one scalar",
                fix="return the log-amplitude alone, e.g. lambda params, r: f(params, r)[1] for a function that "
                "returns (sign, log|psi|).",
            )
        )
    shape = jnp.shape(out)
    if shape != ():
        raise CallError(
            message(
                where,
                f"log_psi(params, r) returned shape {shape} for one walker, not one number.",
                got=f"{describe(out)} for r of shape {tuple(jnp.shape(r))}",
                expected="log|psi| (real) or log psi (complex) of the walker: a scalar, shape ()",
                fix="index or squeeze the output: e.g. nn.Dense(1)(h)[0] or jnp.squeeze(out, -1). log_psi is "
                "called for ONE walker (no batch axis).",
            )
        )
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Metropolis:
    """A Metropolis-Hastings sampler of ``|psi(params, r)|^2`` over walker-sharded chains.

    Args:
        log_psi: ``log_psi(params, r)`` of ONE walker, ``r`` of shape ``(n_electrons, ndim)``
            (any array for ``"gaussian"`` and ``"mala"``); real ``log|psi|`` or complex
            ``log psi``. ``params`` is any pytree (flax, haiku, equinox parameters), passed
            as ``Replicated``.
        n_steps: moves per call, fused in one kernel (for ``"one-electron"``: sweeps over
            the electrons).
        move: ``"gaussian"`` (all electrons), ``"one-electron"`` or ``"mala"`` (see the module).
        target_acceptance: the acceptance :meth:`step` adapts the width toward.
        adapt_rate: the gain of :func:`adapt_width` in :meth:`step`; 0 keeps the width fixed
            (for sampling a fixed distribution exactly, after the burn-in).
        mesh: the mesh of the kernels (``None``: resolved at each call, like ``walker_parallel``).
        axis_name: the walker axis (or axes) of the mesh.
        batch_size: chunk each device's walkers (``walker_parallel``'s option: an int or
            ``"auto"``), bounding memory without changing the chains.

    Attributes:
        kernel: the moves as a walker-parallel kernel,
            ``kernel(params, walkers, key, width, refresh) -> (walkers, acceptance)``:
            ``walkers`` a :class:`Walker` set, ``key`` ONE key, ``width`` a scalar,
            ``refresh`` (a Python bool) recomputes the cached ``log|psi|`` first; the
            acceptance is a ``Mean`` over the valid walkers. Called inside another
            walker-parallel body it runs for that body's walker.
        evaluate: ``evaluate(params, r) -> walkers``: a set of :class:`Walker` with
            ``log|psi|`` computed at the positions ``r`` (or at the positions of a set of
            :class:`Walker`).

    Raises:
        CallError: an unknown ``move``, ``n_steps < 1``, or a negative ``adapt_rate``.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> sampler = sv.mcmc.Metropolis(lambda p, r: -jnp.sum(r**2) / 2, n_steps=10, move="mala")
        >>> r = jnp.zeros((64, 1, 3))
        >>> state = sampler.init(None, r, width=1.0)
        >>> for t in range(3):
        ...     state = sampler.step(None, state, jax.random.key(t))
        >>> state.walkers.data.r.shape, bool(state.width != 1.0)
        ((64, 1, 3), True)
    """

    log_psi: Callable[..., Any]
    n_steps: int = 10
    move: str = "gaussian"
    target_acceptance: float = 0.5
    adapt_rate: float = 0.5
    mesh: Mesh | None = None
    axis_name: str | tuple[str, ...] = "walkers"
    batch_size: int | str | None = None
    kernel: WalkerParallel = dataclasses.field(init=False, repr=False)
    evaluate: WalkerParallel = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.move not in MOVES:
            raise CallError(message(_WHERE, f"move={self.move!r} is not a known proposal.", expected=str(MOVES)))
        if not isinstance(self.n_steps, numbers.Integral) or isinstance(self.n_steps, bool) or self.n_steps < 1:
            raise CallError(message(_WHERE, f"n_steps={self.n_steps!r} must be a positive int."))
        if not self.adapt_rate >= 0:
            raise CallError(
                message(_WHERE, f"adapt_rate={self.adapt_rate!r} must be >= 0.", fix="pass 0 to keep the width.")
            )
        options = {"mesh": self.mesh, "axis_name": self.axis_name, "batch_size": self.batch_size}
        object.__setattr__(self, "n_steps", int(self.n_steps))
        moves = _make_moves(self.log_psi, self.n_steps, self.move)
        evaluate = _make_evaluate(self.log_psi)
        object.__setattr__(self, "kernel", walker_parallel(**options)(moves))
        object.__setattr__(self, "evaluate", walker_parallel(**options)(evaluate))

    def with_options(self, **changes: Any) -> Metropolis:
        """The same sampler with other settings (any of the constructor's arguments), e.g. ``mesh=``.

        Example:
            >>> import jax.numpy as jnp, shardvmc as sv
            >>> sv.mcmc.Metropolis(lambda p, r: -jnp.sum(r**2)).with_options(n_steps=3).n_steps
            3
        """
        return dataclasses.replace(self, **changes)

    def init(self, params: Any, positions: Any, width: float | jax.Array = 0.5) -> SamplerState:
        """The sampler state of walkers at ``positions``, with their ``log|psi|`` computed.

        Args:
            params: the wavefunction's parameters.
            positions: the walkers' positions, walker axis first: a :class:`~shardvmc.WalkerSet`
                (e.g. from ``sv.initialize_walkers_sharded``, padded to the mesh), or an array
                (all walkers valid). Integer or boolean positions are sampled as floats of
                JAX's default float dtype (float32; float64 under ``jax_enable_x64``).
            width: the initial proposal width.

        Returns:
            A :class:`SamplerState` (``acceptance`` is ``nan`` until the first :meth:`step`).

        Raises:
            CallError: ``log_psi`` does not return one number per walker (e.g. shape ``(1,)``
                from a ``Dense(1)`` output, or a ``(sign, log|psi|)`` pair), naming what it returned.
        """
        if not isinstance(positions, WalkerSet):
            positions = WalkerSet(positions)
        walkers = self.evaluate(params, positions)
        dtype = walkers.data.log_psi.dtype
        scalars = (jnp.asarray(width, dtype), jnp.asarray(jnp.nan, dtype))
        try:  # a traced array (init inside jax.jit) has no sharding: nothing to place there
            sharding = walkers.data.log_psi.sharding
        except AttributeError:
            sharding = None
        if isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
            # Placed like the outputs of a step, so that a jitted step sees the same input shardings at its first
            # and second call (an unplaced width would compile the step twice).
            scalars = replicate(scalars, sharding.mesh)
        return SamplerState(walkers, *scalars)

    def step(self, params: Any, state: SamplerState, key: jax.Array, *, refresh: bool = True) -> SamplerState:
        """``n_steps`` moves of every walker, then the width adapted (``adapt_rate > 0``).

        Usable inside your own ``jax.jit`` step.

        Args:
            params: the wavefunction's parameters.
            state: the sampler state (from :meth:`init` or the last :meth:`step`).
            key: ONE key for this call (walker ``i`` uses ``fold_in(key, i)``); give every
                call its own, e.g. ``jax.random.fold_in(key, t)``.
            refresh: recompute the walkers' cached ``log|psi|`` first (one evaluation per
                walker), as needed whenever ``params`` changed since the state was made.
                Pass ``False`` only when they did not (burn-in or evaluation at fixed
                parameters). Ignored by ``"mala"``, which needs the gradient there anyway.

        Returns:
            The new :class:`SamplerState`.
        """
        walkers, acceptance = self.kernel(params, state.walkers, key, state.width, bool(refresh))
        width = state.width
        if self.adapt_rate:
            width = adapt_width(width, acceptance, self.target_acceptance, self.adapt_rate)
        return SamplerState(walkers, width, acceptance.astype(state.acceptance.dtype))

    __call__ = step


def _make_evaluate(log_psi: Callable[..., Any]) -> Callable[..., Any]:
    def evaluate(params: Replicated[Any], r: PerWalker[Any]) -> PerWalker[Walker]:
        x = _positions(r)
        return Walker(x, jnp.real(log_psi_value(log_psi, params, x)).astype(x.dtype))

    evaluate.__qualname__ = "Metropolis.evaluate"
    return evaluate


def _make_moves(log_psi: Callable[..., Any], n_steps: int, move: str) -> Callable[..., Any]:
    def log_abs(params: Any, x: jax.Array) -> jax.Array:
        return jnp.real(log_psi_value(log_psi, params, x)).astype(x.dtype)

    def moves(
        params: Replicated[Any],
        walker: PerWalker[Walker],
        key: WalkerKey,
        width: Replicated[jax.Array],
        refresh: Static[bool],
    ) -> tuple[PerWalker[Walker], Mean[jax.Array]]:
        x = _positions(walker)
        dtype = x.dtype
        w = jnp.asarray(width, dtype)
        zero = jnp.zeros((), dtype)
        if move == "mala":
            lp, g = jax.value_and_grad(log_abs, argnums=1)(params, x)
            x, lp, accepted = _mala(log_abs, params, x, lp, g, key, w, n_steps)
            return Walker(x, lp), accepted / n_steps
        lp = log_abs(params, x) if refresh else walker.log_psi.astype(dtype)
        if move == "gaussian":

            def step(i: jax.Array, numbers: tuple[jax.Array, jax.Array], carry: Any) -> Any:
                return _gaussian_update(log_abs, params, carry, *numbers, w, None)

            draw = functools.partial(_draws, key, shape=x.shape, dtype=dtype)
            x, lp, accepted = _moves_in_blocks(n_steps, draw, step, (x, lp, zero))
            return Walker(x, lp), accepted / n_steps
        n_electrons = x.shape[0]

        def draw_sweep(i: jax.Array) -> tuple[jax.Array, jax.Array]:  # electron e of sweep i: fold_in(key_i, e)
            electron = functools.partial(_draws, jax.random.fold_in(key, i), shape=x.shape[1:], dtype=dtype)
            return jax.vmap(electron)(jnp.arange(n_electrons))

        def sweep(i: jax.Array, numbers: tuple[jax.Array, jax.Array], carry: Any) -> Any:
            def one(e: jax.Array, c: tuple[jax.Array, jax.Array, jax.Array]) -> Any:
                return _gaussian_update(log_abs, params, c, numbers[0][e], numbers[1][e], w, e)

            return jax.lax.fori_loop(0, n_electrons, one, carry)

        x, lp, accepted = _moves_in_blocks(n_steps, draw_sweep, sweep, (x, lp, zero))
        return Walker(x, lp), accepted / (n_steps * n_electrons)

    moves.__qualname__ = "Metropolis.kernel"
    return moves


_BLOCK = 32  # moves whose random numbers are drawn together: a few positions' worth of memory per walker


def _draws(key: jax.Array, i: jax.Array, shape: tuple[int, ...], dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Move ``i``'s random numbers from ``fold_in(key, i)``: ``N(0, 1)`` of ``shape``, and ``log U(0, 1)``."""
    k_move, k_accept = jax.random.split(jax.random.fold_in(key, i))
    return jax.random.normal(k_move, shape, dtype), jnp.log(jax.random.uniform(k_accept, (), dtype))


def _moves_in_blocks(n_steps: int, draw: Callable[[jax.Array], Any], move: Callable[..., Any], carry: Any) -> Any:
    """``carry = move(i, draw(i), carry)`` for ``i`` in ``range(n_steps)``, each block of moves' draws made first.

    Drawn inside the loop, each move hashes its keys (threefry, a loop of its own on CPUs) between the network's
    operations: a tenth of a small network's move on a CPU. Drawn a block at a time, every move still gets the
    numbers of its own keys (the chains do not change) and the memory stays a block of positions per walker.
    """
    size = min(n_steps, _BLOCK)

    def block(b: Any, carry: Any) -> Any:
        start = b * size
        numbers = jax.vmap(draw)(start + jnp.arange(size))
        stop = min(size, n_steps - start) if isinstance(start, int) else jnp.minimum(size, n_steps - start)
        return jax.lax.fori_loop(0, stop, lambda j, c: move(start + j, jax.tree.map(lambda a: a[j], numbers), c), carry)

    if n_steps <= size:
        return block(0, carry)
    return jax.lax.fori_loop(0, -(-n_steps // size), block, carry)


def _gaussian_update(
    log_abs: Callable[..., jax.Array],
    params: Any,
    carry: tuple[jax.Array, jax.Array, jax.Array],
    noise: jax.Array,
    log_u: jax.Array,
    width: jax.Array,
    electron: jax.Array | None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One symmetric Gaussian proposal, of all positions or of row ``electron``, accepted or rejected.

    ``noise`` is the proposal's ``N(0, 1)``, ``log_u`` the acceptance's ``log U(0, 1)``: accepted where
    ``log_u < 2 (log|psi'| - log|psi|)`` (a NaN ratio rejects).
    """
    x, lp, accepted = carry
    proposal = x + width * noise if electron is None else x.at[electron].add(width * noise)
    lp_new = log_abs(params, proposal)
    accept = log_u < 2.0 * (lp_new - lp)
    return jnp.where(accept, proposal, x), jnp.where(accept, lp_new, lp), accepted + accept.astype(x.dtype)


def _mala(
    log_abs: Callable[..., jax.Array],
    params: Any,
    x: jax.Array,
    lp: jax.Array,
    grad: jax.Array,
    key: jax.Array,
    width: jax.Array,
    n_steps: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``n_steps`` Metropolis-adjusted Langevin moves, the gradient carried from step to step."""
    value_and_grad = jax.value_and_grad(log_abs, argnums=1)
    tau = width * width

    def step(i: jax.Array, numbers: tuple[jax.Array, jax.Array], carry: Any) -> Any:
        x, lp, g, accepted = carry
        noise, log_u = numbers
        proposal = x + tau * g + width * noise
        lp_new, g_new = value_and_grad(params, proposal)
        # log q(x | x') - log q(x' | x), q(b | a) = N(b; a + tau grad log|psi|(a), tau)
        backward = x - proposal - tau * g_new
        log_q_ratio = -jnp.sum(backward**2) / (2.0 * tau) + 0.5 * jnp.sum(noise**2)
        accept = log_u < 2.0 * (lp_new - lp) + log_q_ratio  # a NaN ratio rejects
        return (
            jnp.where(accept, proposal, x),
            jnp.where(accept, lp_new, lp),
            jnp.where(accept, g_new, g),
            accepted + accept.astype(x.dtype),
        )

    draw = functools.partial(_draws, key, shape=x.shape, dtype=x.dtype)
    x, lp, _, accepted = _moves_in_blocks(n_steps, draw, step, (x, lp, grad, jnp.zeros((), x.dtype)))
    return x, lp, accepted
