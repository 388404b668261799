"""Everything ``shardvmc.kfac`` needs from kfac-jax beyond its public API, in one place.

What lives here:

- the fix of kfac-jax 0.0.8's ``tag_graph_matcher.eval_jaxpr_eqn`` for JAX >= 0.9.2,
  applied only when the installed kfac-jax fails a behaviour probe;
- read-only access to the optimiser's curvature estimator (its blocks, its traced
  program, its own per-step decisions), which kfac-jax keeps in private attributes;
- the curvature of the valid walkers of every device (:func:`valid_walker_curvature`)
  and kfac-jax's all-reduces packed into one buffer each (:func:`packed_collectives`),
  both active only inside ``shardvmc.kfac``'s step kernel.

Importing this module imports kfac-jax; ``shardvmc.kfac`` turns a missing kfac-jax, or
one that cannot be imported on the installed JAX, into an ``ImportError`` that says why
and how to fix it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import kfac_jax
from kfac_jax._src import tag_graph_matcher
from kfac_jax._src import utils as kfac_utils
from kfac_jax._src.curvature_estimator.block_diagonal import BlockDiagonalCurvature
from kfac_jax._src.utils.accumulators import WeightedMovingAverage

from ._stats import psum_tree

__all__ = [
    "ORIGINAL_EVAL_JAXPR_EQN",
    "PATCHED",
    "curvature_flags",
    "fixed_eval_jaxpr_eqn",
    "packed_collectives",
    "parameter_blocks",
    "runs_shard_map",
    "sync_estimator",
    "steps_share_one_program",
    "valid_walker_curvature",
]


# ----------------------------------------------------------------------------- the eval_jaxpr_eqn fix
#
# What it changes: kfac-jax 0.0.8 re-evaluates traced equations (auto-registration, the
# curvature tracer) with ``subfuns, params = eqn.primitive.get_bind_params(eqn.params)``
# and ``bind(*subfuns, *args, **params)``. Since JAX 0.9.2, ``get_bind_params`` returns
# only the params dict (call primitives carry their functions in ``params["subfuns"]``),
# so the unpacking fails with "too many values to unpack (expected 2)" (or, for a dict
# of exactly two keys, silently unpacks its keys). The replacement binds
# ``bind(*args, **params)``, which is what kfac-jax's source head does since commit
# 222c299 ("[JAX] Require all positional arguments passed to bind to be JAX values",
# March 2026; ``kfac_jax/_src/tag_graph_matcher.py``), unreleased as of kfac-jax 0.0.8.
#
# When it applies: only when the installed ``eval_jaxpr_eqn`` fails the probe below
# (decided by behaviour, not by version: kfac-jax's head still calls itself 0.0.8).
#
# When to delete it: once the oldest kfac-jax that shardvmc's ``kfac`` extra allows
# contains that commit (the first PyPI release after 0.0.8): then raise the pin in
# pyproject.toml and remove this section and its test.


def fixed_eval_jaxpr_eqn(eqn: Any, in_values: list[Any]) -> list[Any]:
    """``kfac_jax._src.tag_graph_matcher.eval_jaxpr_eqn`` for JAX >= 0.9.2 (see the comment above)."""
    params = eqn.primitive.get_bind_params(eqn.params)
    with jex.source_info_util.user_context(eqn.source_info.traceback):
        out = eqn.primitive.bind(*in_values, **params)
    return out if isinstance(out, list) else [out]


@jax.custom_jvp
def _doubled(x: jax.Array) -> jax.Array:
    return 2.0 * x


@_doubled.defjvp
def _doubled_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
    return _doubled(primals[0]), 2.0 * tangents[0]


def _works(eval_eqn: Callable[[Any, list[Any]], list[Any]]) -> bool:
    """Whether ``eval_eqn`` re-evaluates a plain equation and a call primitive's (``custom_jvp_call``) correctly.

    Traced on abstract values only: importing ``shardvmc.kfac`` must not start a JAX
    backend (``jax.distributed.initialize`` must stay possible after it).
    """
    x = jax.ShapeDtypeStruct((), jnp.float32)
    try:
        for fn in (lambda v: v * v, _doubled):  # every input of each equation is the probe's one argument
            traced = jax.make_jaxpr(fn)(x)
            (eqn,) = traced.jaxpr.eqns
            expected = traced.out_avals
            got = jax.make_jaxpr(lambda v, e=eqn: eval_eqn(e, [v] * len(e.invars)))(x).out_avals
            if [(a.shape, a.dtype) for a in got] != [(a.shape, a.dtype) for a in expected]:
                return False
    except Exception:  # the probe only asks whether it runs; any failure means "needs the fix"
        return False
    return True


def _apply_fix() -> bool:
    """Install :func:`fixed_eval_jaxpr_eqn` if the installed kfac-jax needs it; ``True`` if it was installed."""
    if tag_graph_matcher.eval_jaxpr_eqn is fixed_eval_jaxpr_eqn or _works(tag_graph_matcher.eval_jaxpr_eqn):
        return tag_graph_matcher.eval_jaxpr_eqn is fixed_eval_jaxpr_eqn
    if not _works(fixed_eval_jaxpr_eqn):
        raise ImportError(
            f"shardvmc.kfac: kfac-jax {kfac_jax.__version__} cannot re-evaluate JAX {jax.__version__} equations "
            "(its tag_graph_matcher.eval_jaxpr_eqn fails), and shardvmc's fix for kfac-jax 0.0.8 does not cover "
            "this combination. Install a kfac-jax that supports this JAX (pip install -U kfac-jax, or from "
            "https://github.com/google-deepmind/kfac-jax)."
        )
    # kfac-jax's tracer calls it as ``tag_graph_matcher.eval_jaxpr_eqn`` (a module attribute), so this one
    # assignment reaches every use.
    tag_graph_matcher.eval_jaxpr_eqn = fixed_eval_jaxpr_eqn
    return True


ORIGINAL_EVAL_JAXPR_EQN = tag_graph_matcher.eval_jaxpr_eqn
PATCHED = _apply_fix()
"""Whether the installed kfac-jax needed, and got, the ``eval_jaxpr_eqn`` fix."""


# ----------------------------------------------------------------------------- the curvature estimator
#
# What: kfac-jax 0.0.8 keeps its curvature estimator in ``Optimizer._estimator`` (its ``blocks``,
# ``params_block_index``, each block's ``_layer_tag_eq``, the traced ``jaxpr``, ``sync``) and its
# per-step decisions in ``Optimizer._should_update_estimate_curvature``/``_should_update_damping``.
# Why: the step's compilation key (``curvature_flags``), the one averaged estimate of a replicated
# state (``sync_estimator``) and the warning about hidden layers (``parameter_blocks``,
# ``runs_shard_map``) need them, and kfac-jax offers no public reading of either.
# Tested by tests/test_kfac.py (the step against FermiNet's pmap step, the averaged estimate, the
# DiagonalBlockWarning tests, which read the blocks), which fail when these move.
# When it can go: when kfac-jax exposes the estimator and these decisions publicly; then read those.


def _estimator(optimizer: kfac_jax.Optimizer) -> Any:
    return optimizer._estimator  # kfac-jax 0.0.8 and its head: the BlockDiagonalCurvature


def curvature_flags(optimizer: kfac_jax.Optimizer, step: int) -> tuple[bool, bool]:
    """kfac-jax's own decisions for ``step``: update the curvature estimate, adapt the damping.

    These two (and whether ``step`` is 0) are the only ways the step number shapes the
    program ``kfac_jax.Optimizer.step`` traces, so they key its compilation.
    """
    return bool(optimizer._should_update_estimate_curvature(step)), bool(optimizer._should_update_damping(step))


def steps_share_one_program(optimizer: kfac_jax.Optimizer) -> bool:
    """Whether :func:`curvature_flags` are the same at every step (then the step number need not be read)."""
    return not optimizer._use_adaptive_damping and optimizer._curvature_update_period == 1


def sync_estimator(optimizer: kfac_jax.Optimizer, estimator_state: Any, axis_name: str) -> Any:
    """The curvature estimate averaged over ``axis_name`` (kfac-jax's own sync; a no-op when already synced)."""
    return _estimator(optimizer).sync(estimator_state, pmap_axis_name=axis_name)


def parameter_blocks(optimizer: kfac_jax.Optimizer, params: Any) -> list[tuple[str, tuple[int, ...], str | None]]:
    """``(path, shape, variant)`` of every parameter: the layer tag of its curvature block (``"generic"``, ...).

    Read after ``init`` from the estimator's blocks; an empty list when kfac-jax's
    internals are not where this version expects them.
    """
    try:
        estimator = _estimator(optimizer)
        blocks = estimator.blocks
        index = jax.tree_util.tree_leaves(estimator.params_block_index)
    except (AttributeError, ValueError, AssertionError):
        return []
    found = []
    for (path, leaf), i in zip(jax.tree_util.tree_flatten_with_path(params)[0], index):
        eqn = getattr(blocks[i], "_layer_tag_eq", None)
        variant = getattr(getattr(eqn, "params", {}).get("meta"), "variant", None)
        found.append((jax.tree_util.keystr(path) or "<root>", tuple(jnp.shape(leaf)), variant))
    return found


def _subjaxprs(eqn: Any) -> Iterator[Any]:
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, jex.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex.core.Jaxpr):
                yield item


