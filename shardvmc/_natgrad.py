"""Natural gradient (stochastic reconfiguration) on walker-sharded Jacobians, with a memory plan.

Every method solves the same damped least-squares problem. With the ``N`` valid walkers,
``Jc = (J - mean J) / sqrt(N)`` and ``ec = (e - mean e) / sqrt(N)``::

    update = (Jc^H Jc + damping I)^-1 Jc^H ec  =  Jc^H (Jc Jc^H + damping I)^-1 ec

(the second form by the push-through identity). ``dense`` solves the first, P x P,
form; ``minsr`` and ``spring`` the second, N x N, form (Chen & Heyl 2023; Goldshlager et
al. 2024); ``cg`` the first form matrix-free. See ``docs/optimisation.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _compat
from ._caches import bounded
from ._cholesky import spd_solve
from ._errors import CallError, describe, message
from ._memory import compiled_memory, device_memory_budget, format_bytes
from ._mesh import call_mesh, entered_mesh, mesh_of_arrays, onto_mesh, traced_mesh_error
from ._placement import pad_n_walkers, pad_walker
from ._reductions import gram_of_rows, jtv, walker_mean
from ._stats import local_indices, masked, rmatvec
from ._walkerset import check_n_valid, split_walker_set, walker_count

__all__ = [
    "METHODS",
    "NaturalGradientInfo",
    "NaturalGradientMemory",
    "estimate_bytes",
    "natural_gradient",
    "natural_gradient_memory",
]

METHODS = ("dense", "minsr", "spring", "cg")
"""The solvers of :func:`natural_gradient` (``"auto"`` picks one of them)."""

_WHERE = "natural_gradient"
_AUTO_CHUNKS = (1, 4, 16, 64)
_MAX_DEVICES = 4096  # natural_gradient_memory looks for a device count up to this one


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["iterations", "residual"],
    meta_fields=["method", "reason", "chunks", "planned_bytes", "budget_bytes", "n_params"],
)
@dataclasses.dataclass(frozen=True)
class NaturalGradientInfo:
    """What :func:`natural_gradient` did (a pytree: the two arrays are its leaves).

    Attributes:
        method: the solver that ran: ``"dense"``, ``"minsr"``, ``"spring"`` or ``"cg"``.
        reason: why that solver (the caller's choice, or ``method="auto"``'s reasoning).
        chunks: parameter slices the N x N matrix was accumulated over (minsr, spring).
        planned_bytes: per-device bytes of the compiled solver (arguments + outputs +
            temporaries), checked against ``budget_bytes`` before it ran.
        budget_bytes: the per-device memory budget.
        n_params: P, the number of parameters.
        iterations: CG iterations used (0 for the direct solvers).
        residual: relative residual ``|A x - b| / |b|`` of the system solved.
    """

    method: str
    reason: str
    chunks: int
    planned_bytes: int
    budget_bytes: int
    n_params: int
    iterations: jax.Array
    residual: jax.Array


@dataclasses.dataclass(frozen=True)
class _Config:
    """Everything static about one solver program."""

    method: str
    chunks: int
    real: bool
    solver: str
    maxiter: int
    has_previous: bool
    jacobi: bool = True  # CG: diagonal preconditioner
    all_valid: bool = False  # no padding walkers: the reductions need no mask (no masked copy of J)


# ----------------------------------------------------------------------------- the pieces


def _centred(x: jax.Array, mean: jax.Array, scale: jax.Array) -> jax.Array:
    """``(x - mean) * scale``: the one centring of the walker data (``scale = 1/sqrt(N)``)."""
    return (x - mean) * scale.astype(x.real.dtype)


def _local_rows(axis: str, j_loc: jax.Array, e_loc: jax.Array, mu: Any, emean: Any, count: Any) -> tuple[Any, Any]:
    """Inside a ``shard_map``: this device's centred rows ``(n_local R, P)`` and energies ``(n_local R,)``.

    Padding walkers' rows are zero (they enter no product).
    """
    n_local, r, p = j_loc.shape
    mask = local_indices(axis, n_local) < count
    scale = jax.lax.rsqrt(count.astype(j_loc.real.dtype))
    jc = masked(_centred(j_loc, mu, scale), mask).reshape(n_local * r, p)
    return jc, masked(_centred(e_loc, emean, scale), mask).reshape(n_local * r)


def _rows(j: jax.Array, e: jax.Array, real: bool) -> tuple[jax.Array, jax.Array]:
    """``(N, R, P)`` rows and ``(N, R)`` energies: ``R = 2`` (real, imaginary) for real parameters of a complex J.

    For real parameters the system is ``Re(Jc^H Jc) x = Re(Jc^H ec)``, which is the real
    least-squares problem with the real and imaginary parts of each walker's row as two
    rows: ``[Re Jc; Im Jc] x ~ [Re ec; Im ec]``.
    """
    if real:
        if jnp.iscomplexobj(j):
            return jnp.stack([j.real, j.imag], axis=1), jnp.stack([e.real, jnp.imag(e)], axis=1).astype(j.real.dtype)
        return j[:, None, :], jnp.real(e)[:, None].astype(j.dtype)
    dtype = jnp.result_type(j.dtype, e.dtype)
    return j[:, None, :].astype(dtype), e[:, None].astype(dtype)


def _solve(t: jax.Array, damping: Any, unused: jax.Array, b: jax.Array, solver: str, rcond: Any) -> jax.Array:
    """``(t + damping I)^-1 b`` for Hermitian positive semi-definite ``t``, replicated.

    ``unused`` rows (padding walkers) get 1 on the diagonal so the matrix stays
    invertible; their right-hand side is 0, so their solution is 0.
    """
    diag = damping + unused.astype(t.real.dtype)
    if solver == "eigh":
        w, v = jnp.linalg.eigh(t + jnp.diag(unused.astype(t.real.dtype)))
        keep = w > rcond * jnp.max(w)
        inv = jnp.where(keep, 1.0 / jnp.where(keep, w + damping, 1.0), 0.0)
        return v @ (inv * (jnp.conj(v).T @ b))
    return spd_solve(t + jnp.diag(diag).astype(t.dtype), b)


def _relative_residual(a_x: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.linalg.norm(a_x - b) / jnp.maximum(jnp.linalg.norm(b), jnp.finfo(b.real.dtype).tiny)


# ----------------------------------------------------------------------------- the solvers


def _dense(mesh: Mesh, axis: str, cfg: _Config, j: Any, e: Any, mu: Any, emean: Any, count: Any, s: Any) -> Any:
    """``(S + damping I)^-1 Jc^H ec`` with ``S = Jc^H Jc`` (P x P), replicated.

    One ``shard_map``: each device centres its rows and energies into one matrix
    ``[Jc | ec]``, written transposed (the centring copies the rows anyway), and multiplies
    it by itself (:func:`gram_of_rows`); one all-reduce adds the ``(P + 1)^2`` pieces, which
    hold ``S`` and ``Jc^H ec``.
    """
    p = j.shape[2]
    spec = PartitionSpec(axis)

    def body(j_loc: jax.Array, e_loc: jax.Array, mu: Any, emean: Any, count: Any) -> Any:
        jc, ec = _local_rows(axis, j_loc, e_loc, mu, emean, count)
        rows = jnp.concatenate([jc, ec[:, None].astype(jc.dtype)], axis=1)
        return jax.lax.psum(gram_of_rows(rows.T), axis)

    replicated = PartitionSpec()
    both = _compat.shard_map(body, mesh, (spec, spec) + (replicated,) * 3, replicated)(j, e, mu, emean, count)
    big_s, b = both[:p, :p], both[:p, p]
    x = _solve(big_s, s["damping"], jnp.zeros(p, bool), b, cfg.solver, s["rcond"])
    return x, jnp.zeros((), jnp.int32), _relative_residual(big_s @ x + s["damping"] * x, b)


def _sample_space(mesh: Mesh, axis: str, cfg: _Config, j: Any, e: Any, mu: Any, emean: Any, count: Any, s: Any) -> Any:
    """minSR / SPRING: ``Jc^H (Jc Jc^H + damping I)^-1 (ec - momentum Jc prev) + momentum prev``.

    The N x N matrix is built in one ``shard_map`` without gathering J: each parameter
    slice of the centred rows is re-sharded from walkers to parameters with one
    all-to-all, each device multiplies its (N, P/d) piece by its conjugate transpose,
    and one all-reduce adds the pieces. The solve is replicated; ``jtv`` maps the
    solution back (one all-reduce of size P).
    """
    n, r, p = j.shape
    d = _compat.axis_size(mesh, axis)
    block = _block_size(p, cfg.chunks, d)
    if block > p:  # fewer parameters than one block: pad them (small P only)
        j = jnp.pad(j, ((0, 0), (0, 0), (0, block - p)))
        mu_b = jnp.pad(mu, ((0, 0), (0, block - p)))
    else:
        mu_b = mu
    p_blocks = j.shape[2]
    n_blocks = -(-p_blocks // block)
    n_local = n // d
    m = n * r
    spec = PartitionSpec(axis)
    previous = s["previous"]
    momentum = s["momentum"] if cfg.method == "spring" else jnp.zeros((), j.real.dtype)

    def body(j_loc: jax.Array, e_loc: jax.Array, mu_b: jax.Array, emean: Any, count: Any) -> Any:
        mask = local_indices(axis, n_local) < count
        scale = jax.lax.rsqrt(count.astype(j_loc.real.dtype))
        rhs = masked(_centred(e_loc, emean, scale), mask)
        if cfg.has_previous:
            rhs = rhs - momentum * masked(_centred(j_loc[:, :, :p] @ previous, mu @ previous, scale), mask)
        rhs = jax.lax.all_gather(rhs.reshape(n_local * r), axis, tiled=True)

        def add_block(k: Any, t: jax.Array) -> jax.Array:
            # The last block overlaps the one before (padding J to whole blocks would copy it), and counts only its
            # new columns.
            start = jnp.minimum(k * block, p_blocks - block)
            fresh = start + jnp.arange(block) >= k * block
            rows = _centred(
                jax.lax.dynamic_slice_in_dim(j_loc, start, block, axis=2),
                jax.lax.dynamic_slice_in_dim(mu_b, start, block, axis=1),
                scale,
            )
            rows = jnp.where(mask[:, None, None] & fresh, rows, jnp.zeros((), rows.dtype)).reshape(n_local * r, block)
            rows = jax.lax.all_to_all(rows, axis, split_axis=1, concat_axis=0, tiled=True)  # (m, block / d)
            return t + rows @ jnp.conj(rows).T

        t = jax.lax.fori_loop(0, n_blocks, add_block, jnp.zeros((m, m), j_loc.dtype))
        return jax.lax.psum(t, axis), rhs

    t, rhs = _compat.shard_map(
        body, mesh, (spec, spec, PartitionSpec(), PartitionSpec(), PartitionSpec()), PartitionSpec()
    )(j, e, mu_b, emean, count)
    unused = jnp.arange(m) >= r * count
    y = _solve(t, s["damping"], unused, rhs, cfg.solver, s["rcond"])
    residual = _relative_residual(t @ y + s["damping"] * y, rhs)
    j_rows = j[:, :, :p].reshape(m, p)
    mapped = jtv(j_rows, y, None if cfg.all_valid else r * count, mesh=mesh, axis_name=axis)
    mapped = mapped - jnp.einsum("rp,r->p", jnp.conj(mu), y.reshape(n, r).sum(axis=0))  # the centring of Jc
    update = mapped * jax.lax.rsqrt(count.astype(mapped.real.dtype))
    if cfg.has_previous:
        update = update + momentum * previous
    return update, jnp.zeros((), jnp.int32), residual


def _cg(mesh: Mesh, axis: str, cfg: _Config, j: Any, e: Any, mu: Any, emean: Any, count: Any, s: Any) -> Any:
    """Jacobi-preconditioned CG on ``(Jc^H Jc + damping I) x = Jc^H ec``: one all-reduce of size P per step."""
    spec = PartitionSpec(axis)
    real_dtype = j.real.dtype

    def body(j_loc: jax.Array, e_loc: jax.Array, mu: Any, emean: Any, count: Any, damping: Any, tol: Any) -> Any:
        jc, ec = _local_rows(axis, j_loc, e_loc, mu, emean, count)
        b, diag = jax.lax.psum((rmatvec(jc, ec), jnp.sum(jnp.abs(jc) ** 2, axis=0)), axis)
        # The pseudo-inverse of the diagonal: a zero entry (damping=0 and a parameter J does not depend on)
        # is a zero row of S with a zero right-hand side; 0 there keeps CG off that direction, which gives
        # the minimum-norm solution, where 1 / 0 would make every entry NaN.
        shifted = diag + damping
        usable = shifted > jnp.finfo(real_dtype).tiny
        inverse = jnp.where(usable, 1.0 / jnp.where(usable, shifted, 1.0), 0.0)
        precondition = inverse if cfg.jacobi else jnp.ones((), real_dtype)

        def apply(v: jax.Array) -> jax.Array:
            return jax.lax.psum(rmatvec(jc, jc @ v), axis) + damping * v

        def dot(a: jax.Array, b: jax.Array) -> jax.Array:
            return jnp.real(jnp.vdot(a, b))

        b_norm = jnp.maximum(jnp.linalg.norm(b), jnp.finfo(real_dtype).tiny)
        z = precondition * b
        state = (jnp.zeros_like(b), b, z, dot(b, z), jnp.zeros((), jnp.int32))

        def going(state: Any) -> Any:
            _, res, _, _, it = state
            return (it < cfg.maxiter) & (jnp.linalg.norm(res) > tol * b_norm)

        def step(state: Any) -> Any:
            x, res, direction, rz, it = state
            a_dir = apply(direction)
            alpha = rz / dot(direction, a_dir)
            x = x + alpha * direction
            res = res - alpha * a_dir
            z = precondition * res
            rz_new = dot(res, z)
            return x, res, z + (rz_new / rz) * direction, rz_new, it + 1

        x, res, _, _, it = jax.lax.while_loop(going, step, state)
        return x, it, jnp.linalg.norm(res) / b_norm

    replicated = PartitionSpec()
    return _compat.shard_map(body, mesh, (spec, spec) + (replicated,) * 5, replicated)(
        j, e, mu, emean, count, s["damping"], s["tol"]
    )


_SOLVERS = {"dense": _dense, "minsr": _sample_space, "spring": _sample_space, "cg": _cg}


def _block_size(p: int, chunks: int, d: int) -> int:
    """Parameters per slice of the minSR matrix: ``ceil(P / chunks)`` rounded up to a multiple of ``d``."""
    per_chunk = -(-p // chunks)  # ceil: `chunks` slices cover all P
    # The tiled all-to-all hands each of the d devices an equal share of a slice's columns.
    return -(-per_chunk // d) * d


@bounded(32)
def _program(cfg: _Config, mesh: Mesh, axis: str, treedef: Any) -> Any:
    """The jitted solver: ``(leaves, e, count, scalars) -> (flat update, iterations, residual)``."""
    d = _compat.axis_size(mesh, axis)
    walker = NamedSharding(mesh, PartitionSpec(axis))
    replicated = NamedSharding(mesh, PartitionSpec())

    def run(leaves: tuple[jax.Array, ...], e: jax.Array, count: jax.Array, scalars: dict[str, Any]) -> Any:
        # The products at full float32 precision (read when each one is traced): a TPU's default, one bfloat16
        # pass, leaves the Gram matrices 1e-3 off, which a damped solve of condition 1e4 turns into 1e-2 in the
        # update (dense and minSR then disagree). No effect on CPUs and in float64.
        with jax.default_matmul_precision("highest"):
            return solve(leaves, e, count, scalars)

    def solve(leaves: tuple[jax.Array, ...], e: jax.Array, count: jax.Array, scalars: dict[str, Any]) -> Any:
        n = leaves[0].shape[0]
        j = leaves[0] if len(leaves) == 1 else jnp.concatenate([leaf.reshape(n, -1) for leaf in leaves], axis=1)
        j = j.reshape(n, -1)
        if n % d:
            (j, e), _ = pad_walker((j, e), pad_n_walkers(n, d))
        j, e = (_compat.constrain(x, walker) for x in (j, e))
        j, e = _rows(j, e, cfg.real)
        mu, emean = walker_mean((j, e), None if cfg.all_valid else count, mesh=mesh, axis_name=axis)
        scale = jax.lax.rsqrt(count.astype(j.real.dtype))
        scalars = dict(scalars, scale=scale)
        return _SOLVERS[cfg.method](mesh, axis, cfg, j, e, mu, emean, count, scalars)

    return jax.jit(run, out_shardings=replicated)


# ----------------------------------------------------------------------------- planning


def estimate_bytes(method: str, n: int, p: int, d: int, itemsize: int, *, rows: int = 1, chunks: int = 1) -> int:
    """The leading terms of a solver's per-device memory, in bytes (the formulas of ``docs/optimisation.md``).

    ``n`` walkers (padded), ``p`` parameters, ``d`` devices, ``itemsize`` bytes per
    element, ``rows`` per walker (2 for real parameters of a complex J). The compiled
    program's own figure is what :func:`natural_gradient` checks; this ranks candidates
    and names alternatives in errors without compiling them.

    Example:
        >>> from shardvmc._natgrad import estimate_bytes
        >>> estimate_bytes("minsr", 4096, 10**6, 8, 4) < estimate_bytes("cg", 4096, 10**6, 1, 4)
        True
    """
    m = n * rows
    shard = n // d * rows * p * itemsize  # one device's rows of J
    if method == "dense":
        return shard * 2 + 3 * p * p * itemsize
    if method in ("minsr", "spring"):
        block = _block_size(p, chunks, d)
        return 2 * shard + 2 * (n // d) * rows * block * itemsize + 3 * m * m * itemsize + 4 * p * itemsize
    if method == "cg":
        return shard * 2 + 8 * p * itemsize
    raise CallError(message("estimate_bytes", f"unknown method {method!r}.", expected=f"one of {METHODS}"))


@bounded(32)
def _compile(cfg: _Config, mesh: Mesh, axis: str, treedef: Any, signature: tuple[Any, ...]) -> Any:
    """Lower and compile the solver for abstract inputs: ``(compiled, CompiledMemory)``. Nothing runs."""
    leaf_avals, e_aval, real_dtype, p, out_dtype = signature
    walker = NamedSharding(mesh, PartitionSpec(axis))
    replicated = NamedSharding(mesh, PartitionSpec())
    n = leaf_avals[0][0][0]
    sharding = walker if n % _compat.axis_size(mesh, axis) == 0 else replicated
    leaves = tuple(jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) for shape, dtype in leaf_avals)
    e = jax.ShapeDtypeStruct(e_aval[0], e_aval[1], sharding=sharding)
    scalars: dict[str, jax.ShapeDtypeStruct | None] = {
        k: jax.ShapeDtypeStruct((), real_dtype, sharding=replicated) for k in ("damping", "momentum", "tol", "rcond")
    }
    scalars["previous"] = jax.ShapeDtypeStruct((p,), out_dtype, sharding=replicated) if cfg.has_previous else None
    count = jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated)
    compiled = _program(cfg, mesh, axis, treedef).lower(leaves, e, count, scalars).compile()
    return compiled, compiled_memory(compiled)


def _candidates(method: str, n: int, p: int, rows: int, chunks: int | None) -> list[tuple[str, int, str]]:
    """``(method, chunks, reason)`` in the order to try them."""
    if method != "auto":
        return [(method, chunks or 1, f"method={method!r} was asked for")]
    m = n * rows
    out: list[tuple[str, int, str]] = []
    sample = [
        ("minsr", c, f"N={m} < P={p}: the N x N sample-space system (minSR) is the smaller one"
         + ("" if c == 1 else f", accumulated over {c} parameter slices to fit the budget"))
        for c in ((chunks,) if chunks else _AUTO_CHUNKS)
    ]  # fmt: skip
    dense = [("dense", 1, f"P={p} <= N={m}: the P x P system (dense SR) is the smaller one")]
    out = dense + sample if p <= m else sample + dense
    out.append(("cg", 1, "no direct solver fits the memory budget: matrix-free CG (J never copied across devices)"))
    return out


@dataclasses.dataclass(frozen=True)
class NaturalGradientMemory:
    """A natural-gradient step's memory per device, estimated before anything compiles.

    What :func:`natural_gradient_memory` returns: one device's rows of the Jacobian as the
    step computes them (the per-walker ``d log|psi| / d params``) plus the solver's leading
    terms (:func:`estimate_bytes`, the formulas of ``docs/optimisation.md``), against the
    device's budget. :meth:`check` refuses a step that does not fit.

    Attributes:
        method: the solver (``"auto"`` resolved: the first candidate that fits, else the smallest).
        chunks: minSR/SPRING parameter slices (the fewest of 1, 4, 16, 64 that fit,
            unless given); pass it on as ``chunks=``.
        n_walkers: the walkers, padded to a multiple of ``devices``.
        devices: the devices along the walker axis.
        n_params: P, the number of parameters.
        itemsize: bytes per element of J (the parameters' dtype).
        jacobian_bytes: one device's rows of J: ``n_walkers / devices * P * itemsize``.
        solver_bytes: the solver's estimate, :func:`estimate_bytes`.
        budget_bytes: the bytes one device may use.
        max_walkers_per_device: when it does not fit, the most walkers per device that
            would on ``devices`` devices (0: not one); ``None`` when it fits.
        devices_needed: when it does not fit, the fewest devices that would hold the
            ``n_walkers`` (``None``: none up to 4096, or it fits).
    """

    method: str
    chunks: int
    n_walkers: int
    devices: int
    n_params: int
    itemsize: int
    jacobian_bytes: int
    solver_bytes: int
    budget_bytes: int
    max_walkers_per_device: int | None = None
    devices_needed: int | None = None

    @property
    def total_bytes(self) -> int:
        """The estimate per device: J's rows plus the solver's."""
        return self.jacobian_bytes + self.solver_bytes

    @property
    def fits(self) -> bool:
        """Whether the estimate is within the budget."""
        return self.total_bytes <= self.budget_bytes

    def check(self, fix: str = "") -> NaturalGradientMemory:
        """This plan when it fits; else a ``CallError`` with the bytes it needs and what would fit.

        Args:
            fix: the caller's own remedies, added to the message's fix (e.g. its options).

        Raises:
            CallError: when :attr:`fits` is false.
        """
        if self.fits:
            return self
        per_device = self.n_walkers // self.devices
        most = self.max_walkers_per_device or 0
        fixes = [f"at most {most} walkers per device fit: fewer walkers" if most else "not one walker per device fits"]
        fixes.append(
            f"{self.devices_needed} devices hold {self.n_walkers} walkers"
            if self.devices_needed
            else f"no device count up to {_MAX_DEVICES} holds {self.n_walkers} walkers"
        )
        others = _fitting(self.n_walkers, self.n_params, self.devices, self.itemsize, 1, self.budget_bytes,
                          self.jacobian_bytes)  # fmt: skip
        fixes += [f"pass {' or '.join(others)}"] if others else []
        fixes.append("KFAC (sv.kfac.KFAC) keeps per-layer factors, not J" + (f"; {fix}" if fix else ""))
        raise CallError(
            message(
                "natural_gradient_memory",
                f"{_label(self.method, self.chunks)} needs about {format_bytes(self.total_bytes)} per device, over "
                f"the budget of {format_bytes(self.budget_bytes)}.",
                got=f"{self.n_walkers} walkers ({per_device} per device, {self.devices} device(s)) x {self.n_params} "
                f"parameters of {self.itemsize} bytes: J's rows {format_bytes(self.jacobian_bytes)} + the "
                f"solver's {format_bytes(self.solver_bytes)} (estimate_bytes)",
                fix="; ".join(fixes) + ".",
            )
        )


def natural_gradient_memory(
    n_walkers: int,
    params: Any,
    *,
    method: str = "auto",
    devices: int | None = None,
    chunks: int | None = None,
    memory_budget: int | None = None,
) -> NaturalGradientMemory:
    """A natural-gradient step's memory per device, from the sizes alone: nothing is traced or compiled.

    For a step that computes every walker's row of ``J = d log|psi| / d params`` and
    solves with :func:`natural_gradient`: one device's rows of J (``n_walkers / devices``
    x P x the parameters' itemsize) plus the solver's leading terms, :func:`estimate_bytes`.
    ``natural_gradient`` checks its compiled solver against the budget when it is traced;
    this answers before the step's first compilation (and for devices you do not have).

    Args:
        n_walkers: the walkers of a step (padded to a multiple of ``devices``).
        params: the parameters: a pytree of arrays or ``jax.ShapeDtypeStruct`` (e.g. from
            ``jax.eval_shape`` of the initialisation, which compiles nothing).
        method: ``"auto"``, ``"dense"``, ``"minsr"``, ``"spring"`` or ``"cg"``.
        devices: the devices along the walker axis; default ``jax.device_count()``.
        chunks: minSR/SPRING parameter slices; ``None``: the fewest of 1, 4, 16, 64 that fit.
        memory_budget: bytes one device may use; default ``device_memory_budget()`` (the
            first local device's limit, or on CPU half the host's RAM over the local devices).

    Returns:
        A :class:`NaturalGradientMemory`; ``.check()`` raises when it does not fit.

    Raises:
        CallError: an unknown method, or parameters without floating-point leaves.

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> params = {"w": jax.ShapeDtypeStruct((1000, 700), jnp.float32)}
        >>> plan = sv.natural_gradient_memory(1024, params, method="minsr", devices=1, memory_budget=12 * 2**30)
        >>> plan.fits, plan.chunks, plan.jacobian_bytes == 1024 * 700_000 * 4
        (True, 4, True)
        >>> small = sv.natural_gradient_memory(1024, params, method="minsr", devices=1, memory_budget=2**30)
        >>> small.fits, small.max_walkers_per_device, small.devices_needed  # small.check() raises, naming these
        (False, 125, 9)
    """
    _check_options(method, "cholesky", chunks)
    # The leaves' own dtypes (jnp.result_type would read float64 as float32 outside jax.enable_x64).
    dtypes = [(x, np.dtype(getattr(x, "dtype", None) or np.result_type(x))) for x in jax.tree_util.tree_leaves(params)]
    leaves = [(x, dtype) for x, dtype in dtypes if jnp.issubdtype(dtype, jnp.inexact)]
    if not leaves:
        raise CallError(message("natural_gradient_memory", "params has no floating-point leaves.",
                                got=describe(params), fix="pass the parameters or their shapes."))  # fmt: skip
    p = sum(math.prod(np.shape(x)) for x, _ in leaves)
    itemsize = max(dtype.itemsize for _, dtype in leaves)
    d = jax.device_count() if devices is None else int(devices)
    budget = device_memory_budget() if memory_budget is None else int(memory_budget)

    def plan(per_device: int, d: int) -> tuple[int, int, str, int]:
        """``(total, solver bytes, method, chunks)`` at ``per_device`` walkers on ``d`` devices."""
        n, rows = per_device * d, per_device * p * itemsize
        if method == "auto":
            options = [(name, c) for name, c, _ in _candidates("auto", n, p, 1, chunks)]
        else:
            sweep = method in ("minsr", "spring") and chunks is None
            options = [(method, c) for c in (_AUTO_CHUNKS if sweep else (chunks or 1,))]
        costs = [(rows + s, s, name, c) for name, c in options for s in [estimate_bytes(name, n, p, d, itemsize,
                                                                                       chunks=c)]]  # fmt: skip
        return next((x for x in costs if x[0] <= budget), min(costs))

    per_device = -(-int(n_walkers) // d)
    total, solver, name, n_chunks = plan(per_device, d)
    most = needed = None
    if total > budget:  # the most walkers per device that fit (the bytes grow with them), the fewest devices
        low, high = 0, per_device
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if plan(mid, d)[0] <= budget else (low, mid - 1)
        most = low
        more = (k for k in range(d + 1, _MAX_DEVICES + 1) if plan(-(-int(n_walkers) // k), k)[0] <= budget)
        needed = next(more, None)
    return NaturalGradientMemory(name, n_chunks, per_device * d, d, p, itemsize, total - solver, solver, budget,
                                 most, needed)  # fmt: skip


def natural_gradient(
    J: Any,
    e: Any,
    *,
    n_valid: Any = None,
    damping: float,
    method: str = "auto",
    momentum: float = 0.0,
    previous: Any = None,
    real_params: bool = False,
    solver: str = "cholesky",
    rcond: float = 1e-10,
    tol: float = 1e-6,
    maxiter: int = 200,
    precondition: bool | None = None,
    chunks: int | None = None,
    memory_budget: int | None = None,
    mesh: Mesh | None = None,
    axis_name: str = "walkers",
) -> tuple[Any, NaturalGradientInfo]:
    """The natural-gradient (SR) update from walker-sharded log-derivatives and local energies.

    Solves, over the ``N`` valid walkers, with ``Jc = (J - mean J) / sqrt(N)`` and
    ``ec = (e - mean e) / sqrt(N)``::

        update = (Jc^H Jc + damping I)^-1 Jc^H ec = Jc^H (Jc Jc^H + damping I)^-1 ec

    and the caller steps ``params -= lr * update`` (the energy gradient is
    ``2 Re Jc^H ec``; the factor 2 is left to the learning rate). J is never gathered
    on one device. Before running, the chosen solver is compiled for abstract inputs and
    its per-device bytes are checked against the budget.

    Methods (``docs/optimisation.md`` says which when, and what each needs per device):

    - ``"dense"``: ``S = Jc^H Jc`` (P x P) from ``sv.jtj``, solved on every device. Small P.
    - ``"minsr"``: ``T = Jc Jc^H`` (N x N) built without gathering J (all-to-all re-shard
      to parameter slices, local products, one all-reduce), solved replicated, mapped
      back by ``sv.jtv``. P much larger than N.
    - ``"spring"``: minSR with momentum (Goldshlager et al. 2024):
      ``update = Jc^H (T + damping I)^-1 (ec - momentum Jc prev) + momentum prev``, the
      minimiser of ``|ec - Jc x|^2 + damping |x - momentum prev|^2``; pass the previous
      update as ``previous`` (``None`` on the first step) and carry the result.
    - ``"cg"``: Jacobi-preconditioned conjugate gradients on ``(S + damping I) x = Jc^H ec``,
      matrix-free: one all-reduce of size P per iteration; ``tol`` (relative residual)
      and ``maxiter``.
    - ``"auto"``: dense when P <= N, else minSR (with more parameter ``chunks`` when one
      pass does not fit), else CG; ``info.reason`` says why.

    Args:
        J: the per-walker log-derivative rows: an ``(N, P)`` array, or a pytree whose
            leaves are ``(N, ...)`` (e.g. ``jax.vmap(jax.grad(log_psi), (None, 0))``),
            walker-sharded, or a ``sv.WalkerSet`` of them.
        e: the local energies, ``(N,)``, walker-sharded (or a ``sv.WalkerSet``).
        n_valid: the number of real walkers (the first ones; the rest is padding and
            never enters, even as NaN). Read from ``WalkerSet`` arguments when omitted.
        damping: the diagonal shift (> 0 for the Cholesky solves; 0 allowed with
            ``solver="eigh"`` or ``method="cg"``).
        method: ``"auto"``, ``"dense"``, ``"minsr"``, ``"spring"`` or ``"cg"``.
        momentum: SPRING's ``mu`` (``method="spring"`` only).
        previous: SPRING's previous update (J's parameter structure); ``None``: zeros.
        real_params: the parameters are real while J is complex (a complex
            wavefunction of real parameters): solve the real system
            ``(Re Jc^H Jc + damping) x = Re Jc^H ec`` and return a real update. This
            is not the real part of the complex solution. ``False``: a complex J gives
            the complex update of complex (holomorphic) parameters.
        solver: ``"cholesky"`` or ``"eigh"`` (dense, minsr, spring): ``eigh`` drops
            eigenvalues of ``S`` or ``T`` below ``rcond`` times the largest.
        rcond: the relative eigenvalue cutoff of ``solver="eigh"``.
        tol: CG's relative residual target.
        maxiter: CG's iteration limit.
        precondition: CG with the Jacobi (diagonal) preconditioner ``diag(S) + damping``
            (inverted where non-zero; a zero entry, a parameter J does not depend on
            with ``damping=0``, keeps that entry of the update 0, the minimum-norm
            solution); ``None``: only when P <= N. When P > N the right-hand side lies in the
            N-dimensional range of ``Jc^H``, where plain CG stays, while a diagonal
            scaling mixes in the null space of ``S``, whose eigenvalue is only
            ``damping``: a small residual then hides a large error.
        chunks: minSR/SPRING: build ``T`` over this many slices of the parameters
            (less memory per device, the same result); ``None``: 1, or the fewest of
            1, 4, 16, 64 that fit under ``method="auto"``.
        memory_budget: bytes one device may use; default the device's limit
            (``memory_stats()["bytes_limit"]``), or on CPU half the host's RAM over
            the local device count (``shardvmc._memory.device_memory_budget``).
        mesh: the mesh; defaults to the ``use_mesh`` one, else all devices.
        axis_name: the walker axis of ``mesh``.

    Returns:
        ``(update, info)``: the update, replicated, with J's parameter structure (a
        ``(P,)`` array for an ``(N, P)`` J; each leaf without its walker axis for a
        pytree), and a :class:`NaturalGradientInfo`.

    Raises:
        CallError: on inputs that do not fit (shapes, ``n_valid``, disagreeing
            ``WalkerSet`` counts, an unknown method), and when the solver's compiled
            memory exceeds the budget (naming a method or chunking that fits).

    Example:
        >>> import jax, jax.numpy as jnp, shardvmc as sv
        >>> J = sv.shard_walker(jax.random.normal(jax.random.key(0), (64, 200)))
        >>> e = sv.shard_walker(jax.random.normal(jax.random.key(1), (64,)))
        >>> update, info = sv.natural_gradient(J, e, damping=1e-3)
        >>> update.shape, info.method, update.sharding.is_fully_replicated
        ((200,), 'minsr', True)
        >>> dense, _ = sv.natural_gradient(J, e, damping=1e-3, method="dense")
        >>> bool(jnp.allclose(update, dense, atol=1e-3))
        True
    """
    J, n_j = split_walker_set(J)
    mesh, axes, enter = call_mesh(_mesh_of(J, mesh, axis_name), axis_name, _WHERE)
    # Inside another library's mesh the walkers are split over all of its axes, a tuple that JAX's
    # collectives take as one axis name.
    axis_name = cast(str, axes)
    if enter is not None:
        with entered_mesh(enter):
            J, e = onto_mesh(enter, (J, e))
            return natural_gradient(J, e, damping=damping, n_valid=n_valid, method=method, solver=solver,
                                    maxiter=maxiter, tol=tol, rcond=rcond, precondition=precondition,
                                    real_params=real_params,
                                    momentum=momentum, previous=previous, chunks=chunks, memory_budget=memory_budget,
                                    mesh=enter, axis_name=axis_name)  # fmt: skip
    # Three phases: check the arguments, plan (the first solver whose compiled program fits the budget), solve.
    problem = _check(J, e, n_j, n_valid, method, solver, chunks, damping, previous, real_params, mesh, axis_name)
    cfg, compiled, mem, reason, budget = _plan(problem, method, solver, maxiter, chunks, precondition, memory_budget)
    scalars = {"damping": damping, "momentum": momentum, "tol": tol, "rcond": rcond, "previous": previous}
    flat, iterations, residual = _solve_problem(problem, cfg, compiled, scalars)
    update = _unflatten(flat, problem.leaves, problem.treedef)
    info = NaturalGradientInfo(
        method=cfg.method,
        reason=reason,
        chunks=cfg.chunks,
        planned_bytes=mem.total_bytes,
        budget_bytes=budget,
        n_params=problem.p,
        iterations=iterations,
        residual=residual,
    )
    return update, info


@dataclasses.dataclass(frozen=True)
class _Problem:
    """A checked call of :func:`natural_gradient`: J's leaves and e (padded to the mesh when concrete), the sizes."""

    leaves: list[Any]
    treedef: Any
    e: Any
    count: Any  # the valid walkers (an int, or traced)
    n: int  # J's rows, padding included
    n_pad: int  # the rows padded to a multiple of the device count
    p: int  # parameters
    d: int  # devices along the walker axis
    rows: int  # rows per walker: 2 for real parameters of a complex J
    real: bool  # the real system
    real_dtype: Any
    out_dtype: Any
    has_previous: bool
    all_valid: bool  # no padding walkers
    concrete: bool  # no tracers among J, e and the count
    mesh: Mesh
    axis_name: str


