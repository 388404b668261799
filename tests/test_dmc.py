"""shardvmc.dmc: exact energies of nodeless ground states, the same run on any device count, resume, bad inputs."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from meshes import mesh_of

import shardvmc as sv

pytestmark = pytest.mark.usefixtures("x64")  # float64

HELIUM = -2.903724377  # exact non-relativistic ground state (Ha)
HOOKE = 2.0  # Hooke's atom at trap frequency 1/2


def helium_log_psi(b, r):
    """Nodeless: the exact cusps (-2 per electron-nucleus distance, 1/2 for r12) and a Pade Jastrow."""
    r1, r2 = jnp.linalg.norm(r, axis=-1)
    r12 = jnp.linalg.norm(r[0] - r[1])
    return -2.0 * (r1 + r2) + r12 / (2.0 * (1.0 + b * r12))


def helium_potential(r):
    return sv.hamiltonian.coulomb(r, charges=[2.0], coords=[[0.0, 0.0, 0.0]])


def hooke_log_psi(b, r):
    """The trap's Gaussian and a Pade Jastrow: not the exact (1 + r12 / 2) factor, so E_L varies."""
    r12 = jnp.linalg.norm(r[0] - r[1])
    return -jnp.sum(r**2) / 4.0 + r12 / (2.0 * (1.0 + b * r12))


def hooke_potential(r):
    return jnp.sum(r**2) / 8.0 + sv.hamiltonian.coulomb(r)


def walkers_of(n, mesh, scale, seed=0):
    return sv.initialize_walkers_sharded(
        lambda k: scale * jax.random.normal(k, (2, 3)), n, mesh, key=jax.random.key(seed)
    )


def variational_energy(log_psi, potential, b, walkers):
    """The trial function's own energy, <E_L> over |psi|^2, by the same walk without branching.

    With the local energy in the weights clipped to E_T +- 1e-9 every weight is 1 to 1e-10: the drift-diffusion
    moves with their Metropolis acceptance then sample |psi|^2 (detailed balance), and the mixed estimate is the
    plain mean of the local energy.
    """
    vmc = sv.dmc.DMC(log_psi, potential, time_step=0.1, energy_cutoff=1e-9)
    result = sv.driver.run(vmc.step, vmc.init(jnp.float64(b), walkers), 300, key=jax.random.key(4), progress=False)
    assert np.all(result.history["resampled"] == 1) and np.all(
        np.abs(result.history["effective_walkers"] - 1000) < 1e-6
    )
    e = sv.dmc.energy(result, discard=60, population_steps=0)
    return float(e.mean), float(e.error_of_mean)


# ----------------------------------------------------------------------------- accuracy


@pytest.mark.parametrize(
    "name, log_psi, potential, b, scale, exact",
    [
        ("helium", helium_log_psi, helium_potential, 0.3, 0.7, HELIUM),
        ("hooke", hooke_log_psi, hooke_potential, 0.5, 1.5, HOOKE),
    ],
    ids=["helium", "hooke"],
)
def test_nodeless_ground_states_are_exact(name, log_psi, potential, b, scale, exact):
    """Fixed-node DMC is exact for a nodeless ground state whatever the trial function: within two error bars.

    The trial functions' own energies are many error bars away (checked): the projection did the work. At
    tau = 0.1 the time-step bias of these two (UNR's Green's function with tau_eff) is below the error bar
    (measured at tau = 0.1 and 0.05 with 2000 walkers x 3000 steps: helium -2.90413(46) and -2.9037(11),
    Hooke's atom 2.00038(71) and 2.00111(95)).
    """
    walkers = walkers_of(1000, mesh_of(1), scale)
    dmc = sv.dmc.DMC(log_psi, potential, time_step=0.1)
    state = dmc.init(jnp.float64(b), walkers)
    result = sv.driver.run(dmc.step, state, 1400, key=jax.random.key(2), progress=False)
    assert result.status == "finished"
    history = result.history
    assert np.all(history["nonfinite"] == 0) and np.all(history["fallback"] == 0)
    assert np.all(history["resampled"] == 1) and 0.7 < history["acceptance"].mean() < 1.0
    assert 0.06 < history["tau_eff"][-1] < 0.1  # rejected moves shorten the effective step
    e = sv.dmc.energy(result, discard=200)
    assert 1e-4 < e.error_of_mean < 3e-3, e
    assert abs(e.mean - exact) < 2 * e.error_of_mean, (name, str(e), exact)
    variational, v_error = variational_energy(log_psi, potential, b, walkers)
    assert variational - exact > 5 * math.hypot(e.error_of_mean, v_error), (variational, str(e))


