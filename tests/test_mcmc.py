"""shardvmc.mcmc: exact against known densities, chains independent of the device count, padding never counted."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc.mcmc import Metropolis, Walker, adapt_width

ALPHA = 0.5  # log psi = -ALPHA |r|^2: every coordinate of |psi|^2 is N(0, 1 / (4 ALPHA))
SIGMA2 = 1.0 / (4.0 * ALPHA)


def gaussian(alpha: jax.Array, r: jax.Array) -> jax.Array:
    return -alpha * jnp.sum(r**2)


def gaussian_with_phase(alpha: jax.Array, r: jax.Array) -> jax.Array:
    """The same |psi|^2 with a complex phase: the sampler must see exp(2 Re log psi) only."""
    return -alpha * jnp.sum(r**2) + 1j * (3.0 * r[0, 0] - r[1, 2])


def _mesh(k: int):
    return sv.create_mesh(jax.devices()[: min(k, jax.device_count())])


def _walkers(n: int, mesh, shape=(2, 3), scale=1.0) -> sv.WalkerSet:
    return sv.initialize_walkers_sharded(lambda k: scale * jax.random.normal(k, shape), n, mesh, key=jax.random.key(7))


@pytest.mark.parametrize(
    "move, log_psi",
    [("gaussian", gaussian), ("one-electron", gaussian_with_phase), ("mala", gaussian)],
    ids=["gaussian", "one-electron-complex", "mala"],
)
def test_moments_of_a_known_density(move, log_psi):
    """<x^2> and <x^4> of |psi|^2 = N(0, 1/4) per coordinate, within 4 standard errors.

    Walkers are independent chains, so the error of the mean is the spread of the walkers'
    own time averages over sqrt(walkers): honest whatever the autocorrelation within a chain.
    """
    n_walkers, n_burn, n_measure = 192, 8, 12
    sampler = Metropolis(log_psi, n_steps=5, move=move, adapt_rate=0.0)
    alpha = jnp.float32(ALPHA)
    state = sampler.init(alpha, _walkers(n_walkers, None, scale=2.0), width=0.6)

    @jax.jit
    def run(state, key):
        def body(carry, t):
            state = sampler.step(alpha, carry, jax.random.fold_in(key, t))
            return state, (state.walkers.data.r, state.acceptance)

        return jax.lax.scan(body, state, jnp.arange(n_burn + n_measure))

    state, (rs, acceptance) = run(state, jax.random.key(1))
    r = np.asarray(rs[n_burn:, :n_walkers], np.float64)  # (steps, walkers, 2, 3): valid walkers only
    for power, exact in ((2, SIGMA2), (4, 3 * SIGMA2**2)):
        per_walker = np.mean(r**power, axis=(0, 2, 3))
        mean, error = per_walker.mean(), per_walker.std(ddof=1) / math.sqrt(n_walkers)
        assert abs(mean - exact) < 4 * error, (move, power, mean, exact, error)
    assert 0.2 < float(acceptance[-1]) < 0.99
    # the cached log|psi| is that of the positions it is carried with
    cached = np.asarray(state.walkers.data.log_psi[:n_walkers])
    fresh = np.asarray(jax.vmap(lambda x: jnp.real(log_psi(alpha, x)))(state.walkers.data.r[:n_walkers]))
    np.testing.assert_allclose(cached, fresh, rtol=1e-5)


def _cell_integral(offset: int, width: float) -> float:
    """P(x' in [offset, offset + 1)) for x uniform in [0, 1) and x' = x + width N(0, 1)."""
    x = (np.arange(4000) + 0.5) / 4000
    erf = np.vectorize(math.erf)
    phi = lambda z: 0.5 * (1.0 + erf(z / math.sqrt(2.0)))  # noqa: E731
    return float(np.mean(phi((offset + 1 - x) / width) - phi((offset - x) / width)))


def test_transition_probabilities_match_the_metropolis_rule():
    """Detailed balance, on a density that is constant on 4 cells: one move's joint cell counts.

    Walkers start exactly in |psi|^2 (a cell with probability pi_i, uniform inside), make
    one Gaussian move, and the joint frequencies of (start cell, end cell) are compared
    with the exact pi_i T_ij, T_ij = P(propose into j) min(1, pi_j / pi_i): a symmetric
    matrix. Accepting with the ratio of |psi| instead of |psi|^2 would be 10 errors off.
    """
    weights = np.array([1.0, 2.0, 4.0, 1.0])
    pi = weights / weights.sum()
    log_w = jnp.asarray(0.5 * np.log(weights), jnp.float32)

    def cells(params, r):
        x = r[0, 0]
        inside = (x >= 0.0) & (x < 4.0)
        return jnp.where(inside, log_w[jnp.clip(jnp.floor(x), 0, 3).astype(jnp.int32)], -jnp.inf)

    n = 20000
    rng = np.random.default_rng(0)
    start_cell = rng.choice(4, size=n, p=pi)
    x0 = (start_cell + rng.uniform(size=n)).astype(np.float32).reshape(n, 1, 1)
    width = 1.0
    sampler = Metropolis(cells, n_steps=1, adapt_rate=0.0)
    state = sampler.step(None, sampler.init(None, x0, width=width), jax.random.key(3))
    end_cell = np.floor(np.asarray(state.walkers.data.r[:, 0, 0])).astype(int)
    assert end_cell.min() >= 0 and end_cell.max() <= 3  # never accepted outside the support
    joint = np.zeros((4, 4))
    np.add.at(joint, (start_cell, end_cell), 1.0 / n)

    exact = np.zeros((4, 4))
    for i in range(4):
        for j in range(4):
            if i != j:
                exact[i, j] = pi[i] * _cell_integral(j - i, width) * min(1.0, pi[j] / pi[i])
        exact[i, i] = pi[i] - exact[i].sum()
    np.testing.assert_allclose(exact, exact.T, atol=1e-12)  # the rule's detailed balance
    error = np.sqrt(exact * (1 - exact) / n)
    assert np.all(np.abs(joint - exact) < 5 * error + 1e-12), (joint, exact)


def test_chains_are_the_same_on_1_3_and_8_devices():
    """13 walkers (padded on 3 and 8 devices), every move: the same positions, caches, acceptance and width."""
    results = []
    for k in (1, 3, 8):
        mesh = _mesh(k)
        samplers = [Metropolis(gaussian, n_steps=3, move=m, mesh=mesh) for m in ("gaussian", "one-electron", "mala")]
        state = samplers[0].init(jnp.float32(ALPHA), _walkers(13, mesh), width=0.5)
        for t, sampler in enumerate(samplers):
            state = sampler.step(jnp.float32(ALPHA), state, jax.random.key(t))
            assert state.walkers.n_valid == 13
            results.append(jax.tree.map(np.asarray, (state.walkers.valid().data, state.acceptance, state.width)))
    for other in (results[3:6], results[6:9]):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6, atol=1e-6), results[:3], other)


def _chain_written_out(log_psi, params, x, key, width, n_steps, move):
    """One walker's chain move by move, as the module states it: move ``i`` proposes with the normal of
    ``split(fold_in(key, i))[0]`` and accepts where the log of the uniform of ``[1]`` is below
    ``2 (log|psi'| - log|psi|)``; in a sweep, electron ``e`` draws from ``fold_in(fold_in(key, i), e)``."""

    @jax.jit
    def proposal(x, k, e):
        k_move, k_accept = jax.random.split(k)
        noise = jax.random.normal(k_move, x.shape[1:] if move == "one-electron" else x.shape, x.dtype)
        moved = x.at[e].add(width * noise) if move == "one-electron" else x + width * noise
        return moved, jnp.real(log_psi(params, moved)), jnp.log(jax.random.uniform(k_accept, (), x.dtype))

    lp, accepted = jnp.real(log_psi(params, x)), 0
    for i in range(n_steps):
        k = jax.random.fold_in(key, i)
        for e, sub in enumerate([jax.random.fold_in(k, e) for e in range(len(x))] if move == "one-electron" else [k]):
            moved, lp_moved, log_u = proposal(x, sub, e)
            if log_u < 2.0 * (lp_moved - lp):
                x, lp, accepted = moved, lp_moved, accepted + 1
    return np.asarray(x), accepted


@pytest.mark.usefixtures("x64")
@pytest.mark.parametrize("move", ["gaussian", "one-electron"])
def test_each_move_draws_from_its_own_keys_across_blocks_of_draws(move):
    """35 moves (the sampler draws its random numbers 32 moves at a time: a full block and a part of one) are the
    chain written out move by move from each walker's key ``fold_in(key, walker)``, on 3 devices."""
    sampler = Metropolis(gaussian_with_phase, n_steps=35, move=move, adapt_rate=0.0, mesh=_mesh(3))
    alpha, key, walkers = jnp.float64(ALPHA), jax.random.key(11), _walkers(3, _mesh(3))
    state = sampler.step(alpha, sampler.init(alpha, walkers, width=0.6), key)
    moves = 35 * (2 if move == "one-electron" else 1)
    total = 0
    for w in range(3):
        x, accepted = _chain_written_out(
            gaussian_with_phase, alpha, walkers.data[w], jax.random.fold_in(key, w), 0.6, 35, move
        )
        np.testing.assert_allclose(np.asarray(state.walkers.data.r[w]), x, rtol=1e-12, atol=1e-12)
        total += accepted
    assert 0 < total < 3 * moves  # moves accepted and rejected both
    np.testing.assert_allclose(float(state.acceptance), total / (3 * moves), rtol=1e-12)


def test_chunked_moves_equal_unchunked():
    """batch_size= bounds memory without changing the chains."""
    sampler = Metropolis(gaussian, n_steps=2, move="one-electron")
    state = sampler.init(jnp.float32(ALPHA), _walkers(13, None), width=0.5)
    whole = sampler.step(jnp.float32(ALPHA), state, jax.random.key(2))
    chunked = sampler.with_options(batch_size=3).step(jnp.float32(ALPHA), state, jax.random.key(2))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), whole, chunked)


