"""The natural gradient as optax transforms: compose a whole VMC optimiser with ``optax.chain``.

``natural_gradient(...)`` turns the per-walker log-derivative rows ``J`` and local
energies ``e`` (passed to ``update`` as the extra arguments ``jacobian=`` and
``local_energies=``) into ``sv.natural_gradient``'s direction; SPRING's previous
direction lives in its state. ``clip_by_fisher_norm(max_norm, learning_rate)`` is the
step-length constraint of FermiNet and KFAC (``lr^2 d.S.d <= max_norm``, ``S`` the
walkers' covariance of ``J``), which optax does not have. Everything else comes from
optax: ``optax.scale_by_learning_rate`` (a number or any schedule ``t -> lr``, e.g.
``optax.schedules.exponential_decay``), clipping, ``optax.apply_updates``.

Signs follow optax: the natural-gradient transform outputs the descent direction as a
gradient (positive along the energy gradient), and ``optax.scale_by_learning_rate``
flips it, so ``optax.apply_updates(params, updates)`` steps downhill.

Every numeric hyperparameter can be scheduled with ``optax.inject_hyperparams``:
``damping``, ``momentum``, ``tol`` and ``rcond`` of :func:`natural_gradient`,
``max_norm`` and ``learning_rate`` of :func:`clip_by_fisher_norm`, eagerly and under
``jax.jit``. The integer settings (``maxiter``, ``chunks``, ``memory_budget``) shape the
compiled program, so they stay Python values: their defaults are ``None`` (which
``inject_hyperparams`` leaves alone), and one passed explicitly through
``inject_hyperparams`` goes in its ``static_args``.

The module is named after the library whose interface it implements, as
``shardvmc.kfac`` is; import it as ``import shardvmc.optax as svx`` (``import optax``
inside your code still means optax).

Example:
    >>> import jax, jax.numpy as jnp, optax, shardvmc as sv
    >>> import shardvmc.optax as svx
    >>> lr = lambda t: 0.1 / (1.0 + t / 1000.0)   # a schedule: FermiNet's inverse-time decay
    >>> opt = optax.chain(svx.natural_gradient(damping=1e-3, method="minsr"),
    ...                   svx.clip_by_fisher_norm(0.05, lr), optax.scale_by_learning_rate(lr))
    >>> params = jnp.zeros(200)
    >>> state = opt.init(params)
    >>> J = sv.shard_walker(jax.random.normal(jax.random.key(0), (64, 200)))
    >>> e = sv.shard_walker(jax.random.normal(jax.random.key(1), (64,)))
    >>> updates, state = opt.update(params, state, params, jacobian=J, local_energies=e)
    >>> params = optax.apply_updates(params, updates)
    >>> params.shape, bool(jnp.all(jnp.isfinite(params)))
    ((200,), True)
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

from ._errors import install

try:
    import optax
except ImportError as err:  # pragma: no cover - optax comes with the optax and kfac extras
    raise ImportError(f"shardvmc.optax needs optax: {install('optax')} (or pip install optax).") from err

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh

from ._errors import CallError, message
from ._natgrad import natural_gradient as _solve
from ._reductions import walker_mean
from ._walkerset import split_walker_set

__all__ = ["FisherNormState", "NaturalGradientState", "clip_by_fisher_norm", "natural_gradient"]


class NaturalGradientState(NamedTuple):
    """The state of :func:`natural_gradient`.

    Attributes:
        previous: SPRING's previous direction, flat ``(P,)`` (``None`` for the other methods).
        iterations: CG iterations of the last solve (0 for the direct solvers).
        residual: relative residual of the last solve.
    """

    previous: jax.Array | None
    iterations: jax.Array
    residual: jax.Array


class FisherNormState(NamedTuple):
    """The state of :func:`clip_by_fisher_norm`.

    Attributes:
        count: the step number the learning rate is evaluated at (as ``optax.scale_by_schedule`` counts).
        scale: the factor the last update was multiplied by (1 when the constraint did not bind).
    """

    # optax's name for a step counter (its ScaleByScheduleState.count), kept public although it shadows tuple.count
    count: jax.Array  # pyright: ignore[reportIncompatibleMethodOverride]
    scale: jax.Array


def _flat_size(tree: Any) -> int:
    return sum(math.prod(np.shape(x)) for x in jax.tree_util.tree_leaves(tree))


def _required(where: str, name: str, value: Any) -> Any:
    if value is None:
        raise CallError(
            message(
                where,
                f"update() needs the extra argument {name}=.",
                fix=f"call opt.update(updates, state, params, jacobian=J, local_energies=e); {name} is per walker.",
            )
        )
    return value


def _static_int(where: str, name: str, value: Any) -> int | None:
    """An integer setting as a Python int (``None`` kept): it keys the compiled program, so it cannot be traced.

    ``optax.inject_hyperparams`` turns every number it is given into an array in its
    state (traced under ``jax.jit``). An integer setting that reaches the factory as an
    array was injected; it is refused even when concrete, so that the eager call fails
    as the jitted one would, with the fix.
    """
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (jax.Array, Tracer)):
        raise CallError(
            message(
                where,
                f"{name} is an array (optax.inject_hyperparams makes one of every number it is given), but it "
                "keys the compiled program and must be a Python int.",
                got=f"{name} of dtype {value.dtype}" + (", traced" if isinstance(value, Tracer) else ""),
                fix=f'name it in static_args: optax.inject_hyperparams(svx.natural_gradient, static_args=("{name}",)).',
            )
        )
    raise CallError(
        message(where, f"{name} must be a Python int or None.", got=repr(value), fix=f"pass e.g. {name}=4.")
    )


def _like(direction: Any, updates: Any, where: str) -> Any:
    """``direction`` (J's parameter structure) in the structure and dtypes of ``updates``."""
    d_leaves, d_tree = jax.tree_util.tree_flatten(direction)
    u_leaves, u_tree = jax.tree_util.tree_flatten(updates)
    if d_tree == u_tree and all(np.shape(a) == np.shape(b) for a, b in zip(d_leaves, u_leaves)):
        return jax.tree_util.tree_map(lambda d, u: d.astype(jnp.result_type(u)), direction, updates)
    flat = jnp.concatenate([jnp.ravel(x) for x in d_leaves]) if len(d_leaves) > 1 else jnp.ravel(d_leaves[0])
    if flat.shape[0] != _flat_size(updates):
        raise CallError(
            message(
                where,
                "the Jacobian's rows do not have as many entries as the parameters.",
                got=f"{flat.shape[0]} entries per row of J, {_flat_size(updates)} parameters",
                fix="pass J with one column per parameter: ravel_pytree order for an (N, P) array, or the "
                "parameters' pytree with a leading walker axis.",
            )
        )
    _, unravel = ravel_pytree(updates)
    return unravel(flat.astype(ravel_pytree(updates)[0].dtype))


def natural_gradient(
    *,
    damping: float,
    method: str = "auto",
    momentum: float = 0.0,
    real_params: bool = False,
    solver: str = "cholesky",
    rcond: float = 1e-10,
    tol: float = 1e-6,
    maxiter: int | None = None,
    precondition: bool | None = None,
    chunks: int | None = None,
    memory_budget: int | None = None,
    mesh: Mesh | None = None,
    axis_name: str = "walkers",
) -> optax.GradientTransformationExtraArgs:
    """``sv.natural_gradient`` as an optax transform: ``update`` takes ``J`` and the local energies.

    ``update(updates, state, params=None, *, jacobian, local_energies, n_valid=None)``
    returns ``sv.natural_gradient(jacobian, local_energies, ...)``'s direction in the
    structure (and dtypes) of ``updates``; the values of ``updates`` are not used (the
    direction comes from ``J`` and ``e``), so pass the parameters or their gradient.
    ``jacobian`` is an ``(N, P)`` array (columns in ``ravel_pytree`` order of the
    parameters) or a pytree of ``(N, ...)`` leaves; either may be a ``sv.WalkerSet``,
    whose count is used. With ``method="spring"`` the previous direction is kept in the
    state and passed as ``previous=``.

    Args:
        damping: as for :func:`shardvmc.natural_gradient` (and every argument below).
        method: ``"auto"``, ``"dense"``, ``"minsr"``, ``"spring"`` or ``"cg"``.
        momentum: SPRING's momentum.
        real_params: real parameters of a complex wavefunction.
        solver: ``"cholesky"`` or ``"eigh"``.
        rcond: the eigenvalue cutoff of ``solver="eigh"``.
        tol: CG's relative residual target.
        maxiter: CG's iteration limit (``None``: ``sv.natural_gradient``'s, 200). A Python
            int: under ``optax.inject_hyperparams`` name it in ``static_args`` when you
            pass it (the ``None`` default is left static by optax).
        precondition: CG's Jacobi preconditioner (``None``: when P <= N).
        chunks: minSR/SPRING parameter slices (a Python int, as ``maxiter``).
        memory_budget: bytes per device (a Python int, as ``maxiter``).
        mesh: the mesh (default: resolved per call).
        axis_name: the walker axis of ``mesh``.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` with :class:`NaturalGradientState`.

    Raises:
        CallError: for an integer setting given as an array (``optax.inject_hyperparams``
            injected it: list it in ``static_args``).

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv, shardvmc.optax as svx
        >>> J = sv.shard_walker(jax.random.normal(jax.random.key(0), (64, 10)))
        >>> e = sv.shard_walker(jax.random.normal(jax.random.key(1), (64,)))
        >>> ng = svx.natural_gradient(damping=1e-3, method="dense")
        >>> d, _ = ng.update(jnp.zeros(10), ng.init(jnp.zeros(10)), jacobian=J, local_energies=e)
        >>> bool(jnp.allclose(d, sv.natural_gradient(J, e, damping=1e-3, method="dense")[0]))
        True
    """
    where = "shardvmc.optax.natural_gradient"
    spring = method == "spring"
    # damping, momentum, rcond and tol may be arrays, traced under jax.jit when optax.inject_hyperparams schedules
    # them: sv.natural_gradient passes them into its compiled solve as values. The integer settings key the
    # compilation and must be Python ints.
    options: dict[str, Any] = dict(
        damping=damping,
        method=method,
        momentum=momentum,
        real_params=real_params,
        solver=solver,
        rcond=rcond,
        tol=tol,
        precondition=precondition,
        chunks=_static_int(where, "chunks", chunks),
        memory_budget=_static_int(where, "memory_budget", memory_budget),
        mesh=mesh,
        axis_name=axis_name,
    )
    if (maxiter := _static_int(where, "maxiter", maxiter)) is not None:
        options["maxiter"] = maxiter

    def init(params: Any) -> NaturalGradientState:
        flat = ravel_pytree(params)[0]
        real = jnp.finfo(flat.dtype).dtype if jnp.issubdtype(flat.dtype, jnp.inexact) else jnp.result_type(float)
        previous = jnp.zeros_like(flat) if spring else None
        return NaturalGradientState(previous, jnp.zeros((), jnp.int32), jnp.zeros((), real))

    def update(
        updates: Any,
        state: NaturalGradientState,
        params: Any = None,
        *,
        jacobian: Any = None,
        local_energies: Any = None,
        n_valid: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, NaturalGradientState]:
        del params, extra_args  # the other transforms' extra arguments
        jacobian = _required(where, "jacobian", jacobian)
        local_energies = _required(where, "local_energies", local_energies)
        # The previous direction is flat; sv.natural_gradient reads any structure with P entries in J's order.
        direction, info = _solve(
            jacobian, local_energies, n_valid=n_valid, previous=state.previous if spring else None, **options
        )
        previous = None
        if state.previous is not None:  # SPRING
            leaves = jax.tree_util.tree_leaves(direction)
            previous = jnp.concatenate([jnp.ravel(x) for x in leaves]).astype(state.previous.dtype)
        new_state = NaturalGradientState(
            previous, jnp.asarray(info.iterations, jnp.int32), jnp.asarray(info.residual, state.residual.dtype)
        )
        return _like(direction, updates, where), new_state

    # optax's protocols take the state as an ArrayTree; a transform's own NamedTuple state cannot be written so
    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]


