"""Natural gradient at scale: per-device memory, collectives and time of sv.natural_gradient's solvers.

Prints one table (the format of ``run.py``). For N walkers and P parameters on 8 fake
CPU devices, float32:

- **memory and collectives** (P = 1e4, 1e5, 1e6; N = 4096): each solver and a
  straightforward replicated solve (all-gather J, solve the N x N system on every
  device) are lowered for ``jax.ShapeDtypeStruct`` inputs with the walker sharding and
  compiled, never run: temporary bytes per device (``memory_analysis``), the
  collectives of the compiled HLO, and whether a P x P buffer or a full N x P J
  appears on one device.
- **time** (P = 1e4 and 1e5): minSR and CG against the replicated solve, interleaved in
  one run, median ratio over repetitions with quartiles (``harness.interleaved``).
  Fake devices share the host's cores, so the replicated solve's 8 copies of the
  work cost 8 times here; N is smaller than 4096 (``--time-walkers``) so that a
  repetition takes seconds and the gathered J stays far below the shared machine's
  memory (at N = 4096, P = 1e5 it would be 1.6 GB per fake device, 13 GB in all).

Usage (from the repository root)::

    python benchmarks/natgrad.py                 # about 3 minutes on 2 cores
    python benchmarks/natgrad.py --quick         # small sizes, seconds
"""

import argparse
import json
import os
import re
import sys
import time
from typing import Any

from harness import fill_defaults  # this folder is on sys.path when run as a script; starts no backend