def _check(
    J: Any, e: Any, n_j: int | None, n_valid: Any, method: str, solver: str, chunks: Any, damping: Any,
    previous: Any, real_params: bool, mesh: Mesh, axis_name: str,
) -> _Problem:  # fmt: skip
    """Phase 1 of :func:`natural_gradient`: every check of its arguments (a ``CallError`` naming the first that
    fails), and the problem's sizes and dtypes."""
    d = _compat.axis_size(mesh, axis_name)
    e, n_e = split_walker_set(e)
    n_valid = _agree_n_valid(n_valid, n_j, n_e)
    _check_options(method, solver, chunks)
    leaves, treedef = jax.tree_util.tree_flatten(J)
    for what, leaf in [*(("J", leaf) for leaf in leaves), ("e", e)]:
        error = traced_mesh_error(_WHERE, what, leaf, mesh)
        if error is not None:
            raise error
    n = _check_shapes(leaves, J, e)
    check_n_valid(_WHERE, n_valid, n)
    _check_damping(damping, method, solver)
    count = n if n_valid is None else n_valid
    j_dtype = jnp.result_type(*leaves)
    real = bool(real_params) or not (jnp.iscomplexobj(np.empty(0, j_dtype)) or jnp.iscomplexobj(e))
    rows = 2 if real_params and jnp.issubdtype(j_dtype, jnp.complexfloating) else 1
    real_dtype = jnp.finfo(j_dtype).dtype if jnp.issubdtype(j_dtype, jnp.inexact) else jnp.result_type(float)
    out_dtype = real_dtype if real else jnp.result_type(j_dtype, jnp.result_type(e), real_dtype)
    p = sum(math.prod(np.shape(leaf)[1:]) for leaf in leaves)
    n_pad = pad_n_walkers(n, d)
    if previous is not None and method != "spring":
        raise CallError(
            message(_WHERE, "previous= is SPRING's momentum state.", fix="pass method='spring', or drop previous=.")
        )
    all_valid = n_valid is None and n % d == 0
    concrete = not any(isinstance(x, Tracer) for x in [*leaves, e, count])
    if concrete and n % d:  # pad once here, so the arguments can be placed walker-sharded
        (leaves, e), _ = pad_walker((list(leaves), e), n_pad)
        n = n_pad
    return _Problem(list(leaves), treedef, e, count, n, n_pad, p, d, rows, real, real_dtype, out_dtype,
                    previous is not None, all_valid, concrete, mesh, axis_name)  # fmt: skip