def _has_shard_map(jaxpr: Any) -> bool:
    return any(eqn.primitive.name == "shard_map" or any(map(_has_shard_map, _subjaxprs(eqn))) for eqn in jaxpr.eqns)


def runs_shard_map(optimizer: kfac_jax.Optimizer) -> bool:
    """Whether the loss kfac-jax traced holds a ``shard_map`` (whose inside its graph matcher does not read)."""
    try:
        jaxpr = _estimator(optimizer).jaxpr.jaxpr
    except (AttributeError, ValueError, AssertionError):
        return False
    return _has_shard_map(getattr(jaxpr, "jaxpr", jaxpr))


# ----------------------------------------------------------------------------- curvature over the valid walkers
#
# What: kfac-jax estimates the curvature of each device's block of walkers and averages the devices (``sync``).
# Two things then depend on how the walkers are laid out, which shardvmc promises they do not:
#
# - padding walkers (a walker count the devices do not divide) enter every statistic: their sqrt-Fisher
#   vectors flow back through the network, and their layer inputs enter the Kronecker factors' input side;
# - the blocks kfac-jax builds for parameters outside any layer it recognises ("generic": NaiveDiagonal,
#   NaiveFull, NaiveTNT) square each device's SUM of per-walker tangents, ``(sum_i J_i)^2 / n``: the
#   cross terms between walkers of different devices are lost, so the estimate shrinks with the device count
#   (measured: Li, 24 walkers, 2 steps: parameters 5e-5 apart between 1 and 3 devices, 1.6e-4 with 8).
#
# How, while :func:`valid_walker_curvature` is entered (inside shardvmc.kfac's step kernel, whose body knows
# the valid rows of its block, their global count and the mesh axes):
#
# - the loss's sqrt-Fisher (or gradient) vectors are zeroed on padding rows at their source
#   (``_compute_losses_vjp``), so no tangent of a padding walker exists anywhere downstream;
# - a block with per-walker rows (layer inputs and output tangents, every block but the generic ones)
#   computes its statistics of this device's rows with the padding rows zeroed; a zeroed row still adds
#   what a row of zeros adds (a dense layer's bias column of ones), which is taken back exactly: every
#   statistic of kfac-jax's blocks is a sum over rows divided by the rows, so the statistics of one zero
#   row are those of a block of zeros, read from the block itself. The sums over the valid rows are added
#   over the devices (one all-reduce) and divided by the valid count: exactly the statistics of the valid
#   walkers on one device, the same on every device (kfac-jax's own sync, which averages the devices and
#   skips some statistics, such as a repeated dense layer's average repeats, is then not needed);
# - a generic block gets the sum of the tangents over every device (one all-reduce of a parameter-sized
#   vector) scaled by ``sqrt(rows / valid count)``: the one-device estimate ``(sum_i J_i)^2 / n``.
#
# Each statistic reaches the block's moving averages through ``WeightedMovingAverage.update`` (``ema_old``,
# ``ema_new``) of the old, replicated value with the replicated target, so the new state is the same on every
# device bit for bit; the block's own update (on this device's rows) gives the state's structure, and its
# statistics are read from it with ``ema_old=0``, so no block's internals are rewritten.
# Tested by tests/test_kfac.py (1,001 and 13 walkers on 1, 3 and 8 devices against the valid walkers on one
# device: the curvature factors and the update), which fails when kfac-jax moves these.
# When it can go: when kfac-jax takes per-example weights in its curvature estimation.