def test_a_node_is_kept_and_the_exact_node_gives_the_exact_energy():
    """psi = x exp(-0.4 r^2) for the 3-D oscillator: its node x = 0 is exact, so fixed-node DMC gives 2.5.

    Moves that cross the node are rejected (counted), so every walker stays on its side.
    """

    def log_psi(alpha, r):
        return jnp.log(jnp.abs(r[0, 0])) - alpha * jnp.sum(r**2)

    def sign(alpha, r):
        return jnp.sign(r[0, 0])

    dmc = sv.dmc.DMC(log_psi, lambda r: 0.5 * jnp.sum(r**2), time_step=0.05, sign=sign)
    mesh = mesh_of(1)
    walkers = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (1, 3)), 400, mesh, key=jax.random.key(0))
    state = dmc.init(jnp.float64(0.4), walkers)
    sides = np.sign(np.asarray(state.walkers.data.r[:, 0, 0]))
    result = sv.driver.run(dmc.step, state, 600, key=jax.random.key(1), progress=False)
    assert result.history["node_crossings"].sum() > 0
    final = result.state.walkers.data
    assert np.all(np.asarray(final.sign) == np.sign(np.asarray(final.r[:, 0, 0])))
    # resampling copies walkers between sides, but no walker moves across: the signs only come from copies
    assert set(np.unique(np.asarray(final.sign)).tolist()) <= set(np.unique(sides).tolist())
    e = sv.dmc.energy(result, discard=100)
    assert abs(e.mean - 2.5) < 2 * e.error_of_mean + 2e-3, str(e)


# ----------------------------------------------------------------------------- the same run on any layout


def _helium_run(n_devices, n_steps=25, walkers=101, **options):
    mesh = mesh_of(n_devices)
    dmc = sv.dmc.DMC(helium_log_psi, helium_potential, time_step=0.05, **options)
    state = dmc.init(jnp.float64(0.3), walkers_of(walkers, mesh, 0.7))
    return sv.driver.run(dmc.step, state, n_steps, key=jax.random.key(5), progress=False)


@pytest.fixture(scope="module")
def on_8():
    with jax.enable_x64(True):
        return _helium_run(8)


def _final(result):
    data = result.state.walkers
    return {k: np.asarray(v)[: data.n_valid] for k, v in data.data._asdict().items()}


@pytest.mark.parametrize("n_devices", [1, 3])
def test_the_same_run_on_1_3_and_8_devices(on_8, n_devices):
    """101 walkers (3 and 8 do not divide it): every step's statistics and the final walkers, to round-off."""
    other = _helium_run(n_devices)
    assert other.state.walkers.n_valid == 101 == on_8.state.walkers.n_valid
    for name in ("energy", "variance", "growth_energy", "trial_energy", "tau_eff", "effective_walkers"):
        np.testing.assert_allclose(other.history[name], on_8.history[name], rtol=1e-12, atol=1e-12, err_msg=name)
    for name in ("acceptance", "nonfinite", "node_crossings", "resampled"):
        assert other.history[name].tolist() == on_8.history[name].tolist(), name  # counts: equal
    mine, reference = _final(other), _final(on_8)
    for name, value in reference.items():
        np.testing.assert_allclose(mine[name], value, rtol=1e-10, atol=1e-10, err_msg=name)


