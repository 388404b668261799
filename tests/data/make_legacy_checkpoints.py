"""How the 0.2.0-format walker checkpoints in this directory were written (kept as a record).

Run with shardvmc 0.2.0 (commit cee389f on main) importable, from the repository root:

    python tests/data/make_legacy_checkpoints.py one tests/data
    python -m shardvmc.launch -n 2 --devices-per-process 2 -- \\
        python tests/data/make_legacy_checkpoints.py two tests/data

``one``: ``walkers_v1.npz``, one process of 8 devices, float64 (format version 1).
``two``: ``walkers_v2.npz`` with its data directory, 2 processes x 2 devices (format version 2).
``tests/test_checkpoint.py`` rebuilds the same walkers with :func:`walkers` and loads both files.
"""

from __future__ import annotations

import os
import sys

import numpy as np

N, N_VALID = 16, 11


def walkers(x64: bool) -> dict:
    """The saved walkers as host data (all ``N`` rows; the first ``N_VALID`` are saved)."""
    import jax
    import jax.numpy as jnp

    i = np.arange(N)
    return {
        "r": (np.arange(N * 6).reshape(N, 2, 3) / 7).astype(np.float64 if x64 else np.float32),
        "spin": (i % 2).astype(np.int32),
        "moved": i % 3 == 0,
        "log_psi": (-(i.astype(np.float32)) / 4).astype(jnp.bfloat16),
        "keys": jax.random.split(jax.random.key(5), N),
    }


def main(mode: str, directory: str) -> None:
    if mode == "one":
        os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    import shardvmc as sv

    if mode == "two":
        sv.distributed.initialize()
    x64 = mode == "one"
    jax.config.update("jax_enable_x64", x64)
    mesh = sv.create_mesh()
    host = walkers(x64)
    tree = sv.shard_walker({k: v for k, v in host.items() if k != "keys"}, mesh)
    tree["keys"] = jax.random.wrap_key_data(sv.shard_walker(jax.random.key_data(host["keys"]), mesh))
    name = "walkers_v1.npz" if mode == "one" else "walkers_v2.npz"
    sv.save_walkers(os.path.join(directory, name), sv.WalkerSet(tree, N_VALID), metadata={"written_by": "0.2.0"})


if __name__ == "__main__":
    main(*sys.argv[1:])