@dataclasses.dataclass(frozen=True)
class _Rows:
    valid: jax.Array | None  # this device's rows that are valid walkers (None: every row)
    count: Any  # the valid walkers of every device
    axes: tuple[str, ...]  # the mesh axes the walkers are split over


_ROWS: contextvars.ContextVar[_Rows | None] = contextvars.ContextVar("shardvmc_kfac_rows", default=None)


@contextlib.contextmanager
def valid_walker_curvature(valid: jax.Array | None, count: Any, axes: tuple[str, ...]) -> Iterator[None]:
    """While entered, kfac-jax's curvature estimates are those of the valid walkers of all devices (see above)."""
    _install()
    token = _ROWS.set(_Rows(valid, count, axes))
    try:
        yield
    finally:
        _ROWS.reset(token)


_ORIGINAL_UPDATE_BLOCKS = BlockDiagonalCurvature._update_blocks
_ORIGINAL_LOSSES_VJP = BlockDiagonalCurvature._compute_losses_vjp


def _install() -> None:
    # Installed on the class once, inert outside valid_walker_curvature (the context variable is unset there).
    if BlockDiagonalCurvature._update_blocks is not _update_blocks:
        BlockDiagonalCurvature._update_blocks = _update_blocks  # type: ignore[method-assign]
        BlockDiagonalCurvature._compute_losses_vjp = _compute_losses_vjp  # type: ignore[method-assign]