@pytest.mark.parametrize("n_devices, halo", [(1, None), (3, 2), (8, 1), (8, None)])
def test_the_comb_copies_as_a_global_systematic_resampling(n_devices, halo):
    """Slot m gets walker i where the tooth (m + u) W / N falls in i's share of the prefix sums: numpy's comb.

    Uneven weights (zeros, a heavy walker) make copies reach past the neighbours' halos: the all-gather
    fallback then runs, and the copies are the same.
    """
    n = 29
    rng = np.random.default_rng(1)
    weights = rng.exponential(size=n)
    weights[[3, 4, 5, 17]] = 0.0
    weights[20] = 6.0
    u = 0.37
    mesh = mesh_of(n_devices)
    dmc = sv.dmc.DMC(helium_log_psi, helium_potential, time_step=0.05, mesh=mesh)
    positions = walkers_of(n, mesh, 0.7)
    state = dmc.init(jnp.float64(0.3), positions)
    padded = state.walkers.n_walkers
    w = np.ones(padded)
    w[:n] = weights
    walkers = state.walkers.replace(data=state.walkers.data._replace(weight=sv.shard_walker(jnp.asarray(w), mesh)))
    out, fallback = dmc.resample(walkers, jnp.float64(u), jnp.bool_(True), jnp.bool_(True), n, halo or 32)
    prefix = np.cumsum(weights)
    source = np.searchsorted(prefix, (np.arange(n) + u) * prefix[-1] / n, side="right")
    r = np.asarray(walkers.data.r)
    np.testing.assert_array_equal(np.asarray(out.data.r)[:n], r[source])
    np.testing.assert_array_equal(np.asarray(out.data.weight), 1.0)
    np.testing.assert_array_equal(np.asarray(out.data.r)[n:], r[n:])  # padding slots keep their walker
    # the fallback ran exactly when some slot's source lies beyond its device's block and the neighbours' halos
    per_device = padded // n_devices
    h = min(halo or 32, per_device)
    device = np.arange(n) // per_device
    beyond = (source < device * per_device - h) | (source >= (device + 1) * per_device + h)
    assert float(fallback) == float(n_devices > 1 and beyond.any())
    if (n_devices, halo) == (8, 1):
        assert beyond.any()  # (the case is made for it)


def test_the_halos_by_ppermute_give_the_same_run(on_8, monkeypatch):
    """Where every device's halos together exceed sv.dmc._HALOS_IN_GATHER_BYTES they go by one ppermute each way
    instead of inside the all-gather: the same run, to round-off, and the same copies where the fallback runs."""
    monkeypatch.setattr(sv.dmc, "_HALOS_IN_GATHER_BYTES", 0)
    other = _helium_run(8)
    for name in ("energy", "variance", "growth_energy", "effective_walkers"):
        np.testing.assert_allclose(other.history[name], on_8.history[name], rtol=1e-12, atol=1e-12, err_msg=name)
    for name, value in _final(on_8).items():
        np.testing.assert_allclose(_final(other)[name], value, rtol=1e-10, atol=1e-10, err_msg=name)
    for n_devices, halo in [(3, 2), (8, 1), (8, None)]:
        test_the_comb_copies_as_a_global_systematic_resampling(n_devices, halo)


def test_resume_on_another_device_count_continues_the_trajectory(on_8, tmp_path):
    """Checkpointed at step 12 on 8 devices, resumed on 3: the uninterrupted run's trajectory."""
    dmc = sv.dmc.DMC(helium_log_psi, helium_potential, time_step=0.05)
    first = dmc.init(jnp.float64(0.3), walkers_of(101, mesh_of(8), 0.7))
    part = sv.driver.run(dmc.step, first, 12, key=jax.random.key(5), checkpoint=tmp_path, progress=False)
    assert part.step == 12
    like = dmc.init(jnp.float64(0.3), walkers_of(101, mesh_of(3), 0.7))  # the structure, on 3 devices
    rest = sv.driver.run(dmc.step, like, 25, key=jax.random.key(5), checkpoint=tmp_path, progress=False)
    assert rest.resumed_from == 12 and rest.step == 25
    assert len(rest.state.walkers.data.r.sharding.device_set) == 3
    np.testing.assert_allclose(rest.history["energy"], on_8.history["energy"], rtol=0, atol=1e-12)
    for name, value in _final(on_8).items():
        np.testing.assert_allclose(_final(rest)[name], value, rtol=1e-10, atol=1e-10, err_msg=name)


