"""Realistic per-walker programs (``tests/models``) through walker_parallel, against ``jax.vmap`` on one device.

First the programs themselves, on one device: every Laplacian method (folx dense and sparse,
jvp-of-grad in a Python loop, a ``scan`` and a ``fori_loop``) equals ``trace(jax.hessian)``,
and the wavefunctions are antisymmetric. Then the sharded checks, through the public API only:
per-walker local energies, their ``Mean`` and per-walker ``d log|psi| / d params`` equal the
``jax.vmap`` reference to ``rtol=1e-10`` in float64 on meshes of 1, 3 and 8 devices, with 13
walkers (padded inside the kernel), with the functions written both ways users write them
(annotated, and unmodified through ``replicated_args("params")``); once in float32 on a padded
set (against the float64 reference), and once with sparse-Jacobian folx in ``batch_size`` chunks.

float64 runs inside ``jax.enable_x64(True)`` contexts only, so the setting never leaks. Every
network, walker set, reference and kernel is built once per session (compile time dominates).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import warnings
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.flatten_util import ravel_pytree
from models import complex_wf, ferminet, hamiltonian, psiformer, systems
from models.systems import LI

import shardvmc as sv

N_WALKERS = 13  # divisible by none of the mesh sizes 3 and 8: the kernels pad
RTOL = 1e-10
F64, F32 = "float64", "float32"


@dataclasses.dataclass(frozen=True)
class Model:
    """A network of the corpus at test size, for the lithium atom."""

    init: Callable[[jax.Array, jnp.dtype], dict]
    log_psi: Callable[[dict, jax.Array], jax.Array]  # complex for the complex model
    log_abs_psi: Callable[[dict, jax.Array], jax.Array]
    signed_log_psi: Callable[[dict, jax.Array], tuple[jax.Array, jax.Array]] | None = None


MODELS = {
    "ferminet": Model(
        init=lambda key, dtype: ferminet.init(key, LI, hidden_one=16, hidden_two=8, layers=1, dtype=dtype),
        log_psi=lambda p, r: ferminet.log_psi(p, r, LI),
        log_abs_psi=lambda p, r: ferminet.log_psi(p, r, LI),
        signed_log_psi=lambda p, r: ferminet.signed_log_psi(p, r, LI),
    ),
    "psiformer": Model(
        init=lambda key, dtype: psiformer.init(key, LI, hidden=16, heads=2, layers=1, dtype=dtype),
        log_psi=lambda p, r: psiformer.log_psi(p, r, LI),
        log_abs_psi=lambda p, r: psiformer.log_psi(p, r, LI),
        signed_log_psi=lambda p, r: psiformer.signed_log_psi(p, r, LI),
    ),
    "complex": Model(
        init=lambda key, dtype: complex_wf.init(key, LI, hidden_one=16, hidden_two=8, layers=1, dtype=dtype),
        log_psi=lambda p, r: complex_wf.log_psi(p, r, LI),
        log_abs_psi=lambda p, r: complex_wf.log_abs_psi(p, r, LI),
    ),
}


def x64(dtype: str) -> contextlib.AbstractContextManager:
    """``jax.enable_x64`` on for float64, off for float32 (a context: nothing leaks out)."""
    return jax.enable_x64(dtype == F64)


def assert_close(got: np.ndarray, want: np.ndarray, rtol: float) -> None:
    """Elementwise ``rtol``, with entries near zero judged against the largest one."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=rtol, atol=rtol * float(np.max(np.abs(want))))


@functools.cache
def inputs(name: str, dtype: str) -> tuple[dict, jax.Array]:
    """Parameters of model ``name`` and 13 Li walkers, in ``dtype`` (float32: the float64 ones rounded)."""
    if dtype == F32:
        return jax.tree.map(lambda x: np.asarray(x, np.float32), inputs(name, F64))
    with x64(dtype):
        params = MODELS[name].init(jax.random.key(0), jnp.float64)
        walkers = systems.init_walkers(jax.random.key(1), LI, N_WALKERS, jnp.float64)
    return params, walkers


