"""sv.statistics and sv.StatsAccumulator against independent oracles (ArviZ, pyblock, NumPy), float64.

The synthetic data are AR(1) chains ``x_t = phi x_{t-1} + sqrt(1 - phi^2) noise``, with
unit variance and the integrated autocorrelation time (in shardvmc's convention
``tau = 1/2 + sum_t rho_t``) ``(1 + phi) / (2 (1 - phi))``.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv

pytestmark = pytest.mark.usefixtures("x64_padded")  # float64, padded walker counts without PaddingWarning

with warnings.catch_warnings():  # ArviZ announces its refactor with a FutureWarning at import
    warnings.simplefilter("ignore")
    import arviz
    import pyblock

FIELDS = ("mean", "error_of_mean", "variance", "tau_corr", "R_hat", "ess")


def ar1(chains, steps, phi, seed=0, mean=0.0):
    rng = np.random.default_rng(seed)
    x = np.empty((chains, steps))
    x[:, 0] = rng.normal(size=chains)
    noise = rng.normal(size=(chains, steps)) * np.sqrt(1 - phi**2)
    for t in range(1, steps):
        x[:, t] = phi * x[:, t - 1] + noise[:, t]
    return x + mean


def tau_of(phi):
    return (1 + phi) / (2 * (1 - phi))


def arviz_of(x):
    """ArviZ's ESS and MCSE of the mean and split-R-hat (no rank normalisation), computed on the host."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {
            "ess": float(arviz.ess(x, method="mean")),
            "error_of_mean": float(arviz.mcse(x, method="mean")),
            "R_hat": float(arviz.rhat(x, method="split")),
        }


def as_floats(stats):
    return {name: complex(getattr(stats, name)) if name == "mean" else float(getattr(stats, name)) for name in FIELDS}


def assert_stats_close(a, b, rtol=1e-10):
    for name in FIELDS:
        np.testing.assert_allclose(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), rtol=rtol, err_msg=name)


# ----------------------------------------------------------------------------- the oracles


@pytest.mark.parametrize(
    "chains, steps, phi",
    [(13, 501, 0.8), (8, 1000, 0.5), (40, 64, 0.3), (3, 200, 0.95)],
    ids=["13x501", "8x1000", "40x64", "3x200"],
)
def test_ess_error_and_rhat_are_arviz(chains, steps, phi):
    x = ar1(chains, steps, phi, mean=-2.9)
    stats = sv.statistics(x)  # 13 and 3 walkers do not divide the 8 devices: padded by the kernel
    for name, value in arviz_of(x).items():
        assert float(getattr(stats, name)) == pytest.approx(value, rel=1e-10), name
    assert float(stats.mean) == pytest.approx(x.mean(), rel=1e-13)
    assert float(stats.variance) == pytest.approx(x.var(ddof=1), rel=1e-12)
    assert float(stats.tau_corr) == pytest.approx(x.size / (2 * arviz_of(x)["ess"]), rel=1e-10)


def test_known_autocorrelation_time_and_error_of_ar1():
    for phi in (0.0, 0.6, 0.9):
        x = ar1(64, 2000, phi, seed=1)
        stats = sv.statistics(x)
        tau = tau_of(phi)
        assert float(stats.tau_corr) == pytest.approx(tau, rel=0.1), phi
        # The standard error of the mean of unit-variance AR(1) chains: sqrt(2 tau / N).
        assert float(stats.error_of_mean) == pytest.approx(np.sqrt(2 * tau / x.size), rel=0.1), phi
        assert abs(float(stats.R_hat) - 1) < 0.01


def test_error_agrees_with_pyblock_reblocking():
    x = ar1(16, 8192, 0.9, seed=2)
    series = x.mean(axis=0)  # the walkers' mean at each step: one series whose mean is the grand mean
    blocks = pyblock.blocking.reblock(series)
    (optimal,) = pyblock.blocking.find_optimal_block(series.size, blocks)
    reblocked = float(blocks[optimal].std_err)
    error_of_error = float(blocks[optimal].std_err_err)
    stats = sv.statistics(x)
    assert abs(float(stats.error_of_mean) - reblocked) < 3 * error_of_error + 0.02 * reblocked
    assert float(stats.error_of_mean) == pytest.approx(np.sqrt(2 * tau_of(0.9) / x.size), rel=0.1)


