"""shardvmc.hamiltonian: local energies against a Hessian-trace reference, exact eigenstates and jax.vmap."""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc.hamiltonian import coulomb, kinetic_energy, local_energy
from shardvmc.mcmc import Walker

METHODS = [("folx", 0), ("folx", 0.6), ("jvp", 0)]
IDS = ["folx", "folx-sparse", "jvp"]
CHARGES = [3.0, 1.0]
COORDS = [[0.0, 0.0, 0.0], [0.0, 0.0, 1.5]]


def _mesh(k: int):
    return sv.create_mesh(jax.devices()[: min(k, jax.device_count())])


def _params(key=jax.random.key(0), d: int = 9, hidden: int = 6) -> dict:
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "w": 0.4 * jax.random.normal(k1, (d, hidden)),
        "b": 0.1 * jax.random.normal(k2, (hidden,)),
        "v": 0.4 * jax.random.normal(k3, (hidden,)),
    }


def network(params: dict, r: jax.Array) -> jax.Array:
    """A small real log|psi| of 3 electrons in 3-D: a tanh layer, pair distances, an envelope."""
    pairs = jnp.stack([jnp.linalg.norm(r[i] - r[j]) for i, j in itertools.combinations(range(r.shape[0]), 2)])
    h = jnp.tanh(r.reshape(-1) @ params["w"] + params["b"])
    return h @ params["v"] + 0.3 * jnp.sum(pairs / (1.0 + pairs)) - jnp.sum(jnp.linalg.norm(r, axis=-1))


def complex_network(params: dict, r: jax.Array) -> jax.Array:
    """log psi with a position-dependent phase (a plane wave times a network's phase)."""
    phase = 0.7 * r[0, 0] - 0.4 * r[2, 1] + 0.5 * jnp.tanh(r.reshape(-1) @ params["w"]) @ params["v"]
    return network(params, r) + 1j * phase


def potential(r: jax.Array) -> jax.Array:
    return coulomb(r, charges=CHARGES, coords=COORDS)


def reference(log_psi, params, r):
    """-1/2 (trace of jax.hessian + grad.grad) + V, Re and Im parts apart: the oracle."""
    flat = r.reshape(-1)

    def part(f):
        g = jax.grad(lambda x: f(log_psi(params, x.reshape(r.shape))))(flat)
        lap = jnp.trace(jax.hessian(lambda x: f(log_psi(params, x.reshape(r.shape))))(flat))
        return lap, g

    lap_re, g_re = part(jnp.real)
    if not jnp.iscomplexobj(jax.eval_shape(lambda x: log_psi(params, x), r)):
        return -0.5 * (lap_re + g_re @ g_re) + potential(r)
    lap_im, g_im = part(jnp.imag)
    lap, g = lap_re + 1j * lap_im, g_re + 1j * g_im
    return -0.5 * (lap + jnp.sum(g * g)) + potential(r)


@pytest.fixture(scope="module")
def walkers() -> jax.Array:
    with jax.enable_x64(True):
        return jax.random.normal(jax.random.key(1), (13, 3, 3), jnp.float64)


@functools.cache
def _expected(log_psi):
    """Parameters, positions and reference local energies in float64, computed once per log_psi."""
    with jax.enable_x64(True):
        params = jax.tree.map(lambda a: a.astype(jnp.float64), _params())
        r = jax.random.normal(jax.random.key(1), (13, 3, 3), jnp.float64)
        return params, r, jax.jit(jax.vmap(lambda x: reference(log_psi, params, x)))(r)  # jitted: eager, minutes


@pytest.mark.parametrize("log_psi", [network, complex_network], ids=["real", "complex"])
@pytest.mark.parametrize("laplacian, threshold", METHODS, ids=IDS)
def test_against_the_hessian_trace(log_psi, laplacian, threshold):
    params, walkers, expected = _expected(log_psi)
    with jax.enable_x64(True):
        energy = local_energy(log_psi, potential, laplacian=laplacian, sparsity_threshold=threshold)
        got = energy(params, walkers)
        assert jnp.iscomplexobj(got) == (log_psi is complex_network)
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("laplacian", ["folx", "jvp"])
def test_exact_eigenstates_have_constant_local_energy(laplacian):
    r = jax.random.normal(jax.random.key(2), (16, 1, 3)) * 2.0
    # a hydrogen-like 1s orbital of charge Z = 2 (He+): E_L = -Z^2/2
    hydrogenic = local_energy(
        lambda z, x: -z * jnp.linalg.norm(x[0]),
        lambda x: coulomb(x, charges=[2.0], coords=[[0.0, 0.0, 0.0]]),
        laplacian=laplacian,
    )
    np.testing.assert_allclose(np.asarray(hydrogenic(jnp.float32(2.0), r)), -2.0, rtol=1e-5)
    # the ground state of 2 particles in a 3-D harmonic trap of frequency w: E_L = 3 w, with a constant phase
    w = 0.7
    trap = local_energy(
        lambda p, x: -p * jnp.sum(x**2) / 2 + 0.3j, lambda x: w**2 * jnp.sum(x**2) / 2, laplacian=laplacian
    )
    e = trap(jnp.float32(w), jnp.concatenate([r, -r], axis=1))
    np.testing.assert_allclose(np.asarray(e), 3 * w + 0j, rtol=1e-5)