def test_acceptance_counts_valid_walkers_only():
    """Valid walkers accept every move, padding walkers none: the acceptance is exactly 1."""

    def box(params, r):  # |psi|^2 uniform on |x| < 1
        return jnp.where(jnp.all(jnp.abs(r) < 1.0), 0.0, -jnp.inf)

    sampler = Metropolis(box, n_steps=4, adapt_rate=0.0)
    data = jnp.concatenate([jnp.zeros((5, 1, 3)), jnp.full((3, 1, 3), 5.0)])  # 5 valid walkers, 3 outside the box
    state = sampler.init(None, sv.WalkerSet(data, 5), width=1e-3)
    state = sampler.step(None, state, jax.random.key(0))
    assert float(state.acceptance) == 1.0

    @sv.walker_parallel
    def per_walker(w: sv.PerWalker[Walker], key: sv.WalkerKey) -> tuple[sv.PerWalker, sv.PerWalker]:
        return sampler.kernel(None, w, key, jnp.float32(1e-3), True)  # nested: this walker's own acceptance

    _, each = per_walker(sv.WalkerSet(state.walkers.data, 8), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(each.data), [1.0] * 5 + [0.0] * 3)
    # the engine's own padding (7 walkers on 3 devices) is left out too
    state = Metropolis(box, n_steps=2, adapt_rate=0.0, mesh=_mesh(3)).init(None, jnp.zeros((7, 1, 3)), width=1e-3)
    assert (
        float(Metropolis(box, n_steps=2, adapt_rate=0.0, mesh=_mesh(3)).step(None, state, jax.random.key(1)).acceptance)
        == 1.0
    )