def _check_options(method: str, solver: str, chunks: Any) -> None:
    if method != "auto" and method not in METHODS:
        raise CallError(
            message(_WHERE, f"unknown method {method!r}.", expected=f"'auto' or one of {METHODS}", fix="pick one.")
        )
    if solver not in ("cholesky", "eigh"):
        raise CallError(
            message(_WHERE, f"unknown solver {solver!r}.", expected="'cholesky' or 'eigh'", fix="pick one.")
        )
    if chunks is not None and (not isinstance(chunks, int) or chunks < 1):
        raise CallError(
            message(_WHERE, "chunks must be a positive int or None.", got=repr(chunks), fix="pass e.g. chunks=4.")
        )


def _plan(
    problem: _Problem, method: str, solver: str, maxiter: int, chunks: int | None, precondition: bool | None,
    memory_budget: int | None,
) -> tuple[_Config, Any, Any, str, int]:  # fmt: skip
    """Phase 2 of :func:`natural_gradient`: the first candidate solver whose compiled program fits the per-device
    budget: ``(config, compiled, its memory, reason, budget)``; a ``CallError`` naming one that fits if none does."""
    pr = problem
    signature = (
        tuple((tuple(np.shape(leaf)), jnp.result_type(leaf)) for leaf in pr.leaves),
        ((np.shape(pr.e)[0],), jnp.result_type(pr.e)),
        pr.real_dtype,
        pr.p,
        pr.out_dtype,
    )
    budget = int(memory_budget) if memory_budget is not None else device_memory_budget(pr.mesh.devices.flat[0])
    itemsize = np.dtype(pr.real_dtype).itemsize * (1 if pr.real else 2)
    jacobi = pr.p <= pr.n_pad * pr.rows if precondition is None else bool(precondition)
    tried: list[str] = []
    for name, n_chunks, reason in _candidates(method, pr.n_pad, pr.p, pr.rows, chunks):
        estimate = estimate_bytes(name, pr.n_pad, pr.p, pr.d, itemsize, rows=pr.rows, chunks=n_chunks)
        cfg = _Config(name, n_chunks, pr.real, solver, int(maxiter), pr.has_previous, jacobi, pr.all_valid)
        if method == "auto" and estimate > budget:
            tried.append(f"{_label(name, n_chunks)}: about {format_bytes(estimate)} estimated")
            continue
        compiled, mem = _compile(cfg, pr.mesh, pr.axis_name, pr.treedef, signature)
        if mem.total_bytes <= budget:
            return cfg, compiled, mem, reason, budget
        tried.append(f"{_label(name, n_chunks)}: {format_bytes(mem.total_bytes)} compiled")
    raise CallError(_budget_message(method, tried, budget, pr.n_pad, pr.p, pr.d, itemsize, pr.rows, pr.mesh, pr.leaves))


