"""The accelerator set: what must hold on whatever backend runs the tests (``pytest -m accelerator``).

Every test here uses JAX's default devices, so it runs on a TPU or GPU when one is present
(``JAX_PLATFORMS=tpu,cpu python -m pytest -m accelerator -n 0``: one process holds the chip; without
pytest-xdist, ``-o addopts=""`` instead of ``-n 0``) and
on the fake CPU devices in CI. Numbers are checked against an oracle on the host's CPU:
local energies against float64, statistics against the same estimator on the CPU, the
small-matrix determinant against ``jnp.linalg`` in float64, kernels against ``jax.vmap``.
``benchmarks/RESULTS.md`` ("The accelerator test set") has the last run on a TPU.
"""

from __future__ import annotations

import functools

import folx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv

pytestmark = pytest.mark.accelerator

CPU = jax.devices("cpu")[0]
DEVICES = jax.devices()  # the default backend's: the accelerator when there is one
PLATFORM = DEVICES[0].platform


def _on(device, tree):
    return jax.tree_util.tree_map(lambda a: jax.device_put(a, device), tree)


@pytest.fixture(scope="module")
def mesh():
    return sv.create_mesh(DEVICES)


def _networks():
    """The templates' network (examples/network.py) and the corpus's (tests/models), Li, 256 walkers, float32."""
    import network
    from models import ferminet, hamiltonian, systems

    li = network.LI
    params = network.init(jax.random.key(10**6), li, 32, 8, 2, 4, jnp.float32)
    walkers = jax.vmap(lambda k: network.init_walker(k, li, jnp.float32))(jax.random.split(jax.random.key(1), 256))
    template = (
        functools.partial(network.log_psi, system=li),
        lambda r: sv.hamiltonian.coulomb(r, li.charges, li.coords),
    )
    corpus_params = ferminet.init(jax.random.key(0), systems.LI, hidden_one=32, hidden_two=8, layers=2, determinants=4)
    corpus = (
        lambda p, r: ferminet.log_psi(p, r, systems.LI),
        lambda r: hamiltonian.potential(r, systems.LI),
    )
    return {"template": (*template, params, walkers), "corpus": (*corpus, corpus_params, walkers)}


@pytest.mark.parametrize("network", ["template", "corpus"])
def test_local_energies_in_float32_match_float64_on_the_cpu(network):
    """``sv.hamiltonian.local_energy`` in float32 on the backend: errors against float64 like a CPU's in float32.

    At a TPU's defaults the median error was 10^4 times a CPU's (matrix products in one bfloat16
    pass, approximate exp/log/tanh); the median and 95th percentile of |error| are compared,
    the mean and rms being dominated by one or two walkers near a nucleus or a node.
    """
    log_psi, potential, params, walkers = _networks()[network]
    energy = sv.hamiltonian.local_energy(log_psi, potential, mesh=sv.create_mesh(DEVICES[:1]))
    with jax.enable_x64(True):
        reference = np.asarray(
            sv.hamiltonian.local_energy(log_psi, potential, mesh=sv.create_mesh([CPU]))(
                *_on(CPU, jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), (params, walkers)))
            )
        )
    on_cpu = np.asarray(sv.hamiltonian.local_energy(log_psi, potential, mesh=sv.create_mesh([CPU]))(params, walkers))
    with jax.default_matmul_precision(None if PLATFORM == "cpu" else "highest"):
        here = np.asarray(energy(*_on(DEVICES[0], (params, walkers))))
    err_here, err_cpu = np.abs(here - reference), np.abs(on_cpu - reference)
    assert np.all(np.isfinite(here))
    assert np.median(err_here) <= 3 * np.median(err_cpu) + 1e-7, (np.median(err_here), np.median(err_cpu))
    assert np.percentile(err_here, 95) <= 10 * np.percentile(err_cpu, 95) + 1e-6
    assert abs(np.mean(here - reference)) < 0.05  # hartree: not a bias of the kind the TPU's defaults gave


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_statistics_match_the_cpu(dtype, mesh):
    """``sv.statistics`` and ``StatsAccumulator`` on the backend equal the CPU's to the dtype's round-off.

    float64 on a TPU takes the autocovariance lag by lag (no float64 FFT there).
    """
    rng = np.random.default_rng(0)
    n, steps = 64, 200
    x = np.zeros((n, steps))
    for t in range(1, steps):  # AR(1) chains: a real autocorrelation to estimate
        x[:, t] = 0.8 * x[:, t - 1] + rng.normal(size=n)
    tolerance = 1e-5 if dtype == "float32" else 1e-12
    with jax.enable_x64(dtype == "float64"):
        x = x.astype(dtype)
        cpu_mesh = sv.create_mesh([CPU])
        expected = sv.statistics(jax.device_put(x, CPU), mesh=cpu_mesh)
        got = sv.statistics(sv.shard_walker(x, mesh), mesh=mesh)
        acc = sv.StatsAccumulator.create(sv.shard_walker(x[:, 0], mesh), max_blocks=64)
        acc_cpu = sv.StatsAccumulator.create(jax.device_put(x[:, 0], CPU), max_blocks=64)
        for t in range(steps):
            acc = acc.update(sv.shard_walker(x[:, t], mesh))
            acc_cpu = acc_cpu.update(jax.device_put(x[:, t], CPU))
        streamed, streamed_cpu = acc.statistics(mesh=mesh), acc_cpu.statistics(mesh=cpu_mesh)
    for a, b in ((got, expected), (streamed, streamed_cpu)):
        for field in ("mean", "error_of_mean", "variance", "tau_corr", "R_hat"):
            np.testing.assert_allclose(float(getattr(a, field)), float(getattr(b, field)), rtol=tolerance, atol=1e-6)
    assert float(expected.tau_corr) > 2  # the chains are correlated: the autocovariance was needed