def test_width_adapts_to_the_target_acceptance():
    """From a width far too small and one far too large, the acceptance reaches the target and the widths agree."""
    sampler = Metropolis(gaussian, n_steps=4, target_acceptance=0.5, adapt_rate=1.0)
    alpha = jnp.float32(ALPHA)

    @jax.jit
    def run(state):
        return jax.lax.fori_loop(0, 40, lambda t, s: sampler.step(alpha, s, jax.random.key(t)), state)

    ends = [run(sampler.init(alpha, _walkers(256, None), width=w)) for w in (0.01, 30.0)]
    for end in ends:
        assert abs(float(end.acceptance) - 0.5) < 0.05, float(end.acceptance)
    assert abs(math.log(float(ends[0].width) / float(ends[1].width))) < 0.2
    assert float(adapt_width(jnp.float32(2.0), jnp.float32(0.5), target=0.5)) == 2.0  # the fixed point


def test_step_inside_jit_equals_eager():
    sampler = Metropolis(gaussian, n_steps=2, move="one-electron")
    state = sampler.init(jnp.float32(ALPHA), _walkers(16, None), width=0.5)
    eager = sampler.step(jnp.float32(ALPHA), state, jax.random.key(5))
    traces = []

    @jax.jit
    def step(state, key):
        traces.append(key)
        return sampler.step(jnp.float32(ALPHA), state, key)

    jitted = step(state, jax.random.key(5))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6), eager, jitted)
    step(jitted, jax.random.key(6))  # init placed the width like a step's output: no second compilation
    assert len(traces) == 1


