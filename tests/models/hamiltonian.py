"""Local energies of atoms and molecules: kinetic energy from log psi plus the Coulomb potential.

``E_L = -1/2 (lap log psi + grad log psi . grad log psi) + V``, for real or complex log psi
(for complex log psi the square is not conjugated, so ``E_L`` is complex). The Laplacian
comes from one of :data:`METHODS`:

- ``"folx"``: ``folx.forward_laplacian`` with dense Jacobians;
- ``"folx_sparse"``: the same with sparse Jacobians (``sparsity_threshold=0.6``);
- ``"jvp_loop"``: a Python loop of ``jax.jvp`` of ``jax.grad`` over the 3n basis tangents ``jnp.eye(3n)[i]``;
- ``"scan"``: the same jvp-of-grad in a ``jax.lax.scan`` over the rows of ``jnp.eye(3n)``;
- ``"fori"``: ``jax.linearize`` of the gradient once, then a ``jax.lax.fori_loop`` over ``eye[i]`` (FermiNet's way);
- ``"hessian"``: ``jnp.trace(jax.hessian(...))``, the slow reference.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import folx
import jax
import jax.numpy as jnp

from .systems import System

METHODS = ("folx", "folx_sparse", "jvp_loop", "scan", "fori", "hessian")
SPARSITY_THRESHOLD = 0.6


def nuclear_repulsion(system: System) -> float:
    """``sum_{m<l} Z_m Z_l / |R_m - R_l|`` (a Python float)."""
    return sum(
        system.charges[a] * system.charges[b] / math.dist(system.coords[a], system.coords[b])
        for a, b in itertools.combinations(range(system.n_atoms), 2)
    )


def potential(r: jax.Array, system: System) -> jax.Array:
    """Coulomb energy of one walker: electron-nucleus, electron-electron and nucleus-nucleus."""
    n = r.shape[0]
    coords, charges = system.nuclei(r.dtype)
    r_ae = jnp.linalg.norm(r[:, None, :] - coords[None, :, :], axis=-1)
    ee = r[None, :, :] - r[:, None, :]
    r_ee = jnp.linalg.norm(ee + jnp.eye(n)[..., None], axis=-1) * (1.0 - jnp.eye(n))
    v_ee = jnp.sum(jnp.triu(1.0 / (r_ee + jnp.eye(n)), k=1))
    return -jnp.sum(charges / r_ae) + v_ee + nuclear_repulsion(system)


def _is_complex(f: Callable[[jax.Array], jax.Array], x: jax.Array) -> bool:
    """Whether ``f(x)`` is complex (decided by shape evaluation, no computation)."""
    return jnp.iscomplexobj(jax.eval_shape(f, x))


def _as_real(f: Callable[[jax.Array], jax.Array], is_complex: bool) -> Callable[[jax.Array], jax.Array]:
    """``f`` itself if real, else ``x -> [Re f(x), Im f(x)]``."""
    if not is_complex:
        return f
    return lambda x: jnp.stack([jnp.real(f(x)), jnp.imag(f(x))])


def _gradient(f: Callable[[jax.Array], jax.Array], is_complex: bool) -> Callable[[jax.Array], jax.Array]:
    """``jax.grad(f)``, or for complex ``f`` the gradients of its real and imaginary parts ``(d, 2)``."""
    if not is_complex:
        return jax.grad(f)
    parts = (lambda x: jnp.real(f(x)), lambda x: jnp.imag(f(x)))
    return lambda x: jnp.stack([jax.grad(p)(x) for p in parts], axis=-1)


def laplacian_and_gradient(
    f: Callable[[jax.Array], jax.Array], x: jax.Array, method: str
) -> tuple[jax.Array, jax.Array]:
    """Laplacian and gradient of a scalar ``f`` (real or complex) of a flat ``x`` of size ``d``.

    Returns them as real arrays, with a trailing axis (real, imaginary) of size 2 for complex ``f``.
    """
    d = x.shape[0]
    is_complex = _is_complex(f, x)
    if method in ("folx", "folx_sparse"):
        threshold = SPARSITY_THRESHOLD if method == "folx_sparse" else 0
        out = folx.forward_laplacian(_as_real(f, is_complex), sparsity_threshold=threshold)(x)
        return out.laplacian, out.jacobian.dense_array
    if method == "hessian":
        hess = jax.hessian(_as_real(f, is_complex))(x)
        return jnp.trace(hess, axis1=-2, axis2=-1), _gradient(f, is_complex)(x)
    grad_f = _gradient(f, is_complex)
    eye = jnp.eye(d, dtype=x.dtype)
    zero = jnp.zeros((2,) if is_complex else (), x.dtype)
    if method == "jvp_loop":
        lap = zero
        for i in range(d):
            lap = lap + jax.jvp(grad_f, (x,), (eye[i],))[1][i]
        return lap, grad_f(x)
    if method == "scan":

        def body(acc: jax.Array, row: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, None]:
            i, tangent = row
            return acc + jax.jvp(grad_f, (x,), (tangent,))[1][i], None

        lap, _ = jax.lax.scan(body, zero, (jnp.arange(d), eye))
        return lap, grad_f(x)
    if method == "fori":
        grad, grad_jvp = jax.linearize(grad_f, x)
        lap = jax.lax.fori_loop(0, d, lambda i, acc: acc + grad_jvp(eye[i])[i], zero)
        return lap, grad
    raise ValueError(f"unknown Laplacian method {method!r}; expected one of {METHODS}")


def kinetic_from_derivatives(lap: jax.Array, grad: jax.Array) -> jax.Array:
    """``-1/2 (lap + grad . grad)`` from :func:`laplacian_and_gradient`'s output (complex if it has parts)."""
    if lap.ndim:  # complex: the trailing axis holds the real and imaginary parts
        lap = jax.lax.complex(lap[..., 0], lap[..., 1])
        grad = jax.lax.complex(grad[..., 0], grad[..., 1])
    return -0.5 * (lap + jnp.sum(grad * grad))


def kinetic_energy(log_psi: Callable, params: dict, r: jax.Array, method: str = "folx") -> jax.Array:
    """``-1/2 (lap log psi + (grad log psi)^2)`` of one walker (complex if log psi is)."""
    shape = r.shape
    f = lambda x: log_psi(params, x.reshape(shape))  # noqa: E731
    return kinetic_from_derivatives(*laplacian_and_gradient(f, r.reshape(-1), method))


def make_local_energy(log_psi: Callable, system: System, method: str = "folx") -> Callable:
    """``local_energy(params, r)`` of one walker for ``log_psi(params, r)``, by ``method``."""
    if method not in METHODS:
        raise ValueError(f"unknown Laplacian method {method!r}; expected one of {METHODS}")

    def local_energy(params: dict, r: jax.Array) -> jax.Array:
        """Local energy ``-1/2 (lap + grad^2) log psi + V`` of one walker ``r``."""
        return kinetic_energy(log_psi, params, r, method) + potential(r, system)

    return local_energy
