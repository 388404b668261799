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

- **breakdown** (``--breakdown``; N = 512, P = 4,753, float64: the neural example's
  size): where minSR's time goes on 8 fake devices and on one, side by side in one
  run: minSR and CG on 8 devices and on one, the replicated Cholesky factorisation of
  the N x N matrix alone, and a factorisation on device 0 shared by a ``psum``; each
  with the thread count of the OpenBLAS that XLA's CPU LAPACK calls use at its default
  and at 1 (switched at run time between the variants of each repetition).

Usage (from the repository root)::

    python benchmarks/natgrad.py                 # about 3 minutes on 2 cores
    python benchmarks/natgrad.py --quick         # small sizes, seconds
    python benchmarks/natgrad.py --breakdown --params "" --time-params ""   # the breakdown only
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
    parser.add_argument("--breakdown", action="store_true", help="also the minSR time breakdown (see above)")
    parser.add_argument("--breakdown-walkers", type=int, default=512, help="N of the breakdown (default 512)")
    parser.add_argument("--breakdown-params", type=int, default=4753, help="P of the breakdown (default 4753)")
    parser.add_argument("--breakdown-reps", type=int, default=7, help="repetitions of the breakdown (default 7)")
    parser.add_argument(
        "--neural-step",
        action="store_true",
        help="also the neural example's optimisation step with minsr and with cg (default Li network, "
        "--breakdown-walkers walkers), at both OpenBLAS thread counts",
    )
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
    if args.breakdown:
        breakdown(report, facts, mesh, args)
    if args.neural_step:
        neural_step(report, facts, mesh, args)
    info["seconds"] = round(time.perf_counter() - start, 1)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    print()
    print("Ratios: median over repetitions of time(first) / time(second), [25%, 75%] quartiles.")
    print(report.table())
    for key, value in facts.items():
        if key.startswith(("max rel diff", "cg iterations", "breakdown")):
            print(f"{key}: {value}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "config": vars(args), "rows": report.rows, "facts": facts}, f, default=str)
    return 0


def openblas_threads() -> tuple[Any, int] | None:
    """``(set_threads, cores)`` for the OpenBLAS that XLA's CPU LAPACK calls use (scipy's); ``None`` if not found.

    jaxlib's CPU ``lapack_*_ffi`` kernels (Cholesky, triangular solves, eigh) call the
    LAPACK of ``scipy.linalg.cython_lapack``; with scipy's wheels that is OpenBLAS, whose
    thread count can be changed at run time.
    """
    import ctypes

    import scipy.linalg  # noqa: F401  (loads scipy's OpenBLAS)

    with open("/proc/self/maps") as f:
        paths = sorted(set(re.findall(r"(/\S*openblas\S*\.so\S*)", f.read())))
    for path in paths:
        lib = ctypes.CDLL(path)
        for prefix in ("scipy_openblas", "openblas"):
            if hasattr(lib, f"{prefix}_set_num_threads"):
                # OpenBLAS's own default is one thread per core; sv.testing.set_cpu_devices starts it with one.
                return getattr(lib, f"{prefix}_set_num_threads"), os.cpu_count() or 1
    return None


def breakdown(report: Any, facts: dict[str, Any], mesh: Any, args: argparse.Namespace) -> None:
    """Where minSR's time goes on 8 fake devices and on one (N x N factorisation, OpenBLAS threads)."""
    import harness
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import shardvmc as sv

    n, p = args.breakdown_walkers, args.breakdown_params
    blas = openblas_threads()
    d = mesh.devices.size
    mesh1 = sv.create_mesh(mesh.devices.flat[:1])
    rng = np.random.default_rng(1)
    with jax.enable_x64(True):
        j, e = rng.normal(size=(n, p)), rng.normal(size=n)
        on = {d: sv.shard_walker((jnp.asarray(j), jnp.asarray(e)), mesh), 1: sv.shard_walker((j, e), mesh1)}
        jc = (j - j.mean(0)) / np.sqrt(n)
        t = jc @ jc.T + 1e-3 * np.eye(n)  # minSR's N x N matrix
        t_on = {d: jax.device_put(t, NamedSharding(mesh, P())), 1: jax.device_put(t, mesh1.devices.flat[0])}
        cholesky = jax.jit(jnp.linalg.cholesky)

        def factorise_once(a: jax.Array) -> jax.Array:
            # Device 0 factorises, the others contribute zeros to a psum that shares the factor.
            first = jax.lax.axis_index("walkers") == 0
            return jax.lax.psum(jax.lax.cond(first, jnp.linalg.cholesky, jnp.zeros_like, a), "walkers")

        once = jax.jit(jax.shard_map(factorise_once, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))

        def solve(method: str, k: int) -> Any:
            return lambda: sv.natural_gradient(*on[k], damping=1e-3, method=method, mesh=mesh if k == d else mesh1)[0]

        base = {
            f"minsr, {d} devices": solve("minsr", d),
            "minsr, 1 device": solve("minsr", 1),
            f"cg, {d} devices": solve("cg", d),
            "cg, 1 device": solve("cg", 1),
            f"cholesky, replicated on {d} devices": lambda: cholesky(t_on[d]),
            "cholesky, 1 device": lambda: cholesky(t_on[1]),
            f"cholesky on device 0, shared by psum, {d} devices": lambda: once(t_on[d]),
        }
        diff = float(np.abs(np.asarray(base[f"minsr, {d} devices"]()) - np.asarray(base["minsr, 1 device"]())).max())
        facts[f"breakdown: max abs diff minsr {d} vs 1 device"] = diff
        settings = [("default threads", None)]
        if blas is not None:
            set_threads, default = blas
            settings = [(f"OpenBLAS {default} threads", default), ("OpenBLAS 1 thread", 1)]
        facts["breakdown: OpenBLAS"] = "not found" if blas is None else f"its default: {blas[1]} threads (one per core)"
        thunks = {}
        for label, k in settings:
            for name, fn in base.items():

                def thunk(fn: Any = fn, k: int | None = k) -> Any:
                    if k is not None:
                        set_threads(k)
                    return fn()

                thunks[f"{name}, {label}"] = thunk
        times = harness.interleaved(thunks, args.breakdown_reps)
        if blas is not None:
            set_threads(blas[1])
    what = f"minSR breakdown, N={n}, P={p}, float64"
    for name, values in times.items():
        facts[f"breakdown: median ms, {name}"] = round(1e3 * float(np.median(values)), 2)
    for label, _ in settings:
        pairs = [
            (f"minsr, {d} devices", "minsr, 1 device"),
            (f"cg, {d} devices", "cg, 1 device"),
            (f"minsr, {d} devices", f"cg, {d} devices"),
            ("minsr, 1 device", "cg, 1 device"),
            (f"cholesky, replicated on {d} devices", "cholesky, 1 device"),
            (f"cholesky on device 0, shared by psum, {d} devices", "cholesky, 1 device"),
            ("cholesky, 1 device", "minsr, 1 device"),
            (f"cholesky, replicated on {d} devices", f"minsr, {d} devices"),
        ]
        for a, b in pairs:
            report.row(9, f"{what} ({label}): {a} / {b}", str(harness.ratio(times, f"{a}, {label}", f"{b}, {label}")))
    if len(settings) == 2:
        one, many = settings[1][0], settings[0][0]
        for name in (
            f"minsr, {d} devices",
            "minsr, 1 device",
            f"cholesky, replicated on {d} devices",
            f"cg, {d} devices",
        ):
            report.row(
                9, f"{what}: {name}, {one} / {many}", str(harness.ratio(times, f"{name}, {one}", f"{name}, {many}"))
            )


def neural_step(report: Any, facts: dict[str, Any], mesh: Any, args: argparse.Namespace) -> None:
    """The neural example's optimisation step (Li, float64) with minSR and with CG, interleaved."""
    import dataclasses

    import harness
    import jax
    import numpy as np
    from jax.flatten_util import ravel_pytree

    import shardvmc as sv

    neural = harness.neural_example()
    blas = openblas_threads()
    n = args.breakdown_walkers
    thunks: dict[str, Any] = {}
    with jax.enable_x64(True), sv.use_mesh(mesh):
        for optimiser in ("minsr", "cg"):
            config = dataclasses.replace(neural.Config(), walkers=n, optimiser=optimiser)
            steps = neural.make_steps(config, mesh)
            state = neural.initial_state(config, mesh, steps)
            n_params = int(ravel_pytree(state.params)[0].size)
            step = steps.train.lower(state, jax.random.key(1)).compile()
            settings = (
                [(None, "default threads")]
                if blas is None
                else [(blas[1], f"OpenBLAS {blas[1]} threads"), (1, "OpenBLAS 1 thread")]
            )
            for k, label in settings:

                def thunk(step: Any = step, state: Any = state, k: Any = k) -> Any:
                    if k is not None:
                        blas[0](k)
                    return step(state, jax.random.key(2))

                thunks[f"{optimiser}, {label}"] = thunk
        times = harness.interleaved(thunks, args.breakdown_reps)
        if blas is not None:
            blas[0](blas[1])
    what = f"neural example's optimisation step (Li, {n_params} parameters, {n} walkers, float64, {mesh.devices.size}"
    what += " devices)"
    labels = [label for _, label in settings]
    for label in labels:
        report.row(9, f"{what}, {label}: minsr / cg", str(harness.ratio(times, f"minsr, {label}", f"cg, {label}")))
    if len(labels) == 2:
        for optimiser in ("minsr", "cg"):
            one, many = f"{optimiser}, OpenBLAS 1 thread", f"{optimiser}, {labels[0]}"
            report.row(9, f"{what}: {optimiser}, OpenBLAS 1 thread / {labels[0]}", str(harness.ratio(times, one, many)))
    for name, values in times.items():
        facts[f"breakdown: median ms, neural step, {name}"] = round(1e3 * float(np.median(values)), 1)


if __name__ == "__main__":
    sys.exit(main())