def test_bad_settings_are_call_errors():
    with pytest.raises(sv.CallError, match="move='hmc'"):
        Metropolis(gaussian, move="hmc")
    with pytest.raises(sv.CallError, match="n_steps=0"):
        Metropolis(gaussian, n_steps=0)
    with pytest.raises(sv.CallError, match="adapt_rate"):
        Metropolis(gaussian, adapt_rate=-1.0)


@pytest.mark.parametrize("move", ["gaussian", "one-electron", "mala"])
def test_integer_positions_are_sampled_as_floats(move):
    """Integer positions (a lattice, np.zeros(..., int)) give the chains of the same positions as floats of JAX's
    default float dtype; so does the local energy of the walkers."""
    lattice = np.arange(16 * 2 * 3).reshape(16, 2, 3) % 3 - 1  # int64 on the host
    sampler = Metropolis(gaussian, n_steps=3, move=move)
    alpha = jnp.float32(ALPHA)
    as_floats = sampler.step(alpha, sampler.init(alpha, lattice.astype(np.float32)), jax.random.key(3))
    from_ints = sampler.step(alpha, sampler.init(alpha, lattice), jax.random.key(3))
    assert from_ints.walkers.data.r.dtype == jnp.float32 and from_ints.walkers.data.log_psi.dtype == jnp.float32
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), from_ints, as_floats)
    energy = sv.hamiltonian.local_energy(gaussian, lambda r: 2 * ALPHA**2 * jnp.sum(r**2))  # the oscillator's E_L
    np.testing.assert_allclose(np.asarray(energy(alpha, lattice)), 6 * ALPHA, rtol=1e-6)


@pytest.mark.parametrize(
    "log_psi, got",
    [
        (lambda p, r: -jnp.sum(r**2, keepdims=True).reshape(1), "shape (1,)"),  # a Dense(1) output without [0]
        (lambda p, r: -jnp.sum(r**2, axis=1), "shape (2,)"),  # a batch axis
        (lambda p, r: (jnp.float32(1.0), -jnp.sum(r**2)), "returned a tuple"),  # (sign, log|psi|)
    ],
    ids=["dense-1", "per-electron", "sign-and-log"],
)
def test_a_log_psi_that_is_not_one_number_is_refused_at_init(log_psi, got):
    sampler = Metropolis(log_psi)
    with pytest.raises(sv.CallError, match="not one number") as info:
        sampler.init(None, jnp.zeros((8, 2, 3)))
    assert got in str(info.value) and "fix:" in str(info.value)
    with pytest.raises(sv.CallError, match="not one number"):
        sv.hamiltonian.local_energy(log_psi)(None, jnp.zeros((8, 2, 3)))
    complex_ok = Metropolis(gaussian_with_phase).init(jnp.float32(ALPHA), jnp.zeros((8, 2, 3)))  # complex: allowed
    assert complex_ok.walkers.data.log_psi.dtype == jnp.float32