def test_the_halo_buffer_carries_every_field_bit_for_bit():
    """The comb packs the fields it sends into one buffer per message: of their dtype when they share one, else
    of their bits (NaN payloads, -0.0, integers and booleans included)."""
    nan = np.frombuffer(np.uint64(0x7FF8DEADBEEF0001).tobytes(), np.float64)[0]
    tree = {
        "r": jnp.asarray([[[-0.0, nan, 1.5]], [[np.inf, 2.0, -3.0]]]),
        "count": jnp.asarray([7, -(2**31)], jnp.int32),
        "flag": jnp.asarray([True, False]),
        "small": jnp.asarray([0.1, -0.2], jnp.float32),
    }
    for part in (tree, {"r": tree["r"], "e": tree["r"][:, 0, 0]}):
        buffer, unpack = sv.dmc._pack(part)
        assert buffer.shape[0] == 2 and buffer.ndim == 2
        for name, value in part.items():
            got = unpack(buffer)[name]
            assert got.dtype == value.dtype and got.shape == value.shape
            assert np.asarray(got).tobytes() == np.asarray(value).tobytes(), name


def test_resampling_only_below_the_threshold_keeps_the_weights():
    result = _helium_run(1, n_steps=20, resample_threshold=0.5)
    assert result.history["resampled"].sum() < 20
    weights = np.asarray(result.state.walkers.data.weight)
    assert not np.allclose(weights, 1.0) and np.isclose(weights.mean(), 1.0)


# ----------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("tau", [0.0, -0.01, float("nan"), float("inf"), "0.01", True])
def test_a_time_step_that_is_not_positive_is_refused(tau):
    with pytest.raises(sv.CallError, match="time_step"):
        sv.dmc.DMC(helium_log_psi, helium_potential, time_step=tau)


@pytest.mark.parametrize(
    "options, match",
    [
        ({}, "exactly one of potential= and local_energy="),
        ({"potential": helium_potential, "local_energy": lambda p, r: 0.0}, "exactly one"),
        ({"potential": helium_potential, "resample_threshold": 0.0}, "resample_threshold"),
        ({"potential": helium_potential, "energy_cutoff": -1.0}, "energy_cutoff"),
        ({"potential": helium_potential, "halo": 0}, "halo"),
        ({"potential": helium_potential, "laplacian": "fd"}, "laplacian"),
    ],
)
def test_bad_settings_are_refused(options, match):
    with pytest.raises(sv.CallError, match=match):
        sv.dmc.DMC(helium_log_psi, time_step=0.01, **options)


def test_a_complex_log_psi_is_refused():
    dmc = sv.dmc.DMC(lambda p, r: -jnp.sum(r**2) + 0.1j * r[0, 0], lambda r: jnp.sum(r**2), time_step=0.01)
    with pytest.raises(sv.CallError, match="complex"):
        dmc.init(None, walkers_of(8, mesh_of(1), 1.0))


def test_a_walker_where_psi_is_nan_gets_weight_zero_and_is_counted():
    """log|psi| is NaN for x > 2: the walkers there get weight 0 (counted), the energy stays finite, and the
    comb replaces them; no move goes there."""

    def log_psi(b, r):
        return jnp.where(r[0, 0] > 2.0, jnp.nan, helium_log_psi(b, r))

    dmc = sv.dmc.DMC(log_psi, helium_potential, time_step=0.05)
    mesh = mesh_of(3)
    walkers = walkers_of(13, mesh, 0.7)
    data = walkers.data.at[4, 0, 0].set(3.0)  # walker 4 starts where psi is NaN
    walkers = sv.WalkerSet(sv.shard_walker(data, mesh), 13)
    state = dmc.init(jnp.float64(0.3), walkers)
    result = sv.driver.run(dmc.step, state, 5, key=jax.random.key(1), progress=False)
    assert result.history["nonfinite"].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert result.history["rejected_nonfinite"].sum() > 0  # (moves toward x > 2 happen, and are rejected)
    assert np.all(np.isfinite(result.history["energy"]))
    final = _final(result)
    assert np.all(np.isfinite(final["log_psi"])) and np.all(final["r"][:, 0, 0] <= 2.0)


def test_no_finite_walker_at_the_start_is_an_error():
    dmc = sv.dmc.DMC(helium_log_psi, lambda r: jnp.nan * jnp.sum(r), time_step=0.05)
    with pytest.raises(sv.CallError, match="not finite at any walker"):
        dmc.init(jnp.float64(0.3), walkers_of(13, mesh_of(1), 0.7))


def _per_electron_distances(r):
    return jnp.linalg.norm(r, axis=-1)  # one number per electron