def test_fewer_than_four_steps_count_the_walkers_as_independent():
    x = ar1(50, 3, 0.5, seed=3)
    stats = sv.statistics(x)
    walker_means = x.mean(axis=1)
    assert float(stats.error_of_mean) == pytest.approx(walker_means.std(ddof=1) / np.sqrt(50), rel=1e-10)
    one_step = sv.statistics(x[:, :1])
    assert float(one_step.error_of_mean) == pytest.approx(x[:, 0].std(ddof=1) / np.sqrt(50), rel=1e-10)
    assert float(one_step.ess) == pytest.approx(50, rel=1e-10)
    assert float(one_step.tau_corr) == pytest.approx(0.5, rel=1e-10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_constant_series_has_no_error(dtype):
    # An exact eigenstate's local energy: every sample equal. The sums of squares cancel to round-off, which
    # must not come out negative (a NaN error) or as a ratio of two round-offs (an absurd ESS).
    for value in (0.1, -2.9, 1 / 3, np.pi):
        x = np.full((13, 40), value, dtype)  # 13 walkers: padded to 16 by the kernel
        stats, oracle = as_floats(sv.statistics(x)), arviz_of(x.astype(np.float64))
        assert stats["error_of_mean"] == 0.0, value
        assert stats["variance"] == 0.0, value
        assert stats["ess"] == oracle["ess"] == x.size, value  # ArviZ: a constant series is N independent draws
        assert stats["tau_corr"] == 0.5, value
        assert stats["R_hat"] == pytest.approx(np.sqrt(19 / 20), rel=1e-6), value  # B = 0: ((n - 1)/n)^(1/2)
        assert oracle["error_of_mean"] < 1e-7 * abs(value)  # ArviZ's own sd of the data: round-off
    acc = stream(jnp.asarray(x), max_blocks=4)  # merged into blocks of 16 steps and a partial one
    streamed = as_floats(acc.statistics())
    assert (streamed["error_of_mean"], streamed["tau_corr"], streamed["ess"]) == (0.0, 0.5, x.size)


@pytest.mark.parametrize("dtype, scale", [(np.float64, 1e-6), (np.float64, 1e-9), (np.float32, 1e-6)])
def test_a_nearly_constant_series_is_arviz(dtype, scale):
    # Noise of a few ulps (float32 at 1e-6) to a few million: the error comes from what the data hold.
    for value in (-2.9, np.pi):
        x = (value + scale * abs(value) * ar1(13, 40, 0.5, seed=3)).astype(dtype)
        assert np.ptp(x) > 0
        stats = sv.statistics(x)
        for name, expected in arviz_of(x.astype(np.float64)).items():
            assert float(getattr(stats, name)) == pytest.approx(expected, rel=1e-5), (value, name)


# ----------------------------------------------------------------------------- padding, devices, jit, meshes


def test_padding_walkers_never_enter():
    x = ar1(13, 120, 0.7, seed=4)
    reference = sv.statistics(x)
    padded = np.concatenate([x, np.full((3, 120), np.nan)])
    padded[14] = 1e30
    on_mesh = sv.shard_walker(padded)  # 16 walkers over 8 devices, the last 3 padding
    assert_stats_close(sv.statistics(sv.WalkerSet(on_mesh, n_valid=13)), reference)
    assert_stats_close(sv.statistics(on_mesh, n_valid=13), reference)
    assert_stats_close(sv.statistics(padded, n_valid=13), reference)  # on the host, not placed
    assert np.isfinite(float(sv.statistics(on_mesh, n_valid=13).error_of_mean))


def test_same_on_1_3_and_8_devices_and_under_jit(mesh):
    x = ar1(24, 100, 0.8, seed=5)
    one_device = sv.create_mesh(jax.devices()[:1])
    reference, reference_21 = (as_floats(sv.statistics(x[:n], mesh=one_device)) for n in (24, 21))
    placed = sv.shard_walker(x, mesh)
    eager = sv.statistics(placed, mesh=mesh)
    assert isinstance(eager, sv.Stats)
    assert as_floats(eager) == pytest.approx(reference, rel=1e-10)
    assert as_floats(jax.jit(lambda x: sv.statistics(x, mesh=mesh))(placed)) == pytest.approx(reference, rel=1e-10)
    counted = jax.jit(lambda x: sv.statistics(sv.WalkerSet(x, 21), mesh=mesh))(placed)  # a count under jit
    assert as_floats(counted) == pytest.approx(reference_21, rel=1e-10)


def test_explicit_mesh_with_a_walker_count_it_divides():
    mesh = jax.make_mesh((8,), ("walkers",))
    x = ar1(16, 60, 0.5, seed=6)
    reference, reference_13 = sv.statistics(x), sv.statistics(x[:13])
    with jax.set_mesh(mesh):
        placed = jax.device_put(x, jax.NamedSharding(mesh, jax.P("walkers")))
        assert_stats_close(sv.statistics(placed), reference)
        assert_stats_close(sv.statistics(sv.WalkerSet(placed, 13)), reference_13)
        acc = sv.StatsAccumulator.create(placed[:, 0], n_valid=13, max_blocks=16)
        for t in range(60):
            acc = acc.update(placed[:, t])
        assert jax.typeof(acc.block_mean).sharding.spec == jax.P("walkers", None)
        streamed = acc.statistics()
    assert float(streamed.mean) == pytest.approx(float(reference_13.mean), rel=1e-12)
    assert float(streamed.variance) == pytest.approx(float(reference_13.variance), rel=1e-12)


@pytest.mark.filterwarnings("ignore::shardvmc.PaddingWarning")
def test_explicit_mesh_with_a_walker_count_it_does_not_divide():
    mesh = jax.make_mesh((8,), ("walkers",))
    x = ar1(13, 60, 0.5, seed=6)
    assert_stats_close(sv.statistics(x, mesh=mesh), sv.statistics(x))


# ----------------------------------------------------------------------------- complex data


def test_complex_data():
    a = ar1(13, 300, 0.8, seed=7)
    b = ar1(13, 300, 0.8, seed=8)
    real = as_floats(sv.statistics(a))
    # (1 + i) a is sqrt(2) a rotated: the same correlation, twice the variance, sqrt(2) the error.
    rotated = sv.statistics((1 + 1j) * a)
    assert rotated.error_of_mean.dtype == jnp.float64 and rotated.mean.dtype == jnp.complex128
    assert complex(rotated.mean) == pytest.approx((1 + 1j) * a.mean(), rel=1e-12)
    assert float(rotated.variance) == pytest.approx(2 * real["variance"], rel=1e-12)
    assert float(rotated.error_of_mean) == pytest.approx(np.sqrt(2) * arviz_of(a)["error_of_mean"], rel=1e-10)
    for name in ("tau_corr", "R_hat", "ess"):
        assert float(getattr(rotated, name)) == pytest.approx(real[name], rel=1e-10), name
    # A phase does not change anything but the mean.
    phase = np.exp(0.7j)
    x = a + 1j * b
    turned, plain = as_floats(sv.statistics(phase * x)), as_floats(sv.statistics(x))
    assert turned["mean"] == pytest.approx(phase * plain["mean"], rel=1e-12)
    for name in FIELDS[1:]:
        assert turned[name] == pytest.approx(plain[name], rel=1e-10), name
    # Independent real and imaginary parts: the variance of |x - mean|^2 adds up, the correlation stays.
    assert plain["variance"] == pytest.approx(a.var(ddof=1) + b.var(ddof=1), rel=1e-12)
    assert plain["tau_corr"] == pytest.approx(tau_of(0.8), rel=0.25)
    assert plain["error_of_mean"] == pytest.approx(np.sqrt(2 * tau_of(0.8) * plain["variance"] / x.size), rel=0.25)


# ----------------------------------------------------------------------------- streaming


def stream(series, n_valid=None, jit=True, **options):
    """Feed ``series[:, t]`` step by step to an accumulator, in one jitted loop (or eagerly)."""

    def run(series):
        acc = sv.StatsAccumulator.create(series[:, 0], n_valid=n_valid, **options)
        return jax.lax.fori_loop(0, series.shape[1], lambda t, acc: acc.update(series[:, t]), acc)

    return jax.jit(run)(series) if jit else run(series)


def test_streaming_before_a_merge_is_the_batch_result():
    x = ar1(13, 150, 0.8, seed=9)
    padded = sv.shard_walker(np.concatenate([x, np.full((3, 150), np.nan)]))
    acc = stream(padded, n_valid=13, max_blocks=150)
    assert acc.n_steps == 150 and acc.block_mean.sharding.spec == jax.P("walkers")
    assert_stats_close(acc.statistics(), sv.statistics(x))


def test_streaming_blocks_are_the_block_means_of_the_series():
    x = ar1(8, 1000, 0.6, seed=10)
    acc = stream(jnp.asarray(x), max_blocks=16)  # 1000 steps: blocks of 64, 15 complete, 40 steps left over
    k, size, partial = (int(v) for v in acc.counts)
    assert (k, size, partial) == (15, 64, 40)
    blocks = x[:, : k * size].reshape(8, k, size)
    np.testing.assert_allclose(acc.block_mean[:, :k], blocks.mean(axis=-1), rtol=1e-12)
    np.testing.assert_allclose(acc.block_m2[:, :k], ((blocks - blocks.mean(-1, keepdims=True)) ** 2).sum(-1), rtol=1e-9)
    np.testing.assert_allclose(acc.partial_mean, x[:, k * size :].mean(axis=1), rtol=1e-12)
    stats, stored = acc.statistics(), sv.statistics(x)
    assert float(stats.mean) == pytest.approx(float(stored.mean), rel=1e-12)
    assert float(stats.variance) == pytest.approx(float(stored.variance), rel=1e-12)


def test_streaming_after_merges_approximates_the_batch_result():
    # 64 walkers, 4096 steps into 128 blocks of 32 steps (tau up to 9.5 steps). Measured over 12 seeds per phi:
    # streamed / stored error 0.965-1.003, tau 0.93-1.007 (the block chains are shorter: slightly low).
    for phi, seed in ((0.5, 11), (0.8, 12), (0.9, 13)):
        x = ar1(64, 4096, phi, seed=seed)
        acc = stream(sv.shard_walker(x), max_blocks=128)
        assert [int(v) for v in acc.counts] == [128, 32, 0]
        streamed, stored = as_floats(acc.statistics()), as_floats(sv.statistics(x))
        assert streamed["mean"] == pytest.approx(stored["mean"], rel=1e-12)
        assert streamed["variance"] == pytest.approx(stored["variance"], rel=1e-12)
        assert streamed["R_hat"] == pytest.approx(stored["R_hat"], rel=1e-12)  # 128 blocks: split at step 2048
        for name in ("error_of_mean", "tau_corr", "ess"):
            bound = 0.05 if name == "error_of_mean" else 0.1
            assert streamed[name] == pytest.approx(stored[name], rel=bound), (phi, name)
        assert streamed["tau_corr"] == pytest.approx(tau_of(phi), rel=0.15), phi


def test_streaming_eagerly_with_complex_values():
    x = ar1(5, 40, 0.5, seed=14) + 1j * ar1(5, 40, 0.5, seed=15)
    acc = stream(jnp.asarray(x), jit=False, max_blocks=64)
    assert_stats_close(acc.statistics(), sv.statistics(x))
    assert acc.block_m2.dtype == jnp.float64


# ----------------------------------------------------------------------------- the surface


def test_str_reads_mean_error_and_diagnostics():
    x = ar1(13, 300, 0.5, seed=16, mean=-2.9031)  # the shape of test_complex_data: no new compilation
    text = str(sv.statistics(x))
    assert re.fullmatch(r"-2\.\d{3} ± 0\.\d{3} \[σ²=\d\.\d{3}, τ=\d+\.\d, R̂=\d\.\d{4}\]", text), text
    assert re.match(r"-2\.\d{3}\+0\.\d{3}j ± ", str(sv.statistics(x + 0.1j))), str(sv.statistics(x + 0.1j))


def test_bad_inputs_are_call_errors():
    with pytest.raises(sv.CallError, match=r"x\[:, None\]"):
        sv.statistics(jnp.ones(8))
    with pytest.raises(sv.CallError, match="walkers, steps"):
        sv.statistics(jnp.ones((8, 2, 3)))
    with pytest.raises(sv.CallError, match="disagrees"):
        sv.statistics(sv.WalkerSet(jnp.ones((8, 4)), 5), n_valid=6)
    with pytest.raises(sv.CallError, match="n_valid"):
        sv.statistics(jnp.ones((8, 4)), n_valid=9)
    with pytest.raises(sv.CallError, match="max_blocks"):
        sv.StatsAccumulator.create(jnp.ones(8), max_blocks=7)
    with pytest.raises(sv.CallError, match="one value per walker"):
        sv.StatsAccumulator.create(jnp.ones(8)).update(jnp.ones(9))


def test_errors_name_the_function_called_and_its_own_parameters():
    # Not the private block functions behind the kernels (shardvmc._mcstats._series_block, _blocks_block).
    x = jnp.ones((8, 4))
    acc = sv.StatsAccumulator.create(x[:, 0]).update(x[:, 0])
    for call, name in [
        (lambda: sv.statistics(x, n_valid=0), r"(shardvmc\.)?statistics: n_valid=0"),
        (lambda: sv.statistics(x, mesh="walkers"), r"(shardvmc\.)?statistics: mesh"),
        (lambda: sv.statistics(x, axis_name=3), r"(shardvmc\.)?statistics: axis_name"),
        (lambda: sv.statistics(np.full((8, 4), "a")), r"statistics: x must hold numbers"),
        (lambda: acc.statistics(mesh="walkers"), r"(shardvmc\.)?StatsAccumulator\.statistics: mesh"),
        (lambda: acc.statistics(axis_name=["walkers"]), r"(shardvmc\.)?StatsAccumulator\.statistics: axis_name"),
        (lambda: sv.StatsAccumulator.create(x[:, 0]).statistics(), r"StatsAccumulator\.statistics: no step"),
        (lambda: sv.StatsAccumulator.create(x[:, 0], n_valid=9), r"StatsAccumulator\.create: n_valid=9"),
        (lambda: sv.StatsAccumulator.create(x[:, 0], n_valid=0), r"StatsAccumulator\.create: n_valid=0"),
    ]:
        with pytest.raises(sv.CallError, match="^" + name) as err:
            call()
        assert "_block" not in str(err.value) and "walker_parallel" not in str(err.value), str(err.value)


def test_the_series_is_never_gathered():
    x = sv.shard_walker(ar1(16, 64, 0.5, seed=17))
    hlo = jax.jit(sv.statistics).lower(x).compile().as_text()
    for collective in ("all-gather", "all-to-all", "collective-permute"):
        assert collective not in hlo, collective
    reduced = re.findall(r"= (\(.*?\)|\S+) all-reduce(?:-start)?\(", hlo)
    assert 1 <= len(reduced) <= 2, reduced  # the mean, then every sum of the second pass
    assert "f64[16,64]" not in " ".join(reduced)


def test_an_accumulator_of_sharded_values_compiles_its_jitted_update_once():
    """Its counters start on the walkers' mesh, where the update leaves them: the second call is no new program."""
    x = sv.shard_walker(jnp.asarray(ar1(16, 3, 0.5, seed=3)))
    update = jax.jit(lambda acc, v: acc.update(v))
    acc = sv.StatsAccumulator.create(x[:, 0])
    for t in range(3):
        acc = update(acc, x[:, t])
    assert update._cache_size() == 1
    assert acc.n_steps == 3