def test_a_plane_wave_has_its_kinetic_energy():
    """exp(i k.r): E_L = |k|^2 / 2 exactly, real although log psi is complex."""
    k = jnp.array([0.3, -1.2, 0.5])
    for laplacian in ("folx", "jvp"):
        e = kinetic_energy(lambda p, x: 1j * jnp.sum(x * k), None, jnp.ones((1, 3)), laplacian=laplacian)
        np.testing.assert_allclose(complex(e), complex(jnp.sum(k**2) / 2), rtol=1e-6)


def test_on_1_3_and_8_devices_and_chunked_equals_vmap(walkers):
    """The kernel on meshes that do not divide 13 walkers, and chunked, equals jax.vmap on one device."""
    params = _params()
    r = walkers.astype(jnp.float32)
    expected = np.asarray(jax.jit(jax.vmap(lambda x: kinetic_energy(network, params, x) + potential(x)))(r))
    for k, batch_size in ((1, None), (3, 2), (8, None)):
        mesh = _mesh(k)
        padded, n_valid = sv.pad_walker(np.asarray(r), sv.pad_n_walkers(13, mesh.devices.size))
        placed = sv.WalkerSet(sv.shard_walker(padded, mesh), n_valid)
        got = local_energy(network, potential, mesh=mesh, batch_size=batch_size)(params, placed)
        assert got.n_valid == 13
        np.testing.assert_allclose(np.asarray(got.data[:13]), expected, rtol=2e-5, atol=2e-5)


def test_inside_another_kernel_and_on_sampler_walkers(walkers):
    """Called in a walker-parallel body the kernel is that walker's local energy; it takes sampler walkers too."""
    params = _params()
    r = walkers.astype(jnp.float32)
    energy = local_energy(network, potential)

    @sv.walker_parallel
    def energy_and_square(p: sv.Replicated[dict], w: sv.PerWalker[Walker]) -> tuple[sv.PerWalker, sv.Mean]:
        e = energy(p, w)
        return e, e**2

    state = sv.mcmc.Metropolis(network).init(params, r)
    e, mean_square = energy_and_square(params, state.walkers)
    direct = energy(params, r)
    np.testing.assert_allclose(np.asarray(e.data), np.asarray(direct), rtol=1e-6)
    np.testing.assert_allclose(float(mean_square), float(jnp.mean(direct**2)), rtol=1e-5)


def test_coulomb_against_a_double_loop():
    rng = np.random.default_rng(0)
    r, nuclei, z = rng.normal(size=(4, 3)), rng.normal(size=(3, 3)) * 2, np.array([1.0, 2.0, 3.0])
    expected = sum(1 / np.linalg.norm(r[i] - r[j]) for i in range(4) for j in range(i + 1, 4))
    expected -= sum(z[a] / np.linalg.norm(r[i] - nuclei[a]) for i in range(4) for a in range(3))
    expected += sum(z[a] * z[b] / np.linalg.norm(nuclei[a] - nuclei[b]) for a in range(3) for b in range(a + 1, 3))
    with jax.enable_x64(True):
        np.testing.assert_allclose(float(jax.jit(coulomb)(jnp.asarray(r), z, nuclei)), expected, rtol=1e-12)
        np.testing.assert_allclose(float(jax.jit(coulomb)(jnp.asarray(r))), sum(
            1 / np.linalg.norm(r[i] - r[j]) for i in range(4) for j in range(i + 1, 4)), rtol=1e-12)  # fmt: skip
    # electrons alone: the gradient is finite (no zero distance on a diagonal)
    assert bool(jnp.all(jnp.isfinite(jax.jit(jax.grad(coulomb))(jnp.asarray(r, jnp.float32)))))


def test_bad_arguments_are_call_errors():
    with pytest.raises(sv.CallError, match="laplacian='hessian'"):
        local_energy(network, laplacian="hessian")
    with pytest.raises(sv.CallError, match="charges and coords"):
        coulomb(jnp.ones((2, 3)), charges=[1.0])
    with pytest.raises(sv.CallError, match="charges \\[2\\], coords \\[1, 3\\]"):
        coulomb(jnp.ones((2, 3)), charges=[1.0, 2.0], coords=[[0.0, 0.0, 0.0]])