def _solve_problem(problem: _Problem, cfg: _Config, compiled: Any, given: dict[str, Any]) -> tuple[Any, Any, Any]:
    """Phase 3 of :func:`natural_gradient`: the planned program run: ``(flat update, iterations, residual)``."""
    pr = problem
    previous = given["previous"]
    scalars = {k: (None if v is None else jnp.asarray(v, pr.real_dtype)) for k, v in given.items() if k != "previous"}
    scalars["previous"] = None
    if cfg.has_previous:
        flat_prev = jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(previous)])
        if flat_prev.shape != (pr.p,):
            raise CallError(
                message(
                    _WHERE,
                    "previous does not have J's parameter structure.",
                    got=describe(previous),
                    expected=f"{pr.p} parameters in all",
                    fix="pass the update returned by the previous call.",
                )
            )
        scalars["previous"] = flat_prev.astype(pr.out_dtype)
    count_arr = jnp.asarray(pr.count, jnp.int32)
    # The compiled program takes no tracers: a traced damping, momentum, tol, rcond or previous (a schedule under
    # optax.inject_hyperparams in a jitted step) with concrete walker data is traced in with the caller's program.
    if pr.concrete and not any(isinstance(x, Tracer) for x in jax.tree_util.tree_leaves(scalars)):
        walker = NamedSharding(pr.mesh, PartitionSpec(pr.axis_name))
        replicated = NamedSharding(pr.mesh, PartitionSpec())
        args = (
            tuple(jax.device_put(leaf, walker) for leaf in pr.leaves),
            jax.device_put(pr.e, walker),
            jax.device_put(count_arr, replicated),
            jax.tree_util.tree_map(lambda x: jax.device_put(x, replicated), scalars),
        )
        return compiled(*args)
    return _program(cfg, pr.mesh, pr.axis_name, pr.treedef)(tuple(pr.leaves), pr.e, count_arr, scalars)