@functools.cache
def reference(name: str, method: str, dtype: str) -> dict[str, np.ndarray]:
    """``jax.vmap`` on one device: Laplacian, gradient and local energy of log psi for every walker."""
    model = MODELS[name]
    params, walkers = inputs(name, dtype)

    def one(p: dict, r: jax.Array) -> dict[str, jax.Array]:
        """The same arithmetic as ``hamiltonian.make_local_energy``, keeping the pieces."""
        lap, grad = hamiltonian.laplacian_and_gradient(
            lambda x: model.log_psi(p, x.reshape(r.shape)), r.ravel(), method
        )
        energy = hamiltonian.kinetic_from_derivatives(lap, grad) + hamiltonian.potential(r, LI)
        return {"lap": lap, "grad": grad, "energy": energy}

    with x64(dtype):
        out = jax.jit(jax.vmap(one, (None, 0)))(params, walkers)
    return jax.tree.map(np.asarray, out)


@functools.cache
def param_gradients(name: str, dtype: str) -> np.ndarray:
    """``jax.vmap`` on one device of the flattened ``d log|psi| / d params`` of every walker."""
    model = MODELS[name]
    params, walkers = inputs(name, dtype)
    with x64(dtype):
        grads = jax.vmap(lambda p, r: ravel_pytree(jax.grad(model.log_abs_psi)(p, r))[0], (None, 0))
        out = jax.jit(grads)(params, walkers)
    return np.asarray(out)


@pytest.fixture(autouse=True)
def _x64_does_not_leak() -> Iterator[None]:
    """Every test leaves ``jax_enable_x64`` as it found it (off: the other modules run in float32)."""
    before = jax.config.jax_enable_x64
    yield
    assert jax.config.jax_enable_x64 == before


# ---------------------------------------------------------------- the programs, on one device


def test_systems_are_consistent() -> None:
    for system in systems.SYSTEMS.values():
        assert system.n_electrons == round(sum(system.charges))  # neutral
        assert system.hf_energy is None or system.exact_energy < system.hf_energy < 0
        assert hash(system) == hash(dataclasses.replace(system))  # usable as a Static argument
    assert hamiltonian.nuclear_repulsion(systems.LIH) == pytest.approx(3.0 / 3.015)
    assert hamiltonian.nuclear_repulsion(LI) == 0.0


# (model, method, the method it must equal): every method against the Hessian's trace on FermiNet,
# and on the other models folx against a jvp-of-grad loop (one compile less than the Hessian each).
LAPLACIAN_CASES = [("ferminet", m, "hessian") for m in hamiltonian.METHODS if m != "hessian"] + [
    ("psiformer", "folx", "scan"),
    ("complex", "folx", "fori"),
]


@pytest.mark.parametrize(
    ("name", "method", "against"), LAPLACIAN_CASES, ids=[f"{n}-{m}-vs-{a}" for n, m, a in LAPLACIAN_CASES]
)
def test_laplacian_methods_agree(name: str, method: str, against: str) -> None:
    got, want = reference(name, method, F64), reference(name, against, F64)
    assert_close(got["lap"], want["lap"], RTOL)
    assert_close(got["grad"], want["grad"], RTOL)
    assert_close(got["energy"], want["energy"], RTOL)
    assert np.isfinite(got["energy"]).all()
    assert np.iscomplexobj(got["energy"]) == (name == "complex")