def _zero_rows(tree: Any, rows: _Rows, n: int) -> Any:
    """``tree`` with the padding rows of every array whose leading axis is the block's ``n`` rows zeroed."""
    valid = rows.valid
    if valid is None:
        return tree

    def zero(x: Any) -> Any:
        if not isinstance(x, jax.Array) or x.ndim == 0 or x.shape[0] != n:
            return x
        keep = valid.reshape((n,) + (1,) * (x.ndim - 1))
        return jnp.where(keep, x, jnp.zeros((), x.dtype))

    return jax.tree_util.tree_map(zero, tree)


def _compute_losses_vjp(self: Any, func_args: Any) -> Any:
    losses, losses_vjp = _ORIGINAL_LOSSES_VJP(self, func_args)
    rows = _ROWS.get()
    if rows is None or rows.valid is None:
        return losses, losses_vjp
    n = int(rows.valid.shape[0])
    return losses, lambda vectors: losses_vjp(_zero_rows(vectors, rows, n))


def _is_average(x: Any) -> bool:
    return isinstance(x, WeightedMovingAverage)


def _averages(state: Any) -> list[WeightedMovingAverage]:
    return [x for x in jax.tree_util.tree_leaves(state, is_leaf=_is_average) if _is_average(x)]


def _statistics(block: Any, state: Any, info: Any, identity_weight: Any, n: int) -> list[Any]:
    """The new statistics the block computes from ``info`` (an update that keeps nothing of the old values)."""
    fresh = block.update_curvature_matrix_estimate(state, info, 0.0, 1.0, identity_weight, n)
    return [average.value for average in _averages(fresh)]


def _is_generic(info: Any) -> bool:
    """Whether the block is a generic one (no layer inputs: its tangents are already summed over its rows)."""
    return not info.primals.inputs