def _real_dtype(x: Any) -> Any:
    """The real dtype of ``x``'s values (float for an integer ``x``)."""
    dtype = jnp.result_type(x)
    return jnp.finfo(dtype).dtype if jnp.issubdtype(dtype, jnp.inexact) else jnp.result_type(float)


def _rows_times(jacobian: Any, updates: Any, where: str) -> jax.Array:
    """``J d``: one value per walker, for J an ``(N, P)`` array (ravel order) or a pytree shaped like ``d``."""
    j_leaves, j_tree = jax.tree_util.tree_flatten(jacobian)
    d_leaves, d_tree = jax.tree_util.tree_flatten(updates)
    if j_tree == d_tree and all(np.shape(j)[1:] == np.shape(d) for j, d in zip(j_leaves, d_leaves)):
        products = [jnp.tensordot(j, d.astype(j.dtype), axes=np.ndim(d)) for j, d in zip(j_leaves, d_leaves)]
        return functools.reduce(jnp.add, products)
    if len(j_leaves) == 1 and np.ndim(j_leaves[0]) == 2 and np.shape(j_leaves[0])[1] == _flat_size(updates):
        return j_leaves[0] @ ravel_pytree(updates)[0].astype(j_leaves[0].dtype)
    raise CallError(
        message(
            where,
            "the Jacobian's rows do not match the updates.",
            got=f"J leaves {[np.shape(x) for x in j_leaves]}, {_flat_size(updates)} parameters",
            fix="pass J as an (N, P) array in ravel_pytree order, or as the parameters' pytree with a walker axis.",
        )
    )