def test_complex_energy_is_the_amplitude_energy_shifted_by_the_phase() -> None:
    """``E = E_amp + n|k|^2/2 - i k . sum_i grad_i log|amp|`` for ``log psi = log|amp| + i k . sum r``."""
    params, walkers = inputs("complex", F64)
    amp = reference("complex", "folx", F64)  # the real part of the complex model is the amplitude
    got = amp["energy"]
    with x64(F64):
        amplitude = jax.vmap(hamiltonian.potential, (0, None))(walkers, LI)
        lap, grad = amp["lap"][:, 0], amp["grad"][..., 0]
        k = np.asarray(params["k"])
        e_amp = -0.5 * (lap + np.sum(grad**2, axis=-1)) + np.asarray(amplitude)
        want = e_amp + complex_wf.exact_kinetic_shift(params, LI) - 1j * grad.reshape(N_WALKERS, -1, 3).sum(1) @ k
    assert_close(got, np.asarray(want), RTOL)


@pytest.mark.parametrize(
    ("name", "system", "pair"),
    [("ferminet", LI, (0, 1)), ("psiformer", LI, (0, 1)), ("ferminet", systems.BE, (2, 3))],
    ids=["ferminet-Li-up", "psiformer-Li-up", "ferminet-Be-down"],
)
def test_exchanging_same_spin_electrons_flips_the_sign(name: str, system: systems.System, pair: tuple) -> None:
    module = {"ferminet": ferminet, "psiformer": psiformer}[name]
    with x64(F64):
        params = module.init(jax.random.key(0), system, dtype=jnp.float64) if system is not LI else inputs(name, F64)[0]
        r = systems.init_walkers(jax.random.key(2), system, 1, jnp.float64)[0]
        i, j = pair
        swapped = r.at[jnp.array([i, j])].set(r[jnp.array([j, i])])
        signed = jax.jit(jax.vmap(lambda r: module.signed_log_psi(params, r, system)))
        (sign, sign_swapped), (log_abs, log_abs_swapped) = signed(jnp.stack([r, swapped]))
    assert float(sign_swapped) == -float(sign) != 0
    np.testing.assert_allclose(log_abs_swapped, log_abs, rtol=1e-12)


# ---------------------------------------------------------------- sharded, through the public API


def annotated_kernel(name: str, method: str) -> sv.WalkerParallel:
    """The annotated way: energy per walker, its Mean, and ``d log|psi| / d params`` per walker."""
    model = MODELS[name]
    local_energy = hamiltonian.make_local_energy(model.log_psi, LI, method)

    @sv.walker_parallel
    def stats(
        params: sv.Replicated[dict], r: sv.PerWalker[jax.Array]
    ) -> tuple[sv.PerWalker[jax.Array], sv.Mean[jax.Array], sv.PerWalker[jax.Array]]:
        """Local energy of one walker (twice: per walker and averaged) and its parameter gradient."""
        energy = local_energy(params, r)
        return energy, energy, ravel_pytree(jax.grad(model.log_abs_psi)(params, r))[0]

    return stats


def plain_kernel(name: str, method: str) -> Callable[[dict, jax.Array], tuple]:
    """The unmodified way: a plain function through ``replicated_args("params")``; the Mean by ``walker_mean``."""
    model = MODELS[name]
    local_energy = hamiltonian.make_local_energy(model.log_psi, LI, method)

    def energy_and_gradient(params, r):
        """What a user writes, with no shardvmc in sight."""
        return local_energy(params, r), ravel_pytree(jax.grad(model.log_abs_psi)(params, r))[0]

    kernel = sv.walker_parallel(sv.replicated_args("params")(energy_and_gradient))

    def run(params: dict, r: jax.Array) -> tuple:
        """Energies and gradients per walker from the kernel, and the energies' mean."""
        energy, grads = kernel(params, r)
        return energy, sv.walker_mean(energy), grads

    return run


SHARDED = {
    "ferminet-folx-annotated": ("ferminet", "folx", annotated_kernel),
    "ferminet-scan-plain": ("ferminet", "scan", plain_kernel),
    "psiformer-folx-annotated": ("psiformer", "folx", annotated_kernel),
    "complex-folx-plain": ("complex", "folx", plain_kernel),
}


@functools.cache
def kernel(case: str) -> Callable:
    """The kernel of ``case``, built once (it compiles once per mesh)."""
    name, method, make = SHARDED[case]
    return make(name, method)