def _local_sums(block: Any, state: Any, info: Any, identity_weight: Any, n: int, rows: _Rows) -> Any:
    """What the block adds up over the devices: a generic block its tangents, any other its statistics' row sums
    (``info`` with its padding rows zeroed)."""
    if _is_generic(info):
        return info.tangents.params
    sums = [o * n for o in _statistics(block, state, info, identity_weight, n)]  # this device's rows, summed
    if rows.valid is not None:
        zeros = _statistics(block, state, jax.tree_util.tree_map(jnp.zeros_like, info), identity_weight, n)
        padding = n - jnp.sum(rows.valid)
        sums = [s - padding * z for s, z in zip(sums, zeros)]
    return sums


def _update_block(
    block: Any, state: Any, info: Any, total: Any, count: Any, ema_old: Any, ema_new: Any, identity_weight: Any, n: int
) -> Any:
    """The block's new state from ``total``, its :func:`_local_sums` added over every device, and the valid
    walkers' ``count`` (``info`` as :func:`_local_sums` got it)."""
    if _is_generic(info):  # the one-device estimate (sum_i J_i)^2 / n
        scale = jnp.sqrt(n / count)
        params = jax.tree_util.tree_map(lambda t: t * scale.astype(t.dtype), total)
        info = dataclasses.replace(info, tangents=dataclasses.replace(info.tangents, params=params))
        return block.update_curvature_matrix_estimate(state, info, ema_old, ema_new, identity_weight, n)
    new = block.update_curvature_matrix_estimate(state, info, ema_old, ema_new, identity_weight, n)
    # The sums over every valid walker divided by their count, the same on every device: the statistics of the
    # valid walkers on one device (kfac-jax's sync, which some statistics skip, then has nothing to average).
    target = [t / count.astype(t.dtype) for t in total]
    for average, before, t in zip(_averages(new), _averages(state), target):
        # the moving average's own update of the old value with the target, from values that are the same on
        # every device: the result is too, bit for bit (a replicated state; its checkpoint checksums agree)
        updated = jax.tree_util.tree_map(lambda x: x, before)
        updated.update(t, ema_old, ema_new)
        average.value, average.weight = updated.value, updated.weight
    return new


def _update_blocks(
    self: Any, blocks_info: Any, state: Any, ema_old: Any, ema_new: Any, identity_weight: Any, batch_size: Any
) -> Any:
    rows = _ROWS.get()
    if rows is None:
        return _ORIGINAL_UPDATE_BLOCKS(self, blocks_info, state, ema_old, ema_new, identity_weight, batch_size)
    assert len(blocks_info) == self.num_blocks
    n = int(batch_size)
    count = jnp.asarray(rows.count, jnp.result_type(float))
    infos = [info if _is_generic(info) else _zero_rows(info, rows, n) for info in blocks_info]
    blocks = list(zip(self.blocks, state.blocks_states, infos))
    # Every block's sums in one all-reduce of one buffer (psum_tree): XLA's CPU runtime and gloo reduce an
    # all-reduce's operands one at a time, each a rendezvous of every device.
    totals = psum_tree([_local_sums(b, s, info, identity_weight, n, rows) for b, s, info in blocks], rows.axes)
    new_states = tuple(
        _update_block(b, s, info, total, count, ema_old, ema_new, identity_weight, n)
        for (b, s, info), total in zip(blocks, totals)
    )
    # Every block's statistics are already those of every device: kfac-jax's sync is skipped.
    return BlockDiagonalCurvature.State(synced=jnp.asarray(True), blocks_states=new_states)