def clip_by_fisher_norm(
    max_norm: float,
    learning_rate: float | optax.Schedule,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "walkers",
) -> optax.GradientTransformationExtraArgs:
    """Scale the direction ``d`` so that the squared Fisher length of the step, ``lr^2 d.S.d``, is ``<= max_norm``.

    ``S`` is the covariance of the log-derivatives over the valid walkers, so
    ``d.S.d`` is the walkers' variance of ``J d``: the constraint of FermiNet's KFAC
    (``norm_constraint``) and of SR codes, a trust region for the change of the
    wavefunction. Put it after :func:`natural_gradient` and before
    ``optax.scale_by_learning_rate(learning_rate)``, with the same ``learning_rate``:
    the step is then ``min(lr, sqrt(max_norm / d.S.d)) d``. ``update`` takes
    ``jacobian=`` (and ``n_valid=``) like :func:`natural_gradient`.

    Args:
        max_norm: the largest ``lr^2 d.S.d`` of a step.
        learning_rate: the learning rate or schedule (evaluated at the step count, as
            ``optax.scale_by_learning_rate`` does). Both it and ``max_norm`` may be
            scheduled with ``optax.inject_hyperparams``, and both are used in the
            precision of the updates: a float32 schedule in a float64 run costs no
            precision (the step is ``sqrt(max_norm / d.S.d) d`` to float64 round-off
            when the constraint binds).
        mesh: the mesh (default: resolved per call).
        axis_name: the walker axis of ``mesh``.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` with :class:`FisherNormState`.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv, shardvmc.optax as svx
        >>> J = sv.shard_walker(jax.random.normal(jax.random.key(0), (64, 3)))
        >>> clip = svx.clip_by_fisher_norm(1e-4, 0.1)
        >>> d, state = clip.update(jnp.ones(3), clip.init(jnp.ones(3)), jacobian=J)
        >>> ju = J @ d
        >>> round(float(0.1**2 * (jnp.mean(ju**2) - jnp.mean(ju) ** 2)), 6)
        0.0001
    """
    schedule = learning_rate if callable(learning_rate) else (lambda count: learning_rate)

    def init(params: Any) -> FisherNormState:
        del params
        return FisherNormState(jnp.zeros((), jnp.int32), jnp.ones(()))

    def update(
        updates: Any,
        state: FisherNormState,
        params: Any = None,
        *,
        jacobian: Any = None,
        n_valid: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, FisherNormState]:
        del params, extra_args
        where = "shardvmc.optax.clip_by_fisher_norm"
        jacobian, count = split_walker_set(_required(where, "jacobian", jacobian))
        if count is not None:
            n_valid = count
        ju = _rows_times(jacobian, updates, where)
        mean_sq, mean = walker_mean((jnp.abs(ju) ** 2, ju), n_valid, mesh=mesh, axis_name=axis_name)
        # In the precision of the updates (or of J d, if higher), whatever dtype the learning rate and max_norm
        # come in: optax's schedules return float32 even in a float64 run, and lr^2 taken in float32 would put
        # float32 round-off into the step, which scale_by_learning_rate then multiplies by that same lr exactly.
        dtype = jnp.result_type(mean_sq, *(_real_dtype(u) for u in jax.tree_util.tree_leaves(updates)))
        d_s_d = (mean_sq - jnp.abs(mean) ** 2).astype(dtype)
        lr = jnp.asarray(schedule(state.count)).astype(dtype)
        bound = jnp.asarray(max_norm).astype(dtype) / jnp.maximum(lr**2 * d_s_d, jnp.finfo(dtype).tiny)
        scale = jnp.minimum(1.0, jnp.sqrt(bound))
        clipped = jax.tree_util.tree_map(lambda u: (u * scale).astype(u.dtype), updates)
        return clipped, FisherNormState(jnp.asarray(optax.safe_increment(state.count)), scale.astype(state.scale.dtype))

    # optax's protocols take the state as an ArrayTree; a transform's own NamedTuple state cannot be written so
    return optax.GradientTransformationExtraArgs(init, update)  # pyright: ignore[reportArgumentType]