@contextlib.contextmanager
def padding_expected(n_devices: int) -> Iterator[None]:
    """Expect a ``PaddingWarning`` when the mesh does not divide the 13 walkers, and none otherwise."""
    if N_WALKERS % n_devices:
        with pytest.warns(sv.PaddingWarning):
            yield
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error", sv.PaddingWarning)
            yield


# Each case on the meshes that matter for it (every model compiles for each mesh): together they cover one
# device, a mesh that pads the 13 walkers (3) and one that pads more than it holds per device (8).
SHARDED_MESHES = [
    ("ferminet-folx-annotated", 3),
    ("ferminet-folx-annotated", 8),
    ("ferminet-scan-plain", 1),
    ("psiformer-folx-annotated", 3),
    ("complex-folx-plain", 8),
]


@pytest.mark.parametrize(("case", "n_devices"), SHARDED_MESHES, ids=[f"{c}-{n}dev" for c, n in SHARDED_MESHES])
def test_sharded_equals_vmap(case: str, n_devices: int) -> None:
    name, method, _ = SHARDED[case]
    params, walkers = inputs(name, F64)
    mesh = sv.create_mesh(jax.devices()[:n_devices])
    with x64(F64), sv.use_mesh(mesh), padding_expected(n_devices):
        energy, mean, grads = kernel(case)(params, walkers)
    ref = reference(name, method, F64)["energy"]
    assert energy.shape == (N_WALKERS,) and energy.dtype == ref.dtype
    assert_close(energy, ref, RTOL)
    assert_close(mean, np.mean(ref), RTOL)
    assert_close(grads, param_gradients(name, F64), RTOL)


def test_float32_unmodified_local_energy_on_a_padded_set() -> None:
    """The user's call: FermiNet's local energy (linearize + fori_loop) unmodified, float32, 8 devices.

    Against the float64 ``jax.vmap`` reference of the same (rounded) parameters and walkers: a
    float32 reference would cost one more compile and agree no better than float32 rounding.
    """
    params, walkers = inputs("ferminet", F32)
    local_energy = hamiltonian.make_local_energy(MODELS["ferminet"].log_psi, LI, "fori")
    energy_all = sv.walker_parallel(sv.replicated_args("params")(local_energy))
    mesh = sv.create_mesh(jax.devices()[:8])
    with sv.use_mesh(mesh), warnings.catch_warnings():
        warnings.simplefilter("error")  # an already padded set: no PaddingWarning
        padded, n_valid = sv.pad_walker(walkers, sv.pad_n_walkers(N_WALKERS, 8))
        energy = energy_all(params, sv.shard_walker(padded, mesh), n_valid=n_valid)
    assert energy.shape == (16,) and energy.dtype == jnp.float32
    assert_close(energy[:N_WALKERS], reference("ferminet", "fori", F64)["energy"], 2e-4)


def test_unmodified_sparse_folx_local_energy_in_batch_size_chunks() -> None:
    """FermiNet's sparse-Jacobian folx local energy, unmodified, a device's 5 walkers in chunks of 2 (2 + 2 + 1).

    The user's folx failure: with ``check_vma`` on, folx re-evaluated the ``pvary`` JAX put at
    ``jnp.eye(n)`` in the electron-electron distances outside ``shard_map`` and called ``exit()``.
    One mesh only: a chunked kernel compiles the chunk body and the remainder's.
    """
    params, walkers = inputs("ferminet", F64)
    local_energy = hamiltonian.make_local_energy(MODELS["ferminet"].log_psi, LI, "folx_sparse")
    energy_all = sv.walker_parallel(batch_size=2)(sv.replicated_args("params")(local_energy))
    with x64(F64), sv.use_mesh(sv.create_mesh(jax.devices()[:3])), padding_expected(3):
        energy = energy_all(params, walkers)
    assert_close(energy, reference("ferminet", "folx_sparse", F64)["energy"], RTOL)
