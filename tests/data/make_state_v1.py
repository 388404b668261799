"""How ``state_v1/``, a training-state checkpoint of shardvmc 0.3.0 (header version 1, no checksums), was written.

Kept as a record. Run with shardvmc 0.3.0 (commit b68f7d2 on main) importable, from the repository root::

    python tests/data/make_state_v1.py tests/data/state_v1

One process of 8 fake CPU devices, float64. ``tests/test_checkpoint.py`` rebuilds the same state with
:func:`state` and loads the directory with today's shardvmc.
"""

from __future__ import annotations

import os
import sys

import numpy as np

N_VALID = 13  # walkers, padded to 16 on 8 devices


def state(mesh: object) -> dict:
    """The saved state, built on ``mesh`` (``jax_enable_x64`` on): every kind of leaf a checkpoint holds."""
    import jax
    import jax.numpy as jnp

    import shardvmc as sv

    # Random bits scaled exactly (not jax.random.normal, whose float results differ between JAX versions): the same
    # walkers, bit for bit, on every JAX the tests run on.
    def walker(key: jax.Array) -> jax.Array:
        return jax.random.bits(key, (2, 3), jnp.uint32).astype(jnp.float64) / 2.0**32 - 0.5

    walkers = sv.initialize_walkers_sharded(walker, N_VALID, mesh, key=jax.random.key(3))
    # constants, not jnp.linspace: its values depend on XLA's optimisations (a fused multiply-add or not)
    params = sv.replicate({"w": jnp.array([-1.0, -0.75, -0.5, 0.0, 0.25, 0.5, 1.0]), "b": jnp.float32(0.5)}, mesh)
    return {
        "walkers": walkers,
        "params": params,
        "step": 41,
        "energy": -2.875,
        "key": jax.random.key(9),
        "history": np.array([-2.5, -2.75, -2.875]),
    }


if __name__ == "__main__":
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from shardvmc.testing import set_cpu_devices

    set_cpu_devices(8)
    import jax

    jax.config.update("jax_enable_x64", True)
    import shardvmc as sv

    sv.save_state(sys.argv[1], state(sv.create_mesh()), metadata={"written_by": "shardvmc 0.3.0"})
    sv.wait_for_saves()
