"""Float32 arithmetic at float32's accuracy on every platform: ``accurate(f)``, a rewrite of a traced program.

At their defaults, TPUs trade float32 accuracy for speed in two places, measured on a TPU
v5e against float64 (``benchmarks/RESULTS.md``, "On a TPU"):

- matrix products (``dot_general``) of float32 arrays run as one bfloat16 pass (8 bits of
  mantissa), and a FermiNet-style network's local energies came out hundreds of hartree
  off;
- ``exp``, ``log``, ``tanh``, ``log1p``, ``expm1`` and ``logistic`` are fast approximations:
  up to 67 (exp), 1,346 (tanh) and 3,994 (log) units in the last place, against at most 1
  to 5 on a CPU.

A local energy is a sum of large terms of both signs near nuclei and nodes, so those
errors are amplified. ``accurate(f)`` is ``f`` with every float32 ``dot_general`` at
``Precision.HIGHEST`` and those functions computed from ``+``, ``*``, ``/`` and bit
operations (Cephes' single-precision algorithms: exp, log and tanh at most 1.5 ulps on the TPU, all
six within 3 ulps in the tests). It traces
``f`` (after any differentiation inside it, folx's included) and evaluates the program
with those operations replaced, on TPUs only (the kernel's platform, or
``jax.lax.platform_dependent`` outside kernels): on CPUs and GPUs, whose float32 is already
float32, the program is ``f`` unchanged. Other dtypes are
left alone.

The rewrite evaluates the bodies of ``jit``, ``custom_jvp``/``custom_vjp`` functions and
``checkpoint`` inline (their custom derivative rules do not survive: differentiate before
the rewrite, not through it) and rewrites the bodies of ``while``, ``scan`` and ``cond``;
other programs inside ``f`` (a ``shard_map``) run as they are.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from ._internals import Jaxpr, closed_jaxpr_parts, is_jaxpr, literal_value
from ._platform import traced_platform

__all__ = ["accurate", "exp", "expm1", "log", "log1p", "logistic", "tanh"]

_F32 = jnp.dtype(jnp.float32)
_LOG2E = 1.44269504088896341
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 split so that n * _LN2_HI is exact
_SQRT_HALF = 0.707106781186547524


def _pow2(n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``2**n`` for integer-valued ``n`` in [-252, 254] as two float32 factors (neither overflows alone)."""
    n = n.astype(jnp.int32)
    half = n // 2

    def power(k: jax.Array) -> jax.Array:
        return lax.bitcast_convert_type((jnp.clip(k, -126, 127) + 127) << 23, jnp.float32)

    return power(half), power(n - half)


def exp(x: jax.Array) -> jax.Array:
    """``exp`` of float32 ``x`` to 1 ulp: Cephes' ``expf`` (range reduction by ln 2, a degree-6 polynomial)."""
    n = jnp.floor(x * jnp.float32(_LOG2E) + jnp.float32(0.5))
    r = x - n * jnp.float32(_LN2_HI) - n * jnp.float32(_LN2_LO)
    z = r * r
    p = ((((1.9875691500e-4 * r + 1.3981999507e-3) * r + 8.3334519073e-3) * r + 4.1665795894e-2) * r
         + 1.6666665459e-1) * r + 5.0000001201e-1  # fmt: skip
    p = p * z + r + 1.0
    low, high = _pow2(jnp.clip(n, -252, 254))
    y = (p * low) * high
    y = jnp.where(x > 88.72283905206835, jnp.inf, y)
    y = jnp.where(x < -103.97, 0.0, y)
    return jnp.where(jnp.isnan(x), x, y)


def log(x: jax.Array) -> jax.Array:
    """``log`` of float32 ``x`` to 1 ulp: Cephes' ``logf`` (the exponent split off, a degree-8 polynomial)."""
    bits = lax.bitcast_convert_type(x, jnp.int32)
    e = ((bits >> 23) & 0xFF) - 126
    m = lax.bitcast_convert_type((bits & 0x007FFFFF) | 0x3F000000, jnp.float32)  # x = m 2^e, m in [1/2, 1)
    below = m < _SQRT_HALF
    e = jnp.where(below, e - 1, e)
    m = jnp.where(below, m + m - 1.0, m - 1.0)
    z = m * m
    y = (((((((7.0376836292e-2 * m - 1.1514610310e-1) * m + 1.1676998740e-1) * m - 1.2420140846e-1) * m
             + 1.4249322787e-1) * m - 1.6668057665e-1) * m + 2.0000714765e-1) * m - 2.4999993993e-1) * m  # fmt: skip
    y = (y + 3.3333331174e-1) * m * z
    fe = e.astype(jnp.float32)
    y = y + jnp.float32(_LN2_LO) * fe - 0.5 * z
    out = m + y + jnp.float32(_LN2_HI) * fe
    out = jnp.where(x == 0, -jnp.inf, out)
    out = jnp.where(x < 0, jnp.nan, out)
    out = jnp.where(x == jnp.inf, jnp.inf, out)
    return jnp.where(jnp.isnan(x), x, out)