QUICK = {"walkers": 256, "params": "1000,10000", "time_walkers": "128,64", "time_params": "1000,4000", "reps": 3}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run)")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (default 8)")
    parser.add_argument("--walkers", type=int, help="N of the memory table (default 4096)")
    parser.add_argument("--params", help="P of the memory table, comma-separated (default 10000,100000,1000000)")
    parser.add_argument("--time-params", help="P of the timings (default 10000,100000)")
    parser.add_argument("--time-walkers", help="N of each timing (default 1024,256)")
    parser.add_argument("--reps", type=int, help="timed repetitions per ratio (default 9)")
    parser.add_argument("--json", default="", help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    defaults = {
        "walkers": 4096,
        "params": "10000,100000,1000000",
        "time_params": "10000,100000",
        "time_walkers": "1024,256",
        "reps": 9,
    }
    return fill_defaults(args, defaults, QUICK)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:0] = [here, os.path.dirname(here)]  # the harness, and this checkout's shardvmc
    from shardvmc.testing import set_cpu_devices

    # Before JAX starts: the fake devices, and the flag that turns off XLA's concurrency-optimised
    # CPU scheduler, which deadlocks larger programs with collectives (shardvmc.testing.CPU_SCHEDULER_FLAG).
    set_cpu_devices(args.devices)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import harness
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from sections import Report, machine

    import shardvmc as sv
    from shardvmc._memory import compiled_memory, format_bytes

    mesh = sv.create_mesh()
    d = mesh.devices.size
    walker = NamedSharding(mesh, P("walkers"))
    replicated = NamedSharding(mesh, P())
    damping = 1e-3
    huge = 2**60  # the memory table compiles programs far larger than this machine: no budget check

    def replicated_solve(j: jax.Array, e: jax.Array) -> jax.Array:
        """The straightforward way: gather J onto every device and solve the N x N system there."""
        j = jax.lax.with_sharding_constraint(j, replicated)
        e = jax.lax.with_sharding_constraint(e, replicated)
        n = j.shape[0]
        jc = (j - j.mean(0)) / jnp.sqrt(n)
        ec = (e - e.mean()) / jnp.sqrt(n)
        t = jc @ jc.T + damping * jnp.eye(n, dtype=j.dtype)
        y = jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(t), True), ec)
        return jax.lax.with_sharding_constraint(jc.T @ y, replicated)

    def solver(method: str, chunks: int | None = None) -> Any:
        def run(j: jax.Array, e: jax.Array) -> jax.Array:
            return sv.natural_gradient(
                j, e, damping=damping, method=method, chunks=chunks, memory_budget=huge, mesh=mesh, maxiter=100
            )[0]

        return run

    variants = {
        "replicated solve (all-gather J)": replicated_solve,
        "dense": solver("dense"),
        "minsr": solver("minsr"),
        "minsr, chunks=16": solver("minsr", 16),
        "spring, chunks=16": solver("spring", 16),
        "cg": solver("cg"),
    }
    report = Report()
    info: dict[str, Any] = machine()
    info["mesh"] = dict(mesh.shape)
    print("natural-gradient benchmarks:", ", ".join(f"{k}={v}" for k, v in info.items()), flush=True)
    start = time.perf_counter()
    n = args.walkers
    facts: dict[str, Any] = {}
    for p in (int(x) for x in args.params.split(",") if x):
        j = jax.ShapeDtypeStruct((n, p), jnp.float32, sharding=walker)
        e = jax.ShapeDtypeStruct((n,), jnp.float32, sharding=walker)
        base = None
        for name, fn in variants.items():
            if name == "dense" and p > 20000:
                continue  # a P x P matrix of 40 GB and more: not a candidate
            compiled = jax.jit(fn).lower(j, e).compile()
            mem = compiled_memory(compiled)
            text = compiled.as_text()
            shapes = set(re.findall(r"f32\[([\d,]+)\]", text))
            full_j = f"{n},{p}" in shapes or f"{p},{n}" in shapes
            pp = f"{p},{p}" in shapes
            gathers_j = any(
                int(np.prod([int(x) for x in s.split(",")])) >= n * p // d
                for s in re.findall(r"f32\[([\d,]+)\][^=]*? all-gather(?:-start)?\(", text)
            )
            collectives = harness.count_collectives(compiled)
            if base is None:
                base = mem.temp_bytes
            ratio = mem.temp_bytes / base
            facts[f"{name} P={p}"] = {
                "temp": mem.temp_bytes,
                "total": mem.total_bytes,
                "collectives": collectives,
                "full_j": full_j,
                "pxp": pp,
                "gathers_j": gathers_j,
            }
            goal, met = "", None
            if name == "minsr, chunks=16" and p == 10**6:
                goal, met = "< 1/4 of replicated, no all-gather of J", ratio < 0.25 and not gathers_j
            report.row(
                9,
                f"memory, N={n}, P={p:.0e}: {name}",
                f"{format_bytes(mem.temp_bytes)} ({ratio:.3f}); {harness.fmt_collectives(collectives)}; "
                f"{'yes' if full_j else 'no'} / {'yes' if pp else 'no'} / {'yes' if gathers_j else 'no'}",
                goal,
                met,
            )

    rng = np.random.default_rng(0)
    sizes = zip((int(x) for x in args.time_params.split(",") if x), (int(x) for x in args.time_walkers.split(",") if x))
    for p, n_time in sizes:
        j = sv.shard_walker(jnp.asarray(rng.normal(size=(n_time, p)), jnp.float32), mesh)
        e = sv.shard_walker(jnp.asarray(rng.normal(size=n_time), jnp.float32), mesh)
        fns = {name: jax.jit(variants[name]) for name in ("replicated solve (all-gather J)", "minsr", "cg")}
        base = np.asarray(fns["replicated solve (all-gather J)"](j, e), np.float64)
        for name in ("minsr", "cg"):
            diff = np.abs(np.asarray(fns[name](j, e), np.float64) - base).max() / np.abs(base).max()
            facts[f"max rel diff {name} vs replicated, N={n_time}, P={p}"] = float(diff)
        cg_info = sv.natural_gradient(j, e, damping=damping, method="cg", memory_budget=huge, mesh=mesh, maxiter=100)[1]
        facts[f"cg iterations, relative residual, N={n_time}, P={p}"] = (
            int(cg_info.iterations),
            float(cg_info.residual),
        )
        times = harness.interleaved({k: (lambda f=f: f(j, e)) for k, f in fns.items()}, args.reps)
        for name in ("minsr", "cg"):
            report.row(
                9,
                f"time, N={n_time}, P={p:.0e}: {name} / replicated solve (all-gather J)",
                str(harness.ratio(times, name, "replicated solve (all-gather J)")),
            )
    info["seconds"] = round(time.perf_counter() - start, 1)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print()
    print("Ratios: median over repetitions of time(first) / time(second), [25%, 75%] quartiles.")
    print(report.table())
    for key, value in facts.items():
        if key.startswith(("max rel diff", "cg iterations")):
            print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "config": vars(args), "rows": report.rows, "facts": facts}, f, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