@pytest.mark.parametrize(
    "options, call",
    [
        ({"potential": lambda r: -2.0 / _per_electron_distances(r)}, "potential(r)"),
        ({"local_energy": lambda b, r: -2.0 / _per_electron_distances(r)}, "local_energy(params, r)"),
        ({"potential": helium_potential, "sign": lambda b, r: jnp.sign(r[:, 0])}, "sign(params, r)"),
    ],
    ids=["potential", "local_energy", "sign"],
)
def test_a_function_of_one_number_per_electron_is_refused(options, call):
    """Written for the electrons, not for the walker: refused at init with the function and the shape, never
    JAX's "Only scalar arrays can be converted to Python scalars"."""
    dmc = sv.dmc.DMC(helium_log_psi, time_step=0.05, **options)
    with pytest.raises(sv.CallError) as info:
        dmc.init(jnp.float64(0.3), walkers_of(13, mesh_of(3), 0.7))
    text = str(info.value)
    assert text.startswith(f"shardvmc.dmc.DMC: {call} returned shape (2,) for one walker, not one number."), text
    assert "float64[2] for r of shape (2, 3)" in text and "\n  fix:" in text


@pytest.mark.parametrize(
    "make_key, got",
    [
        (lambda: jnp.zeros(3, jnp.float32), ("float32[3]", "float32[3]")),
        (lambda: 3, ("int 3", "int64[]")),  # (jax.jit traces the int as a scalar)
        (lambda: jax.random.split(jax.random.key(0), 13), ("key<fry>[13]", "key<fry>[13]")),
        (lambda: np.zeros(3, np.uint32), ("uint32[3]", "uint32[3]")),
    ],
    ids=["float-array", "int-seed", "key-per-walker", "raw-uint32-of-3"],
)
def test_a_step_key_that_is_not_one_key_is_refused(make_key, got):
    dmc = sv.dmc.DMC(helium_log_psi, helium_potential, time_step=0.05)
    state = dmc.init(jnp.float64(0.3), walkers_of(13, mesh_of(3), 0.7))
    for step, shown in zip((dmc.step, jax.jit(dmc.step)), got):  # eagerly and traced
        with pytest.raises(sv.CallError, match=r"^shardvmc\.dmc\.DMC\.step: key is not ONE PRNG key") as info:
            step(state, make_key())
        assert f"got:      {shown}\n" in str(info.value) and "jax.random.key(seed)" in str(info.value)


def test_a_typed_or_raw_key_takes_the_same_step():
    dmc = sv.dmc.DMC(helium_log_psi, helium_potential, time_step=0.05)
    state = dmc.init(jnp.float64(0.3), walkers_of(13, mesh_of(3), 0.7))
    typed = dmc.step(state, jax.random.key(1))[1]["energy"]
    assert float(dmc.step(state, jax.random.PRNGKey(1))[1]["energy"]) == float(typed)


def test_a_collapsed_population_stops_the_run_with_the_walkers_kept():
    """Every weight NaN (here: a state whose trial energy was damaged): energy is NaN at that step, the run stops
    there, and the walkers are kept, with weight 1."""
    dmc = sv.dmc.DMC(helium_log_psi, helium_potential, time_step=0.05)
    state = dmc.init(jnp.float64(0.3), walkers_of(13, mesh_of(3), 0.7))
    state = state._replace(trial_energy=jnp.float64(jnp.nan))
    result = sv.driver.run(dmc.step, state, 5, key=jax.random.key(1), progress=False, ahead=0)
    assert result.status == "stopped" and result.reason.startswith("energy is nan at step 0")
    assert result.history["nonfinite"].tolist() == [13.0]
    assert np.all(np.asarray(result.state.walkers.data.weight) == 1.0)


def test_a_population_that_cannot_move_stops_the_run():
    """The local energy NaN wherever a walker moves: every move is rejected (counted), and since no move was
    accepted the effective time step is 0 and the energy NaN at the next step: the run stops, not stuck."""

    def local_energy(b, r):
        e = sv.hamiltonian.kinetic_energy(helium_log_psi, b, r) + helium_potential(r)
        return jnp.where(jnp.abs(r[0, 0]) > 1e-300, jnp.nan, e)  # finite only exactly at x = 0

    dmc = sv.dmc.DMC(helium_log_psi, local_energy=local_energy, time_step=0.05)
    walkers = walkers_of(13, mesh_of(1), 0.7)
    walkers = walkers.replace(data=walkers.data.at[:, 0, 0].set(0.0))
    result = sv.driver.run(dmc.step, dmc.init(jnp.float64(0.3), walkers), 5, key=jax.random.key(1), progress=False)
    assert result.status == "stopped" and result.reason.startswith("energy is nan at step 1"), result.reason
    assert result.history["rejected_nonfinite"][0] == 13 and result.history["acceptance"][0] == 0