def _mesh_of(J: Any, mesh: Mesh | None, axis_name: str) -> Mesh | None:
    """The mesh to solve on: ``mesh``, else the one J lives on when nothing else names one (the solver runs there)."""
    if mesh is not None:
        return mesh
    return mesh_of_arrays(J, axis_name)


def _label(method: str, chunks: int) -> str:
    return method if method in ("dense", "cg") else f"{method} (chunks={chunks})"


def _agree_n_valid(n_valid: Any, *counts: int | None) -> Any:
    """The one walker count of ``n_valid=`` and the ``WalkerSet`` arguments; ``CallError`` when they disagree."""
    known = {c for c in counts if c is not None}
    if len(known) > 1:
        raise CallError(
            message(
                _WHERE,
                "J and e are WalkerSets with different valid counts.",
                got=f"n_valid {sorted(known)}",
                fix="pass the J and e of the same walkers.",
            )
        )
    if not known:
        return n_valid
    (count,) = known
    if n_valid is not None and not isinstance(n_valid, Tracer) and int(n_valid) != count:
        raise CallError(
            message(
                _WHERE,
                f"n_valid={int(n_valid)} disagrees with the WalkerSet's n_valid={count}.",
                fix="omit n_valid= (the WalkerSet carries the count), or pass the same count.",
            )
        )
    return count


