"""Soak: a long decorated MCMC loop compiles once and does not keep growing in memory.

Two thousand Metropolis steps of a tiny kernel on the 8 fake devices. Asserted: one
trace of the kernel, no backend compilation after the first step, the same number of
live device arrays at step 500 and at step 2000, and resident memory growth between
them below a bound. Nothing here measures time.
"""

from __future__ import annotations

import gc
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, WalkerKey

STEPS = 2000
WARMUP = 500
N_WALKERS = 64
RSS_GROWTH_BOUND = 8 * 2**20  # bytes; measured here: well under 1 MiB (a leaked executable costs MiBs)


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc/self/statm)."""
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
def test_mcmc_loop_compiles_once_and_memory_stays_flat() -> None:
    mesh = sv.create_mesh()
    assert mesh.size == 8
    traces: list[int] = []

    def log_psi(params: dict, r: jax.Array) -> jax.Array:
        return -params["alpha"] * jnp.sum(jnp.linalg.norm(r, axis=-1))

    @sv.walker_parallel(mesh=mesh)
    def metropolis(
        params: Replicated[dict], key: WalkerKey, r: PerWalker[jax.Array]
    ) -> tuple[PerWalker[jax.Array], Mean[jax.Array]]:
        traces.append(1)
        k_move, k_accept = jax.random.split(key)
        proposal = r + 0.3 * jax.random.normal(k_move, r.shape)
        log_ratio = 2 * (log_psi(params, proposal) - log_psi(params, r))
        accept = jnp.log(jax.random.uniform(k_accept)) < log_ratio
        return jnp.where(accept, proposal, r), accept.astype(jnp.float32)

    params = sv.replicate({"alpha": jnp.float32(1.7)}, mesh)
    r = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), N_WALKERS, mesh, key=jax.random.key(1))
    key = jax.random.key(0)

    compiles: list[str] = []

    def on_event(name: str, seconds: float, **kwargs: object) -> None:
        if name == "/jax/core/compile/backend_compile_duration":
            compiles.append(name)

    r, rate = metropolis(params, jax.random.fold_in(key, 0), r)  # compiles here, and only here
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        rates = []
        for step in range(1, STEPS):
            r, rate = metropolis(params, jax.random.fold_in(key, step), r)
            if step % 100 == 0:
                rates.append(float(rate))
            if step == WARMUP:
                jax.block_until_ready(r)
                gc.collect()
                live_at_warmup = len(jax.live_arrays())
                rss_at_warmup = rss_bytes()
        jax.block_until_ready(r)
        gc.collect()
        live_at_end = len(jax.live_arrays())
        rss_at_end = rss_bytes()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)

    assert len(traces) == 1, f"the kernel was traced {len(traces)} times"
    assert compiles == [], f"{len(compiles)} compilations after the first step"
    # No more device arrays alive than at step 500 (walkers, parameters, key, last rate): nothing accumulates.
    assert live_at_end <= live_at_warmup, (live_at_warmup, live_at_end)
    growth = rss_at_end - rss_at_warmup
    assert growth < RSS_GROWTH_BOUND, f"resident memory grew by {growth / 2**20:.1f} MiB over {STEPS - WARMUP} steps"
    # The chain did something sensible: walkers stay sharded and finite, moves are accepted.
    assert isinstance(r, sv.WalkerSet) and r.n_valid == N_WALKERS
    assert r.data.sharding.spec == jax.sharding.PartitionSpec("walkers") and r.data.shape == (N_WALKERS, 2, 3)
    assert np.isfinite(np.asarray(r.data)).all()
    assert 0.05 < float(np.mean(rates)) < 0.95