# ----------------------------------------------------------------------------- the pieces


def test_a_vmc_state_is_the_start_in_one_call():
    mesh = mesh_of(3)
    sampler = sv.mcmc.Metropolis(hooke_log_psi, mesh=mesh)
    sampled = sampler.init(jnp.float64(0.5), walkers_of(13, mesh, 1.5))
    vmc_state = sv.driver.VMCState(jnp.float64(0.5), None, sampled)  # (its optimiser state is not read)
    dmc = sv.dmc.DMC(hooke_log_psi, hooke_potential, time_step=0.05)
    state = dmc.init(vmc_state)
    assert state.walkers.n_valid == 13
    np.testing.assert_array_equal(np.asarray(state.walkers.data.r), np.asarray(sampled.walkers.data.r))
    e = np.asarray(
        sv.hamiltonian.local_energy(hooke_log_psi, hooke_potential)(jnp.float64(0.5), sampled.positions).data
    )
    np.testing.assert_allclose(np.asarray(state.walkers.data.local_energy)[:13], e[:13], rtol=1e-12)


def test_the_limited_drift_is_unrs():
    from shardvmc.dmc import _limited_drift

    v = jnp.array([[3.0, 0.0, 4.0], [0.0, 0.0, 0.0]])
    tau = 0.1
    got = np.asarray(_limited_drift(v, jnp.float64(tau), 1.0))
    v2 = 25.0
    factor = (-1.0 + math.sqrt(1.0 + 2.0 * v2 * tau)) / (v2 * tau)
    np.testing.assert_allclose(got[0], factor * np.array([3.0, 0.0, 4.0]), rtol=1e-14)
    np.testing.assert_array_equal(got[1], 0.0)


def test_the_estimator_undoes_the_population_control_and_extrapolates():
    steps = 400
    rng = np.random.default_rng(0)
    e = -2.9 + 0.01 * rng.normal(size=steps)
    history = {"energy": e, "growth_energy": e, "tau_eff": np.full(steps, 0.01), "variance": np.full(steps, 0.1)}
    plain = sv.dmc.energy(history, population_steps=0)
    assert plain.mean == pytest.approx(e[80:].mean(), rel=1e-12) and plain.variance == pytest.approx(0.1)
    assert plain.error_of_mean == pytest.approx(0.01 / math.sqrt(320), rel=0.3)
    # steps whose population grew (low growth energy) weigh more: the weighted mean moves toward them
    low = e.copy()
    low[200:] -= 0.5
    weighted = sv.dmc.energy({**history, "energy": low, "growth_energy": low}, population_steps=50)
    assert weighted.mean < sv.dmc.energy({**history, "energy": low, "growth_energy": low}, population_steps=0).mean
    with pytest.raises(sv.CallError, match="growth_energy"):
        sv.dmc.energy({"energy": e})
    with pytest.raises(sv.CallError, match="fewer than 4 steps"):
        sv.dmc.energy(history, discard=398)
    e0, err = sv.dmc.extrapolate([0.1, 0.05], [(-2.95, 0.001), (-2.93, 0.001)])
    assert e0 == pytest.approx(-2.91) and err == pytest.approx(math.sqrt(5) * 0.001)
    with pytest.raises(sv.CallError, match="2 different time steps"):
        sv.dmc.extrapolate([0.1, 0.1], [(-2.9, 0.01), (-2.9, 0.01)])


def _history(steps=200, nan_at=None):
    e = np.full(steps, -2.9) + 0.001 * np.random.default_rng(0).normal(size=steps)
    if nan_at is not None:
        e[nan_at] = np.nan
    return {"energy": e, "growth_energy": e, "tau_eff": np.full(steps, 0.01), "variance": np.full(steps, 0.1)}


