"""One process of the multi-process checkpoint tests (started by ``python -m shardvmc.launch``).

Not a test module itself: ``tests/test_checkpoint.py`` launches it as

    python -m shardvmc.launch --processes P --devices-per-process D -- python tests/mp_checkpoint_worker.py MODE DIR

``save`` (2 x 2): checks ``sv.distributed.check_consistent`` with equal and with
diverged parameters, saves ``DIR/walkers.npz`` (version 1), writes what it saw to
``DIR/save_<process>.json``, then starts a second save in which process 1 kills itself
(SIGKILL) once it has started writing its arrays. ``load`` (any layout): restores the
checkpoint, exactly and with ``n_walkers=6``, and writes the rows its devices got to
``DIR/load_<process>.json``.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import shardvmc as sv

N_VALID = 10  # of 12 walkers: 3 per device on 4 devices


def like() -> dict[str, Any]:
    """The structure of the saved walkers (walker counts do not matter)."""
    return {
        "r": jax.ShapeDtypeStruct((1, 2, 3), jnp.float32),
        "keys": jax.random.split(jax.random.key(0), 1),
        "spin": np.zeros(1, np.int32),
        "step": np.int32(0),
    }


def _local(tree: Any) -> dict[str, Any]:
    """Per walker leaf: the rows this process holds (``[start, stop]``) and their values."""
    out = {}
    for name in ("r", "keys", "spin"):
        x = tree[name]
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        shards = sorted(x.addressable_shards, key=lambda s: s.index[0].indices(x.shape[0])[0])
        out[name] = [[list(s.index[0].indices(x.shape[0])[:2]), np.asarray(s.data).tolist()] for s in shards]
    return out


def save(directory: str) -> None:
    me = jax.process_index()
    mesh = sv.create_mesh()
    result: dict[str, Any] = {}

    params = {
        "w": np.arange(4.0, dtype=np.float32),
        "b": sv.replicate(jnp.float32(0.5), mesh),
        "key": jax.random.key(1),
    }
    sv.distributed.check_consistent(params)
    result["equal"] = "passed"
    w = params["w"].copy()
    if me == 1:
        w[2] = np.nextafter(w[2], np.float32(np.inf))  # one unit in the last place
    try:
        sv.distributed.check_consistent({**params, "w": w}, what="parameters")
        result["different"] = None
    except sv.CallError as err:
        result["different"] = str(err)

    init = sv.initialize_walkers_sharded(lambda k: jax.random.normal(k, (2, 3)), N_VALID, mesh, key=jax.random.key(2))
    r = init.data  # 12 walkers (10 valid), 3 on each device
    # (sv.shard_walker cannot place a process-local key array across processes: place its data.)
    keys = jax.random.wrap_key_data(sv.shard_walker(jax.random.key_data(jax.random.split(jax.random.key(3), 12)), mesh))
    spin = np.arange(12, dtype=np.int32) % 2  # host data that every process holds
    walkers = sv.WalkerSet({"r": r, "keys": keys, "spin": spin, "step": np.int32(7)}, n_valid=N_VALID)
    path = os.path.join(directory, "walkers.npz")
    sv.save_walkers(path, walkers, metadata={"version": 1})
    everything = sv.gather_walkers({"r": r, "keys": jax.random.key_data(keys)})  # for the test's reference only
    result["saved"] = {
        "r": everything["r"][:N_VALID].tolist(),
        "keys": everything["keys"][:N_VALID].tolist(),
        "spin": spin[:N_VALID].tolist(),
    }
    result["steps"] = sorted(os.listdir(path))
    with open(os.path.join(directory, f"save_{me}.json"), "w") as f:
        json.dump(result, f)

    if me == 1:  # die once this process has started writing its arrays of the next checkpoint
        import orbax.checkpoint as ocp

        write = ocp.PyTreeCheckpointHandler.async_save

        def start_then_die(*args: Any, **kwargs: Any) -> Any:
            futures = write(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
            return futures  # pragma: no cover

        ocp.PyTreeCheckpointHandler.async_save = start_then_die
    sv.save_walkers(path, jax.tree_util.tree_map(lambda x: x, walkers), metadata={"version": 2})
    print("the second save completed", flush=True)  # never reached: the group is stopped


def load(directory: str) -> None:
    path = os.path.join(directory, "walkers.npz")
    exact = sv.load_walkers(path, like())
    result = {"n_valid": exact.n_valid, "set_n_valid": exact.walkers.n_valid, "metadata": exact.metadata}
    result["exact"] = _local(exact.walkers.data)
    result["step"] = int(np.asarray(exact.walkers.data["step"].addressable_data(0)))
    fewer = sv.load_walkers(path, like(), n_walkers=6)
    result["fewer"] = {"n_valid": fewer.n_valid, "metadata": fewer.metadata, "local": _local(fewer.walkers.data)}
    with open(os.path.join(directory, f"load_{jax.process_index()}.json"), "w") as f:
        json.dump(result, f)


def main(argv: list[str]) -> None:
    mode, directory = argv
    sv.distributed.initialize()
    {"save": save, "load": load}[mode](directory)


if __name__ == "__main__":
    main(sys.argv[1:])