def tanh(x: jax.Array) -> jax.Array:
    """``tanh`` of float32 ``x`` to 2 ulps: Cephes' ``tanhf`` (a polynomial below 0.625, else from :func:`exp`)."""
    ax = jnp.abs(x)
    z = x * x
    small = ((((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
             - 3.33332819422e-1) * z * x + x  # fmt: skip
    big = 1.0 - 2.0 / (exp(2.0 * jnp.minimum(ax, 10.0)) + 1.0)  # tanh(10) is 1 in float32
    return jnp.where(ax < 0.625, small, jnp.where(x < 0, -big, big))


def expm1(x: jax.Array) -> jax.Array:
    """``exp(x) - 1`` of float32 ``x`` without cancellation: ``2 t / (1 - t)``, ``t = tanh(x / 2)``, near 0."""
    t = tanh(0.5 * jnp.clip(x, -0.5, 0.5))
    return jnp.where(jnp.abs(x) < 0.5, 2.0 * t / (1.0 - t), exp(x) - 1.0)


def log1p(x: jax.Array) -> jax.Array:
    """``log(1 + x)`` of float32 ``x``: ``log(u) - ((u - 1) - x) / u`` with ``u = 1 + x`` (Goldberg's correction)."""
    u = lax.optimization_barrier(1.0 + x)  # XLA's simplifier rewrites (1 + x) - 1 as x: keep u's rounding
    corrected = log(u) - ((u - 1.0) - x) / jnp.where(u == 0, 1.0, u)
    return jnp.where(u == 1.0, x, corrected)


def logistic(x: jax.Array) -> jax.Array:
    """``1 / (1 + exp(-x))`` of float32 ``x``, from :func:`exp` of ``-|x|`` (no overflow)."""
    e = exp(-jnp.abs(x))
    s = 1.0 / (1.0 + e)
    return jnp.where(x >= 0, s, e * s)


_FUNCTIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "exp": exp,
    "log": log,
    "tanh": tanh,
    "expm1": expm1,
    "log1p": log1p,
    "logistic": logistic,
}
# The primitives whose bodies are evaluated inline (their jaxpr parameter), and those whose bodies are rewritten.
_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
           "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "checkpoint": "jaxpr",
           "remat": "jaxpr"}  # fmt: skip
_REWRITE = {"while": ("cond_jaxpr", "body_jaxpr"), "scan": ("jaxpr",), "cond": ("branches",)}


def _rewritten_jaxpr(closed: Any) -> Any:
    """A body of ``while``/``scan``/``cond`` with the same signature, rewritten (traced again through :func:`_eval`)."""
    jaxpr, consts = closed_jaxpr_parts(closed)
    avals = [v.aval for v in jaxpr.invars]
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    return jax.make_jaxpr(lambda *xs: _eval(jaxpr, consts, *xs))(*args)


def _eval(jaxpr: Jaxpr, consts: Any, *args: Any) -> list[Any]:
    """Evaluate ``jaxpr`` with float32 products at HIGHEST and the functions of ``_FUNCTIONS`` replaced."""
    env: dict[Any, Any] = {}

    def read(v: Any) -> Any:
        value = literal_value(v)
        return env[v] if value is None else value[0]

    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    for eqn in jaxpr.eqns:
        invals = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        params = eqn.params
        dtypes = {jnp.dtype(getattr(v.aval, "dtype")) for v in eqn.invars if hasattr(v.aval, "dtype")}
        if name in _FUNCTIONS and dtypes == {_F32}:
            outs = [_FUNCTIONS[name](invals[0])]
        elif name in _INLINE and is_jaxpr(params.get(_INLINE[name])):
            sub, sub_consts = closed_jaxpr_parts(params[_INLINE[name]])
            outs = _eval(sub, sub_consts, *invals)
        else:
            if name == "dot_general" and dtypes == {_F32}:
                params = {**params, "precision": (lax.Precision.HIGHEST, lax.Precision.HIGHEST)}
            elif name in _REWRITE:
                params = dict(params)
                for key in _REWRITE[name]:
                    value = params[key]
                    params[key] = (
                        tuple(_rewritten_jaxpr(b) for b in value)
                        if isinstance(value, tuple)
                        else _rewritten_jaxpr(value)
                    )
            outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
            if not eqn.primitive.multiple_results:
                outs = [outs]
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _rewrite(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` traced and evaluated by :func:`_eval` (on any platform: the TPU branch of :func:`accurate`)."""

    @functools.wraps(f)
    def rewritten(*args: Any) -> Any:
        closed, shape = jax.make_jaxpr(f, return_shape=True)(*args)
        jaxpr, consts = closed_jaxpr_parts(closed)
        out = _eval(jaxpr, consts, *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    return rewritten


def accurate(f: Callable[..., Any], elsewhere: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """``f`` computed at float32's accuracy on TPUs (see the module); ``elsewhere`` (default ``f``) on other platforms.

    ``f`` takes and returns pytrees of arrays. On a TPU its float32 matrix products run at
    ``Precision.HIGHEST`` and its ``exp``, ``log``, ``tanh``, ``log1p``, ``expm1`` and
    ``logistic`` are computed to 1-3 ulps. ``elsewhere``, a function of the same arguments
    and results, is what other platforms run (another algorithm that is faster there).
    """
    other = f if elsewhere is None else elsewhere

    @functools.wraps(f)
    def wrapped(*args: Any) -> Any:
        platform = traced_platform()
        if platform is not None:  # a kernel's trace: its platform's program alone
            return _rewrite(f)(*args) if platform == "tpu" else other(*args)
        leaves, tree = jax.tree_util.tree_flatten(args)

        def call(g: Callable[..., Any]) -> Callable[..., Any]:
            return lambda *flat: g(*jax.tree_util.tree_unflatten(tree, flat))

        # Both branches are traced and must agree on their types, also where the two algorithms promote a
        # constant of another dtype differently (x64 on, float32 inputs): the TPU's results as the other's.
        types = jax.eval_shape(call(other), *leaves)

        def on_tpu(*flat: Any) -> Any:
            return jax.tree_util.tree_map(lambda x, t: x.astype(t.dtype), call(_rewrite(f))(*flat), types)

        return lax.platform_dependent(*leaves, tpu=on_tpu, default=call(other))

    return wrapped