def _check_shapes(leaves: list[Any], J: Any, e: Any) -> int:
    """The walker count N of J and e; ``CallError`` naming the shapes when they do not fit."""
    if not leaves:
        raise CallError(message(_WHERE, "J has no array leaves.", got=describe(J), fix="pass an (N, P) array."))
    n = walker_count(J, _WHERE, "J")
    for leaf in leaves:
        if np.ndim(leaf) < 1 or not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
            raise CallError(
                message(
                    _WHERE,
                    "J must hold floating-point (or complex) arrays with the walker axis first.",
                    got=describe(J),
                    fix="pass the log-derivatives as float arrays of shape (N, P) (or (N, ...) leaves).",
                )
            )
    if np.ndim(e) != 1 or np.shape(e)[0] != n:
        raise CallError(
            message(
                _WHERE,
                "e must hold one local energy per walker of J.",
                got=f"J {describe(J)}, e {describe(e)}",
                expected=f"e of shape ({n},)",
                fix="pass the per-walker local energies (a PerWalker output), not their mean.",
            )
        )
    return n


def _check_damping(damping: Any, method: str, solver: str) -> None:
    if isinstance(damping, Tracer):
        return
    value = float(damping)
    if value < 0 or (value == 0 and solver == "cholesky" and method != "cg"):
        raise CallError(
            message(
                _WHERE,
                f"damping={value} does not make the system positive definite.",
                expected="damping > 0 (0 only with solver='eigh' or method='cg')",
                fix="pass a small positive shift, e.g. damping=1e-3.",
            )
        )