@pytest.mark.parametrize(
    "time_steps, energies, match",
    [
        ([0.02, 0.01], [(np.nan, 0.001), (-2.9, 0.001)], r"energies\[0\] \(at time step 0\.02\) is not finite"),
        ([0.02, 0.01], [(-2.9, 0.001), (-np.inf, 0.001)], r"energies\[1\] \(at time step 0\.01\) is not finite"),
        ([0.02, 0.01], "a run whose energy went NaN", r"energies\[1\] \(at time step 0\.01\) is not finite"),
        ([0.0, 0.01], [(-2.9, 0.001), (-2.9, 0.001)], r"time_steps\[0\] is not a positive finite time step"),
        ([0.02, -0.01], [(-2.9, 0.001), (-2.9, 0.001)], r"time_steps\[1\] is not a positive finite time step"),
        ([np.nan, 0.01], [(-2.9, 0.001), (-2.9, 0.001)], r"time_steps\[0\] is not a positive finite time step"),
        ([np.inf, 0.01], [(-2.9, 0.001), (-2.9, 0.001)], r"time_steps\[0\] is not a positive finite time step"),
        ([0.02, 0.01], [(-2.9, 0.0), (-2.9, 0.001)], r"the error bar of energies\[0\] .* is not positive and finite"),
        ([0.02, 0.01], [(-2.9, 0.001), (-2.9, -0.001)], r"the error bar of energies\[1\] .* is not positive"),
        ([0.02, 0.01], [(-2.9, np.nan), (-2.9, 0.001)], r"the error bar of energies\[0\] .* is not positive"),
        ([0.02, 0.01], [(-2.9, np.inf), (-2.9, 0.001)], r"the error bar of energies\[0\] .* is not positive"),
    ],
)
def test_extrapolate_refuses_what_it_cannot_fit(time_steps, energies, match):
    """Before: a NaN energy gave (nan, 0.0022), a NaN with a finite error bar; a negative time step was fitted."""
    if isinstance(energies, str):  # sv.dmc.energy of a run whose energy was NaN at a step: a Stats of mean NaN
        energies = [sv.dmc.energy(_history()), sv.dmc.energy(_history(nan_at=150))]
        assert math.isnan(energies[1].mean)
    with pytest.raises(sv.CallError, match=r"^shardvmc\.dmc\.extrapolate: " + match) as info:
        sv.dmc.extrapolate(time_steps, energies)
    assert "\n  fix:" in str(info.value)


@pytest.mark.jax_facing  # dtypes as JAX promotes them: on CI's second leg too (the module is not in JAX_FACING)
@pytest.mark.parametrize("x64", [True, False])
def test_mixed_dtypes_give_the_local_energies_of_jax_vmap(x64):
    """float32 walkers with x64 on and a float64 constant in log psi (``jnp.eye``): the walkers' local energies and
    drifts are jax.vmap's of the Hessian trace, in its dtype (the two platforms' programs once disagreed on it)."""

    def log_psi(b, r):
        r12 = jnp.linalg.norm(r[:, None] - r[None] + jnp.eye(2)[..., None], axis=-1)[0, 1]
        return -2.0 * jnp.sum(jnp.linalg.norm(r, axis=-1)) + 0.5 * r12 / (1.0 + b * r12)

    def reference(b, r):
        g = jax.grad(log_psi, 1)(b, r)
        lap = jnp.trace(jax.hessian(lambda x: log_psi(b, x.reshape(r.shape)))(r.reshape(-1)))
        return -0.5 * (lap + jnp.sum(g * g)) + helium_potential(r), g

    with jax.enable_x64(x64):
        r = jnp.asarray(0.7 * np.random.default_rng(0).normal(size=(13, 2, 3)), jnp.float32)
        walkers = sv.WalkerSet(sv.shard_walker(r, mesh_of(1)), 13)
        state = sv.dmc.DMC(log_psi, helium_potential, time_step=0.05).init(jnp.float32(0.3), walkers)
        e, g = jax.vmap(reference, (None, 0))(jnp.float32(0.3), r)
        data = state.walkers.data
        assert data.local_energy.dtype == e.dtype and data.grad.dtype == g.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(data.local_energy)[:13], e, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(np.asarray(data.grad)[:13], g, rtol=1e-4, atol=1e-5)