@pytest.mark.parametrize("n", [2, 3, 8])
def test_small_determinants_and_their_derivatives_match_float64(n):
    """``sv.linalg.slogdet`` on the backend: values, gradient and folx Laplacian against ``jnp.linalg`` in float64."""
    rng = np.random.default_rng(n)
    w = rng.normal(size=(n * n, 6)).astype(np.float32)
    b = rng.normal(size=(n * n,)).astype(np.float32)
    xs = rng.normal(size=(64, 6)).astype(np.float32)

    # A polynomial map (no exp/tanh: the TPU's own are approximations, and this tests the determinant)
    def f(det, x):
        y = x @ w.T + b
        return det((y + 0.1 * y * y).reshape(n, n))[1]

    def derivatives(det, x):
        out = folx.forward_laplacian(functools.partial(f, det))(x)
        return out.x, out.jacobian.dense_array, out.laplacian, jax.grad(functools.partial(f, det))(x)

    with jax.enable_x64(True):
        w64, b64 = w.astype(np.float64), b.astype(np.float64)

        def f64(x):
            y = x @ w64.T + b64
            return jnp.linalg.slogdet((y + 0.1 * y * y).reshape(n, n))[1]

        ref = jax.jit(jax.vmap(lambda x: (f64(x), jax.grad(f64)(x), jnp.trace(jax.hessian(f64)(x)))))(
            jax.device_put(xs.astype(np.float64), CPU)
        )
    with jax.default_matmul_precision(None if PLATFORM == "cpu" else "highest"):
        value, jac, lap, grad = jax.jit(jax.vmap(functools.partial(derivatives, sv.linalg.slogdet)))(
            jax.device_put(xs, DEVICES[0])
        )
    scale = 1 + np.abs(np.asarray(ref[2]))
    np.testing.assert_allclose(np.asarray(value), np.asarray(ref[0]), atol=1e-4 * n)
    np.testing.assert_allclose(np.asarray(grad), np.asarray(ref[1]), atol=1e-3 * n, rtol=1e-3)
    np.testing.assert_allclose(np.asarray(jac), np.asarray(ref[1]), atol=1e-3 * n, rtol=1e-3)
    assert np.max(np.abs(np.asarray(lap) - np.asarray(ref[2])) / scale) < 1e-2