# ----------------------------------------------------------------------------- all-reduces of one buffer
#
# What: while :func:`packed_collectives` is entered, kfac-jax's all-reduces of a pytree (``pmean_if_pmap``,
# ``psum_if_pmap``, and the sum that ends ``distribute_thunks``, its round-robin of the blocks' inverses and
# preconditioning over the devices) reduce one buffer per call (shardvmc's ``psum_tree``) instead of one per
# leaf.
# Why: XLA's CPU runtime reduces an all-reduce's operands one at a time, each a rendezvous of every device
# (``AllReduceThunk``), and gloo between processes does the same over the network. kfac-jax's step reduces
# the gradient, its statistics, every block's new inverse and every parameter's preconditioned gradient
# leaf by leaf: DeepQMC's LiH network on 8 fake CPU devices made about 270 rendezvous a step, most of the
# step's time (benchmarks/RESULTS.md, "Where the 8-device KFAC time goes"). The sums are the same
# elementwise sums; on CPUs the bits are too (each element is added in the devices' order either way).
# Tested by tests/test_kfac.py (the step on 1, 3 and 8 devices against one device; the compiled step's
# all-reduce operands), which fails when kfac-jax renames these.
# When it can go: when XLA's CPU runtime and gloo reduce a multi-operand all-reduce in one exchange.

_PACKED: contextvars.ContextVar[bool] = contextvars.ContextVar("shardvmc_kfac_packed", default=False)
# (A kfac-jax without these keeps its own all-reduces: slower on CPUs, the same numbers.)
_ORIGINAL_PMEAN: Any = getattr(kfac_utils, "pmean_if_pmap", None)
_ORIGINAL_PSUM: Any = getattr(kfac_utils, "psum_if_pmap", None)
_ORIGINAL_DISTRIBUTE: Any = getattr(kfac_utils, "distribute_thunks", None)


@contextlib.contextmanager
def packed_collectives() -> Iterator[None]:
    """While entered, kfac-jax's all-reduces of a pytree reduce one buffer each (see above)."""
    _install_packed()
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _install_packed() -> None:
    # kfac-jax calls these as attributes of its utils package (``utils.pmean_if_pmap(...)``): one assignment each
    # reaches every use. Inert outside packed_collectives.
    if None in (_ORIGINAL_PMEAN, _ORIGINAL_PSUM, _ORIGINAL_DISTRIBUTE, getattr(kfac_utils, "in_pmap", None)):
        return
    if kfac_utils.pmean_if_pmap is not _pmean_if_pmap:
        kfac_utils.pmean_if_pmap = _pmean_if_pmap
        kfac_utils.psum_if_pmap = _psum_if_pmap
        kfac_utils.distribute_thunks = _distribute_thunks


def _packing(axis_name: str | None) -> bool:
    return _PACKED.get() and kfac_utils.in_pmap(axis_name)


def _psum_if_pmap(obj: Any, axis_name: str | None) -> Any:
    if axis_name is None or not _packing(axis_name):
        return _ORIGINAL_PSUM(obj, axis_name)
    return psum_tree(obj, (axis_name,))


def _pmean_if_pmap(obj: Any, axis_name: str | None) -> Any:
    if axis_name is None or not _packing(axis_name):
        return _ORIGINAL_PMEAN(obj, axis_name)
    n = jax.lax.axis_size(axis_name)
    return jax.tree_util.tree_map(lambda v: v / n, psum_tree(obj, (axis_name,)))  # as jax.lax.pmean divides


def _distribute_thunks(thunks: Any, axis_name: str) -> Any:
    """kfac-jax's ``distribute_thunks`` (thunk ``i`` runs on device ``i mod devices``, zeros elsewhere), summed
    over the devices in one buffer."""
    if not _packing(axis_name):
        return _ORIGINAL_DISTRIBUTE(thunks, axis_name)
    devices = jax.lax.axis_size(axis_name)
    shapes = [jax.eval_shape(thunk) for thunk in thunks]

    def branch(device: int) -> Callable[[], tuple[Any, ...]]:
        def run() -> tuple[Any, ...]:
            zeros = lambda shape: jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shape)  # noqa: E731
            return tuple(t() if i % devices == device else zeros(shapes[i]) for i, t in enumerate(thunks))

        return run

    outputs = jax.lax.switch(jax.lax.axis_index(axis_name), [branch(d) for d in range(devices)])
    return psum_tree(outputs, (axis_name,))
