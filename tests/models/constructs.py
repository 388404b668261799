"""Pieces real per-walker code uses beyond plain ``jnp``: custom derivatives and a while loop.

- :func:`safe_norm`: a ``jax.custom_jvp`` Euclidean norm whose derivative is finite at zero.
- :func:`positive`: a ``jax.custom_vjp`` absolute value whose gradient at zero is one, not zero
  (used on parameters only: folx and ``jax.jvp`` cannot push tangents through a ``custom_vjp``).
- :func:`fixed_point`: a ``lax.while_loop`` fixed-point iteration with an implicit-function
  ``custom_vjp``, the JAX documentation's pattern (also for parameters only).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp


@jax.custom_jvp
def safe_norm(x: jax.Array) -> jax.Array:
    """Norm over the last axis, ``sqrt(sum(x**2))``, with a zero derivative at ``x == 0``."""
    return jnp.sqrt(jnp.sum(x**2, axis=-1))


@safe_norm.defjvp
def _safe_norm_jvp(primals: tuple[jax.Array], tangents: tuple[jax.Array]) -> tuple[jax.Array, jax.Array]:
    """``d|x| = x . dx / |x|``, zero where ``|x| == 0`` (no NaN on either branch)."""
    (x,), (dx,) = primals, tangents
    n = safe_norm(x)
    nonzero = n > 0
    return n, jnp.where(nonzero, jnp.sum(x * dx, axis=-1) / jnp.where(nonzero, n, 1.0), 0.0)


@jax.custom_vjp
def positive(x: jax.Array) -> jax.Array:
    """``|x|``, with gradient ``sign(x)`` except 1 at zero (a parameter never gets stuck at 0)."""
    return jnp.abs(x)


def _positive_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Forward pass of :func:`positive`: saves ``x``."""
    return jnp.abs(x), x


def _positive_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    """Backward pass of :func:`positive`."""
    return (jnp.where(x < 0, -g, g),)


positive.defvjp(_positive_fwd, _positive_bwd)


def _tolerance(x: jax.Array) -> jax.Array:
    """Convergence tolerance of :func:`fixed_point` for the dtype of ``x``."""
    return 64 * jnp.finfo(jnp.result_type(x)).eps


def _iterate(f: Callable, a: jax.Array, x0: jax.Array, max_iter: int = 100) -> jax.Array:
    """Iterate ``x <- f(a, x)`` from ``x0`` until it stops moving (or ``max_iter`` steps)."""

    def cond(carry: tuple) -> jax.Array:
        x_prev, x, i = carry
        return (jnp.max(jnp.abs(x - x_prev)) > _tolerance(x) * (1 + jnp.max(jnp.abs(x)))) & (i < max_iter)

    def body(carry: tuple) -> tuple:
        _, x, i = carry
        return x, f(a, x), i + 1

    return jax.lax.while_loop(cond, body, (x0, f(a, x0), 0))[1]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fixed_point(f: Callable, a: jax.Array, x0: jax.Array) -> jax.Array:
    """The fixed point ``x* = f(a, x*)`` reached from ``x0``, differentiable in ``a`` (implicitly)."""
    return _iterate(f, a, x0)


def _fixed_point_fwd(f: Callable, a: jax.Array, x0: jax.Array) -> tuple[jax.Array, tuple]:
    """Forward pass of :func:`fixed_point`: saves ``a`` and ``x*``."""
    x_star = _iterate(f, a, x0)
    return x_star, (a, x_star)


def _fixed_point_bwd(f: Callable, res: tuple, x_star_bar: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Implicit-function backward pass: solve ``u = x*_bar + u (df/dx)`` by the same iteration."""
    a, x_star = res
    _, vjp_a = jax.vjp(lambda a: f(a, x_star), a)
    _, vjp_x = jax.vjp(lambda x: f(a, x), x_star)
    u = _iterate(lambda bar, u: bar + vjp_x(u)[0], x_star_bar, x_star_bar)
    return vjp_a(u)[0], jnp.zeros_like(x_star)


fixed_point.defvjp(_fixed_point_fwd, _fixed_point_bwd)


def babylonian_sqrt(a: jax.Array) -> jax.Array:
    """``sqrt(a)`` for ``a > 0`` by Heron's fixed-point iteration (a :func:`fixed_point` use)."""
    return fixed_point(lambda a, x: 0.5 * (x + a / x), a, jnp.ones_like(a))
