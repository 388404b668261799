"""batch_size="auto": the largest chunk whose compiled per-device bytes fit the budget."""

import dataclasses

import folx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import shardvmc as sv
from shardvmc._memory import compiled_memory


def heavy(w: sv.Replicated[jax.Array], r: sv.PerWalker[jax.Array]) -> sv.PerWalker[jax.Array]:
    """A forward Laplacian, whose per-walker Jacobians make memory grow with the chunk."""
    return folx.forward_laplacian(lambda x: jnp.sum(jnp.tanh(jnp.tanh(x @ w) @ w.T)))(r).laplacian


W = jax.random.normal(jax.random.key(0), (48, 256)) / 8
R = jax.random.normal(jax.random.key(1), (64, 48))  # 16 walkers per device on 4 devices
MESH = sv.create_mesh(jax.devices()[:4])


def needs(batch_size):
    """Per-device bytes of the kernel compiled with a fixed chunk (None: all walkers at once)."""
    kernel = sv.walker_parallel(heavy, mesh=MESH, batch_size=batch_size)
    return compiled_memory(kernel.lower(W, R).compile()).total_bytes


@pytest.fixture(scope="module")
def sizes():
    return {bs: needs(bs) for bs in (None, 8, 4, 2)}


def test_everything_at_once_when_it_fits(sizes):
    kernel = sv.walker_parallel(heavy, mesh=MESH, batch_size="auto", memory_budget=sizes[None])
    np.testing.assert_allclose(
        kernel(W, R), jax.vmap(heavy, (None, 0))(W, R), rtol=1e-3
    )  # float32 sums of large products, chunked differently
    assert list(kernel.chosen_batch_sizes.values()) == [None]


@pytest.mark.parametrize("fits", [8, 4, 2])
def test_the_chosen_chunk_fits_and_its_larger_neighbour_does_not(sizes, fits):
    assert sizes[None] > sizes[8] > sizes[4] > sizes[2]  # memory grows with the chunk
    larger = {8: None, 4: 8, 2: 4}[fits]
    budget = sizes[fits]
    kernel = sv.walker_parallel(heavy, mesh=MESH, batch_size="auto", memory_budget=budget)
    out = kernel(W, R)
    (chosen,) = kernel.chosen_batch_sizes.values()
    assert chosen == fits
    assert needs(chosen) <= budget < needs(larger)
    np.testing.assert_allclose(
        out, jax.vmap(heavy, (None, 0))(W, R), rtol=1e-3
    )  # float32 sums of large products, chunked differently
    assert kernel.explain(W, R).batch_size == fits
    kernel(W, R[:32])  # another shape: chosen again, once
    assert len(kernel.chosen_batch_sizes) == 2


def test_nothing_fits_is_a_call_error(sizes):
    kernel = sv.walker_parallel(heavy, mesh=MESH, batch_size="auto", memory_budget=min(sizes.values()) // 4)
    with pytest.raises(sv.CallError, match=r"(?s)no chunk that fits.*memory_budget"):
        kernel(W, R)


def test_memory_budget_needs_auto():
    with pytest.raises(sv.DecorationError, match="batch_size='auto'"):
        sv.walker_parallel(heavy, batch_size=4, memory_budget=1 << 20)
    assert dataclasses.is_dataclass(sv.walker_parallel(heavy, batch_size="auto")._options)