def test_a_kernel_with_padding_equals_vmap(mesh):
    """A decorated kernel (per-walker and ``Mean`` outputs, padding) on the backend equals ``jax.vmap`` there."""

    @sv.walker_parallel(mesh=mesh)
    def kernel(a: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> tuple[sv.PerWalker, sv.Mean]:
        e = jnp.tanh(a * jnp.sum(r**2))
        return e, e

    r = jax.random.normal(jax.random.key(0), (1001, 3, 3))  # padded to the device count where it does not divide
    per_walker, mean = kernel(jnp.float32(0.3), r)
    reference = jax.vmap(lambda x: jnp.tanh(0.3 * jnp.sum(x**2)))(r)
    np.testing.assert_allclose(np.asarray(per_walker), np.asarray(reference), rtol=1e-6)
    np.testing.assert_allclose(float(mean), float(np.mean(np.asarray(reference))), rtol=1e-5)


@pytest.mark.parametrize("method", ["dense", "minsr", "spring", "cg"])
def test_natural_gradient_in_float32_matches_float64(method, mesh):
    """Each solver in float32 on the backend, with no precision set by the caller, against float64 numpy.

    The bounds are a few times a CPU's float32 errors (dense and CG solve the P x P normal equations of condition
    1e4: 2.4e-3 and 1.3e-3; minSR and SPRING the N x N system: 3e-7); one bfloat16 pass per product is 1e-2 off.
    """
    from test_natgrad import reference as solution  # the float64 numpy solution of the same damped system

    rng = np.random.default_rng(0)
    n, p = 100, 600
    j, e = rng.normal(size=(n, p)).astype(np.float32), rng.normal(size=n).astype(np.float32)
    reference = solution(j, e, n, 1e-3)
    extra = {"tol": 1e-7} if method == "cg" else {}
    update, _ = sv.natural_gradient(jnp.asarray(j), jnp.asarray(e), damping=1e-3, method=method, mesh=mesh, **extra)
    error = np.linalg.norm(np.asarray(update, np.float64) - reference) / np.linalg.norm(reference)
    assert error < (1e-2 if method in ("dense", "cg") else 1e-5), error


def test_minsr_above_4096_walkers_matches_float64(mesh):
    """minSR with a 4,500 x 4,500 sample-space matrix: on TPUs the blocked Cholesky (XLA's compiles for minutes at
    16,384 rows there), elsewhere XLA's; float32 on the backend against float64 numpy on the host."""
    rng = np.random.default_rng(1)
    n, p = 4500, 6000
    j, e = rng.normal(size=(n, p)).astype(np.float32), rng.normal(size=n).astype(np.float32)
    jc = (j - j.mean(0)).astype(np.float64) / np.sqrt(n)
    ec = (e - e.mean()).astype(np.float64) / np.sqrt(n)
    reference = jc.T @ np.linalg.solve(jc @ jc.T + 1e-3 * np.eye(n), ec)
    update, _ = sv.natural_gradient(jnp.asarray(j), jnp.asarray(e), damping=1e-3, method="minsr", mesh=mesh)
    error = np.linalg.norm(np.asarray(update, np.float64) - reference) / np.linalg.norm(reference)
    assert error < 1e-5, error


def test_log_squeeze_matches_deepqmc_in_float64(mesh):
    """``sv.loss.ClipLogSqueeze`` in float32 on the backend against DeepQMC's formula in float64 numpy."""

    @sv.walker_parallel(mesh=mesh)
    def squeezed(e: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
        return sv.loss.ClipLogSqueeze()(e)[0]

    rng = np.random.default_rng(1)
    e = (-7.0 + rng.standard_cauchy(4096) * 0.1).astype(np.float32)  # heavy tails, as local energies have
    from test_loss import _deepqmc  # DeepQMC's median_log_squeeze_and_mask in numpy

    clipped = squeezed(e)
    x = e.astype(np.float64)
    m = np.median(x)
    reference, _ = _deepqmc(x, 1.0, 0.95, np.inf)  # ClipLogSqueeze()'s defaults
    np.testing.assert_allclose(np.asarray(clipped) - m, reference - m, rtol=1e-5, atol=1e-6)


def test_the_precision_policy_of_the_backend(mesh):
    """float32 with 'highest' products on a TPU, float64 elsewhere; float64 refused on a TPU."""
    policy = sv.precision_policy("auto", mesh=mesh)
    if PLATFORM == "tpu":
        assert policy.dtype == np.float32 and policy.matmul_precision == "highest"
        with pytest.raises(sv.CallError, match="no float64"):
            sv.precision_policy("float64", mesh=mesh)
    else:
        assert policy.dtype == np.float64
    with policy.context():
        assert jnp.zeros(1).dtype == policy.dtype


def test_the_main_job_runs_and_finds_correlation():
    """The README's main job, shortened: helium's energy below Hartree-Fock on the backend, in the policy's dtype."""
    import helium_vmc

    config = helium_vmc.Config(walkers=2000, steps=40, eval_steps=32)
    summary = helium_vmc.run(config, sv.create_mesh(DEVICES))
    assert summary["dtype"] == sv.precision_policy(mesh=sv.create_mesh(DEVICES)).dtype.name
    assert summary["energy"] < helium_vmc.HARTREE_FOCK - 0.01
    assert abs(summary["energy"] - helium_vmc.EXACT) < 0.05


def test_a_short_dmc_run_on_helium():
    """Fixed-node DMC of helium on the backend (nodeless: the exact energy -2.9037 within a loose band)."""
    import helium

    mesh = sv.create_mesh(DEVICES)
    potential = functools.partial(sv.hamiltonian.coulomb, charges=[2.0], coords=[[0.0, 0.0, 0.0]])
    dmc = sv.dmc.DMC(helium.log_psi, potential, time_step=0.02)
    walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), 512, mesh, key=jax.random.key(0))
    state = dmc.init(helium.PARAMS, walkers)
    result = sv.driver.run(dmc.step, state, 150, key=jax.random.key(1), progress=False)
    energy = sv.dmc.energy(result, discard=50)
    assert abs(float(energy.mean) + 2.9037) < 0.05