def _fitting(n: int, p: int, d: int, itemsize: int, rows: int, budget: int, extra: int = 0) -> list[str]:
    """Each solver's first setting (fewest chunks) whose estimate plus ``extra`` bytes fits ``budget``, as arguments."""
    fits = []
    for name in METHODS:
        for chunks in _AUTO_CHUNKS if name in ("minsr", "spring") else (1,):
            if extra + estimate_bytes(name, n, p, d, itemsize, rows=rows, chunks=chunks) <= budget:
                fits.append(f"method={name!r}" + (f", chunks={chunks}" if chunks > 1 else ""))
                break
    return fits


def _budget_message(
    method: str, tried: list[str], budget: int, n: int, p: int, d: int, itemsize: int, rows: int, mesh: Mesh, J: Any
) -> str:
    """The error when no solver fits: what was tried, and a method or chunking that would fit."""
    fits = _fitting(n, p, d, itemsize, rows, budget)
    fix = (
        f"pass {' or '.join(fits)}" if fits else "use more devices (the per-device share of J shrinks as 1/d)"
    ) + ", or raise memory_budget= if the device has more memory."
    return message(
        _WHERE,
        f"no solver fits the per-device memory budget of {format_bytes(budget)} (method={method!r}).",
        got=f"J {describe(J)} on mesh {dict(mesh.shape)}; tried: " + "; ".join(tried),
        fix=fix,
    )


def _unflatten(flat: jax.Array, leaves: list[Any], treedef: Any) -> Any:
    """The flat ``(P,)`` update in J's structure, each leaf without its walker axis."""
    shapes = [tuple(np.shape(leaf)[1:]) for leaf in leaves]
    if len(shapes) == 1 and len(shapes[0]) == 1:
        return jax.tree_util.tree_unflatten(treedef, [flat])
    parts, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        parts.append(flat[start : start + size].reshape(shape))
        start += size
    return jax.tree_util.tree_unflatten(treedef, parts)