def test_a_potential_of_one_number_per_particle_is_a_call_error(walkers):
    """One number per electron (a missing sum) would broadcast into the kinetic energy: refused, naming the shapes."""
    per_electron = lambda r: -1.0 / jnp.linalg.norm(r, axis=-1)  # noqa: E731
    params, r = _params(), walkers.astype(jnp.float32)
    energy = local_energy(network, per_electron, mesh=_mesh(1))
    with pytest.raises(sv.CallError, match=r"potential\(r\) must return one number") as err:
        energy(params, r)
    assert f"shape ({r.shape[1]},) for a walker's positions of shape {r.shape[1:]}" in str(err.value)
    total = local_energy(network, lambda x: jnp.sum(per_electron(x)), mesh=_mesh(1))
    assert total(params, r).shape == (r.shape[0],)


def masked_pairs(params: dict, r: jax.Array) -> jax.Array:
    """A log|psi| with a constant in JAX's default float dtype (``jnp.eye``: float64 under x64), as real codes have."""
    n = r.shape[0]
    r_ee = jnp.linalg.norm(r[:, None] - r[None] + jnp.eye(n)[..., None], axis=-1)
    return network(params, r) + 0.5 * jnp.sum(jnp.triu(r_ee / (1.0 + r_ee), 1))


# (x64, the parameters' dtype, the walkers' dtype, the Laplacian): the combinations jax.vmap takes, as users meet
# them, each with another Laplacian (all of them tested in float64 above)
DTYPES = [(True, jnp.float32, jnp.float32, "folx", 0), (True, jnp.float64, jnp.float32, "jvp", 0),
          (False, jnp.float32, jnp.float32, "folx", 0.6), (False, jnp.bfloat16, jnp.float32, "folx", 0),
          (True, jnp.float32, jnp.float64, "folx", 0.6), (True, jnp.float32, jnp.float32, "jvp", 0)]  # fmt: skip


@pytest.mark.parametrize("x64, param_dtype, walker_dtype, laplacian, threshold", DTYPES)
def test_mixed_dtypes_give_what_jax_vmap_gives(x64, param_dtype, walker_dtype, laplacian, threshold):
    """Mixed dtypes as JAX takes them: the local energy's dtype and value are jax.vmap's of the Hessian trace."""
    with jax.enable_x64(x64):
        params = jax.tree.map(lambda a: a.astype(param_dtype), _params())
        r = jax.random.normal(jax.random.key(3), (5, 3, 3)).astype(walker_dtype)
        expected = jax.jit(jax.vmap(lambda x: reference(masked_pairs, params, x)))(r)  # eager: op by op, 20 s
        # one device: the dtypes are the point here (the meshes and padding are tested above), and compile faster
        energy = local_energy(masked_pairs, potential, laplacian=laplacian, sparsity_threshold=threshold, mesh=_mesh(1))
        got = energy(params, r)
        assert got.dtype == expected.dtype, (got.dtype, expected.dtype)
        tol = 5e-2 if param_dtype == jnp.bfloat16 else 2e-4
        np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(expected, np.float64), rtol=tol, atol=tol)
        # outside any kernel (the user's own jax.jit): both platforms' programs are traced, and agree on the types
        # (traced only: eval_shape; the values are the kernel's, above)
        kinetic = jax.eval_shape(jax.vmap(lambda x: kinetic_energy(masked_pairs, params, x, laplacian=laplacian)), r)
        assert kinetic.dtype == jax.eval_shape(jax.vmap(jax.grad(lambda x: masked_pairs(params, x))), r).dtype


def test_a_kernel_traces_its_own_platforms_program_alone(monkeypatch, walkers):
    """On CPUs the TPU's program (the float32 rewrite, the JVP loop) is not traced: a kernel knows its platform."""
    import shardvmc._numerics as numerics

    def refuse(f):
        raise AssertionError("the TPU's program was traced for a CPU mesh")

    monkeypatch.setattr(numerics, "_rewrite", refuse)
    traced = []

    def counted(params, r):
        traced.append(1)
        return network(params, r)

    e = local_energy(counted, potential, mesh=_mesh(2))(_params(), walkers.astype(jnp.float32))
    assert e.shape == (13,)
    # one trace of the folx program, one eval_shape of log psi's value type (kinetic_energy's real/complex check)
    assert len(traced) == 2, len(traced)
    with pytest.raises(AssertionError, match="TPU's program"):  # outside a kernel both are traced, as JAX does
        jax.jit(lambda x: kinetic_energy(network, _params(), x))(walkers[0].astype(jnp.float32))


def test_auto_is_folx_on_every_platform():
    """``"auto"`` is folx's forward Laplacian, also in the TPU's program (the JVP loop was 1.9-4.5 times slower)."""
    from shardvmc._platform import compiling_for

    def loops(laplacian: str) -> int:  # the JVP loop is a loop (a scan: fori_loop of fixed length); folx has none
        with compiling_for("tpu"):
            jaxpr = jax.make_jaxpr(lambda x: kinetic_energy(network, _params(), x, laplacian=laplacian))(
                jnp.ones((3, 3))
            )
        return str(jaxpr).count("scan[") + str(jaxpr).count("while[")

    assert loops("auto") == loops("folx") == 0 and loops("jvp") >= 1
