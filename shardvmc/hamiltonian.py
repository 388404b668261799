"""Local energies from a per-walker ``log psi``: the kinetic term by a forward Laplacian, plus a potential.

``E_L(r) = -1/2 (lap log psi(r) + grad log psi(r) . grad log psi(r)) + V(r)``, for a
real ``log|psi|`` or a complex ``log psi`` (then the square is not conjugated and
``E_L`` is complex). The Laplacian is folx's forward Laplacian (``laplacian="auto"``), the
fastest on every platform and at every size measured: on a TPU the JVP loop (``"jvp"``:
``jax.linearize`` of the gradient once, then one Jacobian-vector product per coordinate in a
``jax.lax.fori_loop``) took 1.9 to 4.5 times its time, from the templates' Li network at the
examples' size to FermiNet's own network on N2 (``docs/accelerators.md``), but holds a
seventh of its memory per walker. Either can be asked for (``"folx"``, optionally with sparse
Jacobians, ``sparsity_threshold``; ``"jvp"``).

On a TPU the local energy is computed at float32's accuracy: its matrix products at
``"highest"`` precision and ``exp``, ``log``, ``tanh`` (and kin) to 1-3 ulps instead of the
TPU's fast approximations; at the TPU's defaults a FermiNet-style network's local energies
came out hundreds of hartree off.

``local_energy(log_psi, potential)`` is a walker-parallel kernel over all walkers
(``batch_size=`` chunks each device's walkers to bound memory); called inside another
walker-parallel body it is the local energy of that body's walker. :func:`kinetic_energy`
and :func:`coulomb` are plain functions of one walker.

Example:
    >>> import jax, jax.numpy as jnp, shardvmc as sv
    >>> def log_psi(params, r):                       # ONE walker, r: (1, 3): hydrogen's 1s orbital
    ...     return -params["z"] * jnp.linalg.norm(r[0])
    >>> potential = lambda r: sv.hamiltonian.coulomb(r, charges=[1.0], coords=[[0.0, 0.0, 0.0]])
    >>> energy = sv.hamiltonian.local_energy(log_psi, potential)
    >>> e = energy({"z": 1.0}, jax.random.normal(jax.random.key(0), (16, 1, 3)))
    >>> bool(jnp.allclose(e, -0.5, atol=1e-5))     # an eigenstate: E_L = -Z^2/2 everywhere
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import folx
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ._decorator import WalkerParallel, walker_parallel
from ._errors import CallError, message
from ._markers import PerWalker, Replicated
from ._numerics import accurate
from .mcmc import Walker, float_positions, log_psi_value

__all__ = ["LAPLACIANS", "coulomb", "kinetic_energy", "local_energy"]
# (value_laplacian_gradient is also dmc's: a module function, not public API)

LAPLACIANS = ("auto", "folx", "jvp")
"""The Laplacian methods: the platform's fastest, folx's forward Laplacian, or JVPs of the linearized gradient."""

# "auto" is folx's forward Laplacian on every platform and at every size measured (benchmarks/scaling.py, one TPU
# v5e): the JVP loop took 3.1 times folx's time for the templates' Li network at the examples' size (4,753
# parameters, 4,096 walkers), 4.5 times for Be, 1.9 and 4.0 times for FermiNet's own network at its default size
# on Li and N2 (0.67 M and 0.77 M parameters, 512 walkers). The loop holds a seventh of folx's memory per walker.


def resolved_laplacian(laplacian: str) -> str:
    """The method that ``laplacian`` (``"auto"`` or a method) takes."""
    return "folx" if laplacian == "auto" else laplacian


def coulomb(r: jax.Array, charges: Any = None, coords: Any = None) -> jax.Array:
    """The Coulomb energy of one walker's electrons and fixed nuclei (atomic units).

    ``sum_{i<j} 1/|r_i - r_j| - sum_{i,a} Z_a/|r_i - R_a| + sum_{a<b} Z_a Z_b/|R_a - R_b|``.

    Args:
        r: the electrons' positions, ``(n_electrons, ndim)``.
        charges: the nuclear charges ``(n_atoms,)``; ``None``: no nuclei (the
            electron-electron term alone, e.g. electrons in a trap).
        coords: the nuclear positions ``(n_atoms, ndim)``.

    Returns:
        A scalar of ``r``'s dtype.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardvmc.hamiltonian import coulomb
        >>> r = jnp.array([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]])          # H2 at 1.4 bohr, two electrons
        >>> round(float(coulomb(r, charges=[1.0, 1.0], coords=[[0, 0, 0.7], [0, 0, -0.7]])), 4)
        -6.6289
    """
    r = jnp.asarray(r)
    if (charges is None) != (coords is None):
        raise CallError(
            message(
                "shardvmc.hamiltonian.coulomb",
                "charges and coords must be given together.",
                fix="pass both (one charge per row of coords), or neither for electrons alone.",
            )
        )
    n = r.shape[0]
    i, j = jnp.triu_indices(n, 1)
    # Only the pairs i < j: no zero distance on a diagonal, so derivatives of the potential stay finite.
    energy = jnp.sum(1.0 / jnp.linalg.norm(r[i] - r[j], axis=-1))
    if charges is None:
        return energy.astype(r.dtype)
    z = jnp.asarray(charges, r.dtype)
    nuclei = jnp.asarray(coords, r.dtype)
    if z.ndim != 1 or nuclei.shape != (z.shape[0], r.shape[-1]):
        raise CallError(
            message(
                "shardvmc.hamiltonian.coulomb",
                "charges and coords do not describe the same nuclei in the electrons' dimension.",
                got=f"charges {list(z.shape)}, coords {list(nuclei.shape)}, electrons {list(r.shape)}",
                expected=f"charges [n_atoms], coords [n_atoms, {r.shape[-1]}]",
            )
        )
    r_ae = jnp.linalg.norm(r[:, None, :] - nuclei[None, :, :], axis=-1)
    energy = energy - jnp.sum(z / r_ae)
    a, b = jnp.triu_indices(z.shape[0], 1)
    energy = energy + jnp.sum(z[a] * z[b] / jnp.linalg.norm(nuclei[a] - nuclei[b], axis=-1))
    return energy.astype(r.dtype)


def value_laplacian_gradient(
    f: Callable[[jax.Array], jax.Array], x: jax.Array, laplacian: str, sparsity_threshold: float | int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Value, Laplacian and gradient of a real ``f`` of a flat ``x``, whose output may have a trailing axis (Re, Im).

    ``laplacian`` as :func:`local_energy`'s; on a TPU at float32's accuracy (``_numerics.accurate``).
    """

    def by_folx(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        out = folx.forward_laplacian(f, sparsity_threshold=sparsity_threshold)(x)
        # folx puts the input axis first in the dense Jacobian: (d,) or (d, 2). Its derivatives in x's dtype, as
        # jax.grad's (folx keeps the dtype a constant of f promoted them to: float64 from float32 walkers).
        return out.x, out.laplacian.astype(x.dtype), out.jacobian.dense_array.astype(x.dtype)

    def by_jvp(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        # jax.grad for a scalar f: jacrev's vmap over a single cotangent made the JVP loop 1.6 times slower
        # (benchmarks/RESULTS.md, "its JVP-loop Laplacian"); jacrev for the (Re, Im) pair of a complex log psi
        grad_f = jax.grad(f) if jax.eval_shape(f, x).shape == () else jax.jacrev(f)  # (d,) or (2, d)
        grad, grad_jvp = jax.linearize(grad_f, x)
        eye = jnp.eye(x.shape[0], dtype=x.dtype)
        zero = jnp.zeros(grad.shape[:-1], x.dtype)
        lap = jax.lax.fori_loop(0, x.shape[0], lambda i, acc: acc + grad_jvp(eye[i])[..., i], zero)
        return f(x), lap, jnp.moveaxis(grad, -1, 0)

    method = {"folx": by_folx, "jvp": by_jvp}[resolved_laplacian(laplacian)]
    return accurate(method)(x)


def kinetic_energy(
    log_psi: Callable[..., Any],
    params: Any,
    r: Any,
    *,
    laplacian: str = "auto",
    sparsity_threshold: float | int = 0,
) -> jax.Array:
    """``-1/2 (lap log psi + grad log psi . grad log psi)`` of ONE walker.

    Args:
        log_psi: ``log_psi(params, r)`` of one walker, real or complex.
        params: its parameters.
        r: the walker's positions (any shape), or a :class:`shardvmc.mcmc.Walker`.
        laplacian: ``"auto"`` (the fastest: folx's), ``"folx"`` (forward Laplacian) or ``"jvp"`` (see the module).
        sparsity_threshold: folx's option: propagate sparse Jacobians while the non-zero
            entries are at most this many (a number above 1) or this fraction (between 0 and
            1; folx recommends about 0.6); 0 keeps them dense. ``"folx"`` only.

    Returns:
        A scalar: real for a real ``log psi``, complex for a complex one.

    Example:
        >>> import jax.numpy as jnp
        >>> from shardvmc.hamiltonian import kinetic_energy
        >>> float(kinetic_energy(lambda p, r: -0.5 * jnp.sum(r**2), None, jnp.zeros((2, 3))))   # 3-D oscillator
        3.0
    """
    if laplacian not in LAPLACIANS:
        raise CallError(
            message(
                "shardvmc.hamiltonian.kinetic_energy",
                f"laplacian={laplacian!r} is not a known method.",
                expected=str(LAPLACIANS),
            )
        )
    x = float_positions(r.r if isinstance(r, Walker) else r)  # (integer positions: as floats, as the sampler's)
    shape = x.shape
    value = jax.eval_shape(lambda y: log_psi_value(log_psi, params, y, "shardvmc.hamiltonian"), x)  # one number
    is_complex = jnp.iscomplexobj(value)

    def f(flat: jax.Array) -> jax.Array:
        value = log_psi(params, flat.reshape(shape))
        # folx and jax.linearize take real functions: a complex value as its (Re, Im) parts
        return jnp.stack([jnp.real(value), jnp.imag(value)]) if is_complex else value

    _, lap, grad = value_laplacian_gradient(f, x.reshape(-1), laplacian, sparsity_threshold)
    if is_complex:
        lap = jax.lax.complex(lap[0], lap[1])
        grad = jax.lax.complex(grad[..., 0], grad[..., 1])
    return -0.5 * (lap + jnp.sum(grad * grad))


def local_energy(
    log_psi: Callable[..., Any],
    potential: Callable[[jax.Array], jax.Array] | None = None,
    *,
    laplacian: str = "auto",
    sparsity_threshold: float | int = 0,
    mesh: Mesh | None = None,
    axis_name: str | tuple[str, ...] = "walkers",
    batch_size: int | str | None = None,
) -> WalkerParallel:
    """The local energy ``H psi / psi`` as a walker-parallel kernel ``energy(params, r) -> E_L``.

    Args:
        log_psi: ``log_psi(params, r)`` of ONE walker, real ``log|psi|`` or complex ``log psi``.
        potential: ``potential(r)`` of one walker's positions, e.g. built on :func:`coulomb`;
            ``None``: no potential. Computed at float32's accuracy on a TPU, as the kinetic energy.
        laplacian: ``"auto"`` (default: the fastest, folx's), ``"folx"`` or ``"jvp"``; see the module.
        sparsity_threshold: folx's sparse-Jacobian threshold (0: dense); see :func:`kinetic_energy`.
        mesh: the kernel's mesh (``None``: resolved at each call).
        axis_name: the walker axis (or axes) of the mesh.
        batch_size: each device's walkers this many at a time (bounds the Laplacian's memory),
            or ``"auto"``; ``walker_parallel``'s option.

    Returns:
        A :class:`~shardvmc.WalkerParallel` kernel ``energy(params, r)``: ``params``
        ``Replicated``, ``r`` the walkers' positions (walker axis first) or a set of
        :class:`shardvmc.mcmc.Walker` (a sampler state's ``walkers``); it returns one local
        energy per walker (a :class:`~shardvmc.WalkerSet` when the walkers came as one).
        Inside another walker-parallel body, ``energy(params, r)`` is that walker's.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> oscillator = lambda p, r: -0.5 * jnp.sum(r**2)          # its ground state: E_L = 3/2 per particle
        >>> energy = sv.hamiltonian.local_energy(oscillator, lambda r: 0.5 * jnp.sum(r**2))
        >>> e = energy(None, jax.random.normal(jax.random.key(0), (10, 2, 3)))
        >>> bool(jnp.allclose(e, 3.0))
        True
    """
    if laplacian not in LAPLACIANS:
        raise CallError(
            message(
                "shardvmc.hamiltonian.local_energy",
                f"laplacian={laplacian!r} is not a known method.",
                expected=str(LAPLACIANS),
            )
        )

    def energy(params: Replicated[Any], r: PerWalker[Any]) -> PerWalker[jax.Array]:
        x = float_positions(r.r if isinstance(r, Walker) else r)
        e = kinetic_energy(log_psi, params, x, laplacian=laplacian, sparsity_threshold=sparsity_threshold)
        if potential is None:
            return e
        shape = jax.eval_shape(potential, x).shape
        if shape != ():  # (broadcast against the kinetic energy, it would raise a bare shape error or broadcast)
            raise CallError(
                message(
                    "shardvmc.hamiltonian.local_energy",
                    "potential(r) must return one number for one walker.",
                    got=f"an array of shape {shape} for a walker's positions of shape {x.shape}",
                    expected="shape (): the walker's potential energy",
                    fix="sum the per-particle terms (e.g. jnp.sum(...)), or build it on sv.hamiltonian.coulomb",
                )
            )
        return e + accurate(potential)(x)

    energy.__qualname__ = "local_energy"
    return walker_parallel(mesh=mesh, axis_name=axis_name, batch_size=batch_size)(energy)
