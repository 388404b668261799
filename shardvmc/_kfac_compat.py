"""Everything ``shardvmc.kfac`` needs from kfac-jax beyond its public API, in one place.

Two kinds of thing live here:

- the fix of kfac-jax 0.0.8's ``tag_graph_matcher.eval_jaxpr_eqn`` for JAX >= 0.9.2,
  applied only when the installed kfac-jax fails a behaviour probe;
- read-only access to the optimiser's curvature estimator (its blocks, its traced
  program, its own per-step decisions), which kfac-jax keeps in private attributes.

Importing this module imports kfac-jax; ``shardvmc.kfac`` turns a missing kfac-jax, or
one that cannot be imported on the installed JAX, into an ``ImportError`` that says why
and how to fix it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import kfac_jax
from kfac_jax._src import tag_graph_matcher

__all__ = [
    "ORIGINAL_EVAL_JAXPR_EQN",
    "PATCHED",
    "curvature_flags",
    "fixed_eval_jaxpr_eqn",
    "parameter_blocks",
    "runs_shard_map",
    "sync_estimator",
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
