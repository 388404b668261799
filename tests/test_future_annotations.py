"""Markers work when annotations are strings (PEP 563)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import shardvmc as sv
from shardvmc import Mean, PerWalker, Replicated, Static, WalkerKey

Params = dict


@sv.walker_parallel
def kernel(
    params: Replicated[Params], r: PerWalker[jax.Array], key: WalkerKey, k: Static[int]
) -> tuple[PerWalker[jax.Array], Mean[jax.Array]]:
    x = params["w"] * jnp.sum(r**k) + jax.random.uniform(key)
    return x, x


def test_string_annotations_resolve_to_markers():
    kinds = [p.kind.value for p in kernel.layout.params]
    assert kinds == ["Replicated", "PerWalker", "WalkerKey", "Static"]
    assert [k.value for k in kernel.layout.output] == ["PerWalker", "Mean"]
    r = jnp.arange(16.0).reshape(8, 2)
    out, mean = kernel({"w": 2.0}, r, jax.random.key(0), 2)
    noise = jax.vmap(lambda i: jax.random.uniform(jax.random.fold_in(jax.random.key(0), i)))(jnp.arange(8))
    np.testing.assert_allclose(out, 2 * jnp.sum(r**2, axis=1) + noise, rtol=1e-6)
    np.testing.assert_allclose(mean, out.mean(), rtol=1e-6)
    assert out.sharding.spec == P("walkers")
