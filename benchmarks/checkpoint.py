"""Training-state checkpoints: save and restore times and bytes, and the per-step cost of asynchronous saves.

    python benchmarks/checkpoint.py io                      # 8 fake devices: save, restore on 8 and on 3
    python -m shardvmc.launch -n 2 --devices-per-process 2 -- \\
        python benchmarks/checkpoint.py io --dir /tmp/ckpt2x2   # 2 x 2 processes: save, restore on 2 x 2
    python benchmarks/checkpoint.py io --restore-only --dir /tmp/ckpt2x2 --devices 3   # that one, on 1 x 3
    python benchmarks/checkpoint.py steps                   # the neural example's step, saves every 10 steps vs none
    python benchmarks/checkpoint.py history                 # sv.driver.run's saves at step 1,000 and at 100,000

``io``: a state of 65,536 walkers of 16 electrons in float64 (a ``WalkerSet``, 25.2 MB)
plus 10^6 float64 parameters with an optax Adam state (24 MB), the step and a key, saved
with ``sv.save_state`` and restored with ``sv.load_state``; beside it, the walkers alone
through ``sv.save_state`` (asynchronous) and ``sv.save_walkers`` (the same storage,
returning once committed), measured in turn in each repetition. Figures are medians over
``--reps`` repetitions, in seconds: ``save`` until the call returns (the state is on the
host), ``commit`` until the checkpoint is on disk, ``restore``. ``checksums on save`` and
``checksums on restore`` time what the checksums of every array add to a save and a restore
of the whole state (computing them; checking the arrays read against them), measured alone in
the same repetitions: a save or restore without checksums takes that much less.

``steps``: the optimisation step of ``examples/neural_vmc.py`` (FermiNet-style network,
folx Laplacian, natural gradient by minSR, the example's default, or ``--optimiser``;
imported from the example by file path) in
blocks of 20 steps, with a ``sv.Checkpointer`` save of the whole state every 10 steps
and without, the two blocks interleaved (the order reversed every other repetition);
the figure is the median over repetitions of the per-block ratio of step times.

``history``: what a save of ``sv.driver.run`` costs late in a long run, of a trivial step (a counter, three
statistics). For each length (``--at``, default 1,000 and 100,000 steps) the run's directory is pre-filled
as ``sv.driver.run`` leaves it ``--saves`` x 10 steps before that length (``log.jsonl`` with a line per step,
a checkpoint of the state, the key and the step count), and ``sv.driver.run`` resumes it with a save every 10
steps, ``--reps`` times (the lengths in turn): ``save s`` is the median time of the loop's save (the log's
flush and ``Checkpointer.save`` until it returns; each run's first save left out as the warm-up), ``bytes``
the size of the checkpoint of the last step (median); each run's history is checked to be the whole run's.
The ratios are the longest run's over the shortest's. ``history in the metadata`` is what a save cost when
every checkpoint carried every step's statistics (the same state saved ``--saves`` times with that metadata,
as ``sv.driver.run`` did before, after all the runs): its time and bytes grow with the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _request_devices(n: int) -> None:
    from shardvmc.testing import set_cpu_devices

    if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    set_cpu_devices(n)


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def make_state(mesh: Any, walkers: int, electrons: int, params: int) -> dict[str, Any]:
    """The benchmark's training state (float64; ``jax_enable_x64`` on)."""
    import jax
    import jax.numpy as jnp
    import optax

    import shardvmc as sv

    walker_set = sv.initialize_walkers_sharded(
        lambda k: jax.random.normal(k, (electrons, 3), jnp.float64), walkers, mesh, key=jax.random.key(0)
    )
    half = params // 2
    p = jax.jit(
        lambda: {
            "w1": jax.random.normal(jax.random.key(1), (half // 1000, 1000), jnp.float64),
            "w2": jax.random.normal(jax.random.key(2), (params - half // 1000 * 1000,), jnp.float64),
        }
    )()
    p = sv.replicate(p, mesh)
    adam = optax.adam(1e-3)
    opt = jax.jit(lambda q: adam.update(jax.tree.map(jnp.sin, q), adam.init(q), q)[1])(p)
    return {"walkers": walker_set, "params": p, "opt": opt, "step": 1000, "key": jax.random.key(3)}


def checksum_times(state: dict[str, Any]) -> tuple[float, float]:
    """Seconds to compute the checksums of ``state``'s arrays as a save does, and to check them as a restore does."""
    import jax

    import shardvmc as sv
    from shardvmc import _checksum  # the checksums a checkpoint stores (benchmarked, not public)

    walker_leaves = jax.tree.leaves(state["walkers"].data)
    other = [x for x in jax.tree.leaves({k: v for k, v in state.items() if k != "walkers"}) if isinstance(x, jax.Array)]
    other = [jax.random.key_data(x) if jax.numpy.issubdtype(x.dtype, jax.dtypes.prng_key) else x for x in other]
    start = time.perf_counter()
    sums = [_checksum.row_checksums(x) for x in walker_leaves] + [_checksum.checksum(x) for x in other]
    jax.block_until_ready(sums)
    saved = time.perf_counter() - start
    start = time.perf_counter()
    rows = [x.shape[0] for x in walker_leaves]
    flags = [_checksum.differs(x, s, n) for x, s, n in zip(walker_leaves, sums, rows)]
    flags += [_checksum.differs(x, s) for x, s in zip(other, sums[len(walker_leaves) :])]
    assert not any(jax.device_get(flags)) and isinstance(state["walkers"], sv.WalkerSet)
    return saved, time.perf_counter() - start


def io(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import numpy as np

    import shardvmc as sv

    if sv.distributed.is_launched():
        sv.distributed.initialize()
    jax.config.update("jax_enable_x64", True)
    mesh = sv.create_mesh()
    me = jax.process_index()
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-bench-"))
    layout = f"{jax.process_count()} x {jax.local_device_count()}"
    state = make_state(mesh, args.walkers, args.electrons, args.params)
    result: dict[str, Any] = {"layout": layout, "walkers": args.walkers, "electrons": args.electrons}
    arrays = [x for x in jax.tree.leaves(state) if hasattr(x, "dtype") and x.ndim]
    result["state_mb"] = sum(np.dtype(x.dtype).itemsize * x.size for x in arrays) / 1e6
    if args.restore_only:
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            restored, _ = sv.load_state(base / "state", state, mesh=mesh)
            jax.block_until_ready(restored)
            times.append(time.perf_counter() - start)
        result.update({"restore s": _median(times), "reps": args.reps})
        print(json.dumps(result, indent=1))
        return result
    other = sv.create_mesh(jax.devices()[:3]) if jax.process_count() == 1 and jax.device_count() > 3 else None
    walkers_only = {"walkers": state["walkers"]}
    rows: dict[str, list[float]] = {}

    def add(name: str, seconds: float) -> None:
        rows.setdefault(name, []).append(seconds)

    for rep in range(args.reps + 1):  # the first round compiles and warms the file system: not counted
        order = ["state", "walkers-orbax", "walkers-save_walkers"]
        for variant in order if rep % 2 else order[::-1]:
            target = base / variant
            if variant == "walkers-save_walkers":
                start = time.perf_counter()
                sv.save_walkers(target, state["walkers"])
                saved = time.perf_counter() - start
                committed = saved
                start = time.perf_counter()
                jax.block_until_ready(sv.load_walkers(target, state["walkers"], mesh).walkers.data)
                restored = time.perf_counter() - start
                size = _bytes(target)
            else:
                tree = state if variant == "state" else walkers_only
                start = time.perf_counter()
                sv.save_state(target, tree)
                saved = time.perf_counter() - start
                sv.wait_for_saves()
                committed = time.perf_counter() - start
                start = time.perf_counter()
                jax.block_until_ready(sv.load_state(target, tree, mesh=mesh)[0])
                restored = time.perf_counter() - start
                size = _bytes(target)
                if other is not None and variant == "state":
                    start = time.perf_counter()
                    jax.block_until_ready(sv.load_state(target, tree, mesh=other)[0])
                    add("state restore on 3 devices", time.perf_counter() - start)
                    start = time.perf_counter()
                    jax.block_until_ready(sv.load_state(target, tree, mesh=other, n_walkers=2 * args.walkers)[0])
                    add("state restore on 3 devices, twice the walkers", time.perf_counter() - start)
            if variant == "state":
                on_save, on_restore = checksum_times(state)
                if rep:
                    add("checksums on save", on_save)
                    add("checksums on restore", on_restore)
            if rep:
                add(f"{variant} save", saved)
                add(f"{variant} commit", committed)
                add(f"{variant} restore", restored)
                result[f"{variant} MB"] = size / 1e6
    if rows.get("state restore on 3 devices"):
        rows = {k: v[1:] if k.startswith("state restore on 3") else v for k, v in rows.items()}  # (first: warm-up)
    result.update({f"{k} s": _median(v) for k, v in rows.items()})
    result["checksums share of the state's commit"] = result["checksums on save s"] / result["state commit s"]
    result["checksums share of the state's restore"] = result["checksums on restore s"] / result["state restore s"]
    result["reps"] = args.reps
    if me == 0:
        print(json.dumps(result, indent=1))
    return result


def steps(args: argparse.Namespace) -> dict[str, Any]:
    from harness import neural_example

    nv = neural_example()
    import jax
    import numpy as np
    from jax.flatten_util import ravel_pytree

    import shardvmc as sv

    # The example's default optimiser (minSR), unless given.
    optimiser = args.optimiser or "minsr"
    config = nv.Config(system=args.system, walkers=args.walkers, sweeps=args.sweeps, optimiser=optimiser)
    mesh = sv.create_mesh()
    root = jax.random.key(config.seed)
    with jax.enable_x64(True), sv.use_mesh(mesh):
        steps = nv.make_steps(config, mesh)
        state = nv.initial_state(config, mesh, steps)
        n_params = int(ravel_pytree(state.params)[0].size)
        t = 0
        blocking: list[float] = []

        def block(ckpt: Any) -> float:
            nonlocal state, t
            start = time.perf_counter()
            for _ in range(args.block):
                state, stats = steps.train(state, jax.random.fold_in(root, t + 1))
                np.asarray(stats)  # the example reads the statistics every step
                t += 1
                if ckpt is not None and t % args.every == 0:
                    s0 = time.perf_counter()
                    ckpt.save(t, {"state": state, "step": t, "key": root})
                    blocking.append(time.perf_counter() - s0)
            return (time.perf_counter() - start) / args.block

        directory = Path(tempfile.mkdtemp(prefix="ckpt-steps-"))
        with sv.Checkpointer(directory, keep=2) as ckpt:
            block(None)
            block(ckpt)  # warm-up: compiles, first saves
            ratios, plain, saving = [], [], []
            for rep in range(args.reps):
                pair = {}
                for variant in ("plain", "saving") if rep % 2 == 0 else ("saving", "plain"):
                    pair[variant] = block(ckpt if variant == "saving" else None)
                plain.append(pair["plain"])
                saving.append(pair["saving"])
                ratios.append(pair["saving"] / pair["plain"])
                print(f"rep {rep}: {pair['plain']:.3f} s/step plain, {pair['saving']:.3f} saving", file=sys.stderr)
            ckpt.wait()
            arrays = [x for x in jax.tree.leaves(state) if hasattr(x, "dtype") and x.ndim]
            state_bytes = sum(np.dtype(x.dtype).itemsize * x.size for x in arrays)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    result = {
        "system": config.system,
        "optimiser": config.optimiser,
        "walkers": config.walkers,
        "n_params": n_params,
        "devices": int(mesh.devices.size),
        "state_mb": state_bytes / 1e6,
        "step_s": _median(plain),
        "step_with_saves_s": _median(saving),
        "ratio": statistics.median(ratios),
        "ratio_q25": q[0],
        "ratio_q75": q[2],
        "save_blocking_s": _median(blocking),
        # what the blocking part of the saves alone adds to a step (the rest is the background write's share
        # of the CPU, which the ratio above includes)
        "blocking_per_step_fraction": _median(blocking) / args.every / _median(plain),
        "reps": args.reps,
        "block": args.block,
        "every": args.every,
    }
    print(json.dumps(result, indent=1))
    return result


def _trivial_step() -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(lambda x, key: (x + 1, {"energy": x * 0.5, "error": jnp.float32(0.25), "variance": jnp.sqrt(x)}))


def _prefill(directory: Path, start: int, key: Any) -> dict[str, list[float]]:
    """``directory`` as ``sv.driver.run`` of the trivial step leaves it after ``start`` steps; the history written."""
    import jax
    import numpy as np

    import shardvmc as sv

    rng = np.random.default_rng(0)
    history = {
        "energy": (np.arange(start) * 0.5).tolist(),
        "error": [0.25] * start,
        "variance": np.sqrt(np.arange(start, dtype=np.float32)).astype(float).tolist(),
        "step_time": rng.uniform(1e-4, 2e-4, start).tolist(),  # full-precision floats, as the loop's clock gives
    }
    directory.mkdir(parents=True)
    with open(directory / "log.jsonl", "w") as f:
        for t in range(start):
            f.write(json.dumps({"step": t, **{name: values[t] for name, values in history.items()}}) + "\n")
    state = {"state": jax.numpy.float32(start), "key": np.asarray(jax.random.key_data(key))}
    with sv.Checkpointer(directory / "state") as ckpt:
        ckpt.save(start, state, metadata={"step": start, "user": {}})  # what sv.driver.run saves
    return history


def _legacy_saves(directory: Path, full: dict[str, list[float]], start: int, n: int, every: int) -> tuple[list, int]:
    """The times of ``n`` saves of the same state with every step's statistics in the metadata (as before), and the
    bytes of the last."""
    import jax
    import numpy as np

    import shardvmc as sv

    times = []
    with sv.Checkpointer(directory, keep=1) as ckpt:
        for k in range(n):
            t = start + k * every
            meta = {"step": t, "history": {name: v[:t] for name, v in full.items()}, "user": {}}
            state = {"state": jax.numpy.float32(t), "key": np.asarray(jax.random.key_data(jax.random.key(0)))}
            begin = time.perf_counter()
            ckpt.save(t, state, metadata=meta)
            times.append(time.perf_counter() - begin)
        ckpt.wait()
    return times[1:], _bytes(directory / str(t))


def history(args: argparse.Namespace) -> dict[str, Any]:
    import jax

    import shardvmc as sv
    from shardvmc import _driver  # the loop's save, timed where the loop calls it (benchmarked, not public)

    step, key, every = _trivial_step(), jax.random.key(0), 10
    times: list[float] = []
    save = _driver._Loop.save

    def timed_save(loop: Any, done: int) -> None:
        start = time.perf_counter()
        save(loop, done)
        times.append(time.perf_counter() - start)

    setattr(_driver._Loop, "save", timed_save)
    base = Path(args.dir or tempfile.mkdtemp(prefix="ckpt-history-"))
    rows: dict[int, dict[str, list[float]]] = {length: {} for length in args.at}
    try:
        for rep in range(args.reps):  # the lengths in turn, the order reversed every other repetition
            for length in args.at if rep % 2 == 0 else args.at[::-1]:
                directory, start = base / f"{rep}-{length}", length - args.saves * every
                _prefill(directory, start, key)
                times.clear()
                run = sv.driver.run(step, jax.numpy.float32(0), length, key=key, checkpoint=directory,
                                    checkpoint_every=every, keep=2, progress=False)  # fmt: skip
                assert len(run.history["energy"]) == length  # the whole history, read back from the log
                row = rows[length]
                row.setdefault("save s", []).extend(times[1:])  # (the first: warm-up)
                row.setdefault("bytes", []).append(_bytes(directory / "state" / str(length)))
    finally:
        setattr(_driver._Loop, "save", save)
    # After all the runs: their megabytes written back to the disk would slow the saves of the runs that followed.
    for length in args.at:
        start = length - args.saves * every
        full = _prefill(base / f"legacy-{length}", start, key)
        legacy, size = _legacy_saves(base / f"legacy-{length}" / "legacy", full, start, args.saves, every)
        rows[length]["history in the metadata: save s"] = legacy
        rows[length]["history in the metadata: bytes"] = [size]
    result: dict[str, Any] = {str(n): {k: _median(v) for k, v in row.items()} for n, row in rows.items()}
    first, last = result[str(args.at[0])], result[str(args.at[-1])]
    for what in ("save s", "bytes", "history in the metadata: save s", "history in the metadata: bytes"):
        result[f"{what} ratio"] = last[what] / first[what]
    result.update(saves=args.saves, reps=args.reps, every=every)
    print(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="part", required=True)
    p_io = sub.add_parser("io", help="save and restore times and bytes")
    p_io.add_argument("--walkers", type=int, default=65536)
    p_io.add_argument("--electrons", type=int, default=16)
    p_io.add_argument("--params", type=int, default=10**6)
    p_io.add_argument("--reps", type=int, default=3)
    p_io.add_argument("--devices", type=int, default=8, help="fake CPU devices of one process (default 8)")
    p_io.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p_io.add_argument("--restore-only", action="store_true", help="restore the state saved in --dir")
    p_steps = sub.add_parser("steps", help="per-step cost of asynchronous saves in the neural example")
    p_steps.add_argument("--system", default="Li")
    p_steps.add_argument("--walkers", type=int, default=512)
    p_steps.add_argument("--sweeps", type=int, default=20, help="Metropolis moves per step (the example's default)")
    p_steps.add_argument("--optimiser", default=None, help="default: the example's (minsr)")
    p_steps.add_argument("--reps", type=int, default=7)
    p_steps.add_argument("--block", type=int, default=20, help="steps per timed block")
    p_steps.add_argument("--every", type=int, default=10, help="steps between saves")
    p_steps.add_argument("--devices", type=int, default=8)
    p_history = sub.add_parser("history", help="sv.driver.run's save time and checkpoint size, early and late")
    p_history.add_argument("--at", type=int, nargs="+", default=[1000, 100000], help="run lengths (steps)")
    p_history.add_argument("--saves", type=int, default=21, help="saves of each run (the first: warm-up)")
    p_history.add_argument("--reps", type=int, default=3, help="runs at each length")
    p_history.add_argument("--devices", type=int, default=1)
    p_history.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    for p in (p_io, p_steps, p_history):
        p.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args(argv)
    if not os.environ.get("SHARDVMC_NUM_PROCESSES"):  # the launcher sets the device count itself
        _request_devices(args.devices)
    result = {"io": io, "steps": steps, "history": history}[args.part](args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
